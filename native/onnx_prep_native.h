/* onnx_prep native API. This header IS the cffi cdef: build_native.py reads the
 * part between the CDEF markers, so Python and C cannot drift.
 * Exported names carry the op_ prefix.
 *
 * Conventions:
 * - Every function that can fail returns an op_status (0 = OP_OK, negative =
 *   error); op_status_string() names it. Functions never abort the process.
 * - Packed buffers are self-describing: they start with an op_packed_header
 *   (64 bytes, little-endian host order) that every kernel validates.
 * - Kernels take a column range [col_begin, col_end) so the caller's executor
 *   splits the work; nothing here starts a thread. cffi API mode releases the
 *   GIL around every call. Any range is correct; ranges on multiples of
 *   op_packed_panel_n() avoid computing a shared panel twice.
 * - `isa` arguments take an OP_ISA_* value; the caller picks it once (Python:
 *   onnx_prep.native.active_isa()). Kernels refuse an ISA this CPU or this build
 *   lacks (OP_E_ISA) instead of faulting on an illegal instruction.
 * - Unpadded tails: K need not be a multiple of the block size (the source pads
 *   each column to whole blocks, as MatMulNBits does) and N need not be a
 *   multiple of the column tile.
 */
#ifndef ONNX_PREP_NATIVE_H
#define ONNX_PREP_NATIVE_H
#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */
const char *op_native_version(void);

/* ---- status codes ---------------------------------------------------------- */
typedef enum {
    OP_OK = 0,
    OP_E_ARG = -1,        /* a bad argument (shape, size, range, null pointer) */
    OP_E_HEADER = -2,     /* packed buffer: bad magic / version / kind / sizes */
    OP_E_ISA = -3,        /* the requested ISA is not available here */
    OP_E_NOMEM = -4,      /* scratch allocation failed */
    OP_E_INDEX = -5       /* gather index out of range */
} op_status;
const char *op_status_string(int status);

/* ---- CPU features and ISA selection ----------------------------------------- */
typedef enum {
    OP_ISA_SCALAR = 0,
    OP_ISA_AVX2 = 1,
    OP_ISA_AVX512 = 2,            /* uses VNNI for the integer paths where the CPU has it */
    OP_ISA_AVX512_NOVNNI = 3      /* AVX-512 without VNNI even if present (tests, benchmarks) */
} op_isa;
/* Named predicates; each includes the OS support check (XGETBV) for the register
 * state it needs. 0/1. */
int op_cpu_has_avx2_fma(void);      /* AVX, AVX2, FMA, F16C + OS saves YMM */
int op_cpu_has_avx512(void);        /* AVX-512 F, BW, VL, DQ + OS saves ZMM/opmask */
int op_cpu_has_avx512_vnni(void);   /* op_cpu_has_avx512() and AVX512_VNNI */
/* op_cpu_has_avx512_vnni(), AMX-TILE and AMX-INT8, the OS saving the tile state, and
 * the process granted its use (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, asked once here) */
int op_cpu_has_amx(void);
int op_isa_compiled(int isa);       /* 1 if this build contains code for `isa` */
int op_isa_supported(int isa);      /* compiled in and the CPU/OS can run it */
uint32_t op_packed_panel_n(void);   /* columns per int4 matmul panel (64): split ranges on it */

/* ---- which kernel code ran ------------------------------------------------------ */
/* What computed the last kernel call (matmul, gemm, gather, prepack, erf) made on the
 * calling thread. Each call's entry point first resets it to OP_KERNEL_NONE; then the
 * code that computes the result writes its own id (each SIMD driver its ISA, every
 * portable loop OP_KERNEL_SCALAR), never the dispatcher, so an ISA mapped to another
 * kernel table shows here. NONE: nothing was computed (an error, an empty column
 * range, or no call yet on this thread). For tests and benchmarks. */
typedef enum {
    OP_KERNEL_NONE = 0,
    OP_KERNEL_SCALAR = 1,        /* portable C */
    OP_KERNEL_AVX2 = 2,          /* AVX2 + FMA */
    OP_KERNEL_AVX512 = 3,        /* AVX-512 F/BW/VL/DQ, no VNNI instruction */
    OP_KERNEL_AVX512_VNNI = 4,   /* AVX-512 with VNNI dot products (integer paths) */
    OP_KERNEL_AMX = 5            /* AMX tile dot products (the INT4 matmul's several-row paths) */
} op_kernel_code;
int op_last_kernel(void);

