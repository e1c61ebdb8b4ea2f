/*
 * simd.h -- the small vector layer the SIMD tiers are written over.  A
 * tier's file (avx2.c, avx512.c, neon.c) defines one of MHA_SIMD_AVX2,
 * MHA_SIMD_AVX512 or MHA_SIMD_NEON and includes simd_tier.h, which holds
 * every micro-kernel once, in terms of these names:
 *
 *   vf      VL floats                vd     float64 lanes (VL / 2)
 *   vi      VL int32 lanes           vm     a lane mask (a compare's result)
 *   vtail   the first n lanes of a vector (0 < n <= VL), for tails
 *
 * and vf_transpose, a VL x VL block of rows transposed in registers.
 *
 * Every operation here is one IEEE operation per lane (fma rounds once),
 * so a kernel's lane gives the same bits in every tier; what differs from
 * tier to tier is only the width, and with it the order of horizontal sums
 * (vf_hsum: the upper half added onto the lower, halving to one lane).
 */
#ifndef MHA_SIMD_H
#define MHA_SIMD_H

#include <stdint.h>
#include <string.h>

#define MK_INLINE static inline __attribute__((always_inline))

#if defined(MHA_SIMD_AVX512)
/* ---- AVX-512F (16 lanes, 32 registers, mask registers) ------------------ */
#include <immintrin.h>
typedef __m512 vf;
typedef __m512i vi;
typedef __m512d vd;
typedef __mmask16 vm;
typedef __mmask16 vtail;
enum { VL = 16, VREGS = 32 };
#define vf_zero() _mm512_setzero_ps()
#define vf_set1(x) _mm512_set1_ps(x)
#define vf_load(p) _mm512_loadu_ps(p)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vt_make(n) ((__mmask16)((1u << (n)) - 1u))
#define vf_load_t(p, t) _mm512_maskz_loadu_ps(t, p)
#define vf_store_t(p, v, t) _mm512_mask_storeu_ps(p, t, v)
#define vf_keep_t(v, t) _mm512_maskz_mov_ps(t, v)   /* lanes >= n: 0 */
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_fma _mm512_fmadd_ps            /* a b + c */
#define vf_fnma _mm512_fnmadd_ps          /* c - a b */
#define vf_fma_where(m, a, b, c) _mm512_mask3_fmadd_ps(a, b, c, m)
#define vf_fms _mm512_fmsub_ps            /* a b - c */
#define vf_max_ign _mm512_max_ps          /* x NaN: m (vmaxps: the 2nd)   */
#define vf_min_ign _mm512_min_ps
#define vf_max_nan(lo, x) _mm512_max_ps(lo, x)   /* x NaN: x          */
#define vf_round_even(x)                                                    \
    _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vf_clamp(x, lo, hi) _mm512_max_ps(lo, _mm512_min_ps(hi, x))
#define vf_abs _mm512_abs_ps
#define vf_cmp_lt(a, b) _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)
#define vf_cmp_le(a, b) _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ)
#define vf_cmp_eq(a, b) _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ)
#define vf_cmp_nz(a) _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ)
#define vf_select(m, a, b) _mm512_mask_blend_ps(m, b, a)
#define vm_all(m) ((m) == 0xFFFF)
#define vf_as_vi _mm512_castps_si512
#define vi_as_vf _mm512_castsi512_ps
#define vi_set1 _mm512_set1_epi32
#define vi_add _mm512_add_epi32
#define vi_sub _mm512_sub_epi32
#define vi_max _mm512_max_epi32
#define vi_load(p) _mm512_loadu_si512(p)
#define vi_cmp_gt _mm512_cmpgt_epi32_mask
#define vi_sll(v, n) _mm512_slli_epi32(v, n)
#define vi_sra(v, n) _mm512_srai_epi32(v, n)
#define vf_or_sign(t, x)                                                    \
    _mm512_castsi512_ps(_mm512_or_si512(                                    \
        _mm512_castps_si512(t),                                             \
        _mm512_and_si512(_mm512_castps_si512(x),                            \
                         _mm512_set1_epi32((int)0x80000000u))))
#define vf_load_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
/* VL floats to f16 at p, to nearest even whatever MXCSR says */
#define vf_store_f16(p, v)                                                  \
    _mm256_storeu_si256((__m256i *)(p),                                     \
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT |      \
                                               _MM_FROUND_NO_EXC))
