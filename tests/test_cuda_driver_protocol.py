"""The driver protocol's device-step calls (core/cuda/driver.py, items 5-10): both
drivers have every method with the protocol's parameters; every cuda-python name the
real one calls exists in the installed binding (skipped where cuda-python is absent);
and the fake refuses, with the real CUresult code, each misuse the real driver refuses
(so the tests that run on it could fail), queues stream work until a synchronisation,
times events, and replays a graph's captured work exactly."""
from __future__ import annotations

import ast
import ctypes
import inspect
from pathlib import Path

import numpy as np
import pytest
from fake_cuda_driver import FakeDriver, ready

from onnx_prep.core.cuda import cuda_python_driver
from onnx_prep.core.cuda.cuda_python_driver import CudaPythonDriver
from onnx_prep.core.cuda.driver import DeviceDriver, DriverCallError, DriverUnavailable


def protocol_methods() -> list[str]:
    return [n for n, v in vars(DeviceDriver).items() if callable(v) and not n.startswith("_")]


def test_both_drivers_have_every_protocol_method_with_its_parameters():
    assert len(protocol_methods()) >= 40
    for name in protocol_methods():
        want = list(inspect.signature(getattr(DeviceDriver, name)).parameters)
        for impl in (CudaPythonDriver, FakeDriver):
            assert list(inspect.signature(getattr(impl, name)).parameters) == want, f"{impl.__name__}.{name}"


def _binding():
    try:
        return cuda_python_driver.import_binding()[0]
    except DriverUnavailable as exc:
        return exc.reason


BINDING = _binding()


@pytest.mark.skipif(isinstance(BINDING, str), reason=f"needs cuda-python: {BINDING}")
def test_every_binding_name_the_real_driver_calls_exists_in_cuda_python():
    module = BINDING
    tree = ast.parse(Path(cuda_python_driver.__file__).read_text())
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Attribute) and node.value.attr == "cu"}
    assert {"cuLaunchKernel", "cuStreamBeginCapture", "cuGraphInstantiate", "cuMemAllocHost"} <= names
    missing = sorted(n for n in names if not hasattr(module, n))
    assert missing == [], f"not in {module.__name__}: {missing}"
    modes = module.CUstreamCaptureMode
    assert hasattr(modes, "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL")
    assert hasattr(module.CUstream_flags, "CU_STREAM_NON_BLOCKING")


def _device():
    d = ready()
    d.use_device(0)
    return d


def _launch_unloaded(d):
    module = d.module_from_source('extern "C" __global__ void int4_matmul_tiled(int x) {}', "k.cu", 0)
    function = d.module_function(module, "int4_matmul_tiled")
    d.module_unload(module)
    d.launch(function, (1, 1, 1), (256, 1, 1), 0, d.stream_create(), ())


def _capture_twice(d):
    s = d.stream_create()
    d.begin_capture(s)
    d.begin_capture(s)


def _launch_destroyed_graph(d):
    s = d.stream_create()
    d.begin_capture(s)
    graph_exec = d.graph_instantiate(d.end_capture(s))
    d.graph_exec_destroy(graph_exec)
    d.graph_launch(graph_exec, s)


def _sync_while_capturing(d):
    s = d.stream_create()
    d.begin_capture(s)
    try:
        d.stream_synchronize(s)
    finally:
        with pytest.raises(DriverCallError, match=r"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED \(901\)"):
            d.end_capture(s)  # the capture is invalidated: its end says so


def _capture_pageable_copy(d):
    s, address = d.stream_create(), d.mem_alloc(64)
    d.begin_capture(s)
    d.copy_to_device_async(address, np.zeros(64, np.uint8), s)


def _elapsed_before_it_ran(d):
    s, a, b = d.stream_create(), d.event_create(), d.event_create()
    d.event_record(a, s)
    d.event_record(b, s)
    d.event_elapsed_ms(a, b)