/* ---- weight streaming ----------------------------------------------------------- */
/* Whether an INT4 matmul pass that reads its weights once (decode) prefetches them
 * non-temporally, past the caches (op_internal.h, OP_STREAM_AHEAD). On here until set;
 * a session sets it to its machine's choice (core/ops/weight_streaming.py, from
 * op_probe_weight_streaming); process-wide, read at each call's start. Results are the
 * same bits either way. Returns the previous setting. */
int op_set_weight_streaming(int on);
/* What the streaming costs on this machine: the fastest of `passes` reads of a
 * `bytes` buffer (made here, a multiple of 64) with plain loads, and the fastest with
 * the GEMVs' non-temporal prefetch ahead of them, in ns, alternated, each after the
 * buffer is flushed from the caches (CLFLUSH), as a decode step's weights come from
 * memory. On some machines the prefetch is what the weights wait for
 * (core/ops/weight_streaming.py decides from these). 0, or -1 when the buffer cannot
 * be had or the CPU is not x86. */
int op_probe_weight_streaming(size_t bytes, int passes, int64_t *plain_ns, int64_t *stream_ns);
/* How many whole panels a one-row int8 GEMV (decode at accuracy level 4, AVX-512) reads
 * side by side: 2 (the default: two sequential streams) or 1. Process-wide, read at each
 * call's start; the same bits either way. Returns the previous setting. For benchmarks
 * that compare both in one run. */
int op_set_gemv_panels(int panels);
/* Whether an INT4 matmul of several rows (4 at levels 0-3; at level 4, each whole 16)
 * runs on AMX tiles where the CPU has them (op_cpu_has_amx; ISA avx512): on until set.
 * The same bits either way (exact integer sums, the same epilogue). Process-wide, read
 * when a matmul is prepared. Returns the previous setting. */
int op_set_amx(int on);

/* ---- packed buffer header (64 bytes) ---------------------------------------- */
typedef struct {
    uint32_t magic;          /* OP_PACK_MAGIC */
    uint16_t format_version; /* OP_PACK_FORMAT_VERSION */
    uint16_t kind;           /* OP_KIND_* */
    uint32_t flags;          /* OP_FLAG_* bits */
    uint32_t block_size;     /* int4 kinds; 0 for gemm */
    uint64_t K;              /* reduction length (gather: row length) */
    uint64_t N;              /* output columns (gather: rows V) */
    uint32_t n_blocks;       /* ceil(K / block_size) (gather: blocks per row) */
    uint32_t panel_n;        /* columns per panel (int4 matmul 64, gemm 16; gather 0) */
    uint64_t panel_stride;   /* bytes per panel (gather: bytes per row) */
    uint64_t data_offset;    /* offset of the first tile / row from the buffer start */
    uint64_t total_size;     /* exact byte length of the whole packed buffer */
} op_packed_header;

enum {
    OP_PACK_MAGIC = 0x4B50504F,      /* "OPPK" read as little-endian bytes */
    OP_PACK_FORMAT_VERSION = 1,
    OP_KIND_INT4_MATMUL = 1,
    OP_KIND_INT4_GATHER = 2,
    OP_KIND_GEMM_B = 3,
    /* flags */
    OP_FLAG_ZP_MASK = 0x3,           /* zero-point kind, bits 0-1: */
    OP_ZP_NONE = 0,                  /*   implicit zero point 8 */
    OP_ZP_U4 = 1,                    /*   uint4 zero points (stored one per byte) */
    OP_ZP_FLOAT = 2,                 /*   float zero points (stored fp32) */
    OP_FLAG_ACC_SHIFT = 4,           /* accuracy level, bits 4-7 */
    OP_FLAG_ACC_MASK = 0xF0,
    OP_FLAG_SCALES_F16 = 0x100,      /* the source scales were fp16 (stored fp32) */
    OP_FLAG_TRANS_B = 0x200          /* gemm: B was given as [N, K] */
};

/* Reads and validates the header of a packed buffer of `size` bytes. */
int op_packed_header_read(const uint8_t *packed, size_t size, int expected_kind,
                          op_packed_header *out);
/* OP_PACK_FORMAT_VERSION, the version every packed header this build writes carries
 * (and the only one it reads); part of the prepared cache's compatibility key. */
uint32_t op_pack_format_version(void);

