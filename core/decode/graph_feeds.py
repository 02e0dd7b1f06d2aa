"""The feeds of one forward of any model (``onnx-prep run --inputs / --shape``,
graph_run.py): every graph input, read from the user's ``.npz`` / ``.npy`` files or
generated from the declared shapes, each checked against what the model declares.

``--inputs`` takes ``FILE.npz`` (its arrays by input name) or ``NAME=FILE.npy`` (one
input), repeated and mixed; then every graph input must be given, each once, with the
declared element type (no silent cast) and a shape that fits the declared one: its rank,
its static dims, and the dims ``--shape`` binds.

Without ``--inputs`` every input is generated from its declared shape, with the symbolic
dims bound by ``--shape batch=1,seq=8`` (NAME=N pairs; repeatable). A symbolic dim left
unbound, a dim with neither size nor name, or an input without a declared shape is one
line naming the input and the dim. The generated arrays are deterministic: each input
draws from its own generator seeded by its name (``zlib.crc32``), so a feed does not
depend on the other inputs or their order. Floats are standard normal, integers uniform
in ``[0, GENERATED_INT_HIGH)`` (valid as indices into any axis of 16 or more), bools
uniform. Their bytes are admitted against the memory budget before any is allocated.

Parsing the options (``parse_input_files``, ``parse_shape_bindings``) is light: numpy is
imported inside the functions that build arrays, as ``RunOptions`` checks the options
before the load path is imported.
"""
from __future__ import annotations

import os
import stat
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from onnx_prep.core.errors import UsageError, Where
from onnx_prep.core.model.dtypes import DTYPES

if TYPE_CHECKING:
    import numpy as np

    from onnx_prep.core.model.resolved_model import ValueInfo

MAX_DIM = (1 << 31) - 1  # a --shape value: no ONNX Runtime dim is wider
GENERATED_INT_HIGH = 16  # generated integer inputs are uniform in [0, 16)
GENERATED = "generated"  # the source of a generated feed
_GENERATED_KINDS = "fiub"  # float, signed, unsigned, bool: what generation knows how to draw
_BIND_HINT = "bind it with --shape"
_GIVE_HINT = "give the input with --inputs NAME=FILE.npy"


@dataclass(frozen=True)
class InputFile:
    """One ``--inputs`` value: ``NAME=FILE.npy`` (``name`` set) or ``FILE.npz`` (None:
    an archive of arrays by input name)."""

    path: Path
    name: str | None = None

    def __str__(self) -> str:
        return str(self.path) if self.name is None else f"{self.name}={self.path}"


def parse_input_files(values: Sequence[str]) -> tuple[InputFile, ...]:
    """The ``--inputs`` values: ``NAME=FILE`` where the text before the first ``=`` is
    not empty and holds no ``/`` (a path with ``=`` in a folder name stays a path), else
    a path ending in ``.npz``. ``UsageError`` for anything else."""
    files = []
    for text in values:
        name, sep, path = text.partition("=")
        if sep and name and path and "/" not in name and os.sep not in name:
            files.append(InputFile(Path(path), name))
        elif text.lower().endswith(".npz"):
            files.append(InputFile(Path(text)))
        else:
            raise UsageError(f"--inputs takes FILE.npz or NAME=FILE.npy, got {text!r}")
    return tuple(files)


def parse_shape_bindings(values: Sequence[str]) -> dict[str, int]:
    """The ``--shape`` values (``batch=1,seq=8``; repeatable) as symbol -> size, each
    size 0 to ``MAX_DIM``. A symbol bound twice to different sizes is a ``UsageError``."""
    bindings: dict[str, int] = {}
    for text in values:
        for pair in text.split(","):
            name, sep, value = (part.strip() for part in pair.partition("="))
            if not sep or not name or not value.isdigit() or not value.isascii():
                raise UsageError(f"--shape takes NAME=N pairs (e.g. batch=1,seq=8), got {pair.strip()!r}")
            size = int(value)
            if size > MAX_DIM:
                raise UsageError(f"--shape {name}={value}: a dim must be at most {MAX_DIM:,}")
            if bindings.get(name, size) != size:
                raise UsageError(f"--shape binds {name!r} twice: {bindings[name]} and {size}")
            bindings[name] = size
    return bindings


