/* XXH64 (Yann Collet's xxHash, 64-bit variant), streaming: the checksum of prepared
 * cache payloads.
 *
 * NOTE: why not SHA-256 here: a payload's digest guards against corruption (a flipped
 * bit, a torn write, a truncated file), not against an attacker: the digest sits in
 * the manifest beside the payload, so whoever can rewrite one can rewrite the other.
 * SHA-256 ran at ~1 GB/s on the machines this was measured on, which made checking a
 * 560 MB cache cost as much as rebuilding it; XXH64 runs at memory speed. Identity
 * (which source bytes an entry was built from) stays SHA-256 (lineage.py).
 *
 * Bytes are read little-endian whatever the host, so the value is the reference's
 * (tests check it against the checksum zstd frames carry, which is XXH64's low half). */
#include "onnx_prep_native.h"

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
