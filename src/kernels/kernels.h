/*
 * kernels.h -- the micro-kernels of the tiled (flash-style) attention, one
 * table per instruction set, chosen once at start-up (dispatch.c).
 *
 * The driver (src/attention/) walks query blocks against key tiles with
 * an online softmax; everything that touches O(rows x keys x d_h) data
 * goes through these few functions, so an instruction set is a table of
 * ten pointers.  Shapes, all row-major, all small (one tile):
 *
 *   q   [mr][dh]        query rows of one head, already multiplied by scale
 *   kt  [dh][ldkt]      one key tile, packed transposed: kt[d][c] = K[c][d]
 *   s   [mr][lds]       scores of the tile
 *   p   [mr][ldp]       probabilities of the tile (unnormalised)
 *   v   [nc][dh]        one value tile, packed contiguous
 *   o   [mr][ldo]       the running output of the query rows
 *
 * qk_kv and pv_kv read kt and v in a KV cache's storage format (below) and
 * convert each vector to float in registers as it is loaded; with
 * MHA_KV_F32 they are qk and pv.
 * Every kernel must give the same result whatever mr, nc and the position
 * of the tile in memory (no data-dependent summation order), so results
 * are bitwise reproducible across runs and thread counts within a tier.
 */
#ifndef MHA_KERNELS_H
#define MHA_KERNELS_H

#include "mha.h"
#include "core/half.h"

#include <stdint.h>

/* The most rows one softmax_rows call takes: a flash block's (attention.h,
 * MHA_BR). */
enum { MHA_UK_ROWS = 64 };

