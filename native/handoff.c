/* GIL-free hand-off of INT4 matmul column chunks between the runtime's threads.
 *
 * The runtime's intra-op split hands chunks to helper threads. Through Python, a helper
 * must take the GIL back before it can start its chunk, which it gets only once the
 * caller is inside its own kernel: on a 2-vCPU VM that costs ~5-20 us a hand-off, about
 * as much as a decode GEMV of a few MB takes. Here a helper that the runtime has lent
 * to a run waits in C (GIL released, spinning) on the run's mailbox and takes chunks
 * straight from the published batch; the caller takes chunks from the same batch, so
 * the split never waits for a helper that is late or absent. No thread is created
 * here: the helpers are the runtime's own CPU workers (docs/runtime.md).
 *
 * Protocol (all on one mailbox):
 *   seq odd = closed, even = a batch is open. The caller publishes (batch, seq++ to
 *   even), runs chunks, waits until every chunk is done, closes (seq++ to odd) and
 *   waits until no helper is inside the batch (active == 0) before the batch's memory
 *   may go. A helper announces itself (active++) and then re-reads seq: if it changed,
 *   it leaves without touching the batch. Both sides use sequentially consistent
 *   operations on seq and active, so either the caller sees the helper's active++ and
 *   waits for it, or the helper sees the close and backs off. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdint.h>

#include "onnx_prep_native.h"
#include "op_internal.h"

#if defined(_WIN32)
#include <windows.h>
static int64_t now_ns(void) {
    LARGE_INTEGER f, c;
    QueryPerformanceFrequency(&f);
    QueryPerformanceCounter(&c);
    return (int64_t)((double)c.QuadPart * 1e9 / (double)f.QuadPart);
}
static void nap(uint32_t *word, uint32_t seen, int64_t max_ns) { (void)word; (void)seen; (void)max_ns; Sleep(0); }
static void wake_all(uint32_t *word) { (void)word; }
#else
#include <time.h>
static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
/* Sleep while *word == seen, for at most max_ns (0: no limit); returns at once if it
 * already changed, or on a signal: the caller re-checks everything either way. */
static void nap(uint32_t *word, uint32_t seen, int64_t max_ns) {
    struct timespec ts = {(time_t)(max_ns / 1000000000), (long)(max_ns % 1000000000)};
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, max_ns > 0 ? &ts : NULL, NULL, 0);
}
static void wake_all(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0); }
#else
static void nap(uint32_t *word, uint32_t seen, int64_t max_ns) {
    (void)word; (void)seen; (void)max_ns;
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
}
static void wake_all(uint32_t *word) { (void)word; }
#endif
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax(void) { _mm_pause(); }
#else
static inline void cpu_relax(void) {}
#endif

int64_t op_batch_run(op_mm_batch *b) {
    int64_t ran = 0;
    for (;;) {
        int64_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_ACQ_REL);
        if (i >= b->n) break;
        const size_t cb = (size_t)b->ranges[2 * i], ce = (size_t)b->ranges[2 * i + 1];
        const op_mm_prep *prep = (const op_mm_prep *)b->prep;
        b->rcs[i] = b->task ? b->task(b->ctx, b->ranges[2 * i], b->ranges[2 * i + 1])
                    : prep  ? op_mm_prep_run(prep, cb, ce)
                            : op_matmul_nbits(b->isa, b->A, (size_t)b->M, (size_t)b->lda, b->packed, b->nbytes,
                                              b->bias, b->Y, (size_t)b->ldy, cb, ce, b->level);
        __atomic_fetch_add(&b->done, 1, __ATOMIC_RELEASE);
        ran++;
    }
    return ran;
}

/* Publish b, run chunks of it, wait for all of them and for every helper to leave it. */
static void publish_and_run(op_mailbox *m, op_mm_batch *b) {
    b->next = 0;
    b->done = 0;
    __atomic_store_n(&m->batch, b, __ATOMIC_RELEASE);
    __atomic_fetch_add(&m->seq, 1, __ATOMIC_SEQ_CST); /* even: open */
    if (__atomic_load_n(&m->sleepers, __ATOMIC_SEQ_CST) > 0) { /* see op_mailbox_serve */
        __atomic_fetch_add(&m->wake, 1, __ATOMIC_SEQ_CST);
        wake_all(&m->wake);
        __atomic_fetch_add(&m->wakes, 1, __ATOMIC_RELAXED);
    }
    int64_t mine = op_batch_run(b);
    if (__atomic_load_n(&b->done, __ATOMIC_ACQUIRE) < b->n) { /* a helper's chunk still runs */
        int64_t t0 = now_ns();
        while (__atomic_load_n(&b->done, __ATOMIC_ACQUIRE) < b->n) cpu_relax();
        m->wait_ns += now_ns() - t0; /* the caller's own fields: no other writer */
    }
    __atomic_fetch_add(&m->seq, 1, __ATOMIC_SEQ_CST); /* odd: closed */
    while (__atomic_load_n(&m->active, __ATOMIC_SEQ_CST) != 0) cpu_relax();
    __atomic_fetch_add(&m->chunks_by_helpers, b->n - mine, __ATOMIC_RELAXED);
    m->batches++;
    if (mine == b->n) m->solo_batches++;
}