/* ---- INT4 matmul (com.microsoft MatMulNBits, bits = 4) ----------------------- */
size_t op_matmul_nbits_packed_size(uint64_t K, uint64_t N, uint32_t block_size, int zp_kind);
/* B: uint8 [N, n_blocks, block_size/2]; scales fp32 [N * n_blocks];
 * zero points: zp_kind OP_ZP_U4 -> zp_u4 holds ONE uint4 value per byte, [N * n_blocks]
 * (the caller unpacks the op's packed nibbles); OP_ZP_FLOAT -> zp_f32 [N * n_blocks].
 * Deterministic: the same inputs give the same bytes (padding is zeroed). */
int op_prepack_matmul_nbits(const uint8_t *B, const float *scales, const uint8_t *zp_u4,
                            const float *zp_f32, uint64_t K, uint64_t N, uint32_t block_size,
                            int zp_kind, int accuracy_level, int scales_were_f16,
                            uint8_t *out, size_t out_size);
/* Y[m, c] = sum_k A[m, k] * dequant(B)[k, c] (+ bias[c]) for c in [col_begin, col_end).
 * A: fp32 rows of length K with row stride lda (elements); Y row stride ldy.
 * accuracy_level: -1 = the packed buffer's; 0-3 = fp32-accurate compute (block
 * floating point: A as 24-bit block mantissas, exact integer dot products; ONNX
 * Runtime computes 0 and 1 alike); 4 = A quantized per block to int8 with integer dot
 * products (ONNX Runtime semantics); OP_COMPUTE_FMA32 = IEEE fp32 FMA chains, one per
 * output and block in ascending k (not an ONNX level: for whoever needs exactly that). */
enum { OP_COMPUTE_FMA32 = 16 };
int op_matmul_nbits(int isa, const float *A, size_t M, size_t lda, const uint8_t *packed,
                    size_t packed_size, const float *bias, float *Y, size_t ldy,
                    size_t col_begin, size_t col_end, int accuracy_level);

/* ---- INT4 row gather (com.microsoft GatherBlockQuantized, quantize_axis last) - */
size_t op_gather_packed_size(uint64_t V, uint32_t n_blocks, uint32_t block_size, int zp_kind);
/* data: uint8 [V, n_blocks, block_size/2]; scales fp32 [V * n_blocks];
 * zero points as for op_prepack_matmul_nbits. */
int op_prepack_gather(const uint8_t *data, const float *scales, const uint8_t *zp_u4,
                      const float *zp_f32, uint64_t V, uint32_t n_blocks, uint32_t block_size,
                      int zp_kind, int scales_were_f16, uint8_t *out, size_t out_size);
/* out[i, :] = dequant(row indices[i]) (K values); negative indices count from the end.
 * packed: an INT4 gather buffer (V = N rows), or an INT4 matmul buffer, whose row v is
 * output column v of its B (a tied embedding reading its LM head's object); the same
 * row gives the same bits from either. On OP_E_INDEX, *bad_position is the position
 * of the first bad index. */
int op_gather_block_quantized(const int64_t *indices, size_t n_indices, const uint8_t *packed,
                              size_t packed_size, float *out, size_t *bad_position);

/* ---- fp32 Gemm / MatMul with a constant B ------------------------------------ */
size_t op_gemm_b_packed_size(uint64_t K, uint64_t N);
/* B: fp32 [K, N] (trans_b = 0) or [N, K] (trans_b = 1), C-contiguous. */
int op_prepack_gemm_b(const float *B, uint64_t K, uint64_t N, int trans_b, uint8_t *out,
                      size_t out_size);
/* Y[m, c] = alpha * sum_k A[m, k] B[k, c] + beta * bias[m * bias_rs + c * bias_cs]
 * for c in [col_begin, col_end); bias may be NULL (strides may be 0 to broadcast). */
int op_gemm(int isa, const float *A, size_t M, size_t lda, const uint8_t *packed,
            size_t packed_size, const float *bias, ptrdiff_t bias_rs, ptrdiff_t bias_cs,
            float alpha, float beta, float *Y, size_t ldy, size_t col_begin, size_t col_end);

/* ---- host stable virtual-address slots -------------------------------------- */
/* Reserve `size` bytes of address space (no memory, no commit charge); return 0 or -errno. */
int op_slot_reserve(size_t size, void **out);
/* Ask for transparent huge pages on the reserved [p, p+n) (MADV_HUGEPAGE); 0 or -errno
 * (-EINVAL where the kernel has no THP). */