typedef struct mha_microkernels {
    const char *name;   /* "scalar", "avx2", "avx512", "neon" */

    /* s[r][c] = sum_d q[r][d] * kt[d][c]  for r < mr, c < nc. */
    void (*qk)(int mr, int nc, int dh, const float *q, const float *kt,
               int ldkt, float *s, int lds);

    /* o[r][d] += sum_c p[r][c] * v[c][d]  for r < mr,
     * d < dh.  Entries of p may be 0; v is finite (the driver takes the
     * pv_exact path below when a value tile holds NaN or Inf). */
    void (*pv)(int mr, int nc, int dh, const float *p, int ldp,
               const float *v, float *o, int ldo);

    /* The same, but an entry p[r][c] == 0 contributes nothing at all, so
     * NaN or Inf in v[c] reaches only the rows that give it weight. */
    void (*pv_exact)(int mr, int nc, int dh, const float *p, int ldp,
                     const float *v, float *o, int ldo);

    /* The backward's products, which add a tile's share to a gradient:
     * o[r][d] += (sum_c p[r][c] * v[c][d]), the sum formed from zero in
     * ascending c and then added to o with one rounding (bitwise: pv into a
     * zeroed buffer, then o + buffer).  The _exact form skips p == 0
     * entries, as pv_exact does. */
    void (*pv_add)(int mr, int nc, int dh, const float *p, int ldp,
                   const float *v, float *o, int ldo);
    void (*pv_add_exact)(int mr, int nc, int dh, const float *p, int ldp,
                         const float *v, float *o, int ldo);

    /* The transposed product: o[c][d] += (sum_r p[r][c] * x[r][d]) for
     * c < nc, d < dh, formed as in pv_add (bitwise pv_add applied to p
     * transposed); x [mr][dh] contiguous. */
    void (*pvt)(int mr, int nc, int dh, const float *p, int ldp,
                const float *x, float *o, int ldo);
    void (*pvt_exact)(int mr, int nc, int dh, const float *p, int ldp,
                      const float *x, float *o, int ldo);

    /* x[c] = exp(x[c] - m) for c < n, returning the sum of the results
     * (in a fixed order).  x may hold -INFINITY (-> 0) and NaN (-> NaN);
     * m is finite.  The accuracy of the tier's exp is in docs/KERNELS.md. */
    float (*exp_sum)(float *x, int n, float m);

    /* Probabilities from a row's stats: x[c] = exp(x[c] - m) * a for
     * c < n, the bits of exp_sum then scale; with d not NULL returns
     * dot_nonzero(x, d, n) of the new x (its bits), else 0.  One pass
     * where the backward's P and its share of delta took three. */
    double (*probs)(float *x, int n, float m, float a, const float *d);

    /* dst[c] = src[c] * a for c < n (dst may be src). */
    void (*scale)(float *dst, const float *src, int n, float a);

    /* dst[c] = src[c] for c < n; returns whether every one is finite
     * (the packing of a value tile, which tells pv from pv_exact). */
    int (*copy_finite)(float *dst, const float *src, int n);

    /* max_c x[c] over c < n, ignoring NaN (-INFINITY if none is larger);
     * the driver relies on NaN reaching the sum through exp_sum instead. */
    float (*max)(const float *x, int n);

    /* The online softmax's step on the mr rows of a score tile, row r at
     * s + r lds, with its running max m[r] and sum l[r] (flash_forward.c):
     * mn = the larger of m[r] and max (above) of the row; a row whose mn
     * is -INFINITY (no live score yet) is left as it is, m and l too, and
     * gets alpha[r] = -1; otherwise alpha[r] = 1 if mn == m[r], else
     * exp(m[r] - mn) (the tier's exp), the row becomes exp(s - mn)
     * (exp_sum), l[r] = l[r] alpha[r] + the row's sum (two roundings),
     * m[r] = mn.  mr <= MHA_UK_ROWS. */
    void (*softmax_rows)(int mr, int nc, float *s, int lds, float *m,
                         float *l, float *alpha);

    /* The softcap (Gemma 2): x[k] = c tanh(x[k] * (1/c)) for k < n, 1/c
     * rounded to float, c > 0; and, when dcap is not NULL, dcap[k] =
     * 1 - tanh^2, its derivative.  +-Inf -> +-c, NaN -> NaN.  The
     * accuracy of the tier's tanh is in docs/KERNELS.md. */
    void (*softcap)(float *x, int n, float c, float *dcap);

    /* qk and pv (pv_exact when exact) on tiles stored as `dtype`: a kt
     * tile of `cols` columns (ldkt = cols), a v tile of `cols` rows, laid
     * out as mha_kv_tile_bytes says.  Each element is converted to the
     * float it stands for (mha_kv_load below) before it enters the FMA
     * chain, so the result is bitwise qk / pv on those floats.  `next`:
     * the tile of the same kind read after this one (of the cache, or a
     * paged cache's next page), or NULL; a 16-bit tile's kernel asks for
     * its rows as it reads its own (a prefetch: never a read, never a
     * fault). */
    void (*qk_kv)(mha_kv_dtype dtype, int mr, int nc, int dh, const float *q,
                  const void *kt, int cols, const void *next, float *s,
                  int lds);
    void (*pv_kv)(mha_kv_dtype dtype, int exact, int mr, int nc, int dh,
                  const float *p, int ldp, const void *v, int cols,
                  const void *next, float *o, int ldo);

    /* The backward's row work (flash_backward.c), once per element of
     * every (block, tile).  dot_nonzero: sum_c p[c] * d[c] over the c < n
     * with p[c] != 0 (so an Inf or NaN in d under a zero p stays out),
     * each product exact in float64 and summed in float64, in an order
     * fixed by n alone. */
    double (*dot_nonzero)(const float *p, const float *d, int n);

    /* ds[c] = p[c] == 0 ? +0 : p[c] * (d[c] - delta) for c < n, the
     * subtraction and the product each rounded to float (never fused):
     * the same bits in every tier.  ds may be d. */
    void (*dscore)(const float *p, const float *d, float delta, float *ds,
                   int n);

    /* qk and pv (pv_exact when exact) on keys and values where they lie,
     * rows ldk / ldv floats apart (a decoding step on given K and V,
     * which packing would cost more than it saves): bitwise qk on the
     * packed kt tile of those keys, and pv on the packed v tile. */
    void (*qk_rows)(int mr, int nc, int dh, const float *q, const float *k,
                    int ldk, float *s, int lds);
    void (*pv_rows)(int exact, int mr, int nc, int dh, const float *p,
                    int ldp, const float *v, int ldv, float *o, int ldo);

    /* Key rows into the layouts above, exactly: x holds n rows of dh
     * elements of an f32, f16 or bf16 dtype, row c at x + c ldx
     * (elements); kt[d][c] (ldkt apart) for d < dh, c < n; and, when v
     * is not NULL, v[c][d] = the same element for d < dv (a latent
     * cache's values: each key's first dv).  kt may be NULL: v alone,
     * rows converted (dv <= dh); then x may also be a q8 or q4 tile of n
     * rows in the value layout (ldx = dh), each code times its block's
     * scale (mha_v_load's bits).  With f32 it is a transposition. */
    void (*widen_t)(mha_kv_dtype dtype, const void *x, int64_t ldx, int n,
                    int dh, float *kt, int ldkt, float *v, int dv);

    /* The input scans (core.h, mha_amax_fn): over `rows` rows of `cols`
     * floats, ld apart, the largest finite |x| (0 for none; a max, exact:
     * the same value in every tier), and *finite = whether every element
     * is finite (a value tile read in place: pv or pv_exact). */
    float (*amax)(const float *x, int64_t rows, int64_t cols, int64_t ld,
                  int *finite);

    /* A 16-bit call's results as they are stored (tiles.c,
     * mha_store_row16): y[i] = x[i] (times *mult where mult is not NULL,
     * the product rounded as scale's) rounded to nearest even into bf16
     * (bf) or f16, half.h's bits (NaN quiet, overflow to Inf, f16's
     * subnormals). */
    void (*narrow)(int bf, const float *x, int n, const float *mult,
                   uint16_t *y);

    /* A parameter, not a kernel: the elements of a latent cache's 576
     * that MLA's scores take in one pv call (flash_forward.c's slabs;
     * 0: all of them).  Any value gives the same bits. */
    int latent_slab;
} mha_microkernels;