@dataclass(frozen=True)
class GraphFeeds:
    """Every graph input's array, and where each came from (a file, or ``GENERATED``)."""

    arrays: Mapping[str, "np.ndarray"]
    sources: Mapping[str, str]

    def to_json(self) -> list[dict]:
        return [{"name": n, "dtype": str(a.dtype), "shape": list(a.shape), "source": self.sources[n]}
                for n, a in self.arrays.items()]


def graph_feeds(inputs: Sequence[ValueInfo], files: Sequence[InputFile], bindings: Mapping[str, int], *,
                model: str, budget: int) -> GraphFeeds:
    """The feeds of one forward: read from ``files`` when any is given, else generated
    (the module docstring's rules). ``budget``: the bytes generated inputs may take.
    Raises ``UsageError`` naming the input, the dim or the file."""
    symbols = {d for vi in inputs for d in (vi.shape or ()) if isinstance(d, str)}
    unknown = sorted(set(bindings) - symbols)
    if unknown:
        raise UsageError(f"--shape binds {', '.join(map(repr, unknown))}, which is no symbolic dim of the "
                         f"model's inputs", Where(model=model),
                         hint=f"its symbolic dims: {', '.join(sorted(symbols)) or 'none'}")
    if files:
        return _read_feeds(inputs, files, bindings, model)
    return _generate_feeds(inputs, bindings, model, budget)


def _numpy_dtype(vi: ValueInfo, model: str) -> "np.dtype":
    dt = DTYPES.get(vi.elem_type)
    if dt is None or dt.bits == 0:
        raise UsageError(f"input {vi.name!r} has element type {dt.name if dt else vi.elem_type}, which run cannot "
                         "feed", Where(model=model, tensor=vi.name))
    return dt.numpy


def _shape_text(shape: Sequence) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


# ---------------------------------------------------------------- from files

def _read_feeds(inputs, files, bindings, model) -> GraphFeeds:
    declared = {vi.name: vi for vi in inputs}
    arrays: dict[str, np.ndarray] = {}
    sources: dict[str, str] = {}
    for f in files:
        for name, array in _load(f):
            where = Where(model=model, tensor=name, file=str(f.path))
            if name not in declared:
                raise UsageError(f"{name!r} is not an input of the model", where,
                                 hint=f"its inputs: {', '.join(declared) or 'none'}")
            if name in arrays:
                raise UsageError(f"input {name!r} is given twice (also in {sources[name]})", where)
            _check_given(declared[name], array, bindings, model, where)
            arrays[name], sources[name] = array, str(f.path)
    missing = [n for n in declared if n not in arrays]
    if missing:
        raise UsageError(f"--inputs gives no array for input(s) {', '.join(map(repr, missing))}",
                         Where(model=model), hint="give every input, or omit --inputs to generate them all")
    return GraphFeeds({n: arrays[n] for n in declared}, {n: sources[n] for n in declared})


def _load(f: InputFile) -> list[tuple[str, "np.ndarray"]]:
    """(name, array) pairs of one file, read whole; never unpickles."""
    import numpy as np

    where = Where(file=str(f.path))
    try:
        if not stat.S_ISREG(os.stat(f.path).st_mode):  # a FIFO or a device would block or never end
            raise UsageError("an --inputs file must be a regular file", where)
        loaded = np.load(f.path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):  # a .npy
            pairs = [("", loaded)]
        else:
            with loaded:
                pairs = list(loaded.items())
    except FileNotFoundError as exc:
        raise UsageError("--inputs file not found", where) from exc
    except OSError as exc:
        raise UsageError(f"cannot read the --inputs file: {exc.strerror or exc}", where) from exc
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"not a .npy or .npz file numpy reads without pickle: {first}", where) from exc
    if f.name is None:
        if pairs and pairs[0][0] == "":
            raise UsageError("a .npz --inputs file holds one array, not an archive", where,
                             hint="give a .npy as NAME=FILE.npy")
        return pairs
    if len(pairs) != 1 or pairs[0][0] != "":
        raise UsageError(f"--inputs {f.name}=FILE takes a .npy (one array), got an archive of {len(pairs)}",
                         where, hint="give an archive as FILE.npz, its arrays named by input")
    return [(f.name, pairs[0][1])]


