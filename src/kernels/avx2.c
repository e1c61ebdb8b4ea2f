/*
 * avx2.c -- the AVX2 + FMA tier (Zen 3 / Haswell class).  This file,
 * and only this file, is compiled with -mavx2 -mfma -mf16c; it is called
 * only when the CPU reports all three (dispatch.c).  AVX / AVX2 / FMA /
 * F16C intrinsics only.
 *
 * Determinism: every output element is one fixed chain of fused
 * multiply-adds in ascending order of the reduction index, whatever block of
 * the register tiling it lands in (full 16-wide block, 8-wide block, masked
 * tail) and whatever mr or the tile's alignment, so splitting a tile gives
 * the same bits.  exp is lane-independent; its sum has a fixed order for a
 * given n.  See docs/KERNELS.md.
 */
#include "bsrc.h"
#include "kernels.h"

#include <immintrin.h>
#include <math.h>

#define MK_INLINE static inline __attribute__((always_inline))

/* ---- the common GEMM-like tile -------------------------------------------
 *
 *   C[r][j] (=|+=) sum_k A[r*lda + k] * B[k*ldb + j],  r < R, j < 8*W
 *
 * qk: A = q (lda dh), B = kt (ldb ldkt), K = dh, C = s, set.
 * pv: A = p (ldp),    B = v  (ldb dh),   K = nc, C = o, accumulate.
 * Each C element is acc = fma(A[r][k], B[k][j], acc) for k = 0, 1, ...,
 * starting from C (FROM_C) or from 0, in every variant below; with ADD the
 * finished sum is then added to C (pv_add, pvt).  EXACT skips A == 0.
 */
enum { FROM_C = 1, EXACT = 2, ADD = 4 };   /* (B's storage: bsrc.h) */
enum { MODE_SET = 0, MODE_ACC = FROM_C, MODE_ACC_EXACT = FROM_C | EXACT,
       MODE_ADD = ADD, MODE_ADD_EXACT = ADD | EXACT };

/* Lanes < n are on (0 < n < 8). */
MK_INLINE __m256i tail_mask(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

MK_INLINE __m256 ld(const float *x, int masked, __m256i m)
{
    return masked ? _mm256_maskload_ps(x, m) : _mm256_loadu_ps(x);
}

MK_INLINE void st(float *x, __m256 v, int masked, __m256i m)
{
    if (masked)
        _mm256_maskstore_ps(x, m, v);
    else
        _mm256_storeu_ps(x, v);
}

/* B[k][j .. j+7] as floats; with `masked` only the n < 8 lanes of the
 * tail are read (the others 0). */
MK_INLINE __m256 ldb(const int T, const bsrc *b, int k, int j, int masked,
                     __m256i m, int n)
{
    const size_t at = (size_t)k * b->ld + j;
    if (T == B_F32)
        return ld((const float *)b->x + at, masked, m);
    if (masked) {
        float buf[8] = {0};
        for (int i = 0; i < n; i++)
            buf[i] = bsrc_elem(T, b, k, j + i);
        return _mm256_loadu_ps(buf);
    }
    /* (Only 16-bit elements are read as such: a q8 row is bytes, and read
     * as 16-bit it ran past the end of a cache's last tile.) */
    const __m128i h = T == B_F16 || T == B_BF16
                          ? _mm_loadu_si128(
                                (const __m128i *)((const uint16_t *)b->x + at))
                          : _mm_setzero_si128();
    switch (T) {
    case B_F16: return _mm256_cvtph_ps(h);
    case B_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    default: break;
    }
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64((const __m128i *)((const int8_t *)b->x + at))));
    if (T == B_Q8K)
        return _mm256_mul_ps(
            c, _mm256_loadu_ps(b->s + (size_t)(k / MHA_Q8_BLOCK) * b->ld + j));
    return _mm256_mul_ps(
        c, _mm256_broadcast_ss(b->s + (size_t)k * b->blocks +
                               j / MHA_Q8_BLOCK));
}

/* R rows x W vectors of C from column j, over k0 <= k < k1; masked only
 * with W == 1 (n columns).  R * W <= 12: the accumulators, B's vectors and a broadcast
 * fit the 16 ymm registers. */