/*
 * The storage of a KV cache's tiles.  f32, f16 and bf16 tiles are arrays
 * of that element, kt [dh][cols] and v [cols][dh].  A q8 tile holds every
 * key's (or value's) d_h elements in blocks of MHA_Q8_BLOCK along d (the
 * last block shorter when d_h is not a multiple), each block x as int8
 * codes c and one float scale s, standing for the floats fl(c * s):
 *
 *     kt tile   float s[blocks][cols],   then int8 c[dh][cols]
 *     v tile    float s[cols][blocks],   then int8 c[cols][dh]
 *
 * and a q8 tile's pointer is its codes' (the scales lie just before it:
 * mha_q8_scales).  The scales come first so that a kernel walking the
 * tiles reads forward only: scales before codes in each tile, tile after
 * tile.  With the scales after the codes, each tile's walk jumped ahead
 * to its end for a block's scales and back, and the hardware's stream
 * prefetchers fell behind (docs/BENCHMARKS.md, "The 8-bit cache").
 *
 * (s = amax|x| / 127 rounded to float, c = x / s rounded to nearest even;
 * a block holding NaN or Inf has s = NaN: all of it reads as NaN.)
 */
enum { MHA_Q8_BLOCK = 32 };

static inline int64_t mha_q8_blocks(int64_t dh)
{
    return (dh + MHA_Q8_BLOCK - 1) / MHA_Q8_BLOCK;
}

/* Bytes of a q8 tile's scales, which precede its codes. */
static inline int64_t mha_q8_scale_bytes(int64_t cols, int64_t dh)
{
    return 4 * cols * mha_q8_blocks(dh);
}

/*
 * A q4 tile is a q8 tile whose codes (in [-7, 7]) are packed two to a
 * byte, in pairs of B's rows (the rows the kernels walk: dims of a kt
 * tile, keys of a v tile), so that a row of B is read as the bytes of a
 * q8 row plus a shift:
 *
 *     kt tile   float s[blocks][cols],   then uint8 c[dh / 2][cols]
 *     v tile    float s[cols][blocks],   then uint8 c[cols / 2][dh]
 *
 * row k's code at column j in the low nibble of byte [k / 2][j] when k is
 * even, the high one when odd (two's complement nibbles).  d_h is even.
 */
