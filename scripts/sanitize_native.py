#!/usr/bin/env python3
"""The native module's tests under AddressSanitizer and UndefinedBehaviorSanitizer.

Builds ``onnx_prep.native._native`` from this checkout's C sources with
``-fsanitize=address,undefined`` into ``build/sanitize/`` (the installed module is not
touched), then runs the tests that drive the C code (every ISA path, the hand-off, the
stable slots, the attention and norm kernels, bound calls) in a Python that loads that
module instead, with the ASan runtime preloaded. Any out-of-bounds access, use after
free or undefined behaviour in C fails the run with the sanitizer's report; so does a
failing test. CI runs it after the suite (``make sanitize``; .ci/run).

    .venv/bin/python scripts/sanitize_native.py [pytest options] [test files, e.g. tests/test_native_gqa.py]

Why: the kernels take raw pointers from Python (cffi), and a wrong length, stride or
lifetime there corrupts memory silently: a struct field pointing at a cffi array that
had been freed once corrupted the heap, and only a crash far away showed it.

Needs gcc's or clang's sanitizer runtimes (``cc -print-file-name=libasan.so``); exits 2,
saying so, where they are missing. Leak detection is off (Python's own allocations are
not freed at exit), allocations that fail return NULL (tests ask for impossible sizes
on purpose) and a SIGSEGV is left to kill the process as it would (the stable-slot
tests check that a decommitted range faults, in a child process).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "sanitize"
FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g")
TESTS = ["tests/test_native_activation.py", "tests/test_native_elementwise.py", "tests/test_native_gather.py",
         "tests/test_native_gemm.py", "tests/test_native_gqa.py", "tests/test_native_isa.py",
         "tests/test_native_last_kernel.py", "tests/test_native_matmul_nbits.py", "tests/test_native_norm.py",
         "tests/test_native_properties.py", "tests/test_native_reference.py", "tests/test_native_rotary.py",
         "tests/test_native_stable_slot.py", "tests/test_native_format_version.py", "tests/test_handoff.py",
         "tests/test_attention_simd.py", "tests/test_attention_mask_kernel.py", "tests/test_bound_calls.py",
         "tests/test_payload_digest.py"]
_MARK = "ONNX_PREP_SANITIZED_MODULE"  # set in the child: the instrumented module's path


def _runtime(name: str) -> Path | None:
    cc = os.environ.get("CC", "cc")
    try:
        out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(out.strip())
    return path if path.is_absolute() and path.exists() else None


def build() -> Path:
    """The instrumented module, built into BUILD (~3 minutes on 2 vCPUs), or the one
    there when it is newer than every C source and header."""
    built = sorted(BUILD.glob("onnx_prep/native/_native*.so"))
    sources = [*ROOT.glob("native/*.c"), *ROOT.glob("native/*.h"), ROOT / "native" / "build_native.py"]
    if built and built[0].stat().st_mtime > max(p.stat().st_mtime for p in sources):
        print(f"sanitize: {built[0].relative_to(ROOT)} is up to date", flush=True)
        return built[0]
    sys.path.insert(0, str(ROOT / "native"))
    import build_native

    # cffi compiles inside tmpdir, where the builder's relative source paths must resolve
    BUILD.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "native", BUILD / "native", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.so", "*.o", "__pycache__", "_native.c"))
    os.chdir(ROOT)
    t = time.perf_counter()
    so = build_native.builder(FLAGS, FLAGS).compile(tmpdir=str(BUILD), verbose=False)
    print(f"sanitize: built {Path(so).relative_to(ROOT)} in {time.perf_counter() - t:.1f} s "
          f"({' '.join(FLAGS)})", flush=True)
    return Path(so)


def run_tests(module: Path, args: list[str]) -> int:
    """In the child (the runtime preloaded): the instrumented module in place of the
    installed one, then pytest."""
    spec = importlib.util.spec_from_file_location("onnx_prep.native._native", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["onnx_prep.native._native"] = mod
    import pytest

    from onnx_prep.native import _module

    assert _module.lib is mod.lib, "the instrumented module was not the one loaded"
    os.chdir(ROOT)
    named = any(a.endswith(".py") or "tests/" in a for a in args)  # else: options for the default tests
    return pytest.main(["-q", "-p", "no:cacheprovider", *args, *([] if named else TESTS)])


def main() -> int:
    if os.environ.get(_MARK):
        return run_tests(Path(os.environ[_MARK]), sys.argv[1:])
    asan = _runtime("libasan.so")
    if asan is None:
        print("sanitize: no AddressSanitizer runtime (cc -print-file-name=libasan.so); install gcc's "
              "libasan or set CC to a compiler that has one", file=sys.stderr)
        return 2
    module = build()
    # the reports go to files: pytest holds fd 2 while a test runs, and a sanitizer that
    # stops the process would take its report with it
    logs = BUILD / "reports"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    # libstdc++ loaded with the runtime: ASan intercepts C++ throws (onnx's, numpy's
    # extensions') only when it finds the real __cxa_throw at start-up
    preload = [str(asan), *(str(p) for p in [_runtime("libstdc++.so.6")] if p is not None)]
    env = dict(os.environ, LD_PRELOAD=":".join(preload), **{_MARK: str(module)},
               ASAN_OPTIONS=f"detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:handle_segv=0:"
                            f"log_path={logs}/asan",
               UBSAN_OPTIONS=f"print_stacktrace=1:halt_on_error=1:log_path={logs}/ubsan")
    t = time.perf_counter()
    rc = subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode
    for report in sorted(logs.iterdir()):
        print(f"--- {report.name}\n{report.read_text()}", file=sys.stderr)
        rc = rc or 1
    print(f"sanitize: tests {'passed' if rc == 0 else f'FAILED (exit {rc})'} under ASan + UBSan in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