MK_INLINE void tile(const int R, const int W, const int masked, const int mode,
                    const int T, int k0, int k1, const float *A, int lda,
                    int ska, const bsrc *B, int j, float *C, int ldc,
                    __m256i m, int n)
{
    __m256 acc[6][8];
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++)
            acc[r][w] = mode & FROM_C
                            ? ld(C + (size_t)r * ldc + 8 * w, masked, m)
                            : _mm256_setzero_ps();

    const __m256 zero = _mm256_setzero_ps();
    /* Register budget: R*W accumulators.  With room for all W vectors of
     * B besides them (the 6 x 16 and 4 x 16 tiles of many rows), B's row
     * is loaded first and each row's broadcast is used at once, one
     * register at a time; loading all R broadcasts first would need
     * R + W + R*W > 16 registers, and the compiler spilled them to the
     * stack, an extra load for every FMA.  One or two rows against wide
     * blocks keep their one or two broadcasts and load B one vector at a
     * time instead.  Either way each accumulator sees the same FMAs in
     * the same order of k: the same bits. */
    const int b_first = R * W + W + 2 <= 16;
    for (int k = k0; k < k1; k++) {
        if (b_first) {
            __m256 b[8];
            for (int w = 0; w < W; w++)
                b[w] = ldb(T, B, k, j + 8 * w, masked, m, n);
            for (int r = 0; r < R; r++) {
                const __m256 a = _mm256_broadcast_ss(A + (size_t)r * lda +
                                                     (size_t)k * ska);
                const __m256 z = mode & EXACT
                                     ? _mm256_cmp_ps(a, zero, _CMP_EQ_OQ)
                                     : zero;
                for (int w = 0; w < W; w++) {
                    const __m256 f = _mm256_fmadd_ps(a, b[w], acc[r][w]);
                    /* (the _exact forms: where a is zero acc stays as it
                     * was, so NaN / Inf in b never reaches the row, the
                     * same bits as skipping the term) */
                    acc[r][w] = mode & EXACT ? _mm256_blendv_ps(f, acc[r][w], z)
                                             : f;
                }
            }
            continue;
        }
        /* A's R values, and for the _exact forms where they are zero. */
        __m256 a[6], z[6];
        for (int r = 0; r < R; r++) {
            a[r] = _mm256_broadcast_ss(A + (size_t)r * lda + (size_t)k * ska);
            if (mode & EXACT)
                z[r] = _mm256_cmp_ps(a[r], zero, _CMP_EQ_OQ);
        }
        /* Each vector of B loaded (and converted) just before its R FMAs:
         * with one or two rows, eight vectors of B held at once would not
         * leave registers for the accumulators. */
        for (int w = 0; w < W; w++) {
            const __m256 b = ldb(T, B, k, j + 8 * w, masked, m, n);
            for (int r = 0; r < R; r++) {
                const __m256 f = _mm256_fmadd_ps(a[r], b, acc[r][w]);
                acc[r][w] = mode & EXACT ? _mm256_blendv_ps(f, acc[r][w], z[r])
                                         : f;
            }
        }
    }

    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++) {
            float *c = C + (size_t)r * ldc + 8 * w;
            st(c, mode & ADD ? _mm256_add_ps(ld(c, masked, m), acc[r][w])
                             : acc[r][w],
               masked, m);
        }
}

/* R rows against all N columns over k0 <= k < k1.  One or two rows
 * (decoding) take 64- or 32-wide blocks: eight or four independent chains
 * keep the FMA units busy where 16-wide blocks of one row would wait on
 * their latency.  Then 16-wide blocks, one 8-wide, a masked tail of 1..7.
 * The block width never changes an element's chain, so never its bits. */
MK_INLINE void cols(const int R, const int mode, const int T, int N, int k0,
                    int k1, const float *A, int lda, int ska, const bsrc *B,
                    float *C, int ldc)
{
    const __m256i none = _mm256_setzero_si256();
    const int wide = !(mode & EXACT);
    int j = 0;
    if (R == 1 && wide)
        for (; j + 64 <= N; j += 64)
            tile(R, 8, 0, mode, T, k0, k1, A, lda, ska, B, j, C + j, ldc,
                 none, 8);
    if (R <= 2 && wide)
        for (; j + 32 <= N; j += 32)
            tile(R, 4, 0, mode, T, k0, k1, A, lda, ska, B, j, C + j, ldc,
                 none, 8);
    for (; j + 16 <= N; j += 16)
        tile(R, 2, 0, mode, T, k0, k1, A, lda, ska, B, j, C + j, ldc, none,
             8);
    if (j + 8 <= N) {
        tile(R, 1, 0, mode, T, k0, k1, A, lda, ska, B, j, C + j, ldc, none,
             8);
        j += 8;
    }
    if (j < N)
        tile(R, 1, 1, mode, T, k0, k1, A, lda, ska, B, j, C + j, ldc,
             tail_mask(N - j), N - j);
}

