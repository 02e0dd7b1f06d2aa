/* Source guard: a data file truncated or rewritten while the reader maps it must be an
 * error, not a SIGBUS that kills the process.
 *
 * The reader registers each shared read-only mapping of a data file (op_guard_add). A
 * SIGBUS whose address lies in a registered range is a page past the file's end now:
 * the handler maps one zero page over it (MAP_FIXED, anonymous, read-only), marks the
 * range hit and returns, so the faulting read (a prepack kernel, a hash) resumes and
 * reads zeros. The reader checks the mark (op_guard_hit) after each consumer of the
 * bytes and fails the task, naming the file; nothing built from the zeros is published.
 *
 * NOTE: why not a thread-local sigsetjmp around each read: the consumers are the
 * kernels themselves (zero copy: the prepack reads the page cache through the mapping),
 * called from Python; a longjmp out of them would skip Python's frames. Why not pread:
 * it costs a zeroing and a copy of every source byte (materializer.py).
 *
 * A SIGBUS outside every registered range goes to the previous disposition (default:
 * the process dies of it, as before). mmap is a plain system call, safe in a handler on
 * Linux. Not on Windows (no SIGBUS; a mapped file cannot be truncated there). */
#define _GNU_SOURCE
#include "onnx_prep_native.h"

#include <errno.h>
#include <stdint.h>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <unistd.h>

#define OP_GUARDS 4096 /* source mappings and file-mapped prepared slots (stable_slot.py) */

static struct {
    _Atomic uintptr_t lo, hi;
    atomic_int hit;
} guards[OP_GUARDS];
static pthread_mutex_t guards_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction previous;
static int installed;
static uintptr_t page_mask;

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < OP_GUARDS; i++) {
        uintptr_t lo = atomic_load(&guards[i].lo), hi = atomic_load(&guards[i].hi);
        if (lo <= a && a < hi) {
            void *p = (void *)(a & ~page_mask);
            if (mmap(p, page_mask + 1, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                != MAP_FAILED) {
                atomic_store(&guards[i].hit, 1);
                return;
            }
            break;
        }
    }
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction) { previous.sa_sigaction(sig, si, uc); return; }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* the default: returning re-runs the faulting access, which now kills the process */
    signal(sig, SIG_DFL);
}

int op_guard_add(const void *p, size_t n) {
    if (!p || n == 0) return -EINVAL;
    pthread_mutex_lock(&guards_lock);
    if (!installed) {
        struct sigaction sa;
        sa.sa_sigaction = on_sigbus;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        page_mask = (uintptr_t)sysconf(_SC_PAGESIZE) - 1;
        if (sigaction(SIGBUS, &sa, &previous)) {
            int e = errno;
            pthread_mutex_unlock(&guards_lock);
            return -e;
        }
        installed = 1;
    }
    int slot = -ENOSPC;
    for (int i = 0; i < OP_GUARDS; i++) {
        if (atomic_load(&guards[i].hi) == 0) {
            atomic_store(&guards[i].hit, 0);
            atomic_store(&guards[i].lo, (uintptr_t)p);
            atomic_store(&guards[i].hi, (uintptr_t)p + n);
            slot = i;
            break;
        }
    }
    pthread_mutex_unlock(&guards_lock);
    return slot;
}

int op_guard_hit(int slot) {
    if (slot < 0 || slot >= OP_GUARDS) return -EINVAL;
    return atomic_load(&guards[slot].hit);
}

void op_guard_remove(int slot) {
    if (slot < 0 || slot >= OP_GUARDS) return;
    pthread_mutex_lock(&guards_lock);
    atomic_store(&guards[slot].hi, 0);
    atomic_store(&guards[slot].lo, 0);
    pthread_mutex_unlock(&guards_lock);
}

#else
int op_guard_add(const void *p, size_t n) { (void)p; (void)n; return -ENOSYS; }
int op_guard_hit(int slot) { (void)slot; return 0; }
void op_guard_remove(int slot) { (void)slot; }
#endif
