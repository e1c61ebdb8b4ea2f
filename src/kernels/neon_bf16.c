/*
 * neon_bf16.c -- the bf16 kernels of aarch64 (bf16_tier.h's algorithm) on
 * FEAT_BF16's BFDOT (Armv8.6-A, optional from 8.2: Neoverse V1/V2/N2,
 * Graviton 3 and 4, Cortex-A510/A710 and later).  Compiled on aarch64
 * with +bf16 for this file alone; called only where mha_bf16_tier() found
 * HWCAP2_BF16 (dispatch.c).
 *
 * BFDOT multiplies pairs: lane i of the accumulator gains a[2i] b[2i] +
 * a[2i+1] b[2i+1], which is exactly what the packed B layout holds (a
 * 32-bit word is the pair (B[2k][n], B[2k+1][n]) of one column n), so the
 * GEMM reads the layout of the x86 kernels (mha_bf16_pack_b) as it is,
 * with A's pairs taken by lane (BFDOT's indexed form).  The packing and
 * the linear layer's rounding of W are plain loops here: they run once
 * per call, not per score.  No aarch64 timing exists yet: the blocking
 * (4 rows x 16 columns, 16 accumulators) follows the register count.
 *
 * BFDOT's own arithmetic: the two products are exact and summed before
 * one rounding onto the accumulator, with bf16 inputs' denormals read as
 * zero (Arm ARM, BFDOT; FEAT_EBF16's other mode is not asked for): within
 * the float32 sums' error, its own bits.
 */
#define MHA_SIMD_NEON
#include "simd.h"

#include "kernels.h"

#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

void mha_bf16_begin(int tiles) { (void)tiles; }   /* nothing to configure */
void mha_bf16_end(void) {}

/* ---- packing (the layout of mha_bf16_pack_b, kernels.h) ------------------ */

void mha_bf16_pack_b(const uint16_t *src, int64_t sk, int64_t sn, int64_t K,
                     int64_t N, uint32_t *dst)
{
    mha_bf16_pack_b_rows(src, sk, sn, K, N, 0, (K + 31) / 32, dst);
}

void mha_bf16_pack_b_rows(const uint16_t *src, int64_t sk, int64_t sn,
                          int64_t K, int64_t N, int64_t kt0, int64_t kt1,
                          uint32_t *dst)
{
    const int64_t nnt = (N + 31) / 32 * 2;
    for (int64_t kt = kt0; kt < kt1; kt++)
        for (int64_t nt = 0; nt < nnt; nt++) {
            uint32_t *t = dst + (kt * nnt + nt) * 256;
            for (int r = 0; r < 16; r++) {
                const int64_t k0 = 32 * kt + 2 * r, k1 = k0 + 1;
                for (int c = 0; c < 16; c++) {
                    const int64_t n = 16 * nt + c;
                    const uint32_t lo =
                        n < N && k0 < K ? src[k0 * sk + n * sn] : 0;
                    const uint32_t hi =
                        n < N && k1 < K ? src[k1 * sk + n * sn] : 0;
                    t[16 * r + c] = lo | hi << 16;
                }
            }
        }
}

uint16_t mha_bf16_max_abs(const uint16_t *x, int64_t ld, int64_t rows,
                          int64_t n)
{
    uint16_t m = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++) {
            const uint16_t v = x[r * ld + j] & 0x7FFF;
            if (v < 0x7F80 && v > m)   /* Inf and NaN skipped */
                m = v;
        }
    return m;
}

/* The word of bf16 (lo, hi), each rounded from a float. */
static uint32_t pair(float lo, float hi)
{
    return mha_bf16_from_float(lo) | (uint32_t)mha_bf16_from_float(hi) << 16;
}

/* The K x N matrix whose (k, n) element is w[k sk + n sn], rounded to
 * bf16, as the packed layout's 16-column tiles nt0 .. nt1 - 1 of every
 * row of tiles; the largest |w| it read. */
static float pack_floats(const float *w, int64_t sk, int64_t sn, int64_t K,
                         int64_t N, int64_t nt0, int64_t nt1, uint32_t *dst)
{
    float top = 0.0f;
    const int64_t nkt = (K + 31) / 32, nnt = (N + 31) / 32 * 2;
    for (int64_t nt = nt0; nt < nt1; nt++)
        for (int64_t kt = 0; kt < nkt; kt++) {
            uint32_t *t = dst + (kt * nnt + nt) * 256;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    const int64_t n = 16 * nt + c, k0 = 32 * kt + 2 * r;
                    const float lo = n < N && k0 < K ? w[k0 * sk + n * sn]
                                                     : 0.0f;
                    const float hi = n < N && k0 + 1 < K
                                         ? w[(k0 + 1) * sk + n * sn] : 0.0f;
                    top = fabsf(lo) > top ? fabsf(lo) : top;
                    top = fabsf(hi) > top ? fabsf(hi) : top;
                    t[16 * r + c] = pair(lo, hi);
                }
        }
    return top;
}

