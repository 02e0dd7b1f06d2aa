/* CPU feature detection: named predicates, each including the OS support check.
 *
 * NOTE: CPUID saying "AVX-512" is not enough: the OS must also save the wider
 * register state on context switches, which XGETBV(XCR0) reports. Without that
 * check a kernel that uses ZMM registers would silently corrupt state (or fault)
 * under an OS or hypervisor that disabled AVX-512. */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "op_internal.h"

#if OP_X86
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static uint64_t xgetbv0(void) {
    uint32_t eax, edx;
    /* xgetbv with ecx = 0 (XCR0); encoded as bytes so no -mxsave flag is needed */
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

typedef struct {
    int valid;
    int avx2_fma, avx512, avx512_vnni, amx;
} features;

/* NOTE: Linux keeps the 8 KiB tile data state off until a process asks for it
 * (XFD): a tile instruction before the grant faults (SIGILL). The grant is
 * process-wide and permanent; a kernel before 5.16 has no such call, and no AMX. */
static int amx_granted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

static features detect(void) {
    features f = {1, 0, 0, 0, 0};
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave) return f;
    uint64_t xcr0 = xgetbv0();
    int os_ymm = (xcr0 & 0x6) == 0x6;          /* SSE + AVX state */
    int os_zmm = (xcr0 & 0xE6) == 0xE6;        /* + opmask, ZMM_Hi256, Hi16_ZMM */
    if (__get_cpuid_max(0, 0) < 7) return f;
    __cpuid_count(7, 0, a, b, c, d);
    int avx2 = (b >> 5) & 1;
    int avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
        avx512vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
    f.avx2_fma = avx && avx2 && fma && f16c && os_ymm;
    f.avx512 = f.avx2_fma && avx512f && avx512dq && avx512bw && avx512vl && os_zmm;
    f.avx512_vnni = f.avx512 && vnni;
    int amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
    int os_tiles = ((xcr0 >> 17) & 3) == 3; /* XTILECFG + XTILEDATA */
    f.amx = f.avx512_vnni && amx_tile && amx_int8 && os_tiles && amx_granted();
    return f;
}

static features cached;

static const features *get(void) {
    /* Benign race: every thread computes the same value. */
    if (!cached.valid) cached = detect();
    return &cached;
}

int op_cpu_has_avx2_fma(void) { return get()->avx2_fma; }
int op_cpu_has_avx512(void) { return get()->avx512; }
int op_cpu_has_avx512_vnni(void) { return get()->avx512_vnni; }
int op_cpu_has_amx(void) { return get()->amx; }
#else
int op_cpu_has_avx2_fma(void) { return 0; }
int op_cpu_has_avx512(void) { return 0; }
int op_cpu_has_avx512_vnni(void) { return 0; }
int op_cpu_has_amx(void) { return 0; }
#endif

int op_isa_compiled(int isa) {
    switch (isa) {
    case OP_ISA_SCALAR: return 1;
    case OP_ISA_AVX2:
    case OP_ISA_AVX512:
    case OP_ISA_AVX512_NOVNNI: return OP_SIMD;
    default: return 0;
    }
}

int op_isa_supported(int isa) {
    if (!op_isa_compiled(isa)) return 0;
    switch (isa) {
    case OP_ISA_SCALAR: return 1;
    case OP_ISA_AVX2: return op_cpu_has_avx2_fma();
    case OP_ISA_AVX512:
    case OP_ISA_AVX512_NOVNNI: return op_cpu_has_avx512();
    default: return 0;
    }
}