static inline int mha_q4_code(const void *codes, int64_t ld, int64_t k,
                              int64_t j)
{
    const int8_t x = ((const int8_t *)codes)[(k >> 1) * ld + j];
    /* (x << 4 as a byte, then an arithmetic shift: the low nibble) */
    return k & 1 ? x >> 4 : (int8_t)(uint8_t)((uint8_t)x << 4) >> 4;
}

/* Bytes of one kt or v tile of `cols` keys; a multiple of 64 when cols
 * is. */
static inline int64_t mha_kv_tile_bytes(mha_kv_dtype dtype, int64_t cols,
                                        int64_t dh)
{
    return dtype == MHA_KV_F32  ? 4 * cols * dh
         : dtype == MHA_KV_Q8   ? mha_q8_scale_bytes(cols, dh) + cols * dh
         : dtype == MHA_KV_Q4   ? mha_q8_scale_bytes(cols, dh) + cols * dh / 2
                                : 2 * cols * dh;
}

/* Whether tiles of this dtype carry scales before their codes. */
static inline int mha_kv_scaled(mha_kv_dtype dtype)
{
    return dtype == MHA_KV_Q8 || dtype == MHA_KV_Q4;
}

/* q8, q4: the float scales of the tile whose codes start at `tile`. */
static inline const float *mha_q8_scales(const void *tile, int64_t cols,
                                         int64_t dh)
{
    return (const float *)((const int8_t *)tile -
                           mha_q8_scale_bytes(cols, dh));
}

/* Element `at` of an f32, f16 or bf16 tile, as the float it stands for. */
static inline float mha_kv_elem(mha_kv_dtype dtype, const void *tile,
                                int64_t at)
{
    return dtype == MHA_KV_F16  ? mha_f16_to_float(((const uint16_t *)tile)[at])
         : dtype == MHA_KV_BF16 ? mha_bf16_to_float(((const uint16_t *)tile)[at])
                                : ((const float *)tile)[at];
}

/* kt[d][c] of a kt tile and v[c][d] of a v tile, as floats. */
static inline float mha_kt_load(mha_kv_dtype dtype, const void *kt,
                                int64_t cols, int64_t dh, int64_t d,
                                int64_t c)
{
    if (dtype == MHA_KV_Q4)
        return (float)mha_q4_code(kt, cols, d, c) *
               mha_q8_scales(kt, cols, dh)[d / MHA_Q8_BLOCK * cols + c];
    if (dtype != MHA_KV_Q8)
        return mha_kv_elem(dtype, kt, d * cols + c);
    return (float)((const int8_t *)kt)[d * cols + c] *
           mha_q8_scales(kt, cols, dh)[d / MHA_Q8_BLOCK * cols + c];
}
static inline float mha_v_load(mha_kv_dtype dtype, const void *v,
                               int64_t cols, int64_t dh, int64_t c, int64_t d)
{
    if (dtype == MHA_KV_Q4)
        return (float)mha_q4_code(v, dh, c, d) *
               mha_q8_scales(v, cols, dh)[c * mha_q8_blocks(dh) +
                                          d / MHA_Q8_BLOCK];
    if (dtype != MHA_KV_Q8)
        return mha_kv_elem(dtype, v, c * dh + d);
    return (float)((const int8_t *)v)[c * dh + d] *
           mha_q8_scales(v, cols, dh)[c * mha_q8_blocks(dh) +
                                      d / MHA_Q8_BLOCK];
}

/* The tiers.  ref is the float64 row loop of src/attention/ref_forward.c
 * and has no micro-kernels. */
typedef enum mha_isa {
    MHA_ISA_REF = 0,
    MHA_ISA_SCALAR = 1,
    MHA_ISA_AVX2 = 2,
    MHA_ISA_AVX512 = 3,
    MHA_ISA_NEON = 4
} mha_isa;

extern const mha_microkernels mha_microkernels_scalar;
extern const mha_microkernels mha_microkernels_avx2;   /* -mavx2 -mfma */
extern const mha_microkernels mha_microkernels_avx512; /* -mavx512f -mfma */
extern const mha_microkernels mha_microkernels_neon;   /* aarch64 only   */

/* The tier chosen once, at the first call (dispatch.c): the widest the
 * CPU and OS support, or the one MHA_ISA=ref|scalar|avx2|avx512|neon
 * forces.
 * Fails, naming MHA_ISA, for an unknown tier or one the CPU lacks. */
