"""CUDA kernels run on the host, where no GPU is: a ``.cu`` source the device compiles,
unchanged, built as C++ with a few definitions standing in for CUDA's, so a test can
launch its entries with the grid, block and arguments the Python launcher decides and
compare what they write with the CPU kernels.

The stand-ins (``PRELUDE``): a block's threads are host threads (one per CUDA thread,
all of them alive at once, so a barrier among them means what it means on a device;
kept between launches, as creating 256 costs more than most launches here);
the blocks run one after another by the same threads, so a ``__shared__`` array is a
``static`` one (one block at a time uses it) and dynamic shared memory one buffer,
refilled with 0xFF bytes before every block (NaN floats, so a read before a write
shows). ``__syncthreads`` is a barrier among the block's threads and ``__syncwarp`` and
the ``__shfl_*_sync`` shuffles one among a warp's 32 lanes (the consecutive linear
thread ids, as CUDA numbers them) over a per-warp exchange array. What CUDA leaves
undefined is refused, loudly, as a :class:`HostKernelFault` naming the block and thread:
a barrier some threads of the block (or lanes of the warp) reach after others returned
or never reach (a watchdog ends the wait), a shuffle with a partial mask or in a warp of
fewer than 32 threads, a misaligned or null ``__ldg``, an argument whose size is not the
parameter's. ``fmaf`` is C's fused one, ``-ffp-contract=off`` keeps ``a * b + c``
two roundings, as written, and the ``__f*_rn`` intrinsics are the IEEE operations;
``tanhf``, ``cosf``, ``sinf`` and the like are the host's libm, not CUDA's (both
within a few ulp of the correctly rounded result: a test holds them to what the
launcher claims, never to bits).

What this cannot show: the device's memory model (here every access is seen in program
order after a barrier), alignment faults of plain loads and stores, out-of-bounds
accesses (they read or corrupt host memory, or crash the process), real warp scheduling
(lanes here run independently between barriers, so a race between threads that a
barrier should order shows only by chance), uninitialised static ``__shared__`` arrays
(they hold the previous block's values, zeros for the first), and NVRTC's code:
its contraction of ``a * b + c`` into FMAs (``--fmad=true``), its approximate
intrinsics, register spills. That is test_cuda_nvrtc.py's and the GPU tests'.

A source is compiled once per process (cached by the digest of what is compiled, in the
pytest session's temp folder) with ``g++ -std=c++20 -O1``; a test module asks for it
through :func:`host_kernels`, which skips, saying so, where no C++20 compiler is."""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

CXX = shutil.which("g++") or shutil.which("c++")
FLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-unknown-pragmas", "-shared",
         "-fPIC", "-pthread")
WATCHDOG_MS = 30_000  # a barrier waited on this long is one some threads never reach

