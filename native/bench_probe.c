/* Memory-bandwidth probes for scripts/bench_kernels.py: the machine's read and copy
 * bandwidth, measured in the same run (and through the same GIL-releasing cffi
 * calls) as the kernels, so "percent of read bandwidth" compares like with like. */
#include <string.h>
#include "op_internal.h"

uint64_t op_bench_read(const uint8_t *p, size_t n) {
    /* Four independent 64-bit sums: the compiler vectorizes this into wide loads, far
     * above DRAM bandwidth, so the probe measures memory, not arithmetic. */
    const uint64_t *w = (const uint64_t *)p;
    size_t words = n / 8, i = 0;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (; i + 4 <= words; i += 4) {
        s0 += w[i];
        s1 += w[i + 1];
        s2 += w[i + 2];
        s3 += w[i + 3];
    }
    for (; i < words; i++) s0 += w[i];
    return s0 + s1 + s2 + s3;
}

/* Read n bytes as `streams` sequential streams at once: the buffer cut into that many
 * parts (multiples of 64 bytes; a remainder is not read), each part advanced by 64
 * bytes per step, in lockstep. Returns the number of bytes read.
 * NOTE: why several streams: one core reads DRAM faster from several sequential
 * streams than from one (more page walks and prefetch streams in flight). Measured
 * on the development VM (256 MiB, best of 5): one stream 25-28 GB/s on 4 KiB pages
 * and 30-32 on 2 MiB pages, four streams 32 and 34. A probe of one stream would rate
 * a kernel that reads faster than it at over 100% of the "read bandwidth". */
#if OP_SIMD
#include <immintrin.h>
#define READ_STREAMS(S)                                                                  \
    __attribute__((target("avx2"))) static uint64_t read_streams_##S(const uint8_t *p, size_t part) { \
        __m256i acc[S];                                                                  \
        for (int s = 0; s < S; s++) acc[s] = _mm256_setzero_si256();                     \
        for (size_t i = 0; i < part; i += 64)                                            \
            for (int s = 0; s < S; s++) {                                                \
                const __m256i *q = (const __m256i *)(p + (size_t)s * part + i);          \
                acc[s] = _mm256_add_epi64(acc[s], _mm256_add_epi64(_mm256_loadu_si256(q),     \
                                                                   _mm256_loadu_si256(q + 1))); \
            }                                                                            \
        __m256i t = acc[0];                                                              \
        for (int s = 1; s < S; s++) t = _mm256_add_epi64(t, acc[s]);                     \
        return (uint64_t)_mm256_extract_epi64(t, 0) + (uint64_t)_mm256_extract_epi64(t, 3); \
    }
READ_STREAMS(1)
READ_STREAMS(2)
READ_STREAMS(4)
READ_STREAMS(8)
#endif

uint64_t op_bench_read_streams(const uint8_t *p, size_t n, int streams) {
    if (streams != 1 && streams != 2 && streams != 4 && streams != 8) return 0;
    const size_t part = n / (size_t)streams / 64 * 64;
#if OP_SIMD
    if (op_cpu_has_avx2_fma()) {
        volatile uint64_t sink;
        switch (streams) {
        case 1: sink = read_streams_1(p, part); break;
        case 2: sink = read_streams_2(p, part); break;
        case 4: sink = read_streams_4(p, part); break;
        default: sink = read_streams_8(p, part); break;
        }
        (void)sink;
        return part * (size_t)streams;
    }
#endif
    /* portable: the parts one after another (one stream at a time) */
    volatile uint64_t sink = 0;
    for (int s = 0; s < streams; s++) sink += op_bench_read(p + (size_t)s * part, part);
    (void)sink;
    return part * (size_t)streams;
}

void op_bench_copy(uint8_t *dst, const uint8_t *src, size_t n) { memcpy(dst, src, n); }

/* Wait until *flag is `value` or OP_BENCH_PARK, spinning with pause (the GIL is
 * released by cffi); returns what it saw. The benchmark hands work to a helper
 * thread this way, without a futex wake-up per call, as ONNX Runtime's pool spins
 * between ops; PARK tells the helper to block in Python instead of spinning while
 * the other side (ORT) is measured. */
#include <sched.h>
uint32_t op_bench_spin_wait(volatile uint32_t *flag, uint32_t value) {
    unsigned spins = 0;
    for (;;) {
        uint32_t v = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
        if (v == value || v == 0xFFFFFFFFu) return v;
#if OP_X86
        __builtin_ia32_pause();
#endif
        if (++spins > (1u << 20)) {
            sched_yield();
            spins = 0;
        }
    }
}
void op_bench_store(volatile uint32_t *flag, uint32_t value) {
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
}