mha_status mha_isa_get(mha_isa *isa, const mha_microkernels **uk);

/* Whether the CPU and OS run AVX-512F (and AVX2, FMA, F16C): the avx512
 * tier, and where the oneDNN GEMM backend is the default (gemm.c). */
int mha_cpu_has_avx512(void);

/* Whether a decoding panel walking a tile in slabs prefetches the next
 * slab of 16-bit elements (simd_tier.h's panel; other dtypes' always
 * are): set by mha_isa_get, off for the avx512 tier on AMD's cores
 * (Zen 4: their stream prefetchers did better alone, the 64-sequence GQA
 * step 1.18-1.21x; docs/BENCHMARKS.md), on elsewhere.  Never the bits: a
 * prefetch reads nothing into a result. */
int mha_slab_prefetch(void);

/* Which of a contiguous cache's tiles ask for the next tile's rows into
 * L2 as they read their own (tiles.c; a paged cache's always do), set by
 * mha_isa_get: 0, none (the avx2 tier: on Zen 3 the GQA f16 step was 10%
 * slower with them); 1, every tile but a lone row's 16-bit one (the
 * avx512 tier; Zen 4: the GQA f16 step 1.23-1.31x, q8 1.14-1.17x, while
 * a lone row's f16 stream ran 6-11% slower with them); 2, every tile
 * (the avx512 tier on AMD family 0x1A, Zen 5, where the lone row's f16
 * and bf16 streams ran 1.08-1.12x faster with them).  Intel unmeasured:
 * 1.  docs/BENCHMARKS.md.  Never the bits. */
int mha_next_prefetch(void);

/* ---- bf16 attention on AMX tiles, AVX512-BF16 or BFDOT --------------------
 * The kernels are bf16_tier.h's, instantiated by amx.c (x86) and
 * neon_bf16.c (aarch64); MHA_BF16_KERNELS says whether this build has
 * them.  mha_bf16_tier: which kernels bf16 attention runs on, chosen once
 * per process: AMX (AMX-TILE and AMX-BF16, the OS saving the tile state,
 * and Linux granting this process the tile data), else DOT (dot products
 * of bf16 pairs: AVX512-BF16's vdpbf16ps with AVX-512 F/BW/DQ/VL, or
 * aarch64's BFDOT where HWCAP2_BF16 says so), else FLOAT32 (the inputs
 * widened, the float32 kernels).  MHA_BF16=amx|avx512bf16|bfdot|float32
 * in the environment caps it (the tests take every path that way; the
 * other ISA's dot-product name means float32); -1 when MHA_BF16 names
 * none of them. */
#if defined(__x86_64__) || defined(__aarch64__)
#define MHA_BF16_KERNELS 1
#else
#define MHA_BF16_KERNELS 0
#endif
enum { MHA_BF16_FLOAT32 = 0, MHA_BF16_DOT = 1, MHA_BF16_AMX = 2 };
int mha_bf16_tier(void);
/* The name of the kernels tier (>= 0) runs on when isa is the float
 * tier chosen: "amx", "avx512bf16" (x86), "bfdot" (aarch64), or
 * "float32" -- also where isa is narrower than the bf16 kernels need
 * (MHA_ISA forcing avx2 or scalar widens bf16 too). */
const char *mha_bf16_tier_name(int tier, mha_isa isa);

/* One block of up to 32 query rows of one (b, h), its K/V head packed by
 * mha_bf16_pack_b (K^T: K = d_h, N = Lk; V: K = Lk, N = d_h; keys rounded
 * up to 32 with zeros; dh a multiple of 32).  Row r sees keys 0 ..
 * lim[r] - 1; out and lse get bf16(O / l) and the row's natural
 * log-sum-exp (-inf and zeros for a row that sees nothing). */
typedef struct mha_bf16_block {
    const uint16_t *q;     /* row r at q + r * ldq                       */
    int64_t ldq;
    int mr, dh;
    const int64_t *lim;    /* (mr) keys each row sees, from key 0        */
    const uint32_t *kp, *vp;
    int64_t kt_stride;     /* K^T's tiles per row of tiles: 2 ceil(Lk/32) */
    float scale;
    uint16_t *out;         /* row r at out + r * ldo                     */
    int64_t ldo;
    float *lse;            /* (mr) or NULL                               */
} mha_bf16_block;