#define vf_load_bf16(p)                                                     \
    _mm512_castsi512_ps(_mm512_slli_epi32(                                  \
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define vi_load_i8(p)                                                       \
    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define vf_load_i8(p) _mm512_cvtepi32_ps(vi_load_i8(p))
#define vi_to_vf _mm512_cvtepi32_ps
/* q4 nibbles as floats: the low 4 bits of each lane index a table of the
 * 16 two's complement values (one permute, no shifts or conversion);
 * the high nibble shifted down first. */
#define Q4_LUT                                                              \
    _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1)
MK_INLINE vf vf_nibble_lo(vi x) { return _mm512_permutexvar_ps(x, Q4_LUT); }
MK_INLINE vf vf_nibble_hi(vi x)
{
    return vf_nibble_lo(_mm512_srli_epi32(x, 4));
}
/* times a scale s, from a table of the 16 products (each fl(c s): the
 * bits of the product after the lookup) */
MK_INLINE vf vf_nibble_lo_times(vi x, float s)
{
    return _mm512_permutexvar_ps(x, _mm512_mul_ps(Q4_LUT, _mm512_set1_ps(s)));
}
MK_INLINE vf vf_nibble_hi_times(vi x, float s)
{
    return vf_nibble_lo_times(_mm512_srli_epi32(x, 4), s);
}
MK_INLINE float vf_hsum(vf v)   /* lanes i + 8 onto i, then 4, 2, 1 */
{
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xEE));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x01));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x0E));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x01));
    return _mm512_cvtss_f32(v);
}
#define vf_hmax _mm512_reduce_max_ps
#define vf_hmin _mm512_reduce_min_ps
/* Lane r = vf_hsum(x[r]) for the VL rows at once, the same additions in
 * the same order (a + b = b + a exactly): each level halves the lanes of
 * every row, as vf_hsum does, while packing two rows' halves into one
 * vector, so 16 rows take 8 + 4 + 2 + 1 adds and no long chain.  Row
 * 4j + q ends in lane 4q + j, then is permuted into lane r.  OP:
 * _mm512_add_ps, or _mm512_max_ps for vf_hmax_rows (a max of non-NaN
 * lanes is exact in any order). */
#define VF_ROWS_TREE(NAME, OP)                                              \
    MK_INLINE vf NAME(const vf x[VL])                                       \
    {                                                                       \
        __m512 y[8], z[4], w[2];                                            \
        for (int p = 0; p < 8; p++) /* lanes i + 8 onto i */                \
            y[p] = OP(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x44),   \
                      _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xEE));  \
        for (int p = 0; p < 4; p++) /* i + 4 onto i */                      \
            z[p] = OP(_mm512_shuffle_f32x4(y[2 * p], y[2 * p + 1], 0x88),   \
                      _mm512_shuffle_f32x4(y[2 * p], y[2 * p + 1], 0xDD));  \
        for (int p = 0; p < 2; p++) /* i + 2 onto i */                      \
            w[p] = OP(_mm512_shuffle_ps(z[2 * p], z[2 * p + 1], 0x44),      \
                      _mm512_shuffle_ps(z[2 * p], z[2 * p + 1], 0xEE));     \
        const __m512 s = OP(_mm512_shuffle_ps(w[0], w[1], 0x88),            \
                            _mm512_shuffle_ps(w[0], w[1], 0xDD));           \
        return _mm512_permutexvar_ps(                                       \
            _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, \
                              11, 15), s);                                  \
    }
