/* Host stable virtual-address slots: the CPU analogue of CUDA VMM reserve/map.
 *
 * reserve  = mmap(PROT_NONE, MAP_NORESERVE): address space only, no commit charge
 * commit   = mprotect(READ|WRITE): pages appear zero-filled on first touch
 * decommit = madvise(MADV_DONTNEED) + mprotect(PROT_NONE): physical pages go back
 *            to the kernel at once (RSS falls) and a stray access faults instead of
 *            silently reading zeros; the address range stays ours.
 * NOTE: MADV_FREE would be wrong here: its pages stay resident (and readable) until
 * memory pressure, so RSS would not fall and stale bytes would survive. */
/* -std=c11 hides POSIX/BSD declarations (mmap flags, madvise, mincore). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "op_internal.h"

#if defined(__linux__) || defined(__APPLE__) || defined(__unix__)
#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MAP_NORESERVE
#define MAP_NORESERVE 0
#endif

size_t op_page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }

static int aligned(const void *p, size_t n) {
    size_t ps = op_page_size();
    return ((uintptr_t)p % ps) == 0 && n % ps == 0;
}

#define OP_HUGE_ALIGN ((size_t)2 << 20)

int op_slot_reserve(size_t size, void **out) {
    if (!out || size == 0 || size % op_page_size()) return -EINVAL;
    /* Over-reserve by 2 MiB and trim so the slot starts on a 2 MiB boundary: commits are
     * whole 2 MiB granules (stable_slot.py), so transparent huge pages can back each
     * granule exactly, and residency stays exact per granule. */
    size_t span = size + OP_HUGE_ALIGN;
    char *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return -errno;
    char *p = (char *)(((uintptr_t)raw + OP_HUGE_ALIGN - 1) & ~(uintptr_t)(OP_HUGE_ALIGN - 1));
    size_t head = (size_t)(p - raw), tail = span - head - size;
    if (head) munmap(raw, head);
    if (tail) munmap(p + size, tail);
    /* NOTE: no MADV_HUGEPAGE by default (op_slot_advise_huge is the opt-in): under
     * THP=always aligned granules get huge pages anyway; under THP=madvise a huge page
     * fault may compact memory first (defrag=madvise), and on a VM that returns free
     * memory to its host (virtio-balloon free page reporting) every huge page taken
     * from reported memory is faulted in again by the host (docs/runtime.md). */
    *out = p;
    return 0;
}

#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif

int op_slot_advise_huge(void *p, size_t n) {
    if (!p || !aligned(p, n)) return -EINVAL;
    if (n == 0) return 0;
    return madvise(p, n, MADV_HUGEPAGE) ? -errno : 0;
}

#define OP_COMMIT_STEP ((size_t)2 << 20)

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels answer EINVAL: then pages fault lazily */
#endif

int op_slot_open(void *p, size_t n) {
    if (!p || !aligned(p, n)) return -EINVAL;
    if (n == 0) return 0;
    return mprotect(p, n, PROT_READ | PROT_WRITE) ? -errno : 0;
}

int op_slot_commit(void *p, size_t n) {
    int rc = op_slot_open(p, n);
    return rc ? rc : op_slot_populate(p, n);
}

/* NOTE: why open and populate apart: mprotect (like mmap and munmap) takes the
 * process's mmap lock for writing, so it waits for every other thread's page
 * population in flight and blocks new ones meanwhile. Two threads committing slots
 * with mprotect + populate each ran no faster than one (40 x 6 MiB: 72 ms on one
 * thread, 65-72 ms on two, ~40% of the time asleep); with the ranges opened
 * beforehand, populating alone took 41-44 ms on two threads. */