PRELUDE = r"""
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
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
// Thrown through the kernel's code: the launch ends, its message (empty: already recorded) reported.
struct Fault { std::string message; };

// A barrier among `expected` threads that knows which of them returned from the kernel:
// one reaching it after another returned, or returning while others wait, is a fault (a
// barrier in divergent code: undefined on a device); so is a wait the launch's watchdog
// finds stuck. Atomics and futex waits (C++20's atomic wait): one wake-up for all waiters.
class Barrier {
  public:
    void reset(unsigned expected, const char *name) {  // while no thread is inside
        expected_ = expected, name_ = name;
        arrived_ = 0, exited_ = 0, broken_ = false;
    }
    void wait(const char *what);
    void exit();
    void brake() {
        broken_ = true;
        phase_.fetch_add(1);
        phase_.notify_all();
    }
    // what the watchdog reads
    unsigned arrived() const { return arrived_.load(); }
    unsigned long phase() const { return phase_.load(); }
    std::string stuck(long long ms) const {
        return std::string(what_.load()) + ": " + std::to_string(arrived()) + " of the " + name_ + "'s " +
               std::to_string(expected_) + " threads waited " + std::to_string(ms) +
               " ms, the others never came: a barrier in divergent code";
    }

  private:
    unsigned expected_ = 0;
    const char *name_ = "";
    std::atomic<const char *> what_{""};
    std::atomic<unsigned> arrived_{0}, exited_{0};
    std::atomic<unsigned long> phase_{0};
    std::atomic<bool> broken_{false};
};

struct Launch {
    dim3 grid, block;
    unsigned threads = 0, warps = 0;
    std::chrono::milliseconds watchdog{0};
    Barrier block_sync;
    std::vector<Barrier> warp_sync;
    std::vector<std::uint64_t> exchange;  // [warp][lane]
    std::vector<std::max_align_t> dynamic_shared;
    std::size_t dynamic_bytes = 0;
    std::mutex error_mu;
    std::string error;
    std::atomic<bool> failed{false};

    void fail(const std::string &message) {
        {
            std::lock_guard<std::mutex> lock(error_mu);
            if (error.empty()) error = message;
        }
        failed = true;
        block_sync.brake();
        for (auto &w : warp_sync) w.brake();
    }
};
inline Launch *launch = nullptr;
inline thread_local unsigned lane = 0, warp = 0;
}  // namespace cuda_host

inline thread_local uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace cuda_host {
inline std::string where() {
    char text[160];
    std::snprintf(text, sizeof text, "block (%u,%u,%u) thread (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z,
                  threadIdx.x, threadIdx.y, threadIdx.z);
    return text;
}

[[noreturn]] inline void fault(const std::string &message) {
    launch->fail(message + " [" + where() + "]");
    throw Fault{};
}

inline void Barrier::wait(const char *what) {
    if (broken_) throw Fault{};
    what_ = what;
    const unsigned long phase = phase_.load();
    const unsigned arrived = arrived_.fetch_add(1) + 1;
    if (const unsigned exited = exited_.load())  // after the increment: exit() sees one or the other
        fault(std::string(what) + " reached after " + std::to_string(exited) + " thread(s) of the " + name_ +
              " returned: a barrier in divergent code");
    if (arrived == expected_) {
        arrived_ = 0;
        phase_.fetch_add(1);
        phase_.notify_all();
        return;
    }
    while (phase_.load() == phase) phase_.wait(phase);
    if (broken_) throw Fault{};  // broken by a fault elsewhere (or the watchdog)
}

inline void Barrier::exit() {
    exited_.fetch_add(1);
    if (const unsigned arrived = arrived_.load(); arrived && !broken_)
        launch->fail("a thread returned while " + std::to_string(arrived) + " other(s) of the " + name_ +
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

// All the threads meet here after each block; the last to come readies the next block.
class BlockEnd {
  public:
    explicit BlockEnd(unsigned n) : n_(n) {}
    template <class F> void wait(F &&next) {
        const unsigned long phase = phase_.load();
        if (arrived_.fetch_add(1) + 1 == n_) {
            next();
            arrived_ = 0;
            phase_.fetch_add(1);
            phase_.notify_all();
            return;
        }
        while (phase_.load() == phase) phase_.wait(phase);
    }

  private:
    unsigned n_;
    std::atomic<unsigned> arrived_{0};
    std::atomic<unsigned long> phase_{0};
};

// Host threads kept for the next launch (creating a block's 256 threads costs more than
// most launches here): thread i < n runs job(i), then the launch returns. Each thread
// waits on its own ticket, bumped once per launch it serves (so none can run a launch
// twice or one it is not in). Never destroyed: its threads wait until the process ends.
class Pool {
  public:
    void run(unsigned n, const std::function<void(unsigned)> &job) {
        while (workers_.size() < n) {
            workers_.push_back(new std::atomic<unsigned long>(0));
            std::thread([this, id = (unsigned)workers_.size() - 1, ticket = workers_.back()] { serve(id, *ticket); })
                .detach();
        }
        job_ = &job;
        running_ = n;
        for (unsigned i = 0; i < n; i++) {
            workers_[i]->fetch_add(1);
            workers_[i]->notify_one();
        }
        for (unsigned left = running_.load(); left; left = running_.load()) running_.wait(left);
    }

  private:
    void serve(unsigned id, std::atomic<unsigned long> &ticket) {
        for (unsigned long seen = 0;; seen++) {
            ticket.wait(seen);
            (*job_)(id);
            if (running_.fetch_sub(1) == 1) running_.notify_all();
        }
    }

    std::vector<std::atomic<unsigned long> *> workers_;
    const std::function<void(unsigned)> *job_ = nullptr;
    std::atomic<unsigned> running_{0};
};

void ready_block(Launch &L) {
    L.block_sync.reset(L.threads, "block");
    for (unsigned w = 0; w < L.warps; w++)
        L.warp_sync[w].reset(w + 1 < L.warps || L.threads % 32 == 0 ? 32 : L.threads % 32, "warp");
    std::memset(L.dynamic_shared.data(), 0xFF, L.dynamic_shared.size() * sizeof(std::max_align_t));
}
}  // namespace cuda_host

static const cuda_host::Entry cuda_host_entries[] = {
    ENTRY_TABLE
};

// 0 when the kernel ran; else 1 and `error` says why (nothing of the launch is left running).
extern "C" int cuda_host_launch(const char *name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, std::size_t shared_bytes, void **params, const std::size_t *sizes,
                                int n_params, unsigned watchdog_ms, char *error, std::size_t error_size) {
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
    L.watchdog = std::chrono::milliseconds(watchdog_ms);
    L.warp_sync = std::vector<cuda_host::Barrier>(L.warps);
    L.exchange.assign(32 * L.warps, 0);
    L.dynamic_shared.resize((shared_bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t) + 1);
    L.dynamic_bytes = shared_bytes;
    cuda_host::launch = &L;
    blockDim = L.block, gridDim = L.grid;
    cuda_host::ready_block(L);
    cuda_host::BlockEnd block_end(L.threads);
    bool stop = false;  // written by the last thread at a block's end, read after it
    const std::function<void(unsigned)> job = [&](unsigned t) {
        threadIdx = {t % bx, (t / bx) % by, t / (bx * by)};
        cuda_host::lane = t % 32, cuda_host::warp = t / 32;
        bool stopped = false;
        for (unsigned z = 0; z < gz && !stopped; z++)
            for (unsigned y = 0; y < gy && !stopped; y++)
                for (unsigned x = 0; x < gx && !stopped; x++) {
                    blockIdx = {x, y, z};
                    try {
                        e->call(params);
                    } catch (const cuda_host::Fault &) {
                    } catch (const std::exception &ex) {
                        L.fail(std::string("a C++ exception: ") + ex.what() + " [" + cuda_host::where() + "]");
                    }
                    L.block_sync.exit();
                    L.warp_sync[cuda_host::warp].exit();
                    block_end.wait([&] {
                        stop = L.failed.load();
                        cuda_host::ready_block(L);
                    });
                    stopped = stop;
                }
    };
    // The watchdog: a barrier some threads wait at, not completed for watchdog_ms, is a fault.
    std::mutex watch_mu;
    std::condition_variable watch_cv;
    bool done = false;
    std::thread watchdog([&] {
        std::vector<cuda_host::Barrier *> barriers{&L.block_sync};
        for (auto &w : L.warp_sync) barriers.push_back(&w);
        std::vector<std::pair<unsigned long, std::chrono::steady_clock::time_point>> seen;
        for (auto *b : barriers) seen.emplace_back(b->phase(), std::chrono::steady_clock::now());
        std::unique_lock<std::mutex> lock(watch_mu);
        while (!watch_cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return done; })) {
            const auto now = std::chrono::steady_clock::now();
            for (std::size_t i = 0; i < barriers.size(); i++) {
                const unsigned long phase = barriers[i]->phase();
                if (!barriers[i]->arrived() || phase != seen[i].first) {
                    seen[i] = {phase, now};
                } else if (now - seen[i].second > L.watchdog && !L.failed) {
                    L.fail(barriers[i]->stuck(L.watchdog.count()));
                }
            }
        }
    });
    static cuda_host::Pool *pool = new cuda_host::Pool;
    pool->run(L.threads, job);
    {
        std::lock_guard<std::mutex> lock(watch_mu);
        done = true;
    }
    watch_cv.notify_all();
    watchdog.join();
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
                                                                 ctypes.c_uint, ctypes.c_char_p, ctypes.c_size_t]
        f.restype = ctypes.c_int
        self.launches: list[str] = []

    def launch(self, name: str, grid: Sequence[int], block: Sequence[int], shared_bytes: int,
               args: Iterable[tuple[Any, Any]], *, watchdog_ms: int = WATCHDOG_MS) -> None:
        """Run entry ``name`` over ``grid`` blocks of ``block`` threads with
        ``shared_bytes`` of dynamic shared memory; ``args`` the launcher's
        ``(ctypes type, value)`` pairs (a driver's KernelArg), passed as cuLaunchKernel
        takes them. Raises HostKernelFault where the launch or the kernel went wrong."""
        values = [ctype(value) for ctype, value in args]
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        sizes = (ctypes.c_size_t * max(1, len(values)))(*[ctypes.sizeof(v) for v in values])
        error = ctypes.create_string_buffer(2048)
        rc = self._lib.cuda_host_launch(name.encode(), *grid, *block, shared_bytes, params, sizes, len(values),
                                        watchdog_ms, error, len(error))
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
