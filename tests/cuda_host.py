"""CUDA kernels run on the host, where no GPU is: a ``.cu`` source the device compiles,
unchanged, built as C++ with a few definitions standing in for CUDA's, so a test can
launch its entries with the grid, block and arguments the Python launcher decides and
compare what they write with the CPU kernels.

The stand-ins (``PRELUDE``): each CUDA thread of a block is a fiber (its own stack,
switched by ``cuda_host_switch``, a few instructions) on the launching host thread;
the blocks run one after another, so a ``__shared__`` array is a ``static`` one (one
block at a time uses it) and dynamic shared memory one buffer, refilled with 0xFF
bytes before every block (NaN floats, so a read before a write shows).
``__syncthreads`` is a barrier among the block's fibers and ``__syncwarp`` and the
``__shfl_*_sync`` shuffles one among a warp's 32 lanes (the consecutive linear thread
ids, as CUDA numbers them) over a per-warp exchange array. The scheduler runs every
ready fiber until it waits at a barrier or returns, in ascending then descending order
by turns: a missing barrier shows deterministically (a thread reads what its
neighbour on either side did or did not write yet), not by chance as with OS threads,
and the shuffles cost nothing like a thread switch each. What CUDA leaves undefined is
refused, loudly, as a :class:`HostKernelFault` naming the block and thread: a barrier
some threads of the block (or lanes of the warp) reach after others returned, or that
none can complete (every fiber left waits), a shuffle with a partial mask or in a warp
of fewer than 32 threads, a misaligned or null ``__ldg``, an argument whose size is not
the parameter's. ``fmaf`` is C's fused one, ``-ffp-contract=off`` keeps ``a * b + c``
two roundings, as written, and the ``__f*_rn`` intrinsics are the IEEE operations;
``tanhf``, ``cosf``, ``sinf``, ``expf`` and the like are the host's libm, not CUDA's
(both within a few ulp of the correctly rounded result: a test holds them to what the
launcher claims, never to bits).

What this cannot show: the device's memory model (here every write is seen by the next
fiber to run), alignment faults of plain loads and stores, out-of-bounds accesses
(they read or corrupt host memory, or crash the process), real warp scheduling (lanes
run one after another between barriers: a race between threads that no barrier
orders shows only in the two orders tried), uninitialised static ``__shared__`` arrays
(they hold the previous block's values, zeros for the first), and NVRTC's code: its
contraction of ``a * b + c`` into FMAs (``--fmad=true``), its approximate intrinsics,
register spills. That is test_cuda_nvrtc*.py's and the GPU tests'.

A source is compiled once per process (cached by the digest of what is compiled, in the
pytest session's temp folder) with ``g++ -std=c++20 -O1``; a test module asks for it
through :func:`host_kernels` (or :func:`host_driver`, for a launcher class), which
skip, saying so, where no C++20 compiler is or the host is not x86-64 Linux (the
fiber switch is written for it)."""
from __future__ import annotations

import ctypes
import hashlib
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

CXX = shutil.which("g++") or shutil.which("c++")
FLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-unknown-pragmas",
         "-fvisibility=hidden", "-shared", "-fPIC", "-pthread")