int op_slot_advise_huge(void *p, size_t n);
/* Make [p, p+n) readable and writable and populate it with zero-filled pages:
 * op_slot_open then op_slot_populate. */
int op_slot_commit(void *p, size_t n);
/* Make [p, p+n) readable and writable without populating it (mprotect only). */
int op_slot_open(void *p, size_t n);
/* Populate the pages of an already open [p, p+n) (no protection change, so no
 * exclusive hold of the process's memory-map lock). */
int op_slot_populate(void *p, size_t n);
/* Drop the physical pages of [p, p+n) and make the range inaccessible again;
 * the address range stays reserved. */
int op_slot_decommit(void *p, size_t n);
/* Give the address range back. */
int op_slot_release(void *p, size_t n);
/* Fault in the pages of a readable mapping [p, p+n) for reading (MADV_POPULATE_READ,
 * in 2 MiB steps), with the GIL released (cffi): a file mapping's pages are read now.
 * p page-aligned. 0, or -errno (-EINVAL: kernel < 5.14, nothing done). */
int op_populate_read(const void *p, size_t n);
/* Map [offset, offset + n) of the file fd read-only at [p, p + round_up(n, page)) of a
 * reserved slot (MAP_FIXED | MAP_PRIVATE, no populate: op_populate_read does that in
 * steps): the slot's bytes ARE the page cache, no copy, no fresh page. p and offset
 * page-aligned. Writing to it faults. Where p and offset are congruent modulo 2 MiB
 * and n spans a whole 2 MiB unit, the mapping is advised MADV_HUGEPAGE (stable_slot.c
 * says why). 0 or -errno. */
int op_slot_map_file(void *p, size_t n, int fd, int64_t offset);
/* Replace a file mapping made by op_slot_map_file over [p, p+n) (n page-aligned) by
 * an inaccessible reservation again (the address range stays the slot's). 0 or -errno. */
int op_slot_unmap_file(void *p, size_t n);
/* Source guard (source_guard.c): a SIGBUS in a registered read-only file mapping
 * [p, p+n) (the file shrank under it) maps a zero page there and marks the slot hit
 * instead of killing the process. add: the slot (>= 0) or -errno (-ENOSPC: all in use,
 * -ENOSYS: no SIGBUS on this platform); hit: 1 once a fault was absorbed, else 0. */
int op_guard_add(const void *p, size_t n);
int op_guard_hit(int slot);
void op_guard_remove(int slot);
/* Bytes of [p, p+n) resident in RAM (mincore), or -errno. p page-aligned. */
int64_t op_resident_bytes(const void *p, size_t n);
/* Bytes of [p, p+n) mapped by 2 MiB page-table entries (PMD-mapped transparent huge
 * pages, file or anonymous), read from the process's page tables (the PAGEMAP_SCAN
 * ioctl of /proc/self/pagemap, Linux 6.7+), or -errno (-ENOTTY: the kernel has no such
 * ioctl; -ENOSYS: not Linux). p page-aligned. */
int64_t op_pmd_mapped_bytes(const void *p, size_t n);
/* A prepared-cache payload mapped and checked in ONE call (mapped_payload.c), so a
 * Python caller gives the GIL up once a payload instead of at each of the steps:
 * op_slot_map_file(p, n, fd, offset), a source guard over [p, p+n), op_populate_read,
 * with hash_len > 0 the XXH3-64 of [p, p+hash_len), then whether the guard saw the file
 * shrink (read last: the checksum read every byte) and op_pmd_mapped_bytes(p, capacity).
 * A range past the file's end (populate's -EFAULT) is said (shrunk = 1, no checksum),
 * not failed: the guard turns reads there into zeros. 0, or -errno with nothing left
 * mapped or guarded (as op_slot_map_file's errors). */
typedef struct {
    int guard;          /* the source-guard slot (>= 0), or -errno where none was added */
    int shrunk;         /* 1: the file was shorter than the mapping while it was read */
    int64_t pmd_bytes;  /* op_pmd_mapped_bytes over the capacity (-errno: cannot tell) */
    uint64_t xxh3;      /* XXH3-64 of the first hash_len bytes; 0 when hash_len is 0 */
} op_mapped_payload;
int op_slot_map_payload(void *p, size_t n, size_t capacity, int fd, int64_t offset, size_t hash_len,
                        op_mapped_payload *out);
