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
#include <stdint.h>

#include "onnx_prep_native.h"

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
        b->rcs[i] = op_matmul_nbits(b->isa, b->A, (size_t)b->M, (size_t)b->lda, b->packed, b->nbytes,
                                    b->bias, b->Y, (size_t)b->ldy, (size_t)b->ranges[2 * i],
                                    (size_t)b->ranges[2 * i + 1], b->level);
        __atomic_fetch_add(&b->done, 1, __ATOMIC_RELEASE);
        ran++;
    }
    return ran;
}

int op_mailbox_fork_join(op_mailbox *m, op_mm_batch *b) {
    b->next = 0;
    b->done = 0;
    __atomic_store_n(&m->batch, b, __ATOMIC_RELEASE);
    __atomic_fetch_add(&m->seq, 1, __ATOMIC_SEQ_CST); /* even: open */
    int64_t mine = op_batch_run(b);
    while (__atomic_load_n(&b->done, __ATOMIC_ACQUIRE) < b->n) cpu_relax();
    __atomic_fetch_add(&m->seq, 1, __ATOMIC_SEQ_CST); /* odd: closed */
    while (__atomic_load_n(&m->active, __ATOMIC_SEQ_CST) != 0) cpu_relax();
    __atomic_fetch_add(&m->chunks_by_helpers, b->n - mine, __ATOMIC_RELAXED);
    for (int64_t i = 0; i < b->n; i++)
        if (b->rcs[i]) return b->rcs[i];
    return 0;
}

int64_t op_mailbox_serve(op_mailbox *m) {
    uint64_t last = 0;
    int64_t ran = 0;
    while (!__atomic_load_n(&m->stop, __ATOMIC_ACQUIRE)) {
        uint64_t s = __atomic_load_n(&m->seq, __ATOMIC_SEQ_CST);
        if ((s & 1) == 0 && s != last) {
            __atomic_fetch_add(&m->active, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&m->seq, __ATOMIC_SEQ_CST) == s)
                ran += op_batch_run(__atomic_load_n(&m->batch, __ATOMIC_ACQUIRE));
            __atomic_fetch_sub(&m->active, 1, __ATOMIC_SEQ_CST);
            last = s;
        } else {
            cpu_relax();
        }
    }
    return ran;
}

void op_mailbox_stop(op_mailbox *m) { __atomic_store_n(&m->stop, 1u, __ATOMIC_RELEASE); }