float mha_bf16_pack_wt(const float *w, int64_t n_in, int64_t n_out,
                       int64_t nt0, int64_t nt1, uint32_t *dst)
{
    return pack_floats(w, 1, n_in, n_in, n_out, nt0, nt1, dst);   /* W^T */
}

void mha_bf16_pack_w(const float *w, int64_t n_in, int64_t n_out,
                     int64_t nt0, int64_t nt1, uint32_t *dst)
{
    (void)pack_floats(w, n_in, 1, n_out, n_in, nt0, nt1, dst);   /* W */
}

void mha_bf16_transpose(const uint16_t *src, int64_t ld, int64_t K,
                        int64_t N, int64_t kt0, int64_t kt1, uint16_t *dst,
                        int64_t ldd)
{
    const int64_t rows = (N + 31) / 32 * 32;
    for (int64_t kt = kt0; kt < kt1; kt++)
        for (int64_t n = 0; n < rows; n++)
            for (int k = 0; k < 32; k++) {
                const int64_t kk = 32 * kt + k;
                dst[n * ldd + kk] = n < N && kk < K ? src[kk * ld + n] : 0;
            }
}

/* ---- the tile GEMM ----------------------------------------------------------
 * Blocks of 4 rows x one 16-column tile: 16 accumulators, the tile's
 * pair row as 4 vectors, and per row 8 bf16 of A (four of its pairs),
 * each pair broadcast by BFDOT's lane index; k ascending, a fixed order.
 */
#define DOT4(k)                                                             \
    do {                                                                    \
        const uint32_t *br = bt + 16 * (k4 + (k));                          \
        bfloat16x8_t bv[4];                                                 \
        for (int x = 0; x < 4; x++)                                         \
            bv[x] = vreinterpretq_bf16_u32(vld1q_u32(br + 4 * x));          \
        for (int r = 0; r < R; r++)                                         \
            for (int x = 0; x < 4; x++)                                     \
                c[r][x] = vbfdotq_laneq_f32(c[r][x], bv[x], a[r], k);       \
    } while (0)

static void gemm32(float *C, int ldc, int N, const uint16_t *A, int lda,
                   int K, const uint32_t *b, int64_t bstride, int acc,
                   int two)
{
    enum { R = 4 };
    for (int nt = 0; nt < N / 16; nt++)
        for (int r0 = 0; r0 < (two ? 32 : 16); r0 += R) {
            float32x4_t c[R][4];
            for (int r = 0; r < R; r++)
                for (int x = 0; x < 4; x++)
                    c[r][x] = acc ? vld1q_f32(C + (r0 + r) * ldc + 16 * nt +
                                              4 * x)
                                  : vdupq_n_f32(0.0f);
            for (int kt = 0; kt < K / 32; kt++) {
                const uint32_t *bt = b + ((int64_t)kt * bstride + nt) * 256;
                for (int k4 = 0; k4 < 16; k4 += 4) {   /* 4 pairs: 8 k */
                    bfloat16x8_t a[R];
                    for (int r = 0; r < R; r++)
                        a[r] = vld1q_bf16((const bfloat16_t *)(
                            A + (r0 + r) * lda + 32 * kt + 2 * k4));
                    DOT4(0);
                    DOT4(1);
                    DOT4(2);
                    DOT4(3);
                }
            }
            for (int r = 0; r < R; r++)
                for (int x = 0; x < 4; x++)
                    vst1q_f32(C + (r0 + r) * ldc + 16 * nt + 4 * x, c[r][x]);
        }
}
#undef DOT4

/* bf16_tier.h's pieces of this ISA: 2^n as the exponent's bits (n >=
 * -126; 0 below, where x86's vscalefps still gives subnormals: weights
 * under 2^-126 of the row's largest, which is 1), and bf16 rounding by
 * BFCVTN. */
MK_INLINE vf vf_scale2(vf p, vf n)
{
    const int32x4_t e = vshlq_n_s32(
        vaddq_s32(vcvtq_s32_f32(vmaxq_f32(n, vdupq_n_f32(-126.0f))),
                  vdupq_n_s32(127)),
        23);
    const vf y = vmulq_f32(p, vreinterpretq_f32_s32(e));   /* NaN n: 2^0 */
    return vbslq_f32(vcltq_f32(n, vdupq_n_f32(-126.0f)), vdupq_n_f32(0.0f),
                     y);
}
MK_INLINE void vf_store_bf16(uint16_t *p, vf v)
{
    vst1_bf16((bfloat16_t *)p, vcvt_bf16_f32(v));
}
MK_INLINE void vf_store_bf16_t(uint16_t *p, vf v, int n)
{
    uint16_t b[4];
    vf_store_bf16(b, v);
    memcpy(p, b, (size_t)n * sizeof *p);
}
#include "bf16_tier.h"
