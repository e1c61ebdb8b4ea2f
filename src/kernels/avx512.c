/*
 * avx512.c -- the AVX-512 tier (Zen 4 / Zen 5 / Skylake-X class).  This
 * file, and only this file, is compiled with -mavx512f -mfma -mf16c; it
 * is called only when the CPU and the OS report AVX-512F (dispatch.c).
 * AVX-512F intrinsics only (no BW / DQ / VL), so any AVX-512 CPU runs it.
 *
 * It is the AVX2 tier (avx2.c) at twice the width, with
 * mask registers in place of blends and masked loads: the same register
 * tiling rule, the same determinism rule (every output element is one chain
 * of fused multiply-adds in ascending order of the reduction index, whatever
 * block of the tiling it lands in), and the same exp, lane for lane.  What
 * differs from avx2 is the order of exp_sum's sum (16 lanes, then a fixed
 * tree), so the two tiers agree to rounding, not bitwise.  docs/KERNELS.md.
 */
#include "bsrc.h"
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

/* B[k][j .. j+15] as floats; lanes outside m (the n < 16 columns of a
 * tail) are not read and read as 0. */
MK_INLINE __m512 ldb(const int T, const bsrc *b, int k, int j, __mmask16 m,
                     int n)
{
    const size_t at = (size_t)k * b->ld + j;
    if (T == B_F32)
        return _mm512_maskz_loadu_ps(m, (const float *)b->x + at);
    if (n < 16) {
        float buf[16] = {0};
        for (int i = 0; i < n; i++)
            buf[i] = bsrc_elem(T, b, k, j + i);
        return _mm512_loadu_ps(buf);
    }
    /* (Only 16-bit elements are read as such: a q8 row is bytes, and read
     * as 16-bit it ran past the end of a cache's last tile.) */
    const __m256i h = T == B_F16 || T == B_BF16
                          ? _mm256_loadu_si256(
                                (const __m256i *)((const uint16_t *)b->x + at))
                          : _mm256_setzero_si256();
    switch (T) {
    case B_F16: return _mm512_cvtph_ps(h);
    case B_BF16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    default: break;
    }
    const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)((const int8_t *)b->x + at))));
    if (T == B_Q8K)
        return _mm512_mul_ps(
            c, _mm512_loadu_ps(b->s + (size_t)(k / MHA_Q8_BLOCK) * b->ld + j));
    return _mm512_mul_ps(
        c, _mm512_set1_ps(b->s[(size_t)k * b->blocks + j / MHA_Q8_BLOCK]));
}

/* R rows (1..6) x W vectors (1, 2, 4, or 8 with R <= 2) of C from column
 * j.  m masks the n columns of a W == 1 tail (0xffff and 16 otherwise):
 * masked lanes are neither read nor written, so the tile never touches
 * memory past its last column. */
MK_INLINE void tile(const int R, const int W, const int mode, const int T,
                    int K, const float *A, int lda, int ska, const bsrc *B,
                    int j, float *C, int ldc, __mmask16 m, int n)
{
    __m512 acc[6][8];
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++)
            acc[r][w] = mode & FROM_C
                            ? _mm512_maskz_loadu_ps(
                                  m, C + (size_t)r * ldc + 16 * w)
                            : _mm512_setzero_ps();

    const __m512 zero = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m512 b[8];
        for (int w = 0; w < W; w++)
            b[w] = ldb(T, B, k, j + 16 * w, m, n);
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

/* R rows against all N columns: for one or two rows (decoding) 128-wide
 * blocks, eight independent chains a row; then 64-wide blocks, a 32-wide
 * and a 16-wide block, a masked tail of 1..15.  The block width never
 * changes an element's chain, so never its bits. */
MK_INLINE void panel(const int R, const int mode, const int T, int N, int K,
                     const float *A, int lda, int ska, const bsrc *B,
                     float *C, int ldc)
{
    const __mmask16 all = 0xffff;
    int j = 0;
    if (R <= 2)
        for (; j + 128 <= N; j += 128)
            tile(R, 8, mode, T, K, A, lda, ska, B, j, C + j, ldc, all, 16);
    for (; j + 64 <= N; j += 64)
        tile(R, 4, mode, T, K, A, lda, ska, B, j, C + j, ldc, all, 16);
    if (j + 32 <= N) {
        tile(R, 2, mode, T, K, A, lda, ska, B, j, C + j, ldc, all, 16);
        j += 32;
    }
    if (j + 16 <= N) {
        tile(R, 1, mode, T, K, A, lda, ska, B, j, C + j, ldc, all, 16);
        j += 16;
    }
    if (j < N)
        tile(R, 1, mode, T, K, A, lda, ska, B, j, C + j, ldc,
             (__mmask16)((1u << (N - j)) - 1u), N - j);
}

