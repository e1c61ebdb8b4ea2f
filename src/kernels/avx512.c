/*
 * avx512.c -- the AVX-512 tier (Zen 4 / Zen 5 / Skylake-X class).  This
 * file, and only this file, is compiled with -mavx512f -mfma; it is called
 * only when the CPU and the OS report AVX-512F (dispatch.c).  AVX-512F
 * intrinsics only (no BW / DQ / VL), so any AVX-512 CPU runs it.
 *
 * It is the AVX2 tier (avx2.c) at twice the width, with
 * mask registers in place of blends and masked loads: the same register
 * tiling rule, the same determinism rule (every output element is one chain
 * of fused multiply-adds in ascending order of the reduction index, whatever
 * block of the tiling it lands in), and the same exp, lane for lane.  What
 * differs from avx2 is the order of exp_sum's sum (16 lanes, then a fixed
 * tree), so the two tiers agree to rounding, not bitwise.  docs/KERNELS.md.
 */
#include "kernels.h"

#include <immintrin.h>
#include <math.h>

#define MK_INLINE static inline __attribute__((always_inline))

/* ---- the common GEMM-like tile -------------------------------------------
 *
 *   C[r][j] (=|+=) sum_k A[r*lda + k*ska] * B[k*ldb + j],  r < R, j < 16*W
 *
 * as in the avx2 tier: the chain of FMAs starts from C (FROM_C: pv) or
 * from 0 (qk, and with ADD the finished sum is added to C: pv_add, pvt);
 * EXACT leaves the chain alone for an A[r][k] that is zero.
 */
enum { FROM_C = 1, EXACT = 2, ADD = 4 };
enum { MODE_SET = 0, MODE_ACC = FROM_C, MODE_ACC_EXACT = FROM_C | EXACT,
       MODE_ADD = ADD, MODE_ADD_EXACT = ADD | EXACT };

/* R rows (1..6) x W vectors (1, 2 or 4) of C.  m masks the columns of a
 * W == 1 tail (0xffff otherwise): masked lanes are neither read nor
 * written, so the tile never touches memory past its last column. */
MK_INLINE void tile(const int R, const int W, const int mode, int K,
                    const float *A, int lda, int ska, const float *B, int ldb,
                    float *C, int ldc, __mmask16 m)
{
    __m512 acc[6][4];
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++)
            acc[r][w] = mode & FROM_C
                            ? _mm512_maskz_loadu_ps(
                                  m, C + (size_t)r * ldc + 16 * w)
                            : _mm512_setzero_ps();

    const __m512 zero = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m512 b[4];
        for (int w = 0; w < W; w++)
            b[w] = _mm512_maskz_loadu_ps(m, B + (size_t)k * ldb + 16 * w);
        for (int r = 0; r < R; r++) {
            const __m512 a =
                _mm512_set1_ps(A[(size_t)r * lda + (size_t)k * ska]);
            if (mode & EXACT) {
                /* Lanes where a != 0 (NaN included) take the FMA; for a
                 * zero a every lane keeps acc, as if the term were
                 * skipped, so NaN / Inf in b never reaches this row. */
                const __mmask16 nz = _mm512_cmp_ps_mask(a, zero, _CMP_NEQ_UQ);
                for (int w = 0; w < W; w++)
                    acc[r][w] = _mm512_mask3_fmadd_ps(a, b[w], acc[r][w], nz);
            } else {
                for (int w = 0; w < W; w++)
                    acc[r][w] = _mm512_fmadd_ps(a, b[w], acc[r][w]);
            }
        }
    }

    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++) {
            float *c = C + (size_t)r * ldc + 16 * w;
            _mm512_mask_storeu_ps(
                c, m,
                mode & ADD ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, c),
                                           acc[r][w])
                           : acc[r][w]);
        }
}

/* R rows against all N columns: 64-wide blocks, then a 32-wide and a
 * 16-wide block, then a masked tail of 1..15. */
