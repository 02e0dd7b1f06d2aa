"""Append buffers: a Concat that extends a graph input into a graph output (the KV-cache
pattern ``present = Concat(past, new)``) writes only the new rows, not the whole past.

Without it every decode step copies the entire KV cache: on the medium fixture, one
thread, a decode step at 519-1030 tokens of context took 65.7 ms with copies and 45.1 ms
with append buffers (medians; docs/runtime.md, "Append buffers").

How: the action program marks such a Concat (:data:`~onnx_prep.core.ops.attributes.APPEND_IN_PLACE`).
Its output is then allocated with room along the axis (about 1.5x the length, at least
:data:`MIN_ROOM` more, spread per buffer by :func:`room_after`; or the length the caller
announced with :func:`room_for`) and handed out as a prefix view of that buffer. When the view
comes back as the next step's past, the Concat writes the new rows into the room and
hands out a longer prefix view of the same buffer: per step, the cost is the new rows;
the past is copied only when the room runs out (amortised O(1) per row).

Safety rules (tested):
- Rows once handed out are never written again. Each buffer records how far it has been
  claimed; only a past that ends exactly at the claim may extend it, and the claim moves
  under a lock before any write. A past that ends earlier (a caller re-running an older
  step, branching two continuations, two runs from one context) gets a fresh buffer, a
  copy, exactly as a plain Concat would.
- Shapes are checked before anything is claimed; a mismatch raises numpy's error for
  ``np.concatenate`` and claims nothing. Mixed dtypes take the plain path.
- The values are those of ``np.concatenate`` (a copy is a copy); only the memory they
  live in differs, and outputs are strided views, as other view-returning ops produce.
"""
from __future__ import annotations

import contextvars
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from onnx_prep.core.ops import run_counters

# NOTE: the least room a fresh buffer gets, in rows along the axis: a prompt of a few
# tokens then decodes 64 steps before the first copy, instead of copying at step 2, 3, 5.
MIN_ROOM = 64


# The length along the axis a caller expects its buffers to reach (0: unknown). A fresh
# buffer gets at least that much room, so a decode of known length never grows one.
_ROOM = contextvars.ContextVar("onnx_prep_append_room", default=0)


@contextmanager
def room_for(rows: int) -> Iterator[None]:
    """Within the block, fresh append buffers get room for ``rows`` along their axis
    (``greedy_decode`` passes prompt + tokens; ``Session`` carries it from the thread
    that built the ``RuntimeContext`` to the thread that runs it). A hint, not a limit:
    buffers still grow past it, and one that cannot be allocated falls back to the
    default room."""
    token = _ROOM.set(max(0, int(rows)))
    try:
        yield
    finally:
        _ROOM.reset(token)


def room_hint() -> int:
    """The ``room_for`` value in effect on this thread (0: none)."""
    return _ROOM.get()


class _Claim:
    """How far a buffer's rows have been handed out, the lock that moves it, and the
    prefix view handed out last (weakly: the next step's past is that very object)."""

    __slots__ = ("ref", "length", "lock", "view")

    def __init__(self, base: np.ndarray, length: int) -> None:
        self.ref = weakref.ref(base)
        self.length = length
        self.lock = threading.Lock()
        self.view: weakref.ref | None = None


_claims: dict[int, _Claim] = {}  # id(buffer) -> claim; dropped when the buffer is collected
# What a marked Concat counts (core/ops/run_counters.py: into the run's own counters):
# "kv_appended_in_place", or "kv_copied" into a fresh buffer (RuntimeStats fields).


def _live_claim(base) -> _Claim | None:
    """The claim of ``base`` when it is a live append buffer."""
    if type(base) is not np.ndarray:
        return None
    claim = _claims.get(id(base))
    return claim if claim is not None and claim.ref() is base else None


def held_bytes(arrays) -> int:
    """The memory ``arrays`` keep alive, for budgets: an append buffer's prefix view
    holds its whole buffer (room included), counted once however many views share it;
    any other array counts its own bytes."""
    seen: set[int] = set()
    total = 0
    for a in arrays:
        base = a.base
        if _live_claim(base) is not None:
            if id(base) not in seen:
                seen.add(id(base))
                total += int(base.nbytes)
        else:
            total += int(a.nbytes)
    return total


def _prefix(base: np.ndarray, axis: int, length: int) -> np.ndarray:
    index = [slice(None)] * base.ndim
    index[axis] = slice(0, length)
    return base[tuple(index)]