/* Rows of B per slab when a panel walks K in slabs (below). */
enum { KSLAB = 8 };

/*
 * R rows against all N columns.  Each block of columns walks all of K, so
 * B is read in strips down its columns: fine when B is in cache (many
 * row blocks reuse it), but a decoding step reads each B (a KV cache's
 * tile) once, from memory, where strips far apart defeat the hardware's
 * streaming.  A panel of 1 to RMAX rows that is the only one (`slabs`:
 * a decoding step's row, or a grouped-query decode's stacked heads) walks
 * K in slabs of KSLAB rows instead, every block of columns through one
 * slab (a few KB, contiguous, read from memory once and then from L1)
 * before the next, the partial sums kept in C between slabs.  An
 * element's chain is the same chain, stored and reloaded exactly: the
 * same bits.  (SET and ACC only: ADD must form the whole sum before
 * adding it to C.  One row against at most 64 columns is one block of
 * columns, a key tile's rows read whole: slabs would only cost it the
 * reloads.  One row against a value tile of d_h 128 was two strips of
 * 64 columns, and walking it in slabs made the q8 step 9% faster and
 * f32's 8%, docs/BENCHMARKS.md.)
 */
MK_INLINE void panel(const int R, const int mode, const int T, int slabs,
                     int N, int K, const float *A, int lda, int ska,
                     const bsrc *B, float *C, int ldc)
{
    if (!slabs || (R == 1 && N <= 64) || (mode & ADD) || K <= KSLAB) {
        cols(R, mode, T, N, 0, K, A, lda, ska, B, C, ldc);
        return;
    }
    const size_t row = (size_t)B->ld * (T == B_F32 ? 4 : T <= B_BF16 ? 2 : 1);
    const uintptr_t base = (uintptr_t)B->x;
    /* The next slab is prefetched, in address order, while this one is
     * worked on; but not one row's 16-bit value slab (the value side is
     * the accumulating one, FROM_C).  That slab (2 KiB at d_h 128) is
     * worked on in about as long as memory takes to deliver it, and the
     * burst of 32 prefetches in front of it held up the loads of the slab
     * in hand: the one-row f16 steps ran 1.14-1.19x faster without it on
     * a Zen 1, the hardware's stream prefetcher alone keeping ahead.  The
     * grouped-query panels (four rows' work per slab) and the q8 and f32
     * slabs keep it: dropping it there was slower or within the noise
     * (docs/BENCHMARKS.md). */
    const int prefetch =
        !(R == 1 && (mode & FROM_C) && (T == B_F16 || T == B_BF16));
    for (int k0 = 0; k0 < K; k0 += KSLAB) {
        if (prefetch)
            for (size_t at = (size_t)(k0 + KSLAB) * row;
                 at < (size_t)(k0 + 2 * KSLAB) * row; at += 64)
                _mm_prefetch((const char *)(base + at), _MM_HINT_T0);
        cols(R, k0 ? mode | FROM_C : mode, T, N, k0,
             k0 + KSLAB < K ? k0 + KSLAB : K, A, lda, ska, B, C, ldc);
    }
}

/* All M rows: blocks of RMAX rows, then one block of the remainder; a
 * single block (M <= RMAX: decoding) walks K in slabs. */