int op_slot_populate(void *p, size_t n) {
    if (!p || !aligned(p, n)) return -EINVAL;
    if (n == 0) return 0;
    /* Commit means commit: populate the pages now. Letting the first writer (a prepack
     * streaming hundreds of MB) take one fault per 4 KiB page cost ~3x the pack itself
     * on the medium fixture. A kernel without MADV_POPULATE_WRITE (EINVAL) leaves
     * lazy faults; any other failure (out of memory, a range not open) is returned.
     * NOTE: in 2 MiB steps, not one call: populating holds the process's mmap lock
     * for reading, and one call over a 33 MB slot kept every other thread's mmap /
     * munmap (slot reserves, source mappings) waiting ~20 ms behind it. */
    for (size_t off = 0; off < n; off += OP_COMMIT_STEP) {
        size_t len = n - off < OP_COMMIT_STEP ? n - off : OP_COMMIT_STEP;
        while (madvise((char *)p + off, len, MADV_POPULATE_WRITE)) {
            if (errno == EINTR) continue;
            return errno == EINVAL ? 0 : -errno;
        }
    }
    return 0;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

int op_populate_read(const void *p, size_t n) {
    if (!p || ((uintptr_t)p & (uintptr_t)(sysconf(_SC_PAGESIZE) - 1))) return -EINVAL;
    for (size_t off = 0; off < n; off += OP_COMMIT_STEP) {
        size_t len = n - off < OP_COMMIT_STEP ? n - off : OP_COMMIT_STEP;
        while (madvise((char *)p + off, len, MADV_POPULATE_READ)) {
            if (errno == EINTR) continue;
            return -errno;
        }
    }
    return 0;
}

int op_slot_map_file(void *p, size_t n, int fd, int64_t offset) {
    size_t ps = op_page_size();
    if (!p || n == 0 || fd < 0 || offset < 0 || ((uintptr_t)p % ps) || ((uint64_t)offset % ps))
        return -EINVAL;
    size_t len = (n + ps - 1) / ps * ps;
    /* NOTE: PROT_READ only: populating a private WRITABLE file mapping breaks COW
     * page by page (a copy of every byte, the cost this avoids). */
    void *q = mmap(p, len, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, (off_t)offset);
    if (q == MAP_FAILED) return -errno;
    /* NOTE: where the address and the file offset agree modulo 2 MiB, a 2 MiB folio of
     * the page cache (the writer's 2 MiB writes make them; docs/cache-format.md) is
     * mapped by one PMD entry instead of 512 PTEs. MADV_HUGEPAGE on this file mapping
     * makes a fault on a cold page cache read ahead whole 2 MiB folios too (measured
     * here: 64 MiB read cold gave 24 MiB PMD-mapped without it, all 64 with it). It
     * allocates no anonymous memory (the slot's own advice is op_slot_advise_huge) and
     * goes with the mapping when op_slot_unmap_file replaces it. Failure is harmless. */
    if (len >= OP_HUGE_ALIGN && ((uintptr_t)p - (uint64_t)offset) % OP_HUGE_ALIGN == 0)
        (void)madvise(p, len, MADV_HUGEPAGE);
    return 0;
}

int op_slot_unmap_file(void *p, size_t n) {
    if (!p || !aligned(p, n)) return -EINVAL;
    if (n == 0) return 0;
    void *q = mmap(p, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return q == MAP_FAILED ? -errno : 0;
}

int op_slot_decommit(void *p, size_t n) {
    if (!p || !aligned(p, n)) return -EINVAL;
    if (n == 0) return 0;
    if (madvise(p, n, MADV_DONTNEED)) return -errno;
    return mprotect(p, n, PROT_NONE) ? -errno : 0;
}

int op_slot_release(void *p, size_t n) {
    if (!p || !aligned(p, n)) return -EINVAL;
    return munmap(p, n) ? -errno : 0;
}

int64_t op_resident_bytes(const void *p, size_t n) {
    if (!p || !aligned(p, n)) return -EINVAL;
    size_t ps = op_page_size(), pages = n / ps;
    if (pages == 0) return 0;
    unsigned char *vec = malloc(pages);
    if (!vec) return -ENOMEM;
    if (mincore((void *)p, n, (void *)vec)) {
        int e = errno;
        free(vec);
        return -e;
    }
    int64_t resident = 0;
    for (size_t i = 0; i < pages; i++) resident += vec[i] & 1;
    free(vec);
    return resident * (int64_t)ps;
}
#if defined(__linux__)
#include <fcntl.h>
#include <sys/ioctl.h>
/* PAGEMAP_SCAN (Linux 6.7, linux/fs.h), declared here for older headers. */
struct op_page_region { uint64_t start, end, categories; };
struct op_pm_scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
    uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define OP_PAGEMAP_SCAN _IOWR('f', 16, struct op_pm_scan_arg)
#define OP_PAGE_IS_HUGE (1ULL << 6)

int64_t op_pmd_mapped_bytes(const void *p, size_t n) {
    if (!p || ((uintptr_t)p % op_page_size())) return -EINVAL;
    if (n == 0) return 0;
    /* One descriptor for the process (opened at the first call, kept): a page-in's count
     * costs the ioctl only. NOTE: a fork()ed child's copy reads the parent's tables
     * (/proc/self resolved at open); none of ours reads it after a fork. */
    static int cached = -1;
    int fd = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
    if (fd < 0) {
        int mine = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
        if (mine < 0) return -errno;
        int expected = -1;
        if (__atomic_compare_exchange_n(&cached, &expected, mine, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            fd = mine;
        } else {
            close(mine);
            fd = expected;
        }
    }
    struct op_page_region vec[64];
    uint64_t start = (uint64_t)(uintptr_t)p, end = start + n;
    int64_t total = 0;
    while (start < end) {
        /* Only the PMD-mapped regions (PAGE_IS_HUGE: a huge page mapped by one entry). */
        struct op_pm_scan_arg arg = {sizeof arg, 0, start, end, 0, (uint64_t)(uintptr_t)vec, 64, 0,
                                     0, OP_PAGE_IS_HUGE, 0, OP_PAGE_IS_HUGE};
        long got = ioctl(fd, OP_PAGEMAP_SCAN, &arg);
        if (got < 0) {
            return -(errno == EINVAL || errno == ENOTTY ? ENOTTY : errno);
        }
        for (long i = 0; i < got; i++) total += (int64_t)(vec[i].end - vec[i].start);
        if (arg.walk_end <= start) break;
        start = arg.walk_end;
    }
    return total;
}
#else
int64_t op_pmd_mapped_bytes(const void *p, size_t n) { (void)p; (void)n; return -ENOSYS; }
#endif
#else
/* KNOWN GAP: no stable-VA slots on non-POSIX hosts (Windows would use
 * VirtualAlloc MEM_RESERVE / MEM_COMMIT / MEM_DECOMMIT). */
size_t op_page_size(void) { return 4096; }
int op_slot_reserve(size_t size, void **out) { (void)size; (void)out; return -38; }
int op_slot_commit(void *p, size_t n) { (void)p; (void)n; return -38; }
int op_slot_decommit(void *p, size_t n) { (void)p; (void)n; return -38; }
int op_slot_release(void *p, size_t n) { (void)p; (void)n; return -38; }
int op_slot_map_file(void *p, size_t n, int fd, int64_t offset) { (void)p; (void)n; (void)fd; (void)offset; return -38; }
int op_slot_unmap_file(void *p, size_t n) { (void)p; (void)n; return -38; }
int64_t op_resident_bytes(const void *p, size_t n) { (void)p; (void)n; return -38; }
int64_t op_pmd_mapped_bytes(const void *p, size_t n) { (void)p; (void)n; return -38; }
#endif