static int first_failure(const op_mm_batch *b) {
    for (int64_t i = 0; i < b->n; i++)
        if (b->rcs[i]) return b->rcs[i];
    return 0;
}

int op_mailbox_fork_join(op_mailbox *m, op_mm_batch *b) {
    /* A is prepared (quantized, for level 4) once here, before the publish, and every
     * chunk reads it: chunks no longer repeat that work, whoever runs them. */
    op_mm_prep prep;
    int st = op_mm_prepare(&prep, b->isa, b->A, (size_t)b->M, (size_t)b->lda, b->packed, b->nbytes, b->bias,
                           b->Y, (size_t)b->ldy, b->level);
    if (st) {
        op_mm_prep_release(&prep);
        return st;
    }
    b->prep = &prep;
    b->task = NULL;
    publish_and_run(m, b);
    b->prep = NULL;
    op_mm_prep_release(&prep);
    return first_failure(b);
}

int op_mailbox_run_task(op_mailbox *m, op_task_fn task, void *ctx, const int64_t *ranges, int64_t n, int *rcs) {
    op_mm_batch b = {0};
    b.task = task;
    b.ctx = ctx;
    b.ranges = ranges;
    b.n = n;
    b.rcs = rcs;
    publish_and_run(m, &b);
    return first_failure(&b);
}

int64_t op_mailbox_serve(op_mailbox *m) {
    uint64_t last = 0;
    int64_t ran = 0;
    int64_t spin_ns = m->spin_ns, linger_ns = m->linger_ns;
    int64_t idle_since = now_ns();
    uint32_t polls = 0;
    /* Idle means no batch published, not none taken: a batch the caller finished before
     * this helper looked (short ones do, on a busy machine) still counts as activity,
     * so a helper of a caller that keeps publishing neither sleeps nor lingers out. */
    uint64_t seen = __atomic_load_n(&m->seq, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&m->serving, 1, __ATOMIC_SEQ_CST);
    while (!__atomic_load_n(&m->stop, __ATOMIC_ACQUIRE)) {
        uint64_t s = __atomic_load_n(&m->seq, __ATOMIC_SEQ_CST);
        if (s != seen) {
            seen = s;
            idle_since = now_ns();
        }
        if ((s & 1) == 0 && s != last) {
            __atomic_fetch_add(&m->active, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&m->seq, __ATOMIC_SEQ_CST) == s)
                ran += op_batch_run(__atomic_load_n(&m->batch, __ATOMIC_ACQUIRE));
            __atomic_fetch_sub(&m->active, 1, __ATOMIC_SEQ_CST);
            last = s;
            idle_since = now_ns();
            continue;
        }
        cpu_relax();
        if ((++polls & 255) != 0) continue;
        const int64_t idle = now_ns() - idle_since;
        if (linger_ns > 0 && idle >= linger_ns) break; /* no batch for linger_ns: back to the pool */
        if (spin_ns <= 0 || idle < spin_ns) continue;
        /* Idle too long: sleep until the next publish or stop. The wake word is read
         * before sleepers++ and seq is checked after it; the publisher bumps seq before
         * it reads sleepers (all sequentially consistent). So either the publisher sees
         * this sleeper and bumps the wake word (the futex then returns at once, or wakes
         * it), or this helper sees the new seq and does not sleep. */
        uint32_t w = __atomic_load_n(&m->wake, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&m->sleepers, 1, __ATOMIC_SEQ_CST);
        uint64_t s2 = __atomic_load_n(&m->seq, __ATOMIC_SEQ_CST);
        if (!((s2 & 1) == 0 && s2 != last) && !__atomic_load_n(&m->stop, __ATOMIC_SEQ_CST)) {
            __atomic_fetch_add(&m->sleeps, 1, __ATOMIC_RELAXED);
            nap(&m->wake, w, linger_ns > 0 ? linger_ns - idle : 0);
        }
        __atomic_fetch_sub(&m->sleepers, 1, __ATOMIC_SEQ_CST);
        /* idle_since stays: woken without a batch (a stray wake-up, a nap that ran
         * out), the helper goes back to sleep at its next clock check */
    }
    __atomic_fetch_sub(&m->serving, 1, __ATOMIC_SEQ_CST);
    return ran;
}

void op_mailbox_stop(op_mailbox *m) {
    __atomic_store_n(&m->stop, 1u, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&m->wake, 1, __ATOMIC_SEQ_CST);
    wake_all(&m->wake);
}
