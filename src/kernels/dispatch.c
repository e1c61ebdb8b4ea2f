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
/* The bf16 kernels' instructions: AVX512-BF16 (CPUID leaf 7 subleaf 1)
 * with AVX-512 F/BW/DQ/VL (leaf 7) for the dot products; AMX-BF16 and
 * AMX-TILE (leaf 7), the tile state saved by the OS (XCR0) and Linux's
 * permission for the tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA: without it the first tile instruction would fault)
 * for the tiles. */
static int bf16_dp_usable(void)
{
    unsigned a, b, c, d, a1, b1, c1, d1;
    if (!mha_cpu_has_avx512() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) ||
        !__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1))
        return 0;
    const int bw_dq_vl = (b >> 30 & 1) && (b >> 17 & 1) && (b >> 31 & 1);
    return bw_dq_vl && (a1 >> 5 & 1);                      /* AVX512_BF16 */
}

static int amx_usable(void)
{
    unsigned a, b, c, d;
    if (!bf16_dp_usable() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) ||
        !((d >> 22 & 1) && (d >> 24 & 1)))                /* BF16, TILE */
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17))   /* XTILECFG, XTILEDATA */
        return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
}

#else
#define bf16_dp_usable() 0
#define amx_usable() 0
#endif

#if defined(__aarch64__) && defined(__linux__)
/* FEAT_BF16 (BFDOT, BFCVT), as the kernel reports it: HWCAP2_BF16, bit
 * 14 of AT_HWCAP2. */
static int bf16_dot_usable(void)
{
    return (getauxval(AT_HWCAP2) >> 14 & 1) != 0;
}
#define BF16_DOT_NAME "bfdot"
#define BF16_ISA MHA_ISA_NEON
#else
static int bf16_dot_usable(void) { return bf16_dp_usable(); }
#define BF16_DOT_NAME "avx512bf16"
#define BF16_ISA MHA_ISA_AVX512
#endif

/* The best the CPU has, at most the one MHA_BF16 names (the dot-product
 * kernels are this ISA's: avx512bf16 on x86, bfdot on aarch64; the other
 * ISA's name, like float32, means none); -1 for a name that is none of
 * them. */
static int bf16_choose(void)
{
    const char *env = getenv("MHA_BF16");
    int cap = MHA_BF16_AMX;
    if (env && *env)
        cap = !strcmp(env, "amx")                 ? MHA_BF16_AMX
            : !strcmp(env, BF16_DOT_NAME)         ? MHA_BF16_DOT
            : !strcmp(env, "float32") || !strcmp(env, "avx512bf16") ||
                      !strcmp(env, "bfdot")
                ? MHA_BF16_FLOAT32
                : -1;
    if (cap < 0)
        return -1;
    if (cap >= MHA_BF16_AMX && amx_usable())
        return MHA_BF16_AMX;
    if (cap >= MHA_BF16_DOT && bf16_dot_usable())
        return MHA_BF16_DOT;
    return MHA_BF16_FLOAT32;
}

const char *mha_bf16_tier_name(int tier, mha_isa isa)
{
    return isa != BF16_ISA            ? "float32"
         : tier == MHA_BF16_AMX       ? "amx"
         : tier == MHA_BF16_DOT       ? BF16_DOT_NAME
                                      : "float32";
}

int mha_bf16_tier(void)
{
    static atomic_int known = -2;   /* chosen once per process */
    int k = atomic_load(&known);
    if (k == -2) {
        k = bf16_choose();
        atomic_store(&known, k);
    }
    return k;
}

/* -1: not chosen yet; otherwise the isa, or 100 + a status on error. */
static atomic_int chosen = -1;

/* kernels.h; 1 until a tier is chosen (the kernels run only after). */
static atomic_int slab_prefetch = 1;

int mha_slab_prefetch(void)
{
    return atomic_load_explicit(&slab_prefetch, memory_order_relaxed);
}

/* kernels.h; 0 until a tier is chosen. */
static atomic_int next_prefetch = 0;

int mha_next_prefetch(void)
{
    return atomic_load_explicit(&next_prefetch, memory_order_relaxed);
}

/* Whether CPUID names AMD ("AuthenticAMD"). */
static int cpu_is_amd(void)
{
#if defined(__x86_64__) || defined(__i386__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u &&
           d == 0x69746e65u && c == 0x444d4163u;
#else
    return 0;
#endif
}

/* AMD's CPU family (CPUID leaf 1: base 0xF plus the extended family;
 * Zen 4 0x19, Zen 5 0x1A), 0 on another vendor. */
static int amd_family(void)
{
#if defined(__x86_64__) || defined(__i386__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_is_amd() || !__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    const unsigned base = (a >> 8) & 0xF, ext = (a >> 20) & 0xFF;
    return (int)(base == 0xF ? base + ext : base);
#else
    return 0;
#endif
}

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
        atomic_store(&slab_prefetch, !(c == MHA_ISA_AVX512 && cpu_is_amd()));
        atomic_store(&next_prefetch,
                     c != MHA_ISA_AVX512  ? 0
                     : amd_family() >= 0x1A ? 2   /* Zen 5 and later */
                                            : 1);
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