size_t op_page_size(void);

/* ---- GIL-free hand-off of matmul chunks (handoff.c) ------------------------------ */
/* One INT4 matmul cut into column chunks: op_matmul_nbits's arguments, the chunks'
 * [col_begin, col_end) pairs and a result code per chunk. next / done / prep / task /
 * ctx: internal (prep: A prepared once for every chunk, set by op_mailbox_fork_join for
 * the batch's duration; NULL: each chunk prepares A itself; task: a batch of other
 * work, op_mailbox_gqa's, each chunk task(ctx, begin, end), the matmul fields unused). */
typedef int (*op_task_fn)(void *ctx, int64_t begin, int64_t end);
typedef struct {
    const float *A; int64_t M; int64_t lda;
    const uint8_t *packed; size_t nbytes;
    const float *bias; float *Y; int64_t ldy;
    int isa; int level;
    const int64_t *ranges; int64_t n; int *rcs;
    int64_t next; int64_t done;
    void *prep;
    op_task_fn task; void *ctx;
} op_mm_batch;
/* Where one caller at a time publishes its batches to the helpers lent to it. Zero it,
 * then set seq = 1 (closed), spin_ns (how long an idle helper spins before it sleeps;
 * 0 = never sleeps) and linger_ns (how long a helper serves without a batch before it
 * returns on its own; 0 = until op_mailbox_stop). chunks_by_helpers counts the chunks
 * helpers ran; sleeps, the times a helper went to sleep; wakes, the times a publish had
 * to wake one; batches, the batches published; solo_batches, those whose every chunk the
 * caller ran itself; wait_ns, the caller's time waiting for helpers' chunks once it had
 * none left to take; serving, the helpers inside op_mailbox_serve now. wake and
 * sleepers belong to handoff.c. */
typedef struct {
    uint64_t seq; op_mm_batch *batch; int64_t active; uint32_t stop; int64_t chunks_by_helpers;
    int64_t spin_ns; uint32_t wake; int32_t sleepers; int64_t sleeps; int64_t wakes;
    int64_t batches; int64_t solo_batches; int64_t wait_ns;
    int64_t linger_ns; int32_t serving;
} op_mailbox;
/* Run chunks of b until none is left; returns how many this thread ran. */
int64_t op_batch_run(op_mm_batch *b);
/* Publish b, run chunks of it, wait for all of them and for every helper to leave it.
 * 0, or the first failing chunk's error code. */
int op_mailbox_fork_join(op_mailbox *m, op_mm_batch *b);
/* A helper: wait on m, running chunks of each batch published, until op_mailbox_stop
 * or linger_ns without a batch. It spins while batches keep coming; after spin_ns
 * without one it sleeps (Linux: a futex; elsewhere: 50 us naps) until the next publish.
 * Returns the chunks it ran. */
int64_t op_mailbox_serve(op_mailbox *m);
void op_mailbox_stop(op_mailbox *m);

