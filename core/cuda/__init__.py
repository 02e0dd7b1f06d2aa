"""CUDA: device discovery, ``--device`` selection, stable-VA device slots over a driver
protocol, the device INT4 matmul, INT4 prepack, tensor ops and decoder ops (NVRTC), a
resolved model's nodes run on the device (DeviceGraphRunner), decode-step graph capture
with its predicate, and the device a session loads its weights onto (docs/cuda.md).
Optional at install (``pip install 'onnx-prep[cuda]'``: cuda-python) and imported only
when a CUDA path is asked for; nothing here runs on the CPU path."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "DeviceDriver": "driver",
    "DriverCallError": "driver",
    "DriverUnavailable": "driver",
    "CudaPythonDriver": "cuda_python_driver",
    "DeviceInfo": "device_probe",
    "DeviceProbe": "device_probe",
    "probe_devices": "device_probe",
    "devices_record": "device_probe",
    "DEVICES": "device_selection",
    "require_device": "device_selection",
    "DeviceSlotPool": "device_slot_pool",
    "DeviceSlotCounters": "device_slot_pool",
    "DeviceView": "device_slot_pool",
    "CaptureDecision": "graph_capture",
    "capture_decision": "graph_capture",
    "DeviceInt4Matmul": "device_int4_matmul",
    "DeviceInt4Prepack": "device_int4_prepack",
    "Int4Source": "device_int4_prepack",
    "PrepackStaging": "device_int4_prepack",
    "DeviceDecoderOps": "device_decoder_ops",
    "KernelCompileError": "nvrtc_program",
    "StepGraph": "step_graph",
    "StepGraphCounters": "step_graph",
    "WeightResidency": "weight_residency",
    "ResidencyCounters": "weight_residency",
    "DeviceDecoder": "device_decoder",
    "DeviceTensorOps": "device_tensor_ops",
    "DEVICE_LAUNCHERS": "device_launchers",
    "register_launcher": "device_launchers",
    "DeviceGraphRunner": "device_graph",
    "DeviceObject": "device_graph",
    "CudaSessionDevice": "session_device",
})