MK_INLINE void gemm(const int RMAX, const int mode, const int T, int M, int N,
                    int K, const float *A, int lda, int ska, const bsrc *B,
                    float *C, int ldc)
{
    const int slabs = M <= RMAX;
    int i = 0;
    for (; i + RMAX <= M; i += RMAX)
        panel(RMAX, mode, T, slabs, N, K, A + (size_t)i * lda, lda, ska, B,
              C + (size_t)i * ldc, ldc);
    const float *Ai = A + (size_t)i * lda;
    float *Ci = C + (size_t)i * ldc;
    switch (M - i) {
    case 5: if (RMAX > 5) panel(5, mode, T, slabs, N, K, Ai, lda, ska, B, Ci, ldc); break;
    case 4: if (RMAX > 4) panel(4, mode, T, slabs, N, K, Ai, lda, ska, B, Ci, ldc); break;
    case 3: panel(3, mode, T, slabs, N, K, Ai, lda, ska, B, Ci, ldc); break;
    case 2: panel(2, mode, T, slabs, N, K, Ai, lda, ska, B, Ci, ldc); break;
    case 1: panel(1, mode, T, slabs, N, K, Ai, lda, ska, B, Ci, ldc); break;
    default: break;
    }
}

/* A float B of ld columns. */
MK_INLINE bsrc f32(const float *x, int ld)
{
    const bsrc b = {x, NULL, ld, 0};
    return b;
}

/* 6 rows x 16 columns: 12 accumulators + 2 B vectors + 1 broadcast. */
static void qk_avx2(int mr, int nc, int dh, const float *q, const float *kt,
                    int ldkt, float *s, int lds)
{
    const bsrc B = f32(kt, ldkt);
    gemm(6, MODE_SET, B_F32, mr, nc, dh, q, dh, 1, &B, s, lds);
}

static void pv_avx2(int mr, int nc, int dh, const float *p, int ldp,
                    const float *v, float *o, int ldo)
{
    const bsrc B = f32(v, dh);
    gemm(6, MODE_ACC, B_F32, mr, dh, nc, p, ldp, 1, &B, o, ldo);
}

/* 4 rows x 16 columns: the compare and the blend need registers too. */
static void pv_exact_avx2(int mr, int nc, int dh, const float *p, int ldp,
                          const float *v, float *o, int ldo)
{
    const bsrc B = f32(v, dh);
    gemm(4, MODE_ACC_EXACT, B_F32, mr, dh, nc, p, ldp, 1, &B, o, ldo);
}

static void pv_add_avx2(int mr, int nc, int dh, const float *p, int ldp,
                        const float *v, float *o, int ldo)
{
    const bsrc B = f32(v, dh);
    gemm(6, MODE_ADD, B_F32, mr, dh, nc, p, ldp, 1, &B, o, ldo);
}

static void pv_add_exact_avx2(int mr, int nc, int dh, const float *p, int ldp,
                              const float *v, float *o, int ldo)
{
    const bsrc B = f32(v, dh);
    gemm(4, MODE_ADD_EXACT, B_F32, mr, dh, nc, p, ldp, 1, &B, o, ldo);
}

/* pT x: A is p read down its columns (row stride 1, k stride ldp). */
static void pvt_avx2(int mr, int nc, int dh, const float *p, int ldp,
                     const float *x, float *o, int ldo)
{
    const bsrc B = f32(x, dh);
    gemm(6, MODE_ADD, B_F32, nc, dh, mr, p, 1, ldp, &B, o, ldo);
}

static void pvt_exact_avx2(int mr, int nc, int dh, const float *p, int ldp,
                           const float *x, float *o, int ldo)
{
    const bsrc B = f32(x, dh);
    gemm(4, MODE_ADD_EXACT, B_F32, nc, dh, mr, p, 1, ldp, &B, o, ldo);
}

/* qk and pv on a KV cache's tiles (kernels.h): the same blocking, B
 * converted as it is loaded. */
static void qk_kv_avx2(mha_kv_dtype dtype, int mr, int nc, int dh,
                       const float *q, const void *kt, int cols, float *s,
                       int lds)
{
    const bsrc B = {kt, mha_q8_scales(kt, cols, dh), cols, 0};
    switch (dtype) {
    case MHA_KV_F16:
        gemm(6, MODE_SET, B_F16, mr, nc, dh, q, dh, 1, &B, s, lds);
        break;
    case MHA_KV_BF16:
        gemm(6, MODE_SET, B_BF16, mr, nc, dh, q, dh, 1, &B, s, lds);
        break;
    case MHA_KV_Q8:
        gemm(6, MODE_SET, B_Q8K, mr, nc, dh, q, dh, 1, &B, s, lds);
        break;
    default:
        qk_avx2(mr, nc, dh, q, kt, cols, s, lds);
    }
}