def _check_given(vi: ValueInfo, array, bindings, model, where: Where) -> None:
    expected = _numpy_dtype(vi, model)
    if array.dtype != expected:
        raise UsageError(f"input {vi.name!r} is {array.dtype}, expected {expected}", where,
                         hint="convert the array; run never casts an input")
    if vi.shape is None:
        return
    got = list(array.shape)
    if len(got) != len(vi.shape):
        raise UsageError(f"input {vi.name!r} has shape {got}, expected {_shape_text(vi.shape)} "
                         f"(rank {len(vi.shape)})", where)
    for i, (dim, size) in enumerate(zip(vi.shape, got)):
        want = bindings.get(dim) if isinstance(dim, str) else dim
        if want is not None and want != size:
            bound = f", --shape {dim}={want}" if isinstance(dim, str) else ""
            raise UsageError(f"input {vi.name!r} has shape {got}, expected {_shape_text(vi.shape)} "
                             f"(dim {i}: {want}{bound})", where)


# ---------------------------------------------------------------- generated

def _generate_feeds(inputs, bindings, model, budget) -> GraphFeeds:
    import numpy as np

    plans = []
    for vi in inputs:
        where = Where(model=model, tensor=vi.name)
        if vi.shape is None:
            raise UsageError(f"input {vi.name!r} declares no shape: it cannot be generated", where,
                             hint=_GIVE_HINT)
        shape = []
        for i, dim in enumerate(vi.shape):
            if dim is None:
                raise UsageError(f"input {vi.name!r} dim {i} has neither a size nor a name", where, hint=_GIVE_HINT)
            if isinstance(dim, str):
                if dim not in bindings:
                    raise UsageError(f"input {vi.name!r} dim {i} is the symbolic {dim!r}, which --shape does "
                                     "not bind", where, hint=f"{_BIND_HINT} {dim}=N")
                dim = bindings[dim]
            shape.append(dim)
        dtype = _numpy_dtype(vi, model)
        if dtype.kind not in _GENERATED_KINDS and dtype.name != "bfloat16":
            raise UsageError(f"input {vi.name!r} is {dtype}, which run does not generate", where, hint=_GIVE_HINT)
        plans.append((vi.name, tuple(shape), dtype))
    sizes = [(name, int(np.prod(shape, dtype=object)) * dtype.itemsize) for name, shape, dtype in plans]
    total = sum(n for _, n in sizes)
    if total > budget:
        from onnx_prep.core.runtime.memory_size import format_size

        largest = max(sizes, key=lambda s: s[1])
        raise UsageError(f"the generated inputs need {format_size(total)} (input {largest[0]!r}: "
                         f"{format_size(largest[1])}), over the memory budget of {format_size(budget)}",
                         Where(model=model), hint="lower the --shape sizes, or raise --memory-budget")
    arrays = {name: _draw(name, shape, dtype) for name, shape, dtype in plans}
    return GraphFeeds(arrays, dict.fromkeys(arrays, GENERATED))


def _draw(name: str, shape: tuple[int, ...], dtype) -> "np.ndarray":
    import numpy as np

    rng = np.random.default_rng(zlib.crc32(name.encode("utf-8")))
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.integers(0, GENERATED_INT_HIGH, size=shape).astype(dtype)
