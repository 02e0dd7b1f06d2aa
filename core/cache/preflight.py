"""The CI preflight: ``preflight(model) -> record``, every problem a load of the model
would meet, found in one run, each a finding that names its subject (docs/check.md).

Input the preflight cannot use at all is raised, not reported (exit 2): a path that is
not a file (``UsageError``), a file that is not an ONNX protobuf (``ModelFormatError``
from ``parse_model_file``). Everything else becomes findings of named checks:

- ``model.conformance``: what resolution refuses, i.e. what ONNX Runtime would refuse
  (``core/model/conformance.py``) and the model forms this runtime does not take.
  Resolution stops at its first refusal, so this check reports at most one (its
  message says so); a per-tensor problem of an initializer is reported for each.
- ``kernels``: each op type with no kernel here, naming its nodes.
- ``external_data``: each data file present, inside the model's folder and regular
  (one finding per file), each tensor's ``[offset, offset + length)`` inside it (one
  per tensor); ``stat`` only, no payload byte is read.
- ``digests``: each external tensor has a trusted digest (a per-tensor sha256 or xxh3
  in its ``metadata_props``, or the file's ``checksum``); with ``verify_payloads``,
  every trusted digest (both per-tensor ones where the model records both) is checked by reading through the one reader
  (``ExternalDataReader.map_shared``: one tensor's pages at a time, released after), and
  so is every data file's ``checksum`` a tensor records, even beside per-tensor digests
  (which resolution trusts instead, so the tensor's descriptor does not carry it).
- ``prepared_cache``: the companion prepared cache (``--prepared``, default
  ``<model stem>.prepared.onnx``), by :func:`prepared_cache_findings`:
  a malformed manifest, each entry a load could not use, with ``require_complete`` each
  missing one, with ``verify_payloads`` each payload against its digest. No cache at
  the default path is no finding (a load then packs from the sources); a cache named
  with ``prepared`` that is not there is one.

A finding about a tensor resolution prunes (no kept node reads it) is a warning: a
load never reads it. The record's ``exit_code`` is 1 when any finding is an error.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Mapping

from onnx_prep.core.errors import (
    EXIT_FINDINGS,
    EXIT_OK,
    DigestError,
    ExternalDataError,
    ModelFormatError,
    OnnxPrepError,
    Where,
)

if TYPE_CHECKING:
    from onnx_prep.core.model.resolved_model import ResolvedModel

CHECK_SCHEMA = "onnx-prep.check/1"
CHECKS = ("model.conformance", "kernels", "external_data", "digests", "prepared_cache")
DIGEST_HINT = "add digests with 'onnx-prep digest --write'"
STOPS = "resolution stops at its first refusal: fix this and run again to see whether more follow"

# ``progress(label, total_bytes)``: a context manager around the payload verification
# that gives a callback taking the bytes just verified (the CLI's bar on stderr).
Progress = Callable[[str, int], ContextManager[Callable[[int], None]]]


@dataclass(frozen=True)
class Finding:
    """One problem: which check found it, its subject (tensor, node, file or cache
    entry), one line saying what is wrong, where (model, tensor, file, offset, ...)."""

    check: str
    subject: str
    message: str
    where: Mapping[str, Any]
    severity: str = "error"  # or "warning": it does not fail the check

    def to_json(self) -> dict:
        return {"check": self.check, "subject": self.subject, "message": self.message,
                "where": dict(self.where), "severity": self.severity}


def finding_from_error(check: str, subject: str, exc: OnnxPrepError, *, severity: str = "error",
                       **extra: Any) -> Finding:
    """A finding from a typed error: its message (and hint), its ``Where`` as fields."""
    message = f"{exc.message}; {exc.hint}" if exc.hint else exc.message
    return Finding(check, subject, message, {**_fields(exc.where), **extra}, severity)


def _fields(where: Where) -> dict:
    return {k: v for k, v in vars(where).items() if v is not None}


@dataclass
class _Check:
    id: str
    status: str = "ok"
    duration_ms: float = 0.0
    reason: str | None = None
    findings: list[Finding] = field(default_factory=list)

    def add(self, finding: Finding) -> None:
        self.findings.append(finding)

    def skip(self, reason: str) -> None:
        self.status, self.reason = "skipped", reason

    def to_json(self) -> dict:
        return {"id": self.id, "status": self.status, "duration_ms": round(self.duration_ms, 3),
                "findings": len(self.findings), "reason": self.reason}


@contextmanager
def _timed(check: _Check) -> Iterator[_Check]:
    t0 = time.perf_counter()
    try:
        yield check
    finally:
        check.duration_ms += (time.perf_counter() - t0) * 1000.0
        if check.status != "skipped" and check.findings:
            check.status = "findings"


def preflight(model_path: str | os.PathLike, *, prepared: str | os.PathLike | None = None,
              require_complete: bool = False, verify_payloads: bool = False, trust_symlinks: bool = False,
              progress: Progress | None = None) -> dict:
    """The ``onnx-prep check`` record (schema ``onnx-prep.check/1``,
    ``core/schemas/check.schema.json``) of the model at ``model_path`` (a file, or a
    folder holding one). Raises only for input it cannot use at all (see the module
    docstring); every other problem is a finding."""
    from onnx_prep import __version__
    from onnx_prep.core.model.model_file import find_model_file, parse_model_file

    path = Path(os.path.abspath(find_model_file(Path(model_path), folder=True)))
    proto = parse_model_file(path)  # not a model at all: raised, exit 2
    checks = {cid: _Check(cid) for cid in CHECKS}
    state = _State(str(path), path.parent, trust_symlinks)

    with _timed(checks["model.conformance"]) as c:
        state.describe(proto, c, checks["external_data"], checks["digests"])
        state.resolve(c, checks)
    with _timed(checks["kernels"]) as c:
        state.kernels(c)
    with _timed(checks["external_data"]) as c:
        state.external_data(c)
    with _timed(checks["digests"]) as c:
        state.digests(c, verify_payloads, progress)
    with _timed(checks["prepared_cache"]) as c:
        state.prepared_cache(c, prepared, require_complete, verify_payloads)

    findings = [f for c in checks.values() for f in c.findings]
    errors = sum(f.severity == "error" for f in findings)
    statuses = [c.status for c in checks.values()]
    return {
        "schema": CHECK_SCHEMA,
        "tool": {"name": "onnx-prep", "version": __version__},
        "model": str(path),
        "options": {"prepared": None if prepared is None else str(prepared),
                    "require_complete": require_complete, "verify_payloads": verify_payloads,
                    "trust_symlinks": trust_symlinks},
        "checks": [c.to_json() for c in checks.values()],
        "findings": [f.to_json() for f in findings],
        "summary": {"checks": len(statuses), "ok": statuses.count("ok"),
                    "findings": statuses.count("findings"), "skipped": statuses.count("skipped"),
                    "errors": errors, "warnings": len(findings) - errors},
        "exit_code": EXIT_FINDINGS if errors else EXIT_OK,
    }


def schema_path() -> Path:
    """The JSON Schema (draft 2020-12) of ``preflight``'s record."""
    return Path(__file__).parents[1] / "schemas" / "check.schema.json"