MK_INLINE void panel(const int R, const int mode, int N, int K, const float *A,
                     int lda, int ska, const float *B, int ldb, float *C,
                     int ldc)
{
    const __mmask16 all = 0xffff;
    int j = 0;
    for (; j + 64 <= N; j += 64)
        tile(R, 4, mode, K, A, lda, ska, B + j, ldb, C + j, ldc, all);
    if (j + 32 <= N) {
        tile(R, 2, mode, K, A, lda, ska, B + j, ldb, C + j, ldc, all);
        j += 32;
    }
    if (j + 16 <= N) {
        tile(R, 1, mode, K, A, lda, ska, B + j, ldb, C + j, ldc, all);
        j += 16;
    }
    if (j < N)
        tile(R, 1, mode, K, A, lda, ska, B + j, ldb, C + j, ldc,
             (__mmask16)((1u << (N - j)) - 1u));
}

/* All M rows: blocks of 6 rows, then one block of the remainder. */
MK_INLINE void gemm(const int mode, int M, int N, int K, const float *A,
                    int lda, int ska, const float *B, int ldb, float *C,
                    int ldc)
{
    int i = 0;
    for (; i + 6 <= M; i += 6)
        panel(6, mode, N, K, A + (size_t)i * lda, lda, ska, B, ldb,
              C + (size_t)i * ldc, ldc);
    const float *Ai = A + (size_t)i * lda;
    float *Ci = C + (size_t)i * ldc;
    switch (M - i) {
    case 5: panel(5, mode, N, K, Ai, lda, ska, B, ldb, Ci, ldc); break;
    case 4: panel(4, mode, N, K, Ai, lda, ska, B, ldb, Ci, ldc); break;
    case 3: panel(3, mode, N, K, Ai, lda, ska, B, ldb, Ci, ldc); break;
    case 2: panel(2, mode, N, K, Ai, lda, ska, B, ldb, Ci, ldc); break;
    case 1: panel(1, mode, N, K, Ai, lda, ska, B, ldb, Ci, ldc); break;
    default: break;
    }
}

/* 6 rows x 64 columns: 24 accumulators + 4 B vectors + 1 broadcast of the
 * 32 zmm registers (the _exact forms keep their zero test in a mask
 * register, so they block the same way). */
static void qk_avx512(int mr, int nc, int dh, const float *q, const float *kt,
                      int ldkt, float *s, int lds)
{
    gemm(MODE_SET, mr, nc, dh, q, dh, 1, kt, ldkt, s, lds);
}

static void pv_avx512(int mr, int nc, int dh, const float *p, int ldp,
                      const float *v, float *o, int ldo)
{
    gemm(MODE_ACC, mr, dh, nc, p, ldp, 1, v, dh, o, ldo);
}

static void pv_exact_avx512(int mr, int nc, int dh, const float *p, int ldp,
                            const float *v, float *o, int ldo)
{
    gemm(MODE_ACC_EXACT, mr, dh, nc, p, ldp, 1, v, dh, o, ldo);
}

static void pv_add_avx512(int mr, int nc, int dh, const float *p, int ldp,
                          const float *v, float *o, int ldo)
{
    gemm(MODE_ADD, mr, dh, nc, p, ldp, 1, v, dh, o, ldo);
}

static void pv_add_exact_avx512(int mr, int nc, int dh, const float *p,
                                int ldp, const float *v, float *o, int ldo)
{
    gemm(MODE_ADD_EXACT, mr, dh, nc, p, ldp, 1, v, dh, o, ldo);
}

/* pT x: A is p read down its columns (row stride 1, k stride ldp). */
static void pvt_avx512(int mr, int nc, int dh, const float *p, int ldp,
                       const float *x, float *o, int ldo)
{
    gemm(MODE_ADD, nc, dh, mr, p, 1, ldp, x, dh, o, ldo);
}

static void pvt_exact_avx512(int mr, int nc, int dh, const float *p, int ldp,
                             const float *x, float *o, int ldo)
{
    gemm(MODE_ADD_EXACT, nc, dh, mr, p, 1, ldp, x, dh, o, ldo);
}

/* ---- exp ------------------------------------------------------------------
 *
 * The avx2 tier's exp (see there, and docs/KERNELS.md), operation for
 * operation on 16 lanes: clamp to [flush, 89], n = round(x log2e), Cody-Waite
 * f, the degree-5 polynomial by Horner with FMA, 2^n as two exact factors,
 * results below FLT_MIN flushed to +0.  Each lane gives the bits the avx2
 * exp gives.
 */
