"""BackgroundWriter: the packed objects a load builds under ``build-if-missing``,
written on a thread of their own at idle priority while the load goes on, held off over
a session's first run, then published as one new generation (``cache_writer.CacheWriter``)
once the caller is done (docs/cache-format.md, "Policies" and "Writing").

A write that fails (read-only folder, full disk) stops the persisting, not the load: it
is recorded once (a warning, unless the caller treats it as fatal: ``build-cache``) and
nothing is published."""
from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from onnx_prep.core.cache.cache_writer import CacheWriteError, CacheWriter, check_manifest_target, collect_leftovers
from onnx_prep.core.cache.manifest import CacheEntry, CacheManifest, SourceRecord
from onnx_prep.core.errors import OnnxPrepError

__all__ = ["BackgroundWriter", "source_model_digest"]

_CHUNK = 1 << 20


def source_model_digest(model_path: Path) -> str:
    h = hashlib.sha256()
    with open(model_path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class BackgroundWriter:
    """One cache's writer thread, started by the first :meth:`put`. Thread-safe: ``put``
    from a session's prepack tasks. ``written(nbytes)`` runs after each object written;
    ``note(message)`` takes the warning of a failed write."""

    def __init__(self, path: Path, folder: Path, stem: str, *, compress: str | None,
                 written: Callable[[int], None], note: Callable[[str], None]) -> None:
        self.path, self.folder, self.stem, self.compress = Path(path), Path(folder), stem, compress
        self._written, self._note = written, note
        self.fatal = False  # build-cache: commit(strict=True) raises write errors, so no warning too
        self.error: str | None = None  # the first write error, one line
        self._lock = threading.Lock()
        # The thread writes while this is set (hold clears it).
        self._open = threading.Event()
        self._open.set()
        self._holds = 0
        self._writer: CacheWriter | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._sources: dict[str, SourceRecord] = {}  # what the queued objects were built from

    @property
    def open(self) -> bool:
        """Whether the thread may write now (no :meth:`hold` in force)."""
        return self._open.is_set()

    def put(self, identity: CacheEntry, packed: np.ndarray, sources: dict[str, SourceRecord],
            done: Callable[[], None]) -> None:
        """Queue ``packed`` (a view of the published object; the caller pinned it) for the
        entry ``identity`` describes; ``done()`` runs once it is written or dropped."""
        with self._lock:
            if self._thread is None:
                try:
                    check_manifest_target(self.path)  # a symlink (trusted for reading) or a folder
                    self._writer = CacheWriter(self.folder, self.stem, self.path.name, compress=self.compress)
                except CacheWriteError as exc:
                    self.fail(exc)
                    done()
                    return
                self._queue = queue.Queue()
                self._thread = threading.Thread(target=self._loop, name="onnx-prep-cache-writer", daemon=True)
                self._thread.start()
            self._sources.update(sources)
        self._queue.put((identity, packed, done))

    def hold(self) -> Callable[[], None]:
        """Hold the thread until the returned ``release()`` is called (once; later calls
        do nothing), or until :meth:`flush`. A session holds it over its first run: the
        writer's page-cache writes and checksums, though at idle priority, took the first
        output of a first build of the medium fixture from 679 to 838 ms (medians of 3, in
        process, 2 vCPUs); held, the objects are written right after the first output
        instead."""
        with self._lock:
            self._holds += 1
            self._open.clear()
        released = [False]

        def release() -> None:
            with self._lock:
                if released[0]:
                    return
                released[0] = True
                self._holds = max(0, self._holds - 1)  # a flush in between zeroed it
                if self._holds == 0:
                    self._open.set()
        return release

    def _loop(self) -> None:
        from onnx_prep.core.runtime.slot_pool import to_idle_priority

        to_idle_priority()  # never competes with the load for a core
        while True:
            self._open.wait()  # hold: not before the first output
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            identity, packed, done = item
            try:
                if self.error is None:
                    self._writer.append(identity, packed)
                    self._written(packed.nbytes)
            except CacheWriteError as exc:
                self.fail(exc)
            except BaseException as exc:  # noqa: BLE001 - recorded, the run goes on
                self.fail(OnnxPrepError(f"prepared cache write failed: {exc!r}"))
            finally:
                done()
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every object handed to :meth:`put` is written (or dropped) and its
        ``done()`` has run. It ends any :meth:`hold`."""
        with self._lock:
            self._holds = 0
            self._open.set()
        if self._queue is not None:
            self._queue.join()

    def fail(self, exc: OnnxPrepError) -> None:
        """Record the first write error; nothing more is written or published."""
        if self.error is None:
            self.error = exc.one_line()
            if not self.fatal:
                self._note(f"{exc.one_line()}; going on without persisting")

    def commit(self, *, live: CacheManifest | None, model_path: Path,
               keep: Callable[[CacheEntry], bool], wanted: Callable[[CacheEntry, CacheEntry | None], bool],
               strict: bool = False) -> tuple[CacheManifest | None, list[CacheEntry]] | None:
        """Wait for the queued writes, then publish them (``CacheWriter.commit``: ``keep``
        and ``wanted`` choose the entries): (the manifest live now, the entries this commit
        added), or None when nothing was published (nothing written, or a write failed:
        ``error`` says so; with ``strict`` that raises CacheWriteError). ``live``: the
        manifest as the cache opened it; with ``strict`` and nothing written, what an
        interrupted commit left beside it is collected."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        writer, self._writer = self._writer, None
        if writer is None:
            if strict and self.error is not None:
                raise CacheWriteError(self.error)
            if strict and live is not None:  # build-cache, up to date: a crash's leftovers go
                try:
                    collect_leftovers(self.folder, self.stem, self.path.name)
                except CacheWriteError as exc:
                    self._note(f"{exc.one_line()}; stale files left for the next build")
            return None
        if self.error is not None:
            writer.discard()
            if strict:
                raise CacheWriteError(self.error)
            return None
        try:
            return writer.commit(source_model_digest=source_model_digest(model_path), sources=self._sources,
                                 keep=keep, wanted=wanted)
        except CacheWriteError as exc:
            writer.discard()
            if strict:
                raise
            self.fail(exc)
            return None