/* ---- grouped-query attention (attention.c) --------------------------------------- */
/* com.microsoft GroupQueryAttention, fp32, ONNX Runtime's CPU semantics (docs/ops.md):
 * query [B, S, num_heads * H], key / value [B, S, kv_num_heads * H] (BSNH); past and
 * present [B, kv_num_heads, len, H] (BNSH). Row b attends to total_b = seqlens_k[b] + 1
 * positions; its new tokens go to present rows [past_b, past_b + S) with past_b = 0
 * when first_prompt, else total_b - S. Causal: query s sees positions <= past_b + s
 * and < total_b (a first prompt's padding rows, s >= total_b, see the row's total_b).
 * present_key may be past_key itself (one shared buffer: only the new rows are
 * written), and so may present_value be past_value; otherwise present rows
 * [0, past_b) are copied from past and the rows after the new ones zeroed.
 * Strides: rows from one (batch row, kv head) to the next in each buffer, >= its length
 * (0: the length; a shared buffer has one stride), so a buffer may have room after
 * its rows (the runtime's append buffers).
 * rotary_dim > 0: the first rotary_dim values of each query and new key head are
 * rotated by cos / sin [cache_rows, rotary_dim / 2] at their position, past_b + s.
 * The work is cut by (batch row, kv head) units: [unit_begin, unit_end) of
 * B * kv_num_heads; each unit writes its present rows and its heads' outputs.
 * mask != NULL: an additive mask instead of the causal span: query s of row b, head h
 * weighs every present row i < total_b with softmax(scale * q.k_i + mask[b * mask_b +
 * h * mask_h + s * mask_s + i]) (strides in floats, 0 to broadcast; a row of keys is
 * contiguous). A row whose softmax is not a number (every key at -inf, a NaN or
 * infinite score) is NaN, as Softmax's max-subtracted formula gives, or 0 with
 * nan_to_zero (an IsNaN -> Where(0) after the Softmax). mask NULL: as before.
 * cache_only: the caches are complete (past_len = present_len rows, present_key /
 * present_value the past buffers themselves); key and value are not read, nothing is
 * written but the output: attention over a KV cache a Concat already extended.
 * windowed 1 (local_window_size = window >= 0): query s of row b, at position p =
 * past_b + s, sees only keys p + 1 - window .. p (and < total_b); a query that sees no
 * key (window 0, or a padding row past its window) outputs zeros, as ONNX Runtime
 * 1.32's does (with softcap > 0 a padding row's window ends at total_b instead, as
 * there: attention.c says why).
 * softcap > 0: each score x becomes softcap * tanh(x / softcap) before the softmax.
 * window_cache (sliding_window_cache = 1, windowed): past and present are one capacity
 * C = past_len = present_len >= window > 0; row b's buffers hold its L(T) most recent
 * positions at rows [0, L(T)), T = total_b, L(T) = T if T <= C, else T - G * ceil((T -
 * C) / G) with G = C - window + 1 (ONNX Runtime's layout: eviction G positions at a
 * time, never a ring); the step's keys are read through a staging copy when it evicts.
 * Present rows [L(T), C) are zeros when present is not past's buffer. windowed, softcap
 * and window_cache need mask NULL and cache_only 0 (zero fields: none of them). */
typedef struct {
    int64_t batch, seq, num_heads, kv_num_heads, head_size;
    int64_t past_len;       /* past buffers' dimension 2 (0: no past) */
    int64_t present_len;    /* present buffers' dimension 2 */
    int64_t rotary_dim;     /* 0: no rotary; else even, <= head_size */
    int64_t cache_rows;     /* cos / sin rows */
    int64_t past_key_stride, past_value_stride, present_key_stride, present_value_stride;
    int32_t interleaved;    /* rotary pairs (2i, 2i+1) instead of (i, i + rotary_dim/2) */
    int32_t first_prompt;   /* 1: past_b = 0 for every row */
    float scale;            /* applied to Q.K before the softmax */
    const float *mask;      /* NULL: causal; else additive, see above */
    int64_t mask_b, mask_h, mask_s;
    int32_t nan_to_zero;
    int32_t cache_only;     /* 1: past holds every key (present is past, one buffer): nothing is written */
    int64_t window;         /* local_window_size when windowed (>= 0): keys p + 1 - window .. p */
    int32_t windowed;       /* 0: no window (a zeroed struct has none) */
    float softcap;          /* > 0: softcap * tanh(score / softcap) before the softmax */
    int32_t window_cache;   /* 1: sliding_window_cache's window-sized buffers (above) */
} op_gqa_params;
/* OP_E_ARG for a shape or a seqlens_k value outside the buffers (see above);
 * *bad_row is then the batch row at fault (-1: not a row's). */
int op_group_query_attention(int isa, const op_gqa_params *p, const float *query, const float *key,
                             const float *value, const float *past_key, const float *past_value,
                             const int64_t *seqlens_k, const float *cos_cache, const float *sin_cache,
                             float *out, float *present_key, float *present_value,
                             int64_t unit_begin, int64_t unit_end, int64_t *bad_row);
/* op_group_query_attention over all of its units (batch row x kv head), cut into
 * `chunks` ranges of units (more than 64 are taken as 64) that m's caller and helpers run as
 * op_mailbox_fork_join runs a matmul's: the same arithmetic per unit, the same bits.
 * 0, or the first failing chunk's error (bad_row as op_group_query_attention's). */
int op_mailbox_gqa(op_mailbox *m, int isa, const op_gqa_params *p, const float *query, const float *key,
                   const float *value, const float *past_key, const float *past_value,
                   const int64_t *seqlens_k, const float *cos_cache, const float *sin_cache, float *out,
                   float *present_key, float *present_value, int64_t chunks, int64_t *bad_row);

/* ---- element-wise math (elementwise.c) ----------------------------------------- */
/* y[i] = erf(x[i]) (libm, double precision; in place allowed). */
void op_erf_f64(const double *x, double *y, size_t n);