PRELUDE = r"""
#include <sys/mman.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
constexpr int warpSize = 32;

namespace cuda_host {
// Thrown through the kernel's code: the fiber's launch failed (its message already recorded).
struct Fault {};

// One CUDA thread: a fiber with its own stack on the launching host thread. The
// scheduler runs each ready fiber until it waits at a barrier or returns.
struct Fiber {
    void *sp = nullptr;
    char *stack = nullptr;
    unsigned id = 0;
    enum { Ready, Waiting, Done } state = Done;
};

struct Launch;
inline Launch *launch = nullptr;
inline Fiber *current = nullptr;
inline void *scheduler_sp = nullptr;
inline unsigned lane = 0, warp = 0;
extern "C" void cuda_host_switch(void **save, void *to);
inline void yield() { cuda_host_switch(&current->sp, scheduler_sp); }

// A barrier among `expected` fibers that knows which of them returned from the kernel:
// one reaching it after another returned, or returning while others wait, is a fault (a
// barrier in divergent code: undefined on a device); so is one no ready fiber can
// complete (the scheduler finds it: every fiber left waits).
struct Barrier {
    unsigned expected = 0, arrived = 0, exited = 0;
    const char *name = "", *what = "";
    std::vector<Fiber *> waiters;

    void reset(unsigned n, const char *kind) {
        expected = n, name = kind, arrived = exited = 0, what = "";
        waiters.clear();
    }
    void wait(const char *at);
    void exit();
};

struct Launch {
    dim3 grid, block;
    unsigned threads = 0, warps = 0;
    Barrier block_sync;
    std::vector<Barrier> warp_sync;
    std::vector<std::uint64_t> exchange;  // [warp][lane]
    std::vector<std::max_align_t> dynamic_shared;
    std::string error;
    bool failed = false;
};
}  // namespace cuda_host

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace cuda_host {
inline std::string where() {
    char text[160];
    std::snprintf(text, sizeof text, "block (%u,%u,%u) thread (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z,
                  threadIdx.x, threadIdx.y, threadIdx.z);
    return text;
}

inline void fail(const std::string &message) {
    if (!launch->failed) launch->error = message;
    launch->failed = true;
}

[[noreturn]] inline void fault(const std::string &message) {
    fail(message + " [" + where() + "]");
    throw Fault{};
}

inline void Barrier::wait(const char *at) {
    if (launch->failed) throw Fault{};
    if (exited)
        fault(std::string(at) + " reached after " + std::to_string(exited) + " thread(s) of the " + name +
              " returned: a barrier in divergent code");
    what = at;
    if (++arrived == expected) {  // the last: every waiter is ready again, this one goes on
        arrived = 0;
        for (Fiber *f : waiters) f->state = Fiber::Ready;
        waiters.clear();
        return;
    }
    current->state = Fiber::Waiting;
    waiters.push_back(current);
    yield();
    if (launch->failed) throw Fault{};
}

inline void Barrier::exit() {
    exited++;
    if (arrived && !launch->failed)
        fail("a thread returned while " + std::to_string(arrived) + " other(s) of the " + name +
             " wait at its barrier: a barrier in divergent code [" + where() + "]");
}

inline void check_full_mask(unsigned mask, const char *what) {
    if (mask != 0xffffffffu) {
        char text[120];
        std::snprintf(text, sizeof text, "%s with mask %#x: only the full mask is emulated", what, mask);
        fault(text);
    }
    if (launch->threads % 32) fault(std::string(what) + " in a block of " + std::to_string(launch->threads) +
                                    " threads: its last warp is partial, the full mask undefined");
}

inline void check_width(int width, const char *what) {
    if (width < 1 || width > 32 || (width & (width - 1)))
        fault(std::string(what) + ": width " + std::to_string(width) + " is not a power of two <= 32");
}

// Every lane writes its value, the warp meets, each reads the lane it names (-1: its
// own), the warp meets again (so the next exchange writes after every read).
template <class T> T exchange(T v, int src, const char *what) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "a shuffle moves at most 8 bytes");
    std::uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof v);
    std::uint64_t *slots = launch->exchange.data() + 32 * warp;
    slots[lane] = bits;
    launch->warp_sync[warp].wait(what);
    bits = slots[src < 0 ? lane : src];
    launch->warp_sync[warp].wait(what);
    std::memcpy(&v, &bits, sizeof v);
    return v;
}

inline void *dynamic_shared() { return launch->dynamic_shared.data(); }
}  // namespace cuda_host

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__
#define __align__(n) alignas(n)
#define __shared__ static

static inline void __syncthreads() { cuda_host::launch->block_sync.wait("__syncthreads"); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    cuda_host::check_full_mask(mask, "__syncwarp");
    cuda_host::launch->warp_sync[cuda_host::warp].wait("__syncwarp");
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    cuda_host::check_full_mask(mask, "__shfl_sync");
    cuda_host::check_width(width, "__shfl_sync");
    const int base = (int)cuda_host::lane & ~(width - 1);
    return cuda_host::exchange(v, base + ((src % width) + width) % width, "__shfl_sync");
}
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    cuda_host::check_full_mask(mask, "__shfl_xor_sync");
    cuda_host::check_width(width, "__shfl_xor_sync");
    const int lane = (int)cuda_host::lane, src = lane ^ lane_mask;  // a later group's lane: its own value
    return cuda_host::exchange(v, src >= 32 || (src & ~(width - 1)) > (lane & ~(width - 1)) ? -1 : src,
                               "__shfl_xor_sync");
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    cuda_host::check_full_mask(mask, "__shfl_down_sync");
    cuda_host::check_width(width, "__shfl_down_sync");
    const int lane = (int)cuda_host::lane;
    return cuda_host::exchange(v, (lane & (width - 1)) + (int)delta >= width ? -1 : lane + (int)delta,
                               "__shfl_down_sync");
}
template <class T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    cuda_host::check_full_mask(mask, "__shfl_up_sync");
    cuda_host::check_width(width, "__shfl_up_sync");
    const int lane = (int)cuda_host::lane;
    return cuda_host::exchange(v, (lane & (width - 1)) < (int)delta ? -1 : lane - (int)delta, "__shfl_up_sync");
}
template <class T> static inline T __ldg(const T *p) {
    if ((std::uintptr_t)p < 4096 || (std::uintptr_t)p % alignof(T)) {
        char text[120];
        std::snprintf(text, sizeof text, "__ldg of a %zu-byte value at %p: %s", sizeof(T), (const void *)p,
                      (std::uintptr_t)p < 4096 ? "a null pointer" : "misaligned");
        cuda_host::fault(text);
    }
    return *p;
}
// Atomics on device memory: std::atomic_ref over the same bytes, returning the old value.
template <class T> static inline T atomicAdd(T *p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> static inline T atomicSub(T *p, T v) { return std::atomic_ref<T>(*p).fetch_sub(v); }
template <class T> static inline T atomicOr(T *p, T v) { return std::atomic_ref<T>(*p).fetch_or(v); }
template <class T> static inline T atomicAnd(T *p, T v) { return std::atomic_ref<T>(*p).fetch_and(v); }
template <class T> static inline T atomicXor(T *p, T v) { return std::atomic_ref<T>(*p).fetch_xor(v); }
template <class T> static inline T atomicExch(T *p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <class T> static inline T atomicCAS(T *p, T expected, T v) {
    std::atomic_ref<T>(*p).compare_exchange_strong(expected, v);
    return expected;
}
template <class T> static inline T atomicMax(T *p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {}
    return old;
}
template <class T> static inline T atomicMin(T *p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (v < old && !a.compare_exchange_weak(old, v)) {}
    return old;
}
// CUDA's min / max: fminf / fmaxf for floating point (a NaN loses), else the usual
// arithmetic conversions' common type (int with unsigned compares as unsigned, as there).
template <class A, class B> static inline auto min(A a, B b) {
    using T = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<T>) return std::fmin((T)a, (T)b);
    else return (T)a < (T)b ? (T)a : (T)b;
}
template <class A, class B> static inline auto max(A a, B b) {
    using T = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<T>) return std::fmax((T)a, (T)b);
    else return (T)a < (T)b ? (T)b : (T)a;
}

// The IEEE round-to-nearest operations (never contracted here either) and conversions.
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __ll2float_rn(long long v) { return (float)v; }
static inline float __int2float_rn(int v) { return (float)v; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
"""