def _rows(base: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * base.ndim
    index[axis] = slice(start, stop)
    return base[tuple(index)]


def _claim_of(past: np.ndarray, axis: int) -> tuple[np.ndarray, _Claim] | None:
    """(buffer, claim) when ``past`` is a prefix view of a live append buffer."""
    base = past.base
    claim = _live_claim(base)
    if claim is None:
        return None
    last = claim.view
    if last is not None and last() is past:
        # NOTE: the view this buffer handed out (a decode step's past is the step before's
        # present): a view never changes its data, strides or shape, so it still is the
        # prefix the checks below would find; they cost ~3 us a KV Concat
        return base, claim
    if (past.strides != base.strides or past.ndim != base.ndim
            or past.__array_interface__["data"][0] != base.__array_interface__["data"][0]
            or any(past.shape[d] != base.shape[d] for d in range(base.ndim) if d != axis)):
        return None
    return base, claim


def _same_rows(parts: list[np.ndarray], axis: int) -> bool:
    """Every part has the first one's shape off the axis (np.concatenate's rule)."""
    first = parts[0]
    off_axis = [d for d in range(first.ndim) if d != axis]
    return all(p.ndim == first.ndim and all(p.shape[d] == first.shape[d] for d in off_axis)
               for p in parts[1:])


def room_after(total: int, spread: float = 0.5) -> int:
    """Rows of room a fresh buffer of ``total`` rows gets without a hint: half its
    length, at least :data:`MIN_ROOM`, scaled by 0.75-1.25 along ``spread`` in [0, 1).

    NOTE: why the spread: a model's KV buffers all start at the prompt's length and grow
    by one row a step, so with equal room every one of them runs out on the same step,
    and that step copies the whole cache (medium fixture, 1024 tokens without a hint:
    steps of 347-476 ms against ~40-45 ms for their neighbours; with the spread, ~80 ms). The action program gives each
    marked Concat its own spread (its position among them), so the copies fall on
    different steps; the mean room, hence the memory and the copies per row, stays the
    same as with 0.5 everywhere."""
    return int(max(total // 2, MIN_ROOM) * (0.75 + 0.5 * min(max(spread, 0.0), 1.0)))


def concat(parts: list[np.ndarray], axis: int, *, spread: float = 0.5) -> np.ndarray:
    """``np.concatenate(parts, axis)``, appending in place when ``parts[0]`` is the
    claimed prefix of an append buffer with room (see the module docstring). A fresh
    buffer gets :func:`room_after` ``(total, spread)`` rows of room, or the
    :func:`room_for` hint when that is more."""
    past, rest = parts[0], parts[1:]
    if not rest or any(p.dtype != past.dtype for p in rest) or not _same_rows(parts, axis):
        return np.concatenate(parts, axis=axis)  # numpy's result and numpy's errors
    length = past.shape[axis]
    total = length + sum(p.shape[axis] for p in rest)
    out, in_place = extend(past, axis, total, spread=spread)
    if in_place:  # rows [length, total) are this call's alone now
        np.concatenate(rest, axis=axis, out=_rows(out, axis, length, total))
    else:
        np.concatenate(parts, axis=axis, out=out)
    return out


def extend(past: np.ndarray, axis: int, total: int, *, spread: float = 0.5) -> tuple[np.ndarray, bool]:
    """Room for ``total`` rows along ``axis`` after ``past``: ``(view, True)`` when
    ``past`` is the claimed prefix of a live append buffer with room (the view is the
    longer prefix; its first rows are the past's, and rows [past's length, total) are
    the caller's alone to write), else ``(view, False)``: a prefix view of a fresh
    buffer with room (``concat``'s rule), every row of it the caller's to write. Counts
    ``kv_appended_in_place`` or ``kv_copied``."""
    length = past.shape[axis]
    found = _claim_of(past, axis)
    if found is not None:
        base, claim = found
        with claim.lock:
            ok = claim.length == length and total <= base.shape[axis]
            if ok:
                claim.length = total
        if ok:
            run_counters.count("kv_appended_in_place")
            return _handed_out(claim, _prefix(base, axis, total)), True
    shape = list(past.shape)
    default = total + room_after(total, spread)
    shape[axis] = max(default, _ROOM.get())
    try:
        base = np.empty(shape, dtype=past.dtype)
    except MemoryError:  # a hint too large for this machine: the default room
        shape[axis] = default
        base = np.empty(shape, dtype=past.dtype)
    key = id(base)
    claim = _claims[key] = _Claim(base, total)
    weakref.finalize(base, _claims.pop, key, None)
    run_counters.count("kv_copied")
    return _handed_out(claim, _prefix(base, axis, total)), False


def _handed_out(claim: _Claim, view: np.ndarray) -> np.ndarray:
    claim.view = weakref.ref(view)
    return view