@pytest.mark.parametrize("misuse,error", [
    (lambda d: d.mem_free(0x1234), r"cuMemFree failed: CUDA_ERROR_INVALID_VALUE \(1\)"),
    (lambda d: d.copy_to_device_async(d.mem_alloc(64) + 32, d.host_alloc(64), d.stream_create()),
     r"cuMemcpyHtoDAsync failed: CUDA_ERROR_INVALID_VALUE \(1\).*not mapped or allocated"),
    (lambda d: d.copy_to_host_async(d.host_alloc(8), 0x99, d.stream_create()), "cuMemcpyDtoHAsync failed"),
    (lambda d: (s := d.stream_create(), d.stream_destroy(s), d.stream_synchronize(s)),
     r"cuStreamSynchronize failed: CUDA_ERROR_INVALID_HANDLE \(400\)"),
    (_launch_unloaded, r"cuLaunchKernel failed: CUDA_ERROR_INVALID_HANDLE \(400\)"),
    (lambda d: d.module_function(d.module_from_source('extern "C" __global__ void f(int x) {}', "k.cu", 0), "g"),
     r"cuModuleGetFunction failed: CUDA_ERROR_NOT_FOUND \(500\)"),
    (lambda d: d.module_from_source("int x;", "k.cu", 0), "cuModuleLoadData failed"),
    (lambda d: d.launch(d.module_function(d.module_from_source('extern "C" __global__ void f(int x) {}', "k.cu", 0),
                                          "f"), (1, 1, 1), (32, 1, 1), 0, d.stream_create(), ()),
     r"CUDA_ERROR_NOT_SUPPORTED \(801\).*cannot run f"),
    (lambda d: d.launch(d.module_function(d.module_from_source(
        'extern "C" __global__ void int4_matmul_tiled(int x) {}', "k.cu", 0), "int4_matmul_tiled"),
        (1, 1, 1), (1024, 2, 1), 0, d.stream_create(), ()), r"cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"),
    (lambda d: d.launch(d.module_function(d.module_from_source(
        'extern "C" __global__ void int4_matmul_tiled(int x) {}', "k.cu", 0), "int4_matmul_tiled"),
        (1, 1, 1), (256, 1, 1), 0, d.stream_create(), ((ctypes.c_int32, 1),)), "fake-only check"),
    (_capture_twice, r"cuStreamBeginCapture failed: CUDA_ERROR_ILLEGAL_STATE \(401\)"),
    (lambda d: d.end_capture(d.stream_create()), r"cuStreamEndCapture failed: CUDA_ERROR_ILLEGAL_STATE \(401\)"),
    (_launch_destroyed_graph, r"cuGraphLaunch failed: CUDA_ERROR_INVALID_VALUE \(1\)"),
    (_sync_while_capturing, r"cuStreamSynchronize failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED \(900\)"),
    (_capture_pageable_copy, r"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED \(900\).*pageable"),
    (lambda d: d.event_elapsed_ms(d.event_create(), d.event_create()),
     r"cuEventElapsedTime failed: CUDA_ERROR_INVALID_HANDLE \(400\).*never recorded"),
    (_elapsed_before_it_ran, r"CUDA_ERROR_NOT_READY \(600\)"),
    (lambda d: d.host_free(np.zeros(8, np.uint8)), "cuMemFreeHost failed"),
], ids=["free unknown", "copy past an allocation", "copy from nowhere", "destroyed stream", "unloaded function",
        "unknown function name", "no kernel in source", "kernel the fake cannot run", "block over 1024 threads",
        "wrong arguments", "capture begun twice", "capture not begun", "destroyed graph", "sync while capturing",
        "captured pageable copy", "event never recorded", "event not run yet", "free pageable host memory"])
def test_the_fake_refuses_each_misuse_the_real_driver_refuses(misuse, error):
    with pytest.raises(DriverCallError, match=error):
        misuse(_device())


def test_stream_work_waits_for_a_synchronisation_and_events_time_it():
    d = _device()
    s = d.stream_create()
    address, src, dst = d.mem_alloc(16), d.host_alloc(16), d.host_alloc(16)
    src[:] = np.arange(16, dtype=np.uint8)
    start, end = d.event_create(), d.event_create()
    d.event_record(start, s)
    d.copy_to_device_async(address, src, s)
    d.copy_to_host_async(dst, address, s)
    d.event_record(end, s)
    assert not dst.any() and d.copy_to_host(address, 16) == bytes(16)  # queued only
    d.event_synchronize(end)
    assert dst.tolist() == list(range(16))
    assert d.event_elapsed_ms(start, end) == pytest.approx(0.003)  # the fake clock: 1 us per op
    for e in (start, end):
        d.event_destroy(e)
    d.stream_destroy(s)
    d.mem_free(address)
    d.host_free(src)
    d.host_free(dst)
    assert d.live() == {"allocations": 0, "host_buffers": 0, "streams": 0, "events": 0, "modules": 0, "graphs": 0}


def test_an_event_recorded_again_stands_for_its_latest_record():
    """cuEventRecord's rule: waiting on a re-recorded event waits for the work before its
    latest record, not the first (what a staging buffer reused across prepacks relies on)."""
    d = _device()
    s = d.stream_create()
    address, first, second, back = d.mem_alloc(4), d.host_alloc(4), d.host_alloc(4), d.host_alloc(4)
    first[:], second[:] = 1, 2
    done = d.event_create()
    d.copy_to_device_async(address, first, s)
    d.event_record(done, s)
    d.copy_to_device_async(address, second, s)
    d.copy_to_host_async(back, address, s)
    d.event_record(done, s)
    d.event_synchronize(done)
    assert back.tolist() == [2, 2, 2, 2]  # everything before the latest record ran
    d.event_destroy(done)
    d.stream_destroy(s)
    d.mem_free(address)
    for buf in (first, second, back):
        d.host_free(buf)


def test_a_graph_replays_the_captured_copies_with_their_addresses_reading_what_is_there_now():
    d = _device()
    s = d.stream_create()
    address, src, dst = d.mem_alloc(8), d.host_alloc(8), d.host_alloc(8)
    d.begin_capture(s)
    d.copy_to_device_async(address, src, s)
    d.copy_to_host_async(dst, address, s)
    graph = d.end_capture(s)
    assert d.copy_to_host(address, 8) == bytes(8) and not s.pending  # recorded, neither run nor queued
    graph_exec = d.graph_instantiate(graph)
    for value in (3, 7):
        src[:] = value
        d.graph_launch(graph_exec, s)
        d.stream_synchronize(s)
        assert dst.tolist() == [value] * 8 and d.copy_to_host(address, 8) == bytes([value] * 8)
    d.graph_exec_destroy(graph_exec)
    d.graph_destroy(graph)
    assert d.live()["graphs"] == 0
