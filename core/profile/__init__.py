"""Measuring: the load profile (``onnx-prep profile``), its trace, and what else used
the machine meanwhile."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "MachineActivity": "machine_activity",
    "describe": "machine_activity",
    "cpu_model": "machine",
    "describe_machine": "machine",
    "LoadProfileOptions": "load_profile",
    "profile_load": "load_profile",
    "LoadSpec": "load_sample",
    "measure_load": "load_sample",
    "trace_document": "chrome_trace",
})