/* All M rows: blocks of 6 rows, then one block of the remainder. */
MK_INLINE void gemm(const int mode, const int T, int M, int N, int K,
                    const float *A, int lda, int ska, const bsrc *B, float *C,
                    int ldc)
{
    int i = 0;
    for (; i + 6 <= M; i += 6)
        panel(6, mode, T, N, K, A + (size_t)i * lda, lda, ska, B,
              C + (size_t)i * ldc, ldc);
    const float *Ai = A + (size_t)i * lda;
    float *Ci = C + (size_t)i * ldc;
    switch (M - i) {
    case 5: panel(5, mode, T, N, K, Ai, lda, ska, B, Ci, ldc); break;
    case 4: panel(4, mode, T, N, K, Ai, lda, ska, B, Ci, ldc); break;
    case 3: panel(3, mode, T, N, K, Ai, lda, ska, B, Ci, ldc); break;
    case 2: panel(2, mode, T, N, K, Ai, lda, ska, B, Ci, ldc); break;
    case 1: panel(1, mode, T, N, K, Ai, lda, ska, B, Ci, ldc); break;
    default: break;
    }
}

/* A float B of ld columns. */
MK_INLINE bsrc f32(const float *x, int ld)
{
    const bsrc b = {x, NULL, ld, 0};
    return b;
}

/* 6 rows x 64 columns: 24 accumulators + 4 B vectors + 1 broadcast of the
 * 32 zmm registers (the _exact forms keep their zero test in a mask
 * register, so they block the same way). */
static void qk_avx512(int mr, int nc, int dh, const float *q, const float *kt,
                      int ldkt, float *s, int lds)
{
    const bsrc B = f32(kt, ldkt);
    gemm(MODE_SET, B_F32, mr, nc, dh, q, dh, 1, &B, s, lds);
}

static void pv_avx512(int mr, int nc, int dh, const float *p, int ldp,
                      const float *v, float *o, int ldo)
{
    const bsrc B = f32(v, dh);
    gemm(MODE_ACC, B_F32, mr, dh, nc, p, ldp, 1, &B, o, ldo);
}

static void pv_exact_avx512(int mr, int nc, int dh, const float *p, int ldp,
                            const float *v, float *o, int ldo)
{
    const bsrc B = f32(v, dh);
    gemm(MODE_ACC_EXACT, B_F32, mr, dh, nc, p, ldp, 1, &B, o, ldo);
}

static void pv_add_avx512(int mr, int nc, int dh, const float *p, int ldp,
                          const float *v, float *o, int ldo)
{
    const bsrc B = f32(v, dh);
    gemm(MODE_ADD, B_F32, mr, dh, nc, p, ldp, 1, &B, o, ldo);
}

static void pv_add_exact_avx512(int mr, int nc, int dh, const float *p,
                                int ldp, const float *v, float *o, int ldo)
{
    const bsrc B = f32(v, dh);
    gemm(MODE_ADD_EXACT, B_F32, mr, dh, nc, p, ldp, 1, &B, o, ldo);
}

/* pT x: A is p read down its columns (row stride 1, k stride ldp). */
static void pvt_avx512(int mr, int nc, int dh, const float *p, int ldp,
                       const float *x, float *o, int ldo)
{
    const bsrc B = f32(x, dh);
    gemm(MODE_ADD, B_F32, nc, dh, mr, p, 1, ldp, &B, o, ldo);
}

static void pvt_exact_avx512(int mr, int nc, int dh, const float *p, int ldp,
                             const float *x, float *o, int ldo)
{
    const bsrc B = f32(x, dh);
    gemm(MODE_ADD_EXACT, B_F32, nc, dh, mr, p, 1, ldp, &B, o, ldo);
}

/* qk and pv on a KV cache's tiles (kernels.h): the same blocking, B
 * converted as it is loaded. */
static void qk_kv_avx512(mha_kv_dtype dtype, int mr, int nc, int dh,
                         const float *q, const void *kt, int cols, float *s,
                         int lds)
{
    const bsrc B = {kt, mha_q8_scales(kt, cols, dh), cols, 0};
    switch (dtype) {
    case MHA_KV_F16:
        gemm(MODE_SET, B_F16, mr, nc, dh, q, dh, 1, &B, s, lds);
        break;
    case MHA_KV_BF16:
        gemm(MODE_SET, B_BF16, mr, nc, dh, q, dh, 1, &B, s, lds);
        break;
    case MHA_KV_Q8:
        gemm(MODE_SET, B_Q8K, mr, nc, dh, q, dh, 1, &B, s, lds);
        break;
    default:
        qk_avx512(mr, nc, dh, q, kt, cols, s, lds);
    }
}

static void pv_kv_avx512(mha_kv_dtype dtype, int exact, int mr, int nc,
                         int dh, const float *p, int ldp, const void *v,
                         int cols, float *o, int ldo)
{
    const bsrc B = {v, mha_q8_scales(v, cols, dh), dh,
                    (int)mha_q8_blocks(dh)};
#define PV_KV(T)                                                           \
    (exact ? gemm(MODE_ACC_EXACT, T, mr, dh, nc, p, ldp, 1, &B, o, ldo)   \
           : gemm(MODE_ACC, T, mr, dh, nc, p, ldp, 1, &B, o, ldo))
    switch (dtype) {
    case MHA_KV_F16: PV_KV(B_F16); break;
    case MHA_KV_BF16: PV_KV(B_BF16); break;
    case MHA_KV_Q8: PV_KV(B_Q8V); break;
    default: PV_KV(B_F32);
    }
#undef PV_KV
}

