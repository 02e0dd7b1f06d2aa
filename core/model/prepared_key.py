"""PrepackRequest and PreparedKey: the identity of a prepared (packed) object.

Dedup rule (docs/design.md, "Prepared keys and dedup"): two kernels that request the same
(source_lineage, layout, device) share one prepared object; any difference gives a
distinct object. The key is a pure function of those three fields, so it is also
the cache identity (together with the lineage's digests).
"""
from __future__ import annotations

from dataclasses import dataclass

PreparedKey = str  # "P:<lineage joined by '+'>|<layout>|<device>"


@dataclass(frozen=True, slots=True)
class PrepackRequest:
    logical_value: str  # the value name the kernel consumes (e.g. the B input of MatMulNBits)
    source_lineage: tuple[str, ...]  # ordered initializer names the packed bytes derive from
    layout: str  # layout key: names every parameter that changes the packed bytes
    device: str = "cpu"

    @property
    def key(self) -> PreparedKey:
        return f"P:{'+'.join(self.source_lineage)}|{self.layout}|{self.device}"

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "logical_value": self.logical_value,
            "source_lineage": list(self.source_lineage),
            "layout": self.layout,
            "device": self.device,
        }