# After the kernel's source: each entry's parameters unpacked from kernelParams (as
# cuLaunchKernel takes them), their sizes checked, and the launch.
LAUNCHER = r"""
// x86-64 System V: save the callee-saved registers, MXCSR and the x87 control word on
// this stack, store its pointer in *save, continue on `to`'s (cuda_host_switch's own
// frame there, or a new fiber's first frame).
__asm__(R"(
    .text
    .globl cuda_host_switch
    .hidden cuda_host_switch
    .type cuda_host_switch, @function
cuda_host_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_host_switch, .-cuda_host_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");

namespace cuda_host {
struct Entry {
    const char *name;
    std::vector<std::size_t> sizes;
    std::function<void(void **)> call;
};
template <class... Args, std::size_t... I>
void call_with(void (*f)(Args...), void **params, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<Args>> *>(params[I])...);
}
template <class... Args> Entry entry(const char *name, void (*f)(Args...)) {
    return {name, {sizeof(Args)...}, [f](void **params) { call_with(f, params, std::index_sequence_for<Args...>{}); }};
}

constexpr std::size_t STACK = 256 << 10;  // per fiber, a guard page below it
inline const Entry *running_entry = nullptr;
inline void **running_params = nullptr;

// A fiber's first frame (entered by cuda_host_switch's ret): the kernel, then its end.
void fiber_main() {
    Fiber *f = current;
    try {
        running_entry->call(running_params);
    } catch (const Fault &) {
    } catch (const std::exception &ex) {
        fail(std::string("a C++ exception: ") + ex.what() + " [" + where() + "]");
    }
    launch->block_sync.exit();
    launch->warp_sync[warp].exit();
    f->state = Fiber::Done;
    yield();
    std::abort();  // a finished fiber is never resumed
}

void start(Fiber &f) {
    char *top = f.stack + STACK;  // 16-byte aligned: the mapping is page-aligned
    void **frame = reinterpret_cast<void **>(top - 72);
    const std::uint32_t control[2] = {0x1F80u, 0x037Fu};  // MXCSR and x87 control word at power-on
    std::memcpy(frame, control, 8);
    for (int r = 1; r <= 6; r++) frame[r] = nullptr;  // r15 .. rbp
    frame[7] = reinterpret_cast<void *>(&fiber_main);  // at top - 16: entered with rsp = 8 (mod 16)
    f.sp = frame;
    f.state = Fiber::Ready;
}

// The fibers, kept for the next launch (their stacks mapped once).
std::vector<Fiber> &fibers(unsigned n) {
    static std::vector<Fiber> *all = new std::vector<Fiber>;
    while (all->size() < n) {
        char *map = static_cast<char *>(mmap(nullptr, STACK + 4096, PROT_READ | PROT_WRITE,
                                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
        if (map == MAP_FAILED) throw std::bad_alloc();
        mprotect(map, 4096, PROT_NONE);
        all->push_back(Fiber{});
        all->back().stack = map + 4096;
        all->back().id = (unsigned)all->size() - 1;
    }
    return *all;
}

void enter(Fiber &f) {
    const dim3 b = launch->block;
    threadIdx = {f.id % b.x, (f.id / b.x) % b.y, f.id / (b.x * b.y)};
    lane = f.id % 32, warp = f.id / 32;
    current = &f;
    cuda_host_switch(&scheduler_sp, f.sp);
}

// One block: every fiber started, then sweeps (ascending, then descending, ...: an order
// a missing barrier cannot hide behind) running each ready one until it waits or
// returns; a sweep with none ready while some wait is a barrier they cannot complete.
void run_block(Launch &L, std::vector<Fiber> &fs) {
    L.block_sync.reset(L.threads, "block");
    for (unsigned w = 0; w < L.warps; w++)
        L.warp_sync[w].reset(w + 1 < L.warps || L.threads % 32 == 0 ? 32 : L.threads % 32, "warp");
    std::memset(L.dynamic_shared.data(), 0xFF, L.dynamic_shared.size() * sizeof(std::max_align_t));
    for (unsigned t = 0; t < L.threads; t++) start(fs[t]);
    for (bool up = true;; up = !up) {
        for (unsigned i = 0; i < L.threads; i++) {
            Fiber &f = fs[up ? i : L.threads - 1 - i];
            if (f.state == Fiber::Ready) enter(f);
        }
        bool ready = false, waiting = false;
        for (unsigned t = 0; t < L.threads; t++)
            ready |= fs[t].state == Fiber::Ready, waiting |= fs[t].state == Fiber::Waiting;
        if (!ready && !waiting) return;
        if (ready) continue;
        if (!L.failed) {  // every fiber left waits: a barrier none can complete
            const Barrier *stuck = L.block_sync.waiters.empty() ? nullptr : &L.block_sync;
            for (auto &w : L.warp_sync)
                if (!stuck && !w.waiters.empty()) stuck = &w;
            const Fiber *first = stuck->waiters.front();
            const dim3 b = L.block;
            char at[80];
            std::snprintf(at, sizeof at, " [block (%u,%u,%u) thread (%u,%u,%u)]", blockIdx.x, blockIdx.y, blockIdx.z,
                          first->id % b.x, (first->id / b.x) % b.y, first->id / (b.x * b.y));
            fail(std::string(stuck->what) + ": " + std::to_string(stuck->waiters.size()) + " of the " + stuck->name +
                 "'s " + std::to_string(stuck->expected) +
                 " threads wait, the others never come: a barrier in divergent code" + at);
        }
        for (unsigned t = 0; t < L.threads; t++)  // the launch failed: the waiters throw Fault
            if (fs[t].state == Fiber::Waiting) fs[t].state = Fiber::Ready;
    }
}
}  // namespace cuda_host

static const cuda_host::Entry cuda_host_entries[] = {
    ENTRY_TABLE
};

// 0 when the kernel ran; else 1 and `error` says why.
#define EXPORTED extern "C" __attribute__((visibility("default")))
EXPORTED int cuda_host_launch(const char *name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, std::size_t shared_bytes, void **params, const std::size_t *sizes,
                              int n_params, char *error, std::size_t error_size) {
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> guard(one_at_a_time);
    auto refuse = [&](const std::string &message) {
        std::snprintf(error, error_size, "%s", message.c_str());
        return 1;
    };
    const cuda_host::Entry *e = nullptr;
    for (const auto &candidate : cuda_host_entries)
        if (std::strcmp(candidate.name, name) == 0) e = &candidate;
    if (!e) return refuse(std::string("no entry named ") + name);
    if ((std::size_t)n_params != e->sizes.size())
        return refuse(std::string(name) + " takes " + std::to_string(e->sizes.size()) + " parameters, " +
                      std::to_string(n_params) + " given");
    for (int i = 0; i < n_params; i++)
        if (sizes[i] != e->sizes[i])
            return refuse(std::string(name) + "'s parameter " + std::to_string(i) + " is " +
                          std::to_string(e->sizes[i]) + " bytes, the argument " + std::to_string(sizes[i]));
    const unsigned long threads = (unsigned long)bx * by * bz;
    if (!gx || !gy || !gz || !threads || threads > 1024)
        return refuse("grid (" + std::to_string(gx) + "," + std::to_string(gy) + "," + std::to_string(gz) +
                      ") of blocks (" + std::to_string(bx) + "," + std::to_string(by) + "," + std::to_string(bz) +
                      "): empty, or over 1024 threads a block");
    cuda_host::Launch L;
    L.grid = {gx, gy, gz}, L.block = {bx, by, bz};
    L.threads = (unsigned)threads, L.warps = (unsigned)((threads + 31) / 32);
    L.warp_sync = std::vector<cuda_host::Barrier>(L.warps);
    L.exchange.assign(32 * L.warps, 0);
    L.dynamic_shared.resize((shared_bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t) + 1);
    std::vector<cuda_host::Fiber> &fs = cuda_host::fibers(L.threads);
    cuda_host::launch = &L;
    cuda_host::running_entry = e, cuda_host::running_params = params;
    blockDim = L.block, gridDim = L.grid;
    for (unsigned z = 0; z < gz && !L.failed; z++)
        for (unsigned y = 0; y < gy && !L.failed; y++)
            for (unsigned x = 0; x < gx && !L.failed; x++) {
                blockIdx = {x, y, z};
                cuda_host::run_block(L, fs);
            }
    cuda_host::launch = nullptr;
    if (L.failed) return refuse(name + std::string(": ") + L.error);
    return 0;
}
"""

