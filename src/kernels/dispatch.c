/*
 * dispatch.c -- which tier runs: chosen once, by the CPU's features (the
 * widest it has: avx512, avx2 or neon, else scalar), or forced with the
 * environment variable MHA_ISA=ref|scalar|avx2|avx512|neon (the tests run
 * every tier this way).
 */
#define _GNU_SOURCE   /* syscall() */
#include "kernels.h"
#include "core/core.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

/* AVX2, FMA and F16C (the f16 KV cache's conversions): every AVX2 CPU
 * has the other two, but each is asked. */
static int cpu_has_avx2_fma(void)
{
#if defined(__x86_64__) || defined(__i386__)
    /* libgcc's cpu model checks CPUID and that the OS saves the YMM state
     * (XGETBV), so a kernel without AVX support reads as no AVX2 here.
     * It has no name for F16C: CPUID leaf 1, ECX bit 29. */
    __builtin_cpu_init();
    unsigned eax, ebx, ecx = 0, edx;
    const int f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) &&
                     (ecx & bit_F16C);
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           f16c;
#else
    return 0;
#endif
}

int mha_cpu_has_avx512(void)
{
#if defined(__x86_64__) || defined(__i386__)
    /* Also checks (XGETBV) that the OS saves the ZMM and mask state. */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && cpu_has_avx2_fma();
#else
    return 0;
#endif
}

/* Advanced SIMD with the half-precision conversions: part of every
 * ARMv8-A CPU, but asked of the kernel (HWCAP_ASIMD, bit 1). */
static int cpu_has_neon(void)
{
#if defined(__aarch64__) && defined(__linux__)
    return (getauxval(AT_HWCAP) >> 1 & 1) != 0;
#else
    return 0;
#endif
}

#if defined(__x86_64__) && defined(__linux__)
/* CPUID leaf 7's bits, XCR0's tile bits, then Linux's permission for the
 * tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without
 * it the first tile instruction would fault. */
static int amx_usable(void)
{
    const char *env = getenv("MHA_AMX");
    if (env && !strcmp(env, "0"))
        return 0;
    if (!mha_cpu_has_avx512())
        return 0;
    unsigned a, b, c, d, a1, b1, c1, d1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) ||
        !__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1))
        return 0;
    const int amx = (d >> 22 & 1) && (d >> 24 & 1);       /* BF16, TILE */
    const int bw_dq_vl = (b >> 30 & 1) && (b >> 17 & 1) && (b >> 31 & 1);
    const int bf16 = a1 >> 5 & 1;                           /* AVX512_BF16 */
    if (!amx || !bw_dq_vl || !bf16)
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17))   /* XTILECFG, XTILEDATA */
        return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
}
#endif

int mha_cpu_has_amx(void)
{
#if defined(__x86_64__) && defined(__linux__)
    static atomic_int known = -1;   /* asked once per process */
    int k = atomic_load(&known);
    if (k < 0) {
        k = amx_usable();
        atomic_store(&known, k);
    }
    return k;
#else
    return 0;
#endif
}

/* -1: not chosen yet; otherwise the isa, or 100 + a status on error. */
static atomic_int chosen = -1;

static int choose(void)
{
    const char *env = getenv("MHA_ISA");
    const int avx2 = cpu_has_avx2_fma(), avx512 = mha_cpu_has_avx512();
    const int neon = cpu_has_neon();
    if (!env || !*env)
        return avx512 ? MHA_ISA_AVX512
             : avx2   ? MHA_ISA_AVX2
             : neon   ? MHA_ISA_NEON
                      : MHA_ISA_SCALAR;
    if (!strcmp(env, "ref"))
        return MHA_ISA_REF;
    if (!strcmp(env, "scalar"))
        return MHA_ISA_SCALAR;
    if (!strcmp(env, "avx2"))
        return avx2 ? MHA_ISA_AVX2 : 100 + MHA_ERR_UNSUPPORTED;
    if (!strcmp(env, "avx512"))
        return avx512 ? MHA_ISA_AVX512 : 100 + MHA_ERR_UNSUPPORTED;
    if (!strcmp(env, "neon"))
        return neon ? MHA_ISA_NEON : 100 + MHA_ERR_UNSUPPORTED;
    return 100 + MHA_ERR_INVALID_ARGUMENT;
}

mha_status mha_isa_get(mha_isa *isa, const mha_microkernels **uk)
{
    int c = atomic_load(&chosen);
    if (c < 0) {
        c = choose();             /* a race computes the same value twice */
        atomic_store(&chosen, c);
    }
    if (c >= 100) {
        const char *env = getenv("MHA_ISA");
        return mha_set_error((mha_status)(c - 100),
                             c - 100 == MHA_ERR_UNSUPPORTED
                                 ? "MHA_ISA=%s, but this CPU or OS lacks "
                                   "its instructions"
                                 : "MHA_ISA=%s: expected ref, scalar, avx2, "
                                   "avx512 or neon",
                             env ? env : "");
    }
    *isa = (mha_isa)c;
    /* (choose() picks only the tiers this build's CPU family has) */
#if defined(__x86_64__) || defined(__i386__)
    *uk = c == MHA_ISA_AVX512 ? &mha_microkernels_avx512
        : c == MHA_ISA_AVX2   ? &mha_microkernels_avx2
                              : &mha_microkernels_scalar;
#elif defined(__aarch64__)
    *uk = c == MHA_ISA_NEON ? &mha_microkernels_neon
                            : &mha_microkernels_scalar;
#else
    *uk = &mha_microkernels_scalar;
#endif
    return MHA_OK;
}

const char *mha_kernel_tier(void)
{
    mha_isa isa = MHA_ISA_REF;
    const mha_microkernels *uk = NULL;
    if (mha_isa_get(&isa, &uk) != MHA_OK)
        return NULL;
    return isa == MHA_ISA_REF ? "ref" : uk->name;
}