static void pv_kv_avx2(mha_kv_dtype dtype, int exact, int mr, int nc, int dh,
                       const float *p, int ldp, const void *v, int cols,
                       float *o, int ldo)
{
    const bsrc B = {v, mha_q8_scales(v, cols, dh), dh,
                    (int)mha_q8_blocks(dh)};
#define PV_KV(T)                                                            \
    (exact ? gemm(4, MODE_ACC_EXACT, T, mr, dh, nc, p, ldp, 1, &B, o, ldo) \
           : gemm(6, MODE_ACC, T, mr, dh, nc, p, ldp, 1, &B, o, ldo))
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
 * exp(x) = 2^n * e^f,  n = round(x / ln2),  f = x - n*ln2 in [-ln2/2, ln2/2]
 * n by the "magic" addition t = fma(x, log2 e, 1.5 * 2^23): floats in
 * [2^23, 2^24) are the integers, so the one rounding of the fma rounds
 * x log2 e to the nearest integer n, and t's low bits hold n itself;
 * n = t - 1.5 * 2^23 exactly.  f by Cody-Waite with FMA: ln2 = L_HI +
 * L_LO, L_HI the float nearest ln2; fma(n, -L_HI, x) is exact
 * (|n| <= 160), then fma(n, -L_LO, .) rounds once.  e^f = 1 + f + f^2 *
 * P(f), P of degree 5 (Cephes expf minimax coefficients), evaluated by
 * Horner with FMA; then (f + f^2 P) + 1, in [0.70, 1.42].
 *
 * 2^n: for |x| <= 86 (every lane: the usual case, a softmax's scores
 * minus their max), |n| <= 125 and y 2^n is a normal float, formed
 * exactly by adding n to y's exponent bits (t shifted left by 23 is n
 * << 23).  Otherwise (-inf, the flush, overflow, NaN in some lane) the
 * general path: x is clamped to [ln FLT_MIN, 89] first (keeps n in
 * [-126, 129]; NaN passes through the clamp), 2^n is two exact float
 * factors 2^(n>>1) * 2^(n - (n>>1)), so n = 128, 129 overflow correctly
 * to +inf, and results for x < ln FLT_MIN = -87.3365... (exact results
 * below FLT_MIN) are flushed to +0: no denormal is produced (nor a
 * microcode assist taken).  Both paths form the same n, f and y, and
 * both scalings are exact, so a lane's result does not depend on its
 * neighbours.  -inf -> 0, NaN -> NaN, 0 -> exactly 1.
 */
MK_INLINE __m256 exp8_poly(__m256 x, __m256 *t)
{
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 magic = _mm256_set1_ps(0x1.8p23f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693147182464599609375f);
    const __m256 ln2_lo = _mm256_set1_ps(-1.904654299957768e-09f);

    *t = _mm256_fmadd_ps(x, log2e, magic);
    const __m256 n = _mm256_sub_ps(*t, magic);
    __m256 f = _mm256_fnmadd_ps(n, ln2_hi, x);
    f = _mm256_fnmadd_ps(n, ln2_lo, f);

    __m256 P = _mm256_set1_ps(1.9875691500e-4f);
    P = _mm256_fmadd_ps(P, f, _mm256_set1_ps(1.3981999507e-3f));
    P = _mm256_fmadd_ps(P, f, _mm256_set1_ps(8.3334519073e-3f));
    P = _mm256_fmadd_ps(P, f, _mm256_set1_ps(4.1665795894e-2f));
    P = _mm256_fmadd_ps(P, f, _mm256_set1_ps(1.6666665459e-1f));
    P = _mm256_fmadd_ps(P, f, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 f2 = _mm256_mul_ps(f, f);
    return _mm256_add_ps(_mm256_fmadd_ps(P, f2, f), _mm256_set1_ps(1.0f));
}

/* The general path of exp8: any x (a rare branch, inlined: a call
 * cost exp_sum a stack frame and the spills around it). */
MK_INLINE __m256 exp8_general(__m256 x)
{
    /* The smallest float whose exp is >= FLT_MIN: -0x1.5d589ep+6 =
     * -87.33654022 (ln FLT_MIN = -87.33654475 lies between it and the next
     * float down, whose exp is already denormal). */
    const __m256 flush = _mm256_set1_ps(-0x1.5d589ep+6f);
    const __m256 x_hi = _mm256_set1_ps(89.0f);

    /* min / max return their second operand when one is NaN: keep x there. */
    const __m256 xc = _mm256_max_ps(flush, _mm256_min_ps(x_hi, x));
    const __m256 below = _mm256_cmp_ps(x, flush, _CMP_LT_OQ);
    __m256 t;
    const __m256 y = exp8_poly(xc, &t);

    /* n is an integer in [-126, 129] (garbage for NaN: y is NaN then). */
    const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t),
                                        _mm256_set1_epi32(0x4B400000));
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    __m256 r = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
    return _mm256_andnot_ps(below, r);
}