MK_INLINE __m512 exp16(__m512 x)
{
    const __m512 flush = _mm512_set1_ps(-0x1.5d589ep+6f);
    const __m512 x_hi = _mm512_set1_ps(89.0f);
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693147182464599609375f);
    const __m512 ln2_lo = _mm512_set1_ps(-1.904654299957768e-09f);
    const __m512 one = _mm512_set1_ps(1.0f);

    /* vmaxps / vminps return the second operand when one is NaN: x. */
    const __m512 xc = _mm512_max_ps(flush, _mm512_min_ps(x_hi, x));
    const __mmask16 below = _mm512_cmp_ps_mask(x, flush, _CMP_LT_OQ);

    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, log2e),
                                          _MM_FROUND_TO_NEAREST_INT |
                                              _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, ln2_hi, xc);
    f = _mm512_fnmadd_ps(n, ln2_lo, f);

    __m512 P = _mm512_set1_ps(1.9875691500e-4f);
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(1.3981999507e-3f));
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(8.3334519073e-3f));
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(4.1665795894e-2f));
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(1.6666665459e-1f));
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 f2 = _mm512_mul_ps(f, f);
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(P, f2, f), one);

    const __m512i ni = _mm512_cvtps_epi32(n);
    const __m512i n1 = _mm512_srai_epi32(ni, 1);
    const __m512i n2 = _mm512_sub_epi32(ni, n1);
    const __m512i bias = _mm512_set1_epi32(127);
    const __m512 s1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
    const __m512 s2 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
    const __m512 r = _mm512_mul_ps(_mm512_mul_ps(y, s1), s2);
    return _mm512_maskz_mov_ps((__mmask16)~below, r);
}

/* Fixed order: lanes (i + 8) onto i, then (i + 4), (i + 2), (i + 1). */
static float hsum16(__m512 v)
{
    float l[16];
    _mm512_storeu_ps(l, v);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++)
            l[i] += l[i + w];
    return l[0];
}

static float exp_sum_avx512(float *x, int n, float m)
{
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    int c = 0;
    for (; c + 16 <= n; c += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + c), mv));
        _mm512_storeu_ps(x + c, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (c < n) {
        /* The tail's lanes only: masked-off lanes are not read, not
         * written, and add zero. */
        const __mmask16 t = (__mmask16)((1u << (n - c)) - 1u);
        const __m512 e =
            exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(t, x + c), mv));
        _mm512_mask_storeu_ps(x + c, t, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(t, e));
    }
    return hsum16(acc);
}

static void scale_avx512(float *x, int n, float a)
{
    const __m512 av = _mm512_set1_ps(a);
    int c = 0;
    for (; c + 32 <= n; c += 32) {
        _mm512_storeu_ps(x + c, _mm512_mul_ps(_mm512_loadu_ps(x + c), av));
        _mm512_storeu_ps(x + c + 16,
                         _mm512_mul_ps(_mm512_loadu_ps(x + c + 16), av));
    }
    for (; c < n; c += 16) {
        const __mmask16 t =
            n - c >= 16 ? (__mmask16)0xffff
                        : (__mmask16)((1u << (n - c)) - 1u);
        _mm512_mask_storeu_ps(
            x + c, t, _mm512_mul_ps(_mm512_maskz_loadu_ps(t, x + c), av));
    }
}

/* vmaxps(x, m) returns m when x is NaN: NaN is ignored, as the contract
 * asks.  The masked-off lanes of the tail keep m. */
static float max_avx512(const float *x, int n)
{
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < n; c += 16) {
        const __mmask16 t =
            n - c >= 16 ? (__mmask16)0xffff
                        : (__mmask16)((1u << (n - c)) - 1u);
        m = _mm512_mask_max_ps(m, t, _mm512_maskz_loadu_ps(t, x + c), m);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, m);
    float r = -INFINITY;
    for (int k = 0; k < 16; k++)
        if (lanes[k] > r)
            r = lanes[k];
    return r;
}

const mha_microkernels mha_microkernels_avx512 = {
    "avx512",         qk_avx512,      pv_avx512,    pv_exact_avx512,
    pv_add_avx512,    pv_add_exact_avx512, pvt_avx512, pvt_exact_avx512,
    exp_sum_avx512,   scale_avx512,   max_avx512};