VF_ROWS_TREE(vf_hsum_rows, _mm512_add_ps)
VF_ROWS_TREE(vf_hmax_rows, _mm512_max_ps)
#undef VF_ROWS_TREE
#define vd_zero() _mm512_setzero_pd()
#define vd_add _mm512_add_pd
#define vd_mul _mm512_mul_pd
#define vd_store _mm512_storeu_pd
#define vd_lo(v) _mm512_cvtps_pd(_mm512_castps512_ps256(v))
#define vd_hi(v)                                                            \
    _mm512_cvtps_pd(_mm256_castpd_ps(                                       \
        _mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
/* r[i][j] <- r[j][i]: a 16 x 16 block transposed in registers (pairs of
 * rows interleaved, then pairs of pairs, then the 128-bit quarters). */
MK_INLINE void vf_transpose(vf r[VL])
{
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {   /* quarters: rows i, i+4, i+8, i+12 */
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

#elif defined(MHA_SIMD_AVX2)
/* ---- AVX2 + FMA + F16C (8 lanes, 16 registers; masks are vectors) ------- */
#include <immintrin.h>
typedef __m256 vf;
typedef __m256i vi;
typedef __m256d vd;
typedef __m256 vm;
typedef __m256i vtail;
enum { VL = 8, VREGS = 16 };
#define vf_zero() _mm256_setzero_ps()
#define vf_set1(x) _mm256_set1_ps(x)
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vt_make(n)                                                          \
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n),                                \
                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define vf_load_t(p, t) _mm256_maskload_ps(p, t)
#define vf_store_t(p, v, t) _mm256_maskstore_ps(p, t, v)
#define vf_keep_t(v, t) _mm256_and_ps(v, _mm256_castsi256_ps(t))
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_fma _mm256_fmadd_ps
#define vf_fnma _mm256_fnmadd_ps
#define vf_fma_where(m, a, b, c) _mm256_blendv_ps(c, _mm256_fmadd_ps(a, b, c), m)
#define vf_fms _mm256_fmsub_ps
#define vf_max_ign _mm256_max_ps
#define vf_min_ign _mm256_min_ps
#define vf_max_nan(lo, x) _mm256_max_ps(lo, x)
#define vf_round_even(x)                                                    \
    _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vf_clamp(x, lo, hi) _mm256_max_ps(lo, _mm256_min_ps(hi, x))
#define vf_abs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define vf_cmp_lt(a, b) _mm256_cmp_ps(a, b, _CMP_LT_OQ)
#define vf_cmp_le(a, b) _mm256_cmp_ps(a, b, _CMP_LE_OQ)
#define vf_cmp_eq(a, b) _mm256_cmp_ps(a, b, _CMP_EQ_OQ)
#define vf_cmp_nz(a) _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_UQ)
#define vf_select(m, a, b) _mm256_blendv_ps(b, a, m)
#define vm_all(m) (_mm256_movemask_ps(m) == 0xFF)
#define vf_as_vi _mm256_castps_si256
#define vi_as_vf _mm256_castsi256_ps
#define vi_set1 _mm256_set1_epi32
#define vi_add _mm256_add_epi32
#define vi_sub _mm256_sub_epi32
#define vi_max _mm256_max_epi32
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_cmp_gt(a, b) _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b))
#define vi_sll(v, n) _mm256_slli_epi32(v, n)
#define vi_sra(v, n) _mm256_srai_epi32(v, n)
#define vf_or_sign(t, x)                                                    \
    _mm256_or_ps(t, _mm256_and_ps(_mm256_set1_ps(-0.0f), x))
#define vf_load_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define vf_store_f16(p, v)                                                  \
    _mm_storeu_si128((__m128i *)(p),                                        \
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT |         \
                                            _MM_FROUND_NO_EXC))