SHARED_DECLARATION = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?(?P<type>[A-Za-z_][\w\s]*?)\s*"
    r"(?:__align__\s*\(\s*\d+\s*\)\s*)?(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;")


class HostKernelFault(AssertionError):
    """A launch the emulation refused or a kernel that did what CUDA leaves undefined."""


def host_source(source: str) -> str:
    """``source`` with each ``extern __shared__ T name[];`` (dynamic shared memory) made
    a name for the launch's one buffer: ``static`` cannot stand in for ``extern``."""
    return SHARED_DECLARATION.sub(
        lambda m: f"\n#define {m['name']} (reinterpret_cast<{m['type'].strip()} *>(cuda_host::dynamic_shared()))\n",
        source)


class HostKernels:
    """One source's entries, built for the host: :meth:`launch` runs one to completion."""

    def __init__(self, library: Path, entries: Sequence[str]) -> None:
        self.library = library
        self.entries = tuple(entries)
        self._lib = ctypes.CDLL(str(library))
        f = self._lib.cuda_host_launch
        f.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                                                                 ctypes.POINTER(ctypes.c_size_t), ctypes.c_int,
                                                                 ctypes.c_char_p, ctypes.c_size_t]
        f.restype = ctypes.c_int
        self.launches: list[str] = []

    def launch(self, name: str, grid: Sequence[int], block: Sequence[int], shared_bytes: int,
               args: Iterable[tuple[Any, Any]]) -> None:
        """Run entry ``name`` over ``grid`` blocks of ``block`` threads with
        ``shared_bytes`` of dynamic shared memory; ``args`` the launcher's
        ``(ctypes type, value)`` pairs (a driver's KernelArg), passed as cuLaunchKernel
        takes them. Raises HostKernelFault where the launch or the kernel went wrong."""
        values = [ctype(value) for ctype, value in args]
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        sizes = (ctypes.c_size_t * max(1, len(values)))(*[ctypes.sizeof(v) for v in values])
        error = ctypes.create_string_buffer(2048)
        rc = self._lib.cuda_host_launch(name.encode(), *grid, *block, shared_bytes, params, sizes, len(values),
                                        error, len(error))
        self.launches.append(name)
        if rc:
            raise HostKernelFault(error.value.decode(errors="replace"))