MK_INLINE __m256 exp8(__m256 x)
{
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    const __m256 in = _mm256_cmp_ps(a, _mm256_set1_ps(86.0f), _CMP_LE_OQ);
    if (__builtin_expect(_mm256_movemask_ps(in) != 0xFF, 0))
        return exp8_general(x);   /* (NaN compares false: here) */
    __m256 t;
    const __m256 y = exp8_poly(x, &t);
    return _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_castps_si256(y),
                         _mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}

/* ---- tanh -----------------------------------------------------------------
 *
 * tanh|x| = (1 - e) / (1 + e), e = exp(-2|x|) (exp8 above), for |x| >=
 * 0.25; below, the Taylor series x (1 + x^2 P(x^2)) to x^11, whose first
 * omitted term is < 1.3e-11 |x| there (the quotient would lose bits to
 * 1 - e).  The sign of x is put back last.  +-Inf -> +-1, NaN -> NaN.
 */
MK_INLINE __m256 tanh8(__m256 x)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign, x);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e),
                                     _mm256_add_ps(one, e));
    const __m256 a2 = _mm256_mul_ps(a, a);
    __m256 P = _mm256_set1_ps(-1382.0f / 155925.0f);
    P = _mm256_fmadd_ps(P, a2, _mm256_set1_ps(62.0f / 2835.0f));
    P = _mm256_fmadd_ps(P, a2, _mm256_set1_ps(-17.0f / 315.0f));
    P = _mm256_fmadd_ps(P, a2, _mm256_set1_ps(2.0f / 15.0f));
    P = _mm256_fmadd_ps(P, a2, _mm256_set1_ps(-1.0f / 3.0f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(P, a2), a, a);
    const __m256 is_small =
        _mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_LT_OQ);
    const __m256 t = _mm256_blendv_ps(big, small, is_small);
    return _mm256_or_ps(t, _mm256_and_ps(sign, x));
}

static void softcap_avx2(float *x, int n, float c, float *dcap)
{
    const __m256 cv = _mm256_set1_ps(c), inv = _mm256_set1_ps(1.0f / c);
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int k = 0; k < n; k += 8) {
        /* The tail through a local buffer, as exp_sum's. */
        float buf[8] = {0}, dbuf[8];
        const int w = n - k < 8 ? n - k : 8;
        float *src = w == 8 ? x + k : buf;
        if (w < 8)
            for (int i = 0; i < w; i++)
                buf[i] = x[k + i];
        const __m256 t = tanh8(_mm256_mul_ps(_mm256_loadu_ps(src), inv));
        _mm256_storeu_ps(src, _mm256_mul_ps(cv, t));
        if (dcap)
            _mm256_storeu_ps(w == 8 ? dcap + k : dbuf,
                             _mm256_fnmadd_ps(t, t, one));
        if (w < 8)
            for (int i = 0; i < w; i++) {
                x[k + i] = buf[i];
                if (dcap)
                    dcap[k + i] = dbuf[i];
            }
    }
}

static float hsum8(__m256 v)
{
    /* Fixed order: (lo128 + hi128), then (0+2, 1+3), then (0 + 1). */
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v),
                          _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

static float exp_sum_avx2(float *x, int n, float m)
{
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + c), mv));
        _mm256_storeu_ps(x + c, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    if (c < n) {
        /* The tail through a local buffer: the same lane-wise exp, no read
         * or write outside [0, n). */
        float buf[8] = {0};
        const int t = n - c;
        for (int i = 0; i < t; i++)
            buf[i] = x[c + i];
        _mm256_storeu_ps(buf,
                         exp8(_mm256_sub_ps(_mm256_loadu_ps(buf), mv)));
        for (int i = 0; i < t; i++) {
            x[c + i] = buf[i];
            sum += buf[i];
        }
    }
    return sum;
}

