/* The checksums of prepared cache payloads, streaming: XXH3-64 (what the writer uses)
 * and XXH64 (what caches were written with before), both Yann Collet's xxHash
 * (BSD-2-Clause), computed here from its definition.
 *
 * NOTE: why not SHA-256 here: a payload's digest guards against corruption (a flipped
 * bit, a torn write, a truncated file), not against an attacker: the digest sits in
 * the manifest beside the payload, so whoever can rewrite one can rewrite the other.
 * SHA-256 ran at ~1 GB/s on the machines this was measured on, which made checking a
 * 560 MB cache cost as much as rebuilding it; XXH64 runs at memory speed. Identity
 * (which source bytes an entry was built from) stays SHA-256 (lineage.py).
 *
 * NOTE: why XXH3 over XXH64: checking the digests is most of what a load from the
 * cache costs once the payloads are mapped; XXH64 is one dependent multiply chain per
 * 8-byte lane, XXH3's long-input loop is 32x32->64 multiplies over 64-byte stripes,
 * which the AVX2 and AVX-512 loops (checksum_simd.c) do eight lanes at a time:
 * measured over the 582 MiB medium cache file, mapped fresh, 2 threads (the reference's
 * code): 25 ms with XXH64, 18.5 ms with XXH3 (scripts/bench_checksum.py prints the rate
 * of each).
 *
 * Bytes are read little-endian whatever the host, so the values are the reference's
 * (tests check XXH64 against the checksum zstd frames carry, which is its low half,
 * and XXH3 against the reference's values at every length path). */
#include "checksum.h"

#include <string.h>

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t round64(uint64_t acc, uint64_t in) {
    acc += in * P2;
    acc = rotl(acc, 31);
    return acc * P1;
}

static inline uint64_t merge64(uint64_t acc, uint64_t v) {
    acc ^= round64(0, v);
    return acc * P1 + P4;
}

void op_xxh64_reset(op_xxh64_state *s, uint64_t seed) {
    memset(s, 0, sizeof *s);
    s->v[0] = seed + P1 + P2;
    s->v[1] = seed + P2;
    s->v[2] = seed;
    s->v[3] = seed - P1;
    s->seed = seed;
}

/* whole 32-byte stripes of p; returns the bytes consumed */
static size_t stripes(uint64_t v[4], const uint8_t *p, size_t n) {
    uint64_t a = v[0], b = v[1], c = v[2], d = v[3];
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a = round64(a, read64(p + i));
        b = round64(b, read64(p + i + 8));
        c = round64(c, read64(p + i + 16));
        d = round64(d, read64(p + i + 24));
    }
    v[0] = a, v[1] = b, v[2] = c, v[3] = d;
    return i;
}

void op_xxh64_update(op_xxh64_state *s, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    s->total += n;
    if (s->buffered + n < 32) {
        memcpy(s->buf + s->buffered, p, n);
        s->buffered += (uint32_t)n;
        return;
    }
    if (s->buffered) {
        size_t take = 32 - s->buffered;
        memcpy(s->buf + s->buffered, p, take);
        stripes(s->v, s->buf, 32);
        p += take, n -= take;
        s->buffered = 0;
    }
    size_t done = stripes(s->v, p, n);
    memcpy(s->buf, p + done, n - done);
    s->buffered = (uint32_t)(n - done);
}