def prepared_cache_findings(resolved: ResolvedModel, prepared_path: Path | None = None, *,
                            require_complete: bool = False, verify_payloads: bool = False,
                            trust_symlinks: bool = False) -> list[dict]:
    """What ``onnx-prep check`` reports about a model's prepared cache: one finding per
    problem, ``{"check", "subject", "message", "where", "severity"}``. A malformed
    manifest is one error; an entry that cannot be used is a warning (an error with
    ``require_complete``, which also makes every object without a compatible entry an
    error); with ``verify_payloads`` every payload is read and checked against its digest
    (bounded memory: 1 MiB at a time). ``trust_symlinks``: a symlinked manifest is read
    through (else it is one error)."""
    from onnx_prep.core.cache.manifest import CacheFormatError
    from onnx_prep.core.cache.prepared_cache import CachePolicy, EntryStatus, PreparedCache, default_cache_path

    path = Path(prepared_path) if prepared_path is not None else default_cache_path(resolved.model_path)
    findings: list[dict] = []

    def add(subject: str, message: str, where: Where, error: bool) -> None:
        findings.append({"check": "prepared_cache", "subject": subject, "message": message,
                         "where": {k: v for k, v in vars(where).items() if v is not None},
                         "severity": "error" if error else "warning"})

    try:
        cache = PreparedCache(resolved, path, policy=CachePolicy.READ_ONLY, trust_symlinks=trust_symlinks)
    except CacheFormatError as exc:
        add(path.name, exc.one_line(), exc.where, True)
        return findings
    try:
        if cache.manifest is None:
            if require_complete:
                add(path.name, f"no prepared cache at {path}; {cache.build_hint()}",
                    Where(file=str(path)), True)
            return findings
        for key, o in sorted(cache.outcomes.items()):
            if o.status is EntryStatus.HIT:
                continue
            if o.status is EntryStatus.MISSING and not require_complete:
                continue  # an incomplete cache is a cache, unless completeness is required
            add(key, f"{o.status.value}: {o.reason}", Where(file=str(path), tensor=key),
                require_complete or o.status is EntryStatus.DAMAGED)
        if verify_payloads:
            for e in cache.manifest.entries:
                problem = cache.payload_problem(e)
                if problem is not None:
                    add(e.key, f"payload unusable: {problem}; {cache.build_hint(verb='rebuild')}",
                        Where(file=str(cache.folder / e.file), tensor=e.tensor_name, offset=e.offset), True)
    finally:
        cache.close()
    return findings


