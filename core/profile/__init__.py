"""Measurement helpers: what else used the machine during a benchmark."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "MachineActivity": "machine_activity",
    "describe": "machine_activity",
    "cpu_model": "machine",
    "describe_machine": "machine",
})