uint64_t op_xxh64_digest(const op_xxh64_state *s) {
    uint64_t h;
    if (s->total >= 32) {
        const uint64_t *v = s->v;
        h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18);
        h = merge64(h, v[0]);
        h = merge64(h, v[1]);
        h = merge64(h, v[2]);
        h = merge64(h, v[3]);
    } else {
        h = s->seed + P5;
    }
    h += s->total;
    const uint8_t *p = s->buf;
    size_t n = s->buffered;
    for (; n >= 8; p += 8, n -= 8) {
        h ^= round64(0, read64(p));
        h = rotl(h, 27) * P1 + P4;
    }
    if (n >= 4) {
        h ^= (uint64_t)read32(p) * P1;
        h = rotl(h, 23) * P2 + P3;
        p += 4, n -= 4;
    }
    for (; n > 0; p++, n--) {
        h ^= (*p) * P5;
        h = rotl(h, 11) * P1;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* ---- XXH3-64, seed 0, the default 192-byte secret ---------------------------------- */

#define P32_1 0x9E3779B1ULL
#define P32_2 0x85EBCA77ULL
#define P32_3 0xC2B2AE3DULL
#define XXH3_BUF 256          /* sizeof op_xxh3_state.buf: 4 stripes */
#define XXH3_MIDSIZE_MAX 240  /* longer inputs take the stripe loop */
#define XXH3_LAST_STRIPE_AT (OP_XXH3_SCRAMBLE_AT - 7)
#define XXH3_MERGE_AT 11

/* The reference's default secret (192 pseudorandom bytes). */
_Alignas(64) const uint8_t op_xxh3_secret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static const uint8_t *const K = op_xxh3_secret;

static inline uint64_t avalanche64(uint64_t h) { /* XXH64's final mix */
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    return h ^ (h >> 32);
}

static inline uint64_t avalanche3(uint64_t h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

static inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl(h, 49) ^ rotl(h, 24);
    h *= 0x9FB21C651E98DF25ULL;
    h ^= (h >> 35) + len;
    h *= 0x9FB21C651E98DF25ULL;
    return h ^ (h >> 28);
}

/* the 128-bit product of a and b, its halves xored */
static inline uint64_t fold64(uint64_t a, uint64_t b) {
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *sec) {
    return fold64(read64(in) ^ read64(sec), read64(in + 8) ^ read64(sec + 8));
}

static uint64_t len_0to16(const uint8_t *in, size_t len) {
    if (len > 8) {
        uint64_t lo = read64(in) ^ (read64(K + 24) ^ read64(K + 32));
        uint64_t hi = read64(in + len - 8) ^ (read64(K + 40) ^ read64(K + 48));
        return avalanche3(len + __builtin_bswap64(lo) + hi + fold64(lo, hi));
    }
    if (len >= 4) {
        uint64_t v = read32(in + len - 4) + ((uint64_t)read32(in) << 32);
        return rrmxmx(v ^ (read64(K + 8) ^ read64(K + 16)), len);
    }
    if (len) {
        uint32_t c = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24) |
                     (uint32_t)in[len - 1] | ((uint32_t)len << 8);
        return avalanche64((uint64_t)c ^ (uint64_t)(read32(K) ^ read32(K + 4)));
    }
    return avalanche64(read64(K + 56) ^ read64(K + 64));
}

/* 17..128 bytes: pairs of 16-byte mixes from both ends, inward */
static uint64_t len_17to128(const uint8_t *in, size_t len) {
    uint64_t acc = len * P1;
    for (size_t i = (len - 1) / 32 + 1; i-- > 0;) {
        acc += mix16(in + 16 * i, K + 32 * i);
        acc += mix16(in + len - 16 * (i + 1), K + 32 * i + 16);
    }
    return avalanche3(acc);
}

/* 129..240 bytes: eight mixes, an avalanche, the rest at secret offset 3, the last
 * 16 bytes at 119 (the minimum secret size, 136, less 17) */
static uint64_t len_129to240(const uint8_t *in, size_t len) {
    uint64_t acc = len * P1;
    for (size_t i = 0; i < 8; i++) acc += mix16(in + 16 * i, K + 16 * i);
    acc = avalanche3(acc);
    for (size_t i = 8; i < len / 16; i++) acc += mix16(in + 16 * i, K + 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, K + 136 - 17);
    return avalanche3(acc);
}

/* One stripe (the scalar twin of the SIMD loops): lane l takes the low half times the
 * high half of (data ^ secret), and lane l ^ 1 takes the data itself. */