class _State:
    """What the checks learn about the model and hand to the next."""

    def __init__(self, model: str, model_dir: Path, trust_symlinks: bool) -> None:
        self.model, self.model_dir, self.trust_symlinks = model, model_dir, trust_symlinks
        self.external: list = []  # WeightDescriptors of the external tensors whose entries parse
        self.resolved = None  # the ResolvedModel, where resolution accepts the model
        self.readable: list = []  # external tensors inside an existing file (external_data)
        # each tensor with per-tensor digests that records its file's ``checksum`` too:
        # the checksum, which its descriptor does not keep (the finer digest is its identity)
        self.file_checksums: dict[str, str] = {}

    # -- model.conformance
    def describe(self, proto, conformance: _Check, external_data: _Check, digests: _Check) -> None:
        """Each initializer's descriptor: a malformed entry or digest is a finding of its
        tensor (resolution would stop at the first one)."""
        from onnx import TensorProto

        from onnx_prep.core.model.resolution import weight_descriptor
        from onnx_prep.core.model.weights import DigestSource

        seen: set[str] = set()
        for t in proto.graph.initializer:
            try:
                d = weight_descriptor(t, self.model)
            except DigestError as exc:
                digests.add(finding_from_error("digests", t.name, exc))
            except ExternalDataError as exc:
                external_data.add(finding_from_error("external_data", t.name, exc))
            except ModelFormatError as exc:
                conformance.add(finding_from_error("model.conformance", t.name, exc))
            else:
                if t.data_location == TensorProto.EXTERNAL and d.name not in seen:  # a duplicate: conformance
                    self.external.append(d)
                    seen.add(d.name)
                    checksum = next((e.value for e in t.external_data if e.key == "checksum"), None)
                    if checksum is not None and d.digest_source is DigestSource.TENSOR_METADATA:
                        self.file_checksums[d.name] = checksum

    def resolve(self, conformance: _Check, checks: Mapping[str, _Check]) -> None:
        from onnx_prep.core.model.resolution import resolve_model

        try:
            self.resolved = resolve_model(self.model, trust_symlinks=self.trust_symlinks, stat_external=False)
        except (ModelFormatError, ExternalDataError, DigestError) as exc:
            check = checks["digests" if isinstance(exc, DigestError) else
                           "external_data" if isinstance(exc, ExternalDataError) else "model.conformance"]
            where = _fields(exc.where)
            # describe() may have reported it already (a tensor's own problem): once
            check.findings = [f for f in check.findings
                              if not (f.message.startswith(exc.message) and dict(f.where) == where)]
            subject = exc.where.tensor or exc.where.node or Path(self.model).name
            found = finding_from_error(check.id, subject, exc)
            if check is conformance:
                found = replace(found, message=f"{found.message}; {STOPS}")
            elif not conformance.findings:
                conformance.skip(f"resolution stopped at the {check.id} finding on {subject!r}; "
                                 "fix it and run again")
            check.add(found)

    def _severity(self, name: str) -> str:
        """A tensor resolution prunes is never read by a load: a warning."""
        return "error" if self.resolved is None or name in self.resolved.weights else "warning"

    # -- kernels
    def kernels(self, check: _Check) -> None:
        if self.resolved is None:
            check.skip("needs the model resolved (see model.conformance)")
            return
        for u in self.resolved.unsupported:
            op = f"{u.domain or 'ai.onnx'}::{u.op_type}"
            shown = ", ".join(u.nodes[:5]) + (f", ... ({len(u.nodes)} in all)" if len(u.nodes) > 5 else "")
            check.add(Finding("kernels", op, f"no kernel here for {op} (nodes {shown})",
                              {"model": self.model, "op_type": u.op_type, "domain": u.domain,
                               "nodes": list(u.nodes)}))

    # -- external_data
    def external_data(self, check: _Check) -> None:
        from onnx_prep.core.io.external_data import check_bounds, stat_external_file

        by_file: dict[str, list] = {}
        for d in self.external:
            by_file.setdefault(d.file, []).append(d)
        for file, descs in by_file.items():
            severity = "error" if any(self._severity(d.name) == "error" for d in descs) else "warning"
            try:
                size = stat_external_file(self.model_dir, file, trust_symlinks=self.trust_symlinks,
                                          where=Where(model=self.model, file=file)).st_size
            except ExternalDataError as exc:
                check.add(finding_from_error("external_data", file, exc, severity=severity,
                                             tensors=len(descs)))
                continue
            for d in descs:
                try:
                    check_bounds(d.offset, d.length, size,
                                 Where(model=self.model, tensor=d.name, file=d.file, offset=d.offset))
                except ExternalDataError as exc:
                    check.add(finding_from_error("external_data", d.name, exc,
                                                 severity=self._severity(d.name), length=d.length))
                else:
                    self.readable.append(d)

    # -- digests
    def digests(self, check: _Check, verify: bool, progress: Progress | None) -> None:
        from onnx_prep.core.model.weights import DigestSource

        for d in self.external:
            if not d.trusted:
                check.add(Finding("digests", d.name, f"no trusted digest: its bytes cannot be verified, and "
                                  f"a prepared cache never reuses what it packs from them; {DIGEST_HINT}",
                                  {"model": self.model, "tensor": d.name, "file": d.file, "offset": d.offset},
                                  self._severity(d.name)))
        if not verify:
            return
        per_tensor = [d for d in self.readable if d.digest_source is DigestSource.TENSOR_METADATA]
        per_file: dict[str, Any] = {}  # one tensor per file (the smallest): the file's checksum
        for d in self.readable:
            if d.digest_source is DigestSource.FILE_CHECKSUM:
                if d.file not in per_file or d.length < per_file[d.file].length:
                    per_file[d.file] = d
        # A file whose tensors record their own digests and its checksum too: the checksum
        # is checked as well (a file changed outside every tensor fails only it), through
        # a stand-in descriptor of its smallest tensor whose digest is that checksum.
        beside: dict[str, Any] = {}
        for d in self.readable:
            checksum = self.file_checksums.get(d.name)
            if checksum is not None and d.file not in per_file and (
                    d.file not in beside or d.length < beside[d.file].length):
                beside[d.file] = replace(d, digest=f"sha1:{checksum.lower()}@{d.offset}+{d.length}",
                                         digest_source=DigestSource.FILE_CHECKSUM, fast_digest=None)
        files = {d.file: (self.model_dir / d.file).stat().st_size for d in (*per_file.values(), *beside.values())}
        total = sum(d.length for d in per_tensor) + sum(files.values())
        with (progress("verify payloads", total) if progress else nullcontext(None)) as advance:
            self._verify(check, per_tensor, per_file, beside, files, advance or (lambda n: None))

    def _verify(self, check: _Check, per_tensor: list, per_file: dict, beside: dict, files: dict,
                advance: Callable[[int], None]) -> None:
        from onnx_prep.core.io.external_data import ExternalDataReader
        from onnx_prep.core.model.resolved_model import PayloadManifest

        def reader_of(descs) -> ExternalDataReader:
            return ExternalDataReader(self.model_dir, PayloadManifest(tuple(descs)), trust_symlinks=self.trust_symlinks,
                                      model=self.model, verify_every_digest=True)

        tensors = reader_of(self.readable)
        # The stand-ins share their tensors' names: a reader of their own admits them.
        checksums = reader_of(beside.values()) if beside else tensors
        try:
            for subject, d, nbytes, reader in ([(d.file, d, files[d.file], tensors) for d in per_file.values()]
                                               + [(d.file, d, files[d.file], checksums) for d in beside.values()]
                                               + [(d.name, d, d.length, tensors) for d in per_tensor]):
                try:
                    reader.map_shared(d, verify=True)
                except DigestError as exc:
                    if subject == d.file:  # the whole file's checksum: every tensor in it
                        exc.where = Where(model=self.model, file=d.file, offset=0)
                    check.add(finding_from_error("digests", subject, exc, severity=self._severity(d.name),
                                                 expected=exc.expected, actual=exc.actual))
                except ExternalDataError as exc:  # the file changed since it was checked
                    check.add(finding_from_error("digests", subject, exc, severity=self._severity(d.name)))
                finally:
                    reader.release_shared(d)
                advance(nbytes)
        finally:
            tensors.close_shared()
            if checksums is not tensors:
                checksums.close_shared()

    # -- prepared_cache
    def prepared_cache(self, check: _Check, prepared, require_complete: bool, verify: bool) -> None:
        if self.resolved is None:
            check.skip("needs the model resolved (see model.conformance)")
            return
        path = None if prepared is None else Path(prepared)
        if path is not None and not path.exists():  # named, so expected: it is not optional here
            check.add(Finding("prepared_cache", str(path), f"no prepared cache at {path}; build it: "
                              f"onnx-prep build-cache -o {path}", {"model": self.model, "file": str(path)}))
            return
        try:
            found = prepared_cache_findings(self.resolved, path, require_complete=require_complete,
                                            verify_payloads=verify, trust_symlinks=self.trust_symlinks)
        except OnnxPrepError as exc:  # a cache that cannot be read at all: one finding, not exit 2
            found = [finding_from_error("prepared_cache", str(path or exc.where.file or "prepared cache"), exc)]
        for f in found:
            check.add(Finding(**f))
