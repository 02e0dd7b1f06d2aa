/* A prepared-cache payload mapped into its slot and checked, in one call.
 *
 * NOTE: why one call: every cffi call releases the GIL and takes it back. A payload
 * mapped step by step from Python (map, guard, populate, checksum reset / update /
 * digest, guard check, page-table count: ~10 calls) handed the GIL to another worker
 * at each step and waited for it to come back: on 2 cores, two mapped workers and the
 * run's thread spent about a third of a load from the cache waiting so. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "op_internal.h"

#include <errno.h>
#include <string.h>

int op_slot_map_payload(void *p, size_t n, size_t capacity, int fd, int64_t offset, size_t hash_len,
                        op_mapped_payload *out) {
    if (!out || hash_len > n || capacity < n) return -EINVAL;
    memset(out, 0, sizeof *out);
    int rc = op_slot_map_file(p, n, fd, offset);
    if (rc) return rc;
    out->guard = op_guard_add(p, n);
    rc = op_populate_read(p, n);
    if (rc == -EFAULT && out->guard >= 0) {
        /* a page the file no longer has (it was cut after its size was taken): a read
         * there would raise SIGBUS, which the guard turns into zeros. Said, not failed:
         * the caller rebuilds the object instead of accepting it. */
        out->shrunk = 1;
        out->pmd_bytes = op_pmd_mapped_bytes(p, capacity);
        return 0;
    }
    if (rc && rc != -EINVAL) { /* -EINVAL: kernel < 5.14, pages fault on first touch */
        if (out->guard >= 0) op_guard_remove(out->guard);
        out->guard = -1;
        (void)op_slot_unmap_file(p, n);
        return rc;
    }
    if (hash_len) {
        op_xxh3_state s;
        op_xxh3_reset(&s);
        op_xxh3_update(&s, p, hash_len);
        out->xxh3 = op_xxh3_digest(&s);
    }
    out->shrunk = out->guard >= 0 && op_guard_hit(out->guard) == 1;
    out->pmd_bytes = op_pmd_mapped_bytes(p, capacity);
    return 0;
}