/* A thread's scratch for mha_bf16_flash_rows (64-byte aligned parts). */
#define MHA_BF16_BK 256     /* keys per step of the online softmax      */
typedef struct mha_bf16_scratch {
    float *S;              /* 32 x MHA_BF16_BK scores                     */
    float *O;              /* 32 x dh accumulators                       */
    float *m;              /* 32 row maxima (scaled, log2 units)         */
    float *l;              /* 32 x 16: each row's sum, lane by lane      */
    uint16_t *P;           /* 32 x MHA_BF16_BK bf16 weights               */
    uint16_t *Q;           /* 32 x dh bf16 query rows                    */
} mha_bf16_scratch;

/* Floats of scratch one thread needs for head dim dh (parts in order). */
static inline int64_t mha_bf16_scratch_floats(int dh)
{
    return 32 * MHA_BF16_BK + 32 * (int64_t)dh + 32 + 32 * 16 +
           32 * MHA_BF16_BK / 2 + 32 * (int64_t)dh / 2;
}
/* This thread's configuration for the kernels below: AMX tiles (tiles =
 * 1: the tile configuration loaded) or dot products (0) on the same
 * packed layouts; the choice is the thread's, like the tile state itself.
 * mha_bf16_end releases it.  (aarch64 has only the dot products.) */
void mha_bf16_begin(int tiles);
void mha_bf16_end(void);
void mha_bf16_flash_rows(const mha_bf16_block *w, mha_bf16_scratch *s);

/* The B operands' layout: the K x N matrix whose (k, n) element
 * is src[k sk + n sn] as B tiles, tile (kt, nt) at dst + (kt * nnt + nt)
 * * 256 words, nnt = 2 ceil(N / 32); zeros past K and N. */
void mha_bf16_pack_b(const uint16_t *src, int64_t sk, int64_t sn, int64_t K,
                    int64_t N, uint32_t *dst);
/* Its rows of tiles kt0 .. kt1 - 1 only (k = 32 kt0 .. 32 kt1 - 1), so
 * that threads can pack row ranges of one matrix side by side. */
void mha_bf16_pack_b_rows(const uint16_t *src, int64_t sk, int64_t sn,
                         int64_t K, int64_t N, int64_t kt0, int64_t kt1,
                         uint32_t *dst);
/* The largest finite |x| of rows x n bf16 (rows ld apart), as bf16 bits
 * (Inf and NaN skipped, as mha_max_abs_finite does for floats). */
uint16_t mha_bf16_max_abs(const uint16_t *x, int64_t ld, int64_t rows,
                         int64_t n);
static inline int64_t mha_bf16_b_words(int64_t K, int64_t N)
{
    return (K + 31) / 32 * ((N + 31) / 32) * 512;
}

/* C (32 x N floats, rows ldc apart; rows 16-31 only when two) = (acc:
 * C +) A (32 x K bf16, rows lda apart) B, B packed as above with its tile
 * (kt, nt) at b + (kt bstride + nt) 256; N and K multiples of 32.  The
 * one tile GEMM of every product above, for the bf16 linear layer
 * (module/linear.c). */
void mha_bf16_gemm32(float *C, int ldc, int N, const uint16_t *A, int lda,
                    int K, const uint32_t *b, int64_t bstride, int acc,
                    int two);

/* ---- the bf16 linear layer's pieces (amx_linear.c, neon_bf16.c) ---------
 * W (n_out x n_in float32, row-major, PyTorch's [out, in]) rounded to
 * bf16 and packed as the B operand of y = x W^T (K = n_in, N = n_out,
 * the layout of mha_bf16_pack_b, mha_bf16_b_words(n_in, n_out) words):
 * its 16-column tiles nt0 .. nt1 - 1 of every row of tiles, so that
 * threads can pack column ranges of one W side by side.  Returns the
 * largest |w| it read (parameters are finite): the range check of the
 * rounding, in the same pass. */