static void scale_avx2(float *x, int n, float a)
{
    const __m256 av = _mm256_set1_ps(a);
    int c = 0;
    for (; c + 32 <= n; c += 32) {
        _mm256_storeu_ps(x + c, _mm256_mul_ps(_mm256_loadu_ps(x + c), av));
        _mm256_storeu_ps(x + c + 8,
                         _mm256_mul_ps(_mm256_loadu_ps(x + c + 8), av));
        _mm256_storeu_ps(x + c + 16,
                         _mm256_mul_ps(_mm256_loadu_ps(x + c + 16), av));
        _mm256_storeu_ps(x + c + 24,
                         _mm256_mul_ps(_mm256_loadu_ps(x + c + 24), av));
    }
    for (; c + 8 <= n; c += 8)
        _mm256_storeu_ps(x + c, _mm256_mul_ps(_mm256_loadu_ps(x + c), av));
    for (; c < n; c++)
        x[c] *= a;
}

/* _mm256_max_ps(x, m) returns m when x is NaN: NaN is ignored, as the
 * contract asks.  A max is exact, so the order of the lanes is free. */
static float max_avx2(const float *x, int n)
{
    __m256 m = _mm256_set1_ps(-INFINITY);
    int c = 0;
    for (; c + 8 <= n; c += 8)
        m = _mm256_max_ps(_mm256_loadu_ps(x + c), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float r = -INFINITY;
    for (int k = 0; k < 8; k++)
        if (lanes[k] > r)
            r = lanes[k];
    for (; c < n; c++)
        if (x[c] > r)
            r = x[c];
    return r;
}

/* Eight products at a time, converted to float64 four by four (each
 * exact there: 24 x 24 bits), summed in two vectors of four lanes; the
 * lanes added in a fixed tree, then the tail in order.  A lane whose p is
 * zero adds p * 0 (its d zeroed first), never p * d. */
double mha_dot_nonzero_avx2(const float *p, const float *d, int n)
{
    const __m256 zero = _mm256_setzero_ps();
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 pv = _mm256_loadu_ps(p + c);
        const __m256 dv = _mm256_and_ps(
            _mm256_loadu_ps(d + c), _mm256_cmp_ps(pv, zero, _CMP_NEQ_UQ));
        s0 = _mm256_add_pd(s0, _mm256_mul_pd(
                                   _mm256_cvtps_pd(_mm256_castps256_ps128(pv)),
                                   _mm256_cvtps_pd(_mm256_castps256_ps128(dv))));
        s1 = _mm256_add_pd(s1, _mm256_mul_pd(
                                   _mm256_cvtps_pd(_mm256_extractf128_ps(pv, 1)),
                                   _mm256_cvtps_pd(_mm256_extractf128_ps(dv, 1))));
    }
    double l[4];
    _mm256_storeu_pd(l, _mm256_add_pd(s0, s1));
    double s = (l[0] + l[1]) + (l[2] + l[3]);
    for (; c < n; c++)
        if (p[c] != 0.0f)
            s += (double)p[c] * d[c];
    return s;
}

void mha_dscore_avx2(const float *p, const float *d, float delta, float *ds,
                     int n)
{
    const __m256 dl = _mm256_set1_ps(delta), zero = _mm256_setzero_ps();
    int c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 pv = _mm256_loadu_ps(p + c);
        const __m256 v =
            _mm256_mul_ps(pv, _mm256_sub_ps(_mm256_loadu_ps(d + c), dl));
        _mm256_storeu_ps(ds + c, _mm256_andnot_ps(
                                     _mm256_cmp_ps(pv, zero, _CMP_EQ_OQ), v));
    }
    for (; c < n; c++)
        ds[c] = p[c] == 0.0f ? 0.0f : p[c] * (d[c] - delta);
}

const mha_microkernels mha_microkernels_avx2 = {
    "avx2",         qk_avx2,        pv_avx2,      pv_exact_avx2,
    pv_add_avx2,    pv_add_exact_avx2, pvt_avx2,  pvt_exact_avx2,
    exp_sum_avx2,   scale_avx2,     max_avx2,     softcap_avx2,
    qk_kv_avx2,     pv_kv_avx2,     mha_dot_nonzero_avx2, mha_dscore_avx2};