/* com.microsoft QuickGelu: y[i] = x[i] * sigmoid(alpha * x[i]) over n floats (y may
 * alias x; activation.h states the arithmetic). Every ISA gives the scalar path's bits. */
int op_quick_gelu(int isa, const float *x, float *y, size_t n, float alpha);

/* ---- row normalization (norm.c) and rotary embedding (rotary.c) ---------------- */
/* Per row r of `rows` rows of n floats: v = x + skip (+ bias) when skip or bias is
 * given (skip: skip_rows rows, row r reads skip row r % skip_rows; written to sum_out
 * when given, else to y), else v = x; then simplified 1 (RMSNorm):
 * y = (v * inv) * gamma with inv = 1 / sqrt(mean(v^2) + epsilon); simplified 0
 * (LayerNorm): y = ((v - mean) * inv) * gamma (+ beta), inv = 1 / sqrt(mean((v -
 * mean)^2) + epsilon). mean_out / inv_out (may be NULL): [rows]. Every ISA gives the
 * scalar path's bits. */
int op_norm_rows(int isa, const float *x, const float *skip, size_t skip_rows, const float *bias,
                 const float *gamma, const float *beta, size_t rows, size_t n, float epsilon,
                 int simplified, float *y, float *sum_out, float *mean_out, float *inv_out);
/* com.microsoft RotaryEmbedding: x and y [batch, seq, heads, head_size] (transposed 0)
 * or [batch, heads, seq, head_size] (transposed 1); pos: [batch * seq] ids
 * (pos_per_token 1) or one start id, token s at pos[0] + s (0); caches [max_pos,
 * rot_dim / 2]. OP_E_INDEX with *bad_position for a position outside [0, max_pos). */
int op_rotary_embedding(const float *x, float *y, size_t batch, size_t seq, size_t heads,
                        size_t head_size, size_t rot_dim, int transposed, int interleaved,
                        const int64_t *pos, int pos_per_token, const float *cos_cache,
                        const float *sin_cache, size_t max_pos, size_t *bad_position);

/* ---- benchmark probes (scripts/bench_kernels.py) ------------------------------- */
uint64_t op_bench_read(const uint8_t *p, size_t n);   /* reads n bytes (p 8-aligned) */
/* reads n bytes as 1, 2, 4 or 8 sequential streams in lockstep; returns the bytes read
 * (0 for another stream count) */
uint64_t op_bench_read_streams(const uint8_t *p, size_t n, int streams);
void op_bench_copy(uint8_t *dst, const uint8_t *src, size_t n);   /* memcpy */
uint32_t op_bench_spin_wait(volatile uint32_t *flag, uint32_t value); /* spin until value or PARK */
void op_bench_store(volatile uint32_t *flag, uint32_t value);     /* release store */
/* ---- payload checksum (checksum.c): XXH64, streaming (caches written before XXH3) - */
typedef struct {
    uint64_t v[4];
    uint64_t total;
    uint64_t seed;
    uint8_t buf[32];
    uint32_t buffered;
} op_xxh64_state;
void op_xxh64_reset(op_xxh64_state *s, uint64_t seed);
void op_xxh64_update(op_xxh64_state *s, const void *data, size_t n);
uint64_t op_xxh64_digest(const op_xxh64_state *s);
/* ---- payload checksum (checksum.c): XXH3-64 (seed 0, default secret), streaming -- */
/* op_xxh3_reset picks the best ISA this CPU runs for the long-input loop;
 * op_xxh3_set_isa forces one (OP_E_ISA where it cannot run). Every ISA gives the same
 * value, the reference's, whatever the cut of the input into updates. */
typedef struct {
    uint64_t acc[8];
    uint8_t buf[256];   /* the bytes not yet accumulated; buf[192..256) keeps the last
                           stripe accumulated, for a final stripe that reaches back */
    uint64_t total;
    uint32_t buffered;
    uint32_t in_block;  /* stripes accumulated in the current block (0..15) */
    int isa;
} op_xxh3_state;
void op_xxh3_reset(op_xxh3_state *s);
int op_xxh3_set_isa(op_xxh3_state *s, int isa);
void op_xxh3_update(op_xxh3_state *s, const void *data, size_t n);
uint64_t op_xxh3_digest(const op_xxh3_state *s);
/* CDEF-END */

#endif