float mha_bf16_pack_wt(const float *w, int64_t n_in, int64_t n_out,
                      int64_t nt0, int64_t nt1, uint32_t *dst);
/* W itself (not transposed) rounded and packed as the B operand of the
 * input gradient dx = dy W (K = n_out, N = n_in, mha_bf16_b_words(n_out,
 * n_in) words): its 16-column tiles nt0 .. nt1 - 1 (columns of W). */
void mha_bf16_pack_w(const float *w, int64_t n_in, int64_t n_out,
                    int64_t nt0, int64_t nt1, uint32_t *dst);
/* dst (round32(N) rows, ldd apart) = the K x N bf16 matrix src (rows ld
 * apart) transposed, its columns k of the 32-row blocks kt0 .. kt1 - 1:
 * dst[n][k] = src[k][n], zeros for k >= K and n >= N.  The A operand
 * dy^T of the weight gradient dW = dy^T x. */
void mha_bf16_transpose(const uint16_t *src, int64_t ld, int64_t K,
                       int64_t N, int64_t kt0, int64_t kt1, uint16_t *dst,
                       int64_t ldd);
/* y (rows x cols bf16, rows ldy apart) = C (rows ldc apart) + bias (cols
 * floats, or NULL), rounded to nearest even. */
void mha_bf16_round_rows(const float *C, int ldc, int rows, int cols,
                        const float *bias, uint16_t *y, int64_t ldy);

/* One query head as the key blocks of sweep 1 read it: Q^T and dO^T
 * (K = d_h, N = Lq) and Q and dO (K = Lq, N = d_h) packed, and per query
 * (padded with zeros to a multiple of 64): lim, the keys it sees, from 0;
 * lse log2 e; D = sum_d dO O. */
typedef struct mha_bf16_bwd_head {
    const uint32_t *qt, *dot, *qn, *don;
    int64_t qt_stride, dot_stride, qn_stride, don_stride;   /* nnt */
    const int32_t *lim;
    const float *lse2, *D;
    int64_t Lq;
} mha_bf16_bwd_head;

/* Sweep 1: keys j0 .. j0 + mr - 1 (mr <= 32) of one K/V head, against
 * the `heads` query heads that read it; dK and dV written as bf16. */
typedef struct mha_bf16_bwd_kv {
    const uint16_t *k, *v;      /* row r at k + r ldk (v + r ldv)          */
    int64_t ldk, ldv, j0;
    int mr, dh, heads;
    const mha_bf16_bwd_head *head;
    float scale;
    uint16_t *dk, *dv;
    int64_t ldk_out, ldv_out;
} mha_bf16_bwd_kv;

/* Sweep 2: query rows of one head (mr <= 32) against its K/V head: K^T
 * and V^T (K = d_h, N = Lk) and K (K = Lk, N = d_h) packed; per row lim,
 * lse log2 e and D; dQ written as bf16. */
typedef struct mha_bf16_bwd_q {
    const uint16_t *q, *dout;
    int64_t ldq, ldo;
    int mr, dh;
    const int64_t *lim;
    const float *lse2, *D;
    const uint32_t *kt, *vt, *kn;
    int64_t kt_stride, vt_stride, kn_stride;
    float scale;
    uint16_t *dq;
    int64_t ldq_out;
} mha_bf16_bwd_q;

typedef struct mha_bf16_bwd_scratch {
    float *S, *dP;              /* 32 x 64 each                            */
    float *acc;                 /* 64 x dh: dK then dV, or dQ              */
    uint16_t *P, *dS;           /* 32 x 64 bf16 each                       */
    uint16_t *x, *y;            /* 32 x dh bf16 each: staged rows          */
} mha_bf16_bwd_scratch;
static inline int64_t mha_bf16_bwd_scratch_floats(int dh)
{
    return 2 * 32 * 64 + 64 * (int64_t)dh + 32 * 64 + 32 * (int64_t)dh;
}
void mha_bf16_backward_kv(const mha_bf16_bwd_kv *w, mha_bf16_bwd_scratch *s);
void mha_bf16_backward_q(const mha_bf16_bwd_q *w, mha_bf16_bwd_scratch *s);

#endif /* MHA_KERNELS_H */