static inline void accumulate512(uint64_t acc[8], const uint8_t *p, const uint8_t *sec) {
    for (int l = 0; l < 8; l++) {
        uint64_t d = read64(p + 8 * l), k = d ^ read64(sec + 8 * l);
        acc[l ^ 1] += d;
        acc[l] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

static inline void scramble(uint64_t acc[8], const uint8_t *sec) {
    for (int l = 0; l < 8; l++) {
        uint64_t a = acc[l];
        a ^= a >> 47;
        a ^= read64(sec + 8 * l);
        acc[l] = a * P32_1;
    }
}

static void stripes_portable(uint64_t acc[8], const uint8_t *p, size_t n, uint32_t *in_block) {
    uint32_t j = *in_block;
    for (size_t i = 0; i < n; i++, p += OP_XXH3_STRIPE) {
        accumulate512(acc, p, K + 8 * j);
        if (++j == OP_XXH3_BLOCK_STRIPES) {
            scramble(acc, K + OP_XXH3_SCRAMBLE_AT);
            j = 0;
        }
    }
    *in_block = j;
}

static void stripes_scalar(uint64_t acc[8], const uint8_t *p, size_t n, uint32_t *in_block) {
    stripes_portable(acc, p, n, in_block);
    op_ran(OP_KERNEL_SCALAR);
}

const op_xxh3_table op_xxh3_scalar = {OP_KERNEL_SCALAR, stripes_scalar};

static const op_xxh3_table *xxh3_table(int isa) {
    switch (isa) {
#if OP_SIMD
    case OP_ISA_AVX2: return &op_xxh3_avx2;
    case OP_ISA_AVX512:
    case OP_ISA_AVX512_NOVNNI: return &op_xxh3_avx512;
#endif
    default: return &op_xxh3_scalar;
    }
}

void op_xxh3_reset(op_xxh3_state *s) {
    static const uint64_t init[8] = {P32_3, P1, P2, P3, P4, P32_2, P5, P32_1};
    memset(s, 0, sizeof *s);
    memcpy(s->acc, init, sizeof init);
    s->isa = op_isa_supported(OP_ISA_AVX512) ? OP_ISA_AVX512
             : op_isa_supported(OP_ISA_AVX2) ? OP_ISA_AVX2 : OP_ISA_SCALAR;
}

int op_xxh3_set_isa(op_xxh3_state *s, int isa) {
    if (!op_isa_supported(isa)) return OP_E_ISA;
    s->isa = isa;
    return OP_OK;
}

/* NOTE: the last byte of the input is never accumulated here: the final stripe is the
 * one ending at the last byte, accumulated by the digest with another secret offset.
 * So an update leaves 1..256 bytes buffered once it has more than 256, and keeps the
 * last stripe it accumulated in buf[192..256), which the final stripe reaches back into
 * when fewer than 64 bytes follow it. */
void op_xxh3_update(op_xxh3_state *s, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    op_ran(OP_KERNEL_NONE); /* the stripe loop records its code, if it runs */
    s->total += n;
    if (s->buffered + n <= XXH3_BUF) {
        if (n) memcpy(s->buf + s->buffered, p, n);
        s->buffered += (uint32_t)n;
        return;
    }
    const op_xxh3_table *t = xxh3_table(s->isa);
    if (s->buffered) {
        size_t take = XXH3_BUF - s->buffered;
        memcpy(s->buf + s->buffered, p, take);
        p += take, n -= take;
        t->stripes(s->acc, s->buf, XXH3_BUF / OP_XXH3_STRIPE, &s->in_block);
        s->buffered = 0;
    }
    /* n >= 1 here (more than 256 bytes were at hand) */
    size_t whole = (n - 1) / OP_XXH3_STRIPE;
    if (whole) {
        t->stripes(s->acc, p, whole, &s->in_block);
        p += whole * OP_XXH3_STRIPE, n -= whole * OP_XXH3_STRIPE;
        memcpy(s->buf + XXH3_BUF - OP_XXH3_STRIPE, p - OP_XXH3_STRIPE, OP_XXH3_STRIPE);
    }
    memcpy(s->buf, p, n); /* n <= 64: clear of buf[192..256) */
    s->buffered = (uint32_t)n;
}

uint64_t op_xxh3_digest(const op_xxh3_state *s) {
    size_t n = s->buffered;
    if (s->total <= XXH3_MIDSIZE_MAX) { /* the whole input is in buf */
        if (n <= 16) return len_0to16(s->buf, n);
        if (n <= 128) return len_17to128(s->buf, n);
        return len_129to240(s->buf, n);
    }
    uint64_t acc[8];
    memcpy(acc, s->acc, sizeof acc);
    if (n >= OP_XXH3_STRIPE) {
        uint32_t j = s->in_block;
        stripes_portable(acc, s->buf, (n - 1) / OP_XXH3_STRIPE, &j);
        accumulate512(acc, s->buf + n - OP_XXH3_STRIPE, K + XXH3_LAST_STRIPE_AT);
    } else { /* the final stripe starts in the last stripe accumulated */
        uint8_t last[OP_XXH3_STRIPE];
        memcpy(last, s->buf + XXH3_BUF - (OP_XXH3_STRIPE - n), OP_XXH3_STRIPE - n);
        memcpy(last + OP_XXH3_STRIPE - n, s->buf, n);
        accumulate512(acc, last, K + XXH3_LAST_STRIPE_AT);
    }
    uint64_t h = s->total * P1;
    for (int i = 0; i < 4; i++)
        h += fold64(acc[2 * i] ^ read64(K + XXH3_MERGE_AT + 16 * i),
                    acc[2 * i + 1] ^ read64(K + XXH3_MERGE_AT + 16 * i + 8));
    return avalanche3(h);
}