#define vf_load_bf16(p)                                                     \
    _mm256_castsi256_ps(_mm256_slli_epi32(                                  \
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define vi_load_i8(p)                                                       \
    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define vf_load_i8(p) _mm256_cvtepi32_ps(vi_load_i8(p))
#define vi_to_vf _mm256_cvtepi32_ps
#define vf_nibble_lo(x) vi_to_vf(vi_sra(vi_sll(x, 28), 28))
#define vf_nibble_hi(x) vi_to_vf(vi_sra(x, 4))
#define vf_nibble_lo_times(x, s) vf_mul(vf_nibble_lo(x), vf_set1(s))
#define vf_nibble_hi_times(x, s) vf_mul(vf_nibble_hi(x), vf_set1(s))
MK_INLINE float vf_hsum(vf v)   /* lanes i + 4 onto i, then 2, 1 */
{
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v),
                          _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
MK_INLINE float vf_hmax(vf v)   /* (no NaN lanes: the callers' max) */
{
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v),
                          _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
MK_INLINE float vf_hmin(vf v)   /* (no NaN lanes) */
{
    __m128 a = _mm_min_ps(_mm256_castps256_ps128(v),
                          _mm256_extractf128_ps(v, 1));
    a = _mm_min_ps(a, _mm_movehl_ps(a, a));
    a = _mm_min_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
/* Lane r = vf_hsum(x[r]) for the VL rows at once, the same additions in
 * the same order (see the AVX-512 form); row 2j + h ends in lane 4h + j,
 * then is permuted into lane r.  OP: _mm256_add_ps, or _mm256_max_ps for
 * vf_hmax_rows. */
#define VF_ROWS_TREE(NAME, OP)                                              \
    MK_INLINE vf NAME(const vf x[VL])                                       \
    {                                                                       \
        __m256 y[4], z[2];                                                  \
        for (int p = 0; p < 4; p++) /* lanes i + 4 onto i */                \
            y[p] = OP(_mm256_permute2f128_ps(x[2 * p], x[2 * p + 1], 0x20), \
                      _mm256_permute2f128_ps(x[2 * p], x[2 * p + 1], 0x31)); \
        for (int p = 0; p < 2; p++) /* i + 2 onto i */                      \
            z[p] = OP(_mm256_shuffle_ps(y[2 * p], y[2 * p + 1], 0x44),      \
                      _mm256_shuffle_ps(y[2 * p], y[2 * p + 1], 0xEE));     \
        const __m256 s = OP(_mm256_shuffle_ps(z[0], z[1], 0x88),            \
                            _mm256_shuffle_ps(z[0], z[1], 0xDD));           \
        return _mm256_permutevar8x32_ps(                                    \
            s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));                  \
    }
VF_ROWS_TREE(vf_hsum_rows, _mm256_add_ps)
VF_ROWS_TREE(vf_hmax_rows, _mm256_max_ps)
#undef VF_ROWS_TREE
#define vd_zero() _mm256_setzero_pd()
#define vd_add _mm256_add_pd
#define vd_mul _mm256_mul_pd
#define vd_store _mm256_storeu_pd
#define vd_lo(v) _mm256_cvtps_pd(_mm256_castps256_ps128(v))
#define vd_hi(v) _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))
/* r[i][j] <- r[j][i]: an 8 x 8 block transposed in registers. */
MK_INLINE void vf_transpose(vf r[VL])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

#elif defined(MHA_SIMD_NEON)
/* ---- aarch64 Advanced SIMD (4 lanes, 32 registers; masks are vectors) --- */
#include <arm_neon.h>
typedef float32x4_t vf;
typedef int32x4_t vi;
typedef float64x2_t vd;
typedef uint32x4_t vm;
typedef int vtail;                       /* NEON has no masked loads    */
enum { VL = 4, VREGS = 32 };
#define vf_zero() vdupq_n_f32(0.0f)
#define vf_set1(x) vdupq_n_f32(x)
#define vf_load(p) vld1q_f32(p)
#define vf_store(p, v) vst1q_f32(p, v)
#define vt_make(n) (n)
MK_INLINE vf vf_load_t(const float *p, int n)   /* lanes >= n: 0, unread */
{
    float b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    memcpy(b, p, (size_t)n * sizeof *p);
    return vld1q_f32(b);
}
MK_INLINE void vf_store_t(float *p, vf v, int n)
{
    float b[4];
    vst1q_f32(b, v);
    memcpy(p, b, (size_t)n * sizeof *p);
}
MK_INLINE vf vf_keep_t(vf v, int n)
{
    const uint32_t idx[4] = {0, 1, 2, 3};
    return vbslq_f32(vcltq_u32(vld1q_u32(idx), vdupq_n_u32((uint32_t)n)), v,
                     vdupq_n_f32(0.0f));
}
#define vf_add vaddq_f32
#define vf_sub vsubq_f32
#define vf_mul vmulq_f32
#define vf_div vdivq_f32
#define vf_fma(a, b, c) vfmaq_f32(c, a, b)
#define vf_fnma(a, b, c) vfmsq_f32(c, a, b)
#define vf_fma_where(m, a, b, c) vbslq_f32(m, vfmaq_f32(c, a, b), c)
#define vf_fms(a, b, c) vfmaq_f32(vnegq_f32(c), a, b)
#define vf_max_ign vmaxnmq_f32           /* FMAXNM: the number, not NaN   */
#define vf_min_ign vminnmq_f32
#define vf_max_nan vmaxq_f32             /* FMAX: NaN if either is        */
#define vf_round_even vrndnq_f32
#define vf_clamp(x, lo, hi) vmaxq_f32(lo, vminq_f32(hi, x))   /* NaN stays */
#define vf_abs vabsq_f32
#define vf_cmp_lt vcltq_f32
#define vf_cmp_le vcleq_f32
#define vf_cmp_eq vceqq_f32
#define vf_cmp_nz(a) vmvnq_u32(vceqq_f32(a, vdupq_n_f32(0.0f)))
#define vf_select vbslq_f32
#define vm_all(m) (vminvq_u32(m) == 0xFFFFFFFFu)
#define vf_as_vi vreinterpretq_s32_f32
#define vi_as_vf vreinterpretq_f32_s32
#define vi_set1 vdupq_n_s32
#define vi_add vaddq_s32
#define vi_sub vsubq_s32
#define vi_max vmaxq_s32
#define vi_load vld1q_s32
#define vi_cmp_gt vcgtq_s32
#define vi_sll(v, n) vshlq_n_s32(v, n)
#define vi_sra(v, n) vshrq_n_s32(v, n)
#define vf_or_sign(t, x)                                                    \
    vreinterpretq_f32_u32(vorrq_u32(                                        \
        vreinterpretq_u32_f32(t),                                           \
        vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u))))
