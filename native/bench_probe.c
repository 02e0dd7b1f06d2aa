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