/* ---- exp ------------------------------------------------------------------
 *
 * The avx2 tier's exp (see there, and docs/KERNELS.md), operation for
 * operation on 16 lanes: n by the magic addition t = fma(x, log2e,
 * 1.5 * 2^23), Cody-Waite f, the degree-5 polynomial by Horner with FMA;
 * when every lane has |x| <= 86, 2^n added to y's exponent bits (t << 23),
 * otherwise the general path: x clamped to [flush, 89], 2^n as two exact
 * factors, results below FLT_MIN flushed to +0.  Each lane gives the bits
 * the avx2 exp gives, whichever path its 8 or 16 lanes took.
 */
MK_INLINE __m512 exp16_poly(__m512 x, __m512 *t)
{
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 magic = _mm512_set1_ps(0x1.8p23f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693147182464599609375f);
    const __m512 ln2_lo = _mm512_set1_ps(-1.904654299957768e-09f);

    *t = _mm512_fmadd_ps(x, log2e, magic);
    const __m512 n = _mm512_sub_ps(*t, magic);
    __m512 f = _mm512_fnmadd_ps(n, ln2_hi, x);
    f = _mm512_fnmadd_ps(n, ln2_lo, f);

    __m512 P = _mm512_set1_ps(1.9875691500e-4f);
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(1.3981999507e-3f));
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(8.3334519073e-3f));
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(4.1665795894e-2f));
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(1.6666665459e-1f));
    P = _mm512_fmadd_ps(P, f, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 f2 = _mm512_mul_ps(f, f);
    return _mm512_add_ps(_mm512_fmadd_ps(P, f2, f), _mm512_set1_ps(1.0f));
}

MK_INLINE __m512 exp16_general(__m512 x)
{
    const __m512 flush = _mm512_set1_ps(-0x1.5d589ep+6f);
    const __m512 x_hi = _mm512_set1_ps(89.0f);

    /* vmaxps / vminps return the second operand when one is NaN: x. */
    const __m512 xc = _mm512_max_ps(flush, _mm512_min_ps(x_hi, x));
    const __mmask16 below = _mm512_cmp_ps_mask(x, flush, _CMP_LT_OQ);
    __m512 t;
    const __m512 y = exp16_poly(xc, &t);

    const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(t),
                                        _mm512_set1_epi32(0x4B400000));
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

MK_INLINE __m512 exp16(__m512 x)
{
    const __mmask16 in = _mm512_cmp_ps_mask(
        _mm512_abs_ps(x), _mm512_set1_ps(86.0f), _CMP_LE_OQ);
    if (__builtin_expect(in != 0xFFFF, 0))
        return exp16_general(x);   /* (NaN compares false: here) */
    __m512 t;
    const __m512 y = exp16_poly(x, &t);
    return _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_castps_si512(y),
                         _mm512_slli_epi32(_mm512_castps_si512(t), 23)));
}

/* tanh, as avx2.c's tanh8 (the same formulas, 16 lanes). */
MK_INLINE __m512 tanh16(__m512 x)
{
    const __m512 a = _mm512_abs_ps(x);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e),
                                     _mm512_add_ps(one, e));
    const __m512 a2 = _mm512_mul_ps(a, a);
    __m512 P = _mm512_set1_ps(-1382.0f / 155925.0f);
    P = _mm512_fmadd_ps(P, a2, _mm512_set1_ps(62.0f / 2835.0f));
    P = _mm512_fmadd_ps(P, a2, _mm512_set1_ps(-17.0f / 315.0f));
    P = _mm512_fmadd_ps(P, a2, _mm512_set1_ps(2.0f / 15.0f));
    P = _mm512_fmadd_ps(P, a2, _mm512_set1_ps(-1.0f / 3.0f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(P, a2), a, a);
    const __mmask16 is_small =
        _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_LT_OQ);
    const __m512 t = _mm512_mask_mov_ps(big, is_small, small);
    /* the sign of x back on |tanh| */
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(t),
        _mm512_and_si512(_mm512_castps_si512(x),
                         _mm512_set1_epi32((int)0x80000000u))));
}

static void softcap_avx512(float *x, int n, float c, float *dcap)
{
    const __m512 cv = _mm512_set1_ps(c), inv = _mm512_set1_ps(1.0f / c);
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int k = 0; k < n; k += 16) {
        const __mmask16 m =
            n - k >= 16 ? (__mmask16)0xffff
                        : (__mmask16)((1u << (n - k)) - 1u);
        const __m512 t =
            tanh16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), inv));
        _mm512_mask_storeu_ps(x + k, m, _mm512_mul_ps(cv, t));
        if (dcap)
            _mm512_mask_storeu_ps(dcap + k, m, _mm512_fnmadd_ps(t, t, one));
    }
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
    exp_sum_avx512,   scale_avx512,   max_avx512,   softcap_avx512,
    qk_kv_avx512,     pv_kv_avx512,   mha_dot_nonzero_avx2, mha_dscore_avx2};