_built: dict[str, HostKernels] = {}


ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


def compile_host(source: str, entries: Sequence[str] | None, folder: Path) -> HostKernels:
    """``source``'s ``entries`` (None: every ``extern "C" __global__`` function in it)
    built for the host under ``folder`` (once per digest of what is compiled). Raises
    RuntimeError with the compiler's messages if it fails."""
    entries = tuple(sorted(set(ENTRY.findall(source) if entries is None else entries)))  # one build per set
    table = ",\n    ".join(f'cuda_host::entry("{name}", {name})' for name in entries)
    unit = (PRELUDE + '\n#line 1 "kernel.cu"\n' + host_source(source) + '\n#line 1 "launcher.cpp"\n'
            + LAUNCHER.replace("ENTRY_TABLE", table))
    digest = hashlib.sha256("\0".join((CXX or "", *FLAGS, unit)).encode()).hexdigest()[:20]
    if digest in _built:
        return _built[digest]
    library = folder / f"kernels-{digest}.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"kernels-{digest}.cpp").write_text(unit)
        partial = folder / f"kernels-{digest}.so.partial"
        built = subprocess.run([CXX, *FLAGS, "-o", str(partial), str(folder / f"kernels-{digest}.cpp")],
                               capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(built.stderr[-4000:])
        partial.rename(library)
    _built[digest] = HostKernels(library, entries)
    return _built[digest]


def cxx20_missing() -> str | None:
    """Why kernels cannot be built for the host here, or None."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (f"the CUDA kernels' host emulation switches fibers on x86-64 Linux, not {sys.platform} "
                f"{platform.machine()}")
    if CXX is None:
        return "needs a C++ compiler (g++) to build the CUDA kernels for the host"
    probe = subprocess.run([CXX, "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input="#include <version>\n",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"needs a C++20 compiler to build the CUDA kernels for the host: {CXX} -std=c++20 fails"
    return None


def host_kernels(tmp_path_factory, source: str, entries: Sequence[str]) -> HostKernels:
    """For a module-scoped fixture: ``source``'s entries built for the host, or the
    test skipped saying why; a source that does not build fails the test with the
    compiler's messages."""
    missing = cxx20_missing()
    if missing:
        pytest.skip(missing)
    try:
        return compile_host(source, entries, tmp_path_factory.getbasetemp() / "cuda_host")
    except RuntimeError as exc:
        pytest.fail(f"the kernels did not build for the host:\n{exc}")


class HostDriver:
    """The driver calls a launcher class (DeviceTensorOps, DeviceDecoderOps, ...) and
    the tests' buffers make, on the host: "device" memory is host memory (numpy
    buffers, 256-byte aligned as cuMemAlloc's), a module is the source built by
    :func:`compile_host`, a launch runs to completion at once (a valid order of one
    stream's work), a synchronisation has nothing left to wait for. Only what those
    need; the slot pool's virtual memory calls and graphs are not here."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._memory: dict[int, np.ndarray] = {}
        self.launched: list[str] = []

    def init(self) -> None:
        pass

    def use_device(self, ordinal: int) -> None:
        pass

    def mem_alloc(self, nbytes: int) -> int:
        buf = np.zeros(nbytes + 256, np.uint8)
        address = buf.ctypes.data + (-buf.ctypes.data % 256)
        self._memory[address] = buf
        return address

    def mem_free(self, address: int) -> None:
        del self._memory[address]

    def host_alloc(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)

    def host_free(self, host) -> None:
        pass

    def copy_to_device(self, address: int, data) -> None:
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        ctypes.memmove(address, data.ctypes.data, data.nbytes)

    def copy_to_host(self, address: int, nbytes: int) -> bytes:
        return ctypes.string_at(address, nbytes)

    def copy_to_device_async(self, address: int, host, stream) -> None:
        self.copy_to_device(address, host)

    def copy_to_host_async(self, host, address: int, stream) -> None:
        host = np.asarray(host).view(np.uint8).reshape(-1)
        ctypes.memmove(host.ctypes.data, address, host.nbytes)

    def stream_create(self):
        return object()

    def stream_synchronize(self, stream) -> None:
        pass

    def stream_destroy(self, stream) -> None:
        pass

    def module_from_source(self, source: str, name: str, ordinal: int) -> HostKernels:
        return compile_host(source, None, self.folder)

    def module_function(self, module: HostKernels, name: str):
        if name not in module.entries:
            raise HostKernelFault(f"no entry named {name} in the module (it has {', '.join(module.entries)})")
        return module, name

    def module_unload(self, module) -> None:
        pass

    def launch(self, function, grid, block, shared_bytes: int, stream, args) -> None:
        module, name = function
        self.launched.append(name)
        module.launch(name, grid, block, shared_bytes, args)


def host_driver(tmp_path_factory) -> HostDriver:
    """For a fixture: a :class:`HostDriver`, or the test skipped where no C++20 compiler is."""
    missing = cxx20_missing()
    if missing:
        pytest.skip(missing)
    return HostDriver(tmp_path_factory.getbasetemp() / "cuda_host")