#define vf_load_f16(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))
/* (to nearest even: FPCR's default rounding, which Linux leaves) */
#define vf_store_f16(p, v) vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v)))
#define vf_load_bf16(p) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))
MK_INLINE vi vi_load_i8(const int8_t *p)   /* exactly 4 bytes read */
{
    int32_t w;
    memcpy(&w, p, 4);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vmovl_s16(vget_low_s16(h));
}
#define vf_load_i8(p) vcvtq_f32_s32(vi_load_i8(p))
#define vi_to_vf vcvtq_f32_s32
#define vf_nibble_lo(x) vi_to_vf(vi_sra(vi_sll(x, 28), 28))
#define vf_nibble_hi(x) vi_to_vf(vi_sra(x, 4))
#define vf_nibble_lo_times(x, s) vf_mul(vf_nibble_lo(x), vf_set1(s))
#define vf_nibble_hi_times(x, s) vf_mul(vf_nibble_hi(x), vf_set1(s))
MK_INLINE float vf_hsum(vf v)   /* lanes i + 2 onto i, then 1 */
{
    const float32x2_t a = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(a, 0) + vget_lane_f32(a, 1);
}
#define vf_hmax vmaxvq_f32
#define vf_hmin vminvq_f32
MK_INLINE vf vf_hsum_rows(const vf x[VL])   /* lane r: vf_hsum(x[r]) */
{
    const float32x4_t r = {vf_hsum(x[0]), vf_hsum(x[1]), vf_hsum(x[2]),
                           vf_hsum(x[3])};
    return r;
}
MK_INLINE vf vf_hmax_rows(const vf x[VL])
{
    const float32x4_t r = {vf_hmax(x[0]), vf_hmax(x[1]), vf_hmax(x[2]),
                           vf_hmax(x[3])};
    return r;
}
#define vd_zero() vdupq_n_f64(0.0)
#define vd_add vaddq_f64
#define vd_mul vmulq_f64
#define vd_store vst1q_f64
#define vd_lo(v) vcvt_f64_f32(vget_low_f32(v))
#define vd_hi(v) vcvt_high_f64_f32(v)
/* r[i][j] <- r[j][i]: a 4 x 4 block transposed in registers. */
MK_INLINE void vf_transpose(vf r[VL])
{
    const float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    const float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
#define D_(x) vreinterpretq_f64_f32(x)
#define F_(x) vreinterpretq_f32_f64(x)
    r[0] = F_(vtrn1q_f64(D_(t0), D_(t2)));
    r[1] = F_(vtrn1q_f64(D_(t1), D_(t3)));
    r[2] = F_(vtrn2q_f64(D_(t0), D_(t2)));
    r[3] = F_(vtrn2q_f64(D_(t1), D_(t3)));
#undef D_
#undef F_
}

#else
#error "simd.h: define MHA_SIMD_AVX512, MHA_SIMD_AVX2 or MHA_SIMD_NEON"
#endif

#endif /* MHA_SIMD_H */
