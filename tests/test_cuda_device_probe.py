"""Device discovery: each reason CUDA may be unusable, in one line, and the devices when
it is usable. Without cuda-python (this CI) the real probe is run and must say so; the
driver library's absence is the real loader's answer; the driver's own answers come
from the fake driver (tests/fake_cuda_driver.py), which refuses what the real one does."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fake_cuda_driver import MiB, FakeDriver

import onnx_prep.core.cuda
from onnx_prep import native
from onnx_prep.core.cuda.cuda_python_driver import import_binding
from onnx_prep.core.cuda.device_probe import DeviceProbe, describe_device, devices_record, probe_devices
from onnx_prep.core.cuda.device_selection import refuse_on_device, require_device
from onnx_prep.core.cuda.driver import DRIVER_LIBRARY, DriverUnavailable, load_driver_library
from onnx_prep.core.errors import EXIT_UNUSABLE, DeviceError, UsageError



def _has_cuda_python() -> bool:
    try:
        import_binding()
    except DriverUnavailable:
        return False
    return True


HAS_CUDA_PYTHON = _has_cuda_python()


def test_every_cuda_module_imports_without_cuda_python():
    """In a fresh interpreter, so nothing imported before hides a missing import."""
    # every module of the package, listed from its folder, so a new one cannot be missed
    folder = Path(onnx_prep.core.cuda.__file__).parent
    modules = ["onnx_prep.core.cuda", "onnx_prep.cli.devices"] + sorted(
        f"onnx_prep.core.cuda.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__")
    assert "onnx_prep.core.cuda.weight_residency" in modules
    code = ("import importlib, sys\n"
            "sys.modules['cuda'] = None  # as if cuda-python were not installed\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "import onnx_prep.core.cuda as c\n"
            "for name in c.__all__: getattr(c, name)\n"
            "print('cuda' in sys.modules and sys.modules['cuda'] is not None)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"  # importing them did not import cuda-python


@pytest.mark.skipif(HAS_CUDA_PYTHON, reason="cuda-python is installed here: its absence cannot be probed")
def test_without_cuda_python_the_probe_says_so():
    probe = probe_devices()
    assert probe == DeviceProbe(usable=False, reason="cuda-python not installed (pip install 'onnx-prep[cuda]')")
    assert probe.one_line() == "CUDA not usable: cuda-python not installed (pip install 'onnx-prep[cuda]')"


def test_a_missing_driver_library_is_named_with_the_loaders_error():
    try:
        load_driver_library()
    except DriverUnavailable as exc:  # this machine: no driver
        assert exc.reason.startswith(f"the CUDA driver library {DRIVER_LIBRARY} is missing (")
    with pytest.raises(DriverUnavailable, match=r"^the CUDA driver library libcuda-not-here\.so\.1 is missing \(.+\)$"):
        load_driver_library("libcuda-not-here.so.1")


def test_unavailable_and_failing_drivers_give_one_line_reasons():
    def missing():
        raise DriverUnavailable("the CUDA driver library libcuda.so.1 is missing (not found)",
                                "cuda.bindings.driver 13")

    assert probe_devices(missing).reason == "the CUDA driver library libcuda.so.1 is missing (not found)"
    assert probe_devices(missing).binding == "cuda.bindings.driver 13"  # the package was found
    probe = probe_devices(lambda: FakeDriver(init_error="CUDA_ERROR_NO_DEVICE"))
    assert not probe.usable and probe.reason == "cuInit failed: CUDA_ERROR_NO_DEVICE (100)"
    assert probe.binding == "fake driver"
    probe = probe_devices(lambda: FakeDriver(devices=0))
    assert not probe.usable and probe.reason == "no CUDA device (cuDeviceGetCount found 0)"
    assert probe.driver_version == 12040
    for p in (probe, probe_devices(missing)):
        assert "\n" not in p.one_line() and p.devices == ()


def test_a_usable_device_is_described_with_what_the_driver_reports():
    fake = FakeDriver(devices=2, memory=80 << 30, granularity=2 * MiB, name="Fake H100", capability=(9, 0))
    probe = probe_devices(lambda: fake)
    assert probe.usable and probe.reason is None and len(probe.devices) == 2
    d = probe.devices[1]
    assert (d.ordinal, d.name, d.compute_capability, d.total_memory, d.vmm_supported, d.granularity) == \
        (1, "Fake H100", (9, 0), 80 << 30, True, 2 * MiB)
    assert ("cuMemGetAllocationGranularity", 1) in fake.calls  # asked, not assumed
    assert probe.one_line() == ("CUDA usable (driver 12.4, fake driver): device 0: Fake H100, compute 9.0, 80 GiB, "
                                "VMM yes, granularity 2 MiB; device 1: Fake H100, compute 9.0, 80 GiB, VMM yes, "
                                "granularity 2 MiB")
    other = FakeDriver(granularity=64 << 10)
    other.init()
    assert describe_device(other, 0).granularity == 64 << 10


def test_a_device_without_vmm_reports_no_granularity():
    probe = probe_devices(lambda: FakeDriver(vmm=False))  # the fake refuses the granularity query there
    assert probe.usable and probe.devices[0].vmm_supported is False and probe.devices[0].granularity is None
    assert probe.devices[0].one_line().endswith("VMM no")


def test_a_driver_call_failing_while_describing_makes_cuda_unusable_naming_the_call():
    probe = probe_devices(_BadName)
    assert not probe.usable
    assert probe.reason == "device 0: cuDeviceGetName failed: CUDA_ERROR_INVALID_DEVICE (101): device 7"


class _BadName(FakeDriver):
    def device_name(self, ordinal):  # the driver answering an error where it answered a count
        return super().device_name(ordinal + 7)


def test_the_devices_record_matches_its_schema():
    import json
    from importlib import resources

    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema not installed: schema check skipped")

    schema = json.loads(resources.files("onnx_prep.core").joinpath("schemas/devices.schema.json").read_text())
    for probe in (probe_devices(lambda: FakeDriver(devices=2)), probe_devices(lambda: FakeDriver(vmm=False)),
                  probe_devices(lambda: FakeDriver(devices=0))):
        doc = devices_record(probe)
        jsonschema.validate(doc, schema)
        assert doc["cpu"]["amx_tiles"] == (doc["cpu"]["isa"] == "avx512" and native.cpu_features()["amx"])
        assert doc["summary"] == probe.one_line()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "extra": 1}, schema)


def test_require_device_refuses_cuda_with_the_reason_and_never_falls_back():
    assert require_device("cpu") is None  # nothing to check
    with pytest.raises(UsageError, match=r"--device must be one of \['cpu', 'cuda'\], got 'tpu'"):
        require_device("tpu")
    with pytest.raises(DeviceError) as unusable:
        require_device("cuda", probe_devices(lambda: FakeDriver(init_error="CUDA_ERROR_NO_DEVICE")))
    assert unusable.value.one_line() == ("--device cuda: CUDA is not usable: cuInit failed: CUDA_ERROR_NO_DEVICE "
                                         "(100); use --device cpu")
    assert unusable.value.exit_code == EXIT_UNUSABLE
    probe = require_device("cuda", probe_devices(lambda: FakeDriver(name="Fake H200")))
    assert probe.usable and probe.devices[0].name == "Fake H200"
    with pytest.raises(DeviceError) as not_there:  # usable, but this command has no device path
        refuse_on_device("the load profile", probe)
    line = not_there.value.one_line()
    assert line == ("--device cuda: the load profile does not run on a device yet; found Fake H200 (device 0); "
                    "use --device cpu; docs/cuda.md says what runs on a device")
    assert not_there.value.exit_code == EXIT_UNUSABLE
