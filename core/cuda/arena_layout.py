"""ArenaLayout: where a device step's values live in one arena, decided on the host before
anything is issued.

A step's values are placed in the order its nodes run and given back once their last
reader ran (the device graph runner's liveness: core/cuda/device_graph.py), so a later
value reuses the place of one that is dead. First fit over a sorted, merged free list:
the arena's size (``end``) is the step's peak, not the sum of its values. Reuse is safe
because one stream runs the step's work in order: a value's last reader is queued
before the launch that overwrites its place.
"""
from __future__ import annotations

__all__ = ["ARENA_ALIGN", "ArenaLayout", "Region"]

ARENA_ALIGN = 256  # every place starts on a 256-byte boundary: aligned for any load


class ArenaLayout:
    """First-fit places in one arena: offsets, ``ARENA_ALIGN``-byte aligned; ``end`` is
    the arena's size so far (its peak)."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (offset, size), sorted, merged
        self.end = 0

    def alloc(self, nbytes: int) -> int:
        size = max(-(-nbytes // ARENA_ALIGN), 1) * ARENA_ALIGN
        for k, (offset, room) in enumerate(self.free):
            if room >= size:
                self.free[k:k + 1] = [(offset + size, room - size)] if room > size else []
                return offset
        offset, self.end = self.end, self.end + size
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        size = max(-(-nbytes // ARENA_ALIGN), 1) * ARENA_ALIGN
        self.free.append((offset, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self.free = merged


class Region:
    """A place in the arena, shared by a value and its views (``refs``)."""

    __slots__ = ("offset", "nbytes", "refs")

    def __init__(self, offset: int, nbytes: int) -> None:
        self.offset, self.nbytes, self.refs = offset, nbytes, 0
