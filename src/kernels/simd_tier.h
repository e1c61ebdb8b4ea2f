/*
 * simd_tier.h -- the micro-kernels of kernels.h, written once over the
 * vector layer (simd.h) and instantiated by each SIMD tier's file, which
 * defines its ISA and these parameters first:
 *
 *   TIER_NAME         the table's name ("avx2", ...), TIER_TABLE its symbol
 *   TIER_RMAX         rows of a register block (TIER_RMAX_EXACT for the
 *                     _exact forms, whose zero test may need registers)
 *   TIER_W1, TIER_W2  vectors of columns in a block of one / two rows
 *                     (decoding: many independent chains hide the FMA's
 *                     latency where a row has few)
 *   TIER_WM           vectors of columns of every other block
 *   TIER_WIDE_EXACT   whether the _exact forms take the wide blocks too
 *   TIER_SLABS        whether a lone panel walks K in slabs (below)
 *   TIER_LATENT_SLAB  the table's latent_slab (kernels.h): MLA's scores
 *                     over this many of the 576 a pv call, 0 all at once
 *
 * Determinism: every output element of a product is one chain of fused
 * multiply-adds in ascending order of the reduction index, whatever block
 * of the tiling it lands in (wide block, narrow block, masked tail),
 * whatever mr or the tile's alignment: splitting a tile gives the same
 * bits, and so does the choice of parameters.  exp is lane-independent
 * and the same lane for lane in every tier; a sum of lanes (exp_sum,
 * dot_nonzero) has a fixed order for a given n, which differs between
 * widths.  docs/KERNELS.md.
 */
#include "bsrc.h"
#include "kernels.h"
#include "simd.h"

#include <float.h>
#include <math.h>

/* ---- the common GEMM-like tile -------------------------------------------
 *
 *   C[r][j] (=|+=) sum_k A[r*lda + k*ska] * B[k*ldb + j],  r < R
 *
 * qk: A = q (lda dh), B = kt (ldb ldkt), K = dh, C = s, set.
 * pv: A = p (ldp),    B = v  (ldb dh),   K = nc, C = o, accumulate.
 * Each C element is acc = fma(A[r][k], B[k][j], acc) for k = 0, 1, ...,
 * starting from C (FROM_C) or from 0; with ADD the finished sum is then
 * added to C (pv_add, pvt).  EXACT skips the terms whose A is zero.
 * NEXT (cache tiles only) asks for B->next's rows as B's are read (ahead).
 */
enum { FROM_C = 1, EXACT = 2, ADD = 4, NEXT = 8 };   /* (B's storage: bsrc.h) */

/* The register block's loops over its rows and vectors, unrolled whatever
 * the optimisation level: at -O2 GCC left them as loops over arrays of
 * vectors in memory, and qk ran at a quarter of its -O3 speed
 * (docs/KERNELS.md). */
#if defined(__clang__)
#define UNROLL   /* (clang's forced unrolling, with the fuzzer's coverage
                    and ASan, took over 20 minutes on avx512.c) */
#else
#define UNROLL _Pragma("GCC unroll 16")
#endif
/* The k loop of a register block unrolled TIER_KUNROLL times where the
 * tier asks (avx2: a block at d_h 64 walks 64 steps, and the exit of a
 * loop of 64 was mispredicted at every block), not at all elsewhere.
 * The same FMAs in the same order: the same bits. */
#if defined(TIER_KUNROLL) && !defined(__clang__)
#define KLOOP_S(x) _Pragma(#x)
#define KLOOP_E(x) KLOOP_S(x)   /* (TIER_KUNROLL expanded first) */
#define KLOOP KLOOP_E(GCC unroll TIER_KUNROLL)
#else
#define KLOOP
#endif
enum { MODE_SET = 0, MODE_ACC = FROM_C, MODE_ACC_EXACT = FROM_C | EXACT,
       MODE_ADD = ADD, MODE_ADD_EXACT = ADD | EXACT };

/* VL q4 codes of one row (bytes p, the row's nibble hi or low), widened:
 * the byte sign-extended to 32 bits, then the nibble by shifts. */
MK_INLINE vf vf_load_i4(const int8_t *p, int hi)
{
    const vi x = vi_load_i8(p);
    return hi ? vf_nibble_hi(x) : vf_nibble_lo(x);
}

/* B[k][j ..] as VL floats; `masked`: only its first n lanes are read
 * (the others 0), the tail of the columns. */
MK_INLINE vf ldb(const int T, const bsrc *b, int k, int j, const int masked,
                 vtail t, int n)
{
    const size_t at = (size_t)k * b->ld + j;
    if (T == B_F32)
        return masked ? vf_load_t((const float *)b->x + at, t)
                      : vf_load((const float *)b->x + at);
    if (masked) {
        float buf[VL] = {0};
        for (int i = 0; i < n; i++)
            buf[i] = bsrc_elem(T, b, k, j + i);
        return vf_load(buf);
    }
    if (T == B_Q4K || T == B_Q4V) {   /* a q8 load of the pair's bytes */
        const vf c = vf_load_i4((const int8_t *)b->x +
                                    (size_t)(k >> 1) * b->ld + j, k & 1);
        if (T == B_Q4K)
            return vf_mul(c, vf_load(b->s + (size_t)(k / MHA_Q8_BLOCK) *
                                                b->ld + j));
        return vf_mul(c, vf_set1(b->s[(size_t)k * b->blocks +
                                      j / MHA_Q8_BLOCK]));
    }
    /* (Only 16-bit elements are read as such: a q8 row is bytes, and read
     * as 16-bit it ran past the end of a cache's last tile.) */
    if (T == B_F16)
        return vf_load_f16((const uint16_t *)b->x + at);
    if (T == B_BF16)
        return vf_load_bf16((const uint16_t *)b->x + at);
    const vf c = vf_load_i8((const int8_t *)b->x + at);
    if (T == B_Q8K)   /* a scale per key: per column */
        return vf_mul(c, vf_load(b->s + (size_t)(k / MHA_Q8_BLOCK) * b->ld + j));
    /* one scale per MHA_Q8_BLOCK columns of the row: VL divides it */
    return vf_mul(c, vf_set1(b->s[(size_t)k * b->blocks + j / MHA_Q8_BLOCK]));
}

/* What a cache's tile asks for before it reads row k, columns j ..
 * j + W VL - 1 (a prefetch changes no bits; docs/BENCHMARKS.md has what
 * was tried):
 * - 8- and 4-bit codes: the bytes AHEAD_K (a key tile) or AHEAD_V (a
 *   value tile) past them.  A decoding step reads 64 or 128 bytes of
 *   codes an iteration, and with only the loads a core keeps in flight a
 *   one-row q8 step read 9 GB/s on one Zen 4 thread where f16 read 25.
 *   (Past a tile's end the request falls on the next tile, as a
 *   contiguous cache lays them out.)  With NEXT, the same bytes of the
 *   next tile too, into L2 as for 16-bit tiles (below): a one-row q8
 *   step 1.17x faster on Zen 4, a GQA q8 step 1.15x; with those requests
 *   alone, and none into L1, GQA steps ran slower than without any.
 * - 16-bit elements: the same row of the tile read next (B->next: the
 *   next tile of a contiguous cache, or of a paged cache's page or next
 *   page, wherever it lies), so that it arrives spread over this tile's
 *   walk, a tile (16 KiB at d_h 128) ahead, without waiting for the
 *   hardware's prefetchers (which cannot follow a jump to another page).
 *   Into L2 (prefetcht2), whose misses a core keeps more of in flight
 *   than L1's: into L1 (t0) it gained only at a page's jump, and a GQA
 *   f16 step ran 1.3x slower than with these requests into L2.  A mode
 *   bit of its own (NEXT), not a test of B->next in the loop: that test
 *   alone cost a step 2-3%.  f32 tiles the same way (4-byte elements):
 *   a GQA f32 step 1.15x faster on Zen 4, a lone row's 1.04x. */
enum { AHEAD_K = 1024, AHEAD_V = 2048 };
MK_INLINE void ahead(const int T, const int W, const int mode,
                     const bsrc *B, int k, int j)
{
    if (T == B_F32 || T == B_F16 || T == B_BF16) {
        if (!(mode & NEXT))
            return;
        const int es = T == B_F32 ? 4 : 2;
        const char *p = B->next + ((size_t)k * B->ld + j) * es;
        for (int w = 0; w < W * VL * es; w += 64)   /* (into L2: below) */
            __builtin_prefetch(p + w, 0, 1);
        return;
    }
    if (T < B_Q8K)
        return;
    const size_t row = (size_t)(T >= B_Q4K ? k >> 1 : k) * B->ld;
    const char *p = (const char *)B->x + row + j +
                    (T == B_Q8K || T == B_Q4K ? AHEAD_K : AHEAD_V);
    for (int w = 0; w < W * VL; w += 64)
        __builtin_prefetch(p + w, 0, 3);
    if (mode & NEXT) {
        const char *q = B->next + row + j;
        for (int w = 0; w < W * VL; w += 64)
            __builtin_prefetch(q + w, 0, 1);
    }
}

/* acc[r][w] += A[r][k] * b[w] for R rows: one step of the tile below. */
MK_INLINE void fma_rows(const int R, const int W, const int mode,
                        const float *A, int lda, int ska, int k, const vf *b,
                        vf acc[6][8])
{
    UNROLL
    for (int r = 0; r < R; r++) {
        const vf a = vf_set1(A[(size_t)r * lda + (size_t)k * ska]);
        if (mode & EXACT) {
            /* where a is zero acc stays as it was, so NaN / Inf in b
             * never reaches the row: the bits of skipping it */
            const vm nz = vf_cmp_nz(a);
            UNROLL
            for (int w = 0; w < W; w++)
                acc[r][w] = vf_fma_where(nz, a, b[w], acc[r][w]);
        } else {
            UNROLL
            for (int w = 0; w < W; w++)
                acc[r][w] = vf_fma(a, b[w], acc[r][w]);
        }
    }
}

/* R rows (1 .. 6) x W vectors (1 .. 8) of C from column j, over k0 <= k
 * < k1; masked only with W == 1 (n columns, the tail). */
MK_INLINE void tile(const int R, const int W, const int masked, const int mode,
                    const int T, int k0, int k1, const float *A, int lda,
                    int ska, const bsrc *B, int j, float *C, int ldc,
                    vtail t, int n)
{
    vf acc[6][8];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int w = 0; w < W; w++) {
            const float *c = C + (size_t)r * ldc + VL * w;
            acc[r][w] = !(mode & FROM_C) ? vf_zero()
                        : masked         ? vf_load_t(c, t)
                                         : vf_load(c);
        }

    /* Register budget: R*W accumulators.  With room for all W vectors of
     * B besides them, B's row is loaded first and each row's broadcast is
     * used at once; otherwise (one or two rows against wide blocks on a
     * 16-register ISA) the R broadcasts are held and B is loaded one vector
     * at a time.  Loading both at once made GCC spill to the stack, an
     * extra load for every FMA.  Either way each accumulator sees the
     * same FMAs in the same order of k: the same bits. */
    const int b_first = R * W + W + 2 <= VREGS;
    int k = k0;
    /* q4: a byte row holds B's rows k and k + 1 (k even): loaded once,
     * both nibbles widened, then the two rows' FMAs in order of k as
     * below (the same bits), with no per-row address arithmetic. */
    if ((T == B_Q4K || T == B_Q4V) && !masked &&
        R * W + 2 * W + 2 <= VREGS) {
        if (k & 1 && k < k1) {
            vf b[8];
            UNROLL
            for (int w = 0; w < W; w++)
                b[w] = ldb(T, B, k, j + VL * w, 0, t, n);
            fma_rows(R, W, mode, A, lda, ska, k, b, acc);
            k++;
        }
        for (; k + 1 < k1; k += 2) {
            ahead(T, W, mode, B, k, j);
            const int8_t *row = (const int8_t *)B->x +
                                (size_t)(k >> 1) * B->ld + j;
            vf lo[8], hi[8];
            UNROLL
            for (int w = 0; w < W; w++) {
                const vi x = vi_load_i8(row + VL * w);
                if (T == B_Q4K) {   /* k, k + 1: one block of 32 */
                    const vf sc = vf_load(B->s + (size_t)(k / MHA_Q8_BLOCK) *
                                                     B->ld + j + VL * w);
                    lo[w] = vf_mul(vf_nibble_lo(x), sc);
                    hi[w] = vf_mul(vf_nibble_hi(x), sc);
                } else {   /* a scale per row and block */
                    const int blk = (j + VL * w) / MHA_Q8_BLOCK;
                    lo[w] = vf_nibble_lo_times(
                        x, B->s[(size_t)k * B->blocks + blk]);
                    hi[w] = vf_nibble_hi_times(
                        x, B->s[(size_t)(k + 1) * B->blocks + blk]);
                }
            }
            fma_rows(R, W, mode, A, lda, ska, k, lo, acc);
            fma_rows(R, W, mode, A, lda, ska, k + 1, hi, acc);
        }
    }
    KLOOP
    for (; k < k1; k++) {
        if (!masked)
            ahead(T, W, mode, B, k, j);
        if (b_first) {
            vf b[8];
            UNROLL
            for (int w = 0; w < W; w++)
                b[w] = ldb(T, B, k, j + VL * w, masked, t, n);
            fma_rows(R, W, mode, A, lda, ska, k, b, acc);
            continue;
        }
        vf a[6];
        vm nz[6];
        UNROLL
        for (int r = 0; r < R; r++) {
            a[r] = vf_set1(A[(size_t)r * lda + (size_t)k * ska]);
            if (mode & EXACT)
                nz[r] = vf_cmp_nz(a[r]);
        }
        UNROLL
        for (int w = 0; w < W; w++) {
            const vf b = ldb(T, B, k, j + VL * w, masked, t, n);
            UNROLL
            for (int r = 0; r < R; r++)
                acc[r][w] = mode & EXACT
                                ? vf_fma_where(nz[r], a[r], b, acc[r][w])
                                : vf_fma(a[r], b, acc[r][w]);
        }
    }

    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int w = 0; w < W; w++) {
            float *c = C + (size_t)r * ldc + VL * w;
            if (masked)
                vf_store_t(c,
                           mode & ADD ? vf_add(vf_load_t(c, t), acc[r][w])
                                      : acc[r][w],
                           t);
            else
                vf_store(c, mode & ADD ? vf_add(vf_load(c), acc[r][w])
                                       : acc[r][w]);
        }
}

/* R rows against columns j0 <= j < N over k0 <= k < k1: the wide blocks
 * of one or two rows, then blocks of TIER_WM vectors, of fewer, a masked
 * tail. */
MK_INLINE void cols(const int R, const int mode, const int T, int j0, int N,
                    int k0, int k1, const float *A, int lda, int ska,
                    const bsrc *B, float *C, int ldc)
{
    const vtail full = vt_make(VL);
    const int wide = !(mode & EXACT) || TIER_WIDE_EXACT;
    int j = j0;
#define TILE(W, masked, t, n)                                               \
    tile(R, W, masked, mode, T, k0, k1, A, lda, ska, B, j, C + j, ldc, t, n)
    if (R == 1 && wide)
        for (; j + TIER_W1 * VL <= N; j += TIER_W1 * VL)
            TILE(TIER_W1, 0, full, VL);
    if (R <= 2 && wide)
        for (; j + TIER_W2 * VL <= N; j += TIER_W2 * VL)
            TILE(TIER_W2, 0, full, VL);
    for (; j + TIER_WM * VL <= N; j += TIER_WM * VL)
        TILE(TIER_WM, 0, full, VL);
    if (TIER_WM > 2 && j + 2 * VL <= N) {
        TILE(2, 0, full, VL);
        j += 2 * VL;
    }
    if (TIER_WM > 1 && j + VL <= N) {
        TILE(1, 0, full, VL);
        j += VL;
    }
    if (j < N)
        TILE(1, 1, vt_make(N - j), N - j);
#undef TILE
}

/* Rows of B per slab when a panel walks K in slabs (below). */
enum { KSLAB = 8 };

/*
 * R rows against all N columns.  Each block of columns walks all of K, so
 * B is read in strips down its columns: fine when B is in cache (many
 * row blocks reuse it), but a decoding step reads each B (a KV cache's
 * tile) once, from memory, where strips far apart defeat the hardware's
 * streaming.  With TIER_SLABS, a panel of 1 to RMAX rows that is the only
 * one (`slabs`: a decoding step's row, or a grouped-query decode's
 * stacked heads) walks K in slabs of KSLAB rows instead, every block of
 * columns through one slab (a few KB, contiguous, read from memory once
 * and then from L1) before the next, the partial sums kept in C between
 * slabs.  An element's chain is the same chain, stored and reloaded
 * exactly: the same bits.  (SET and ACC only: ADD must form the whole sum
 * before adding it to C; the _exact forms, for the rare tile holding NaN
 * or Inf, are left out, which keeps the instantiations, and the compile
 * time of the sanitizer builds, down.  One row against at most 64 columns,
 * and stacked rows whose columns fit one block (a key tile under a
 * grouped-query decode's heads on AVX-512), read each row of B whole
 * already: slabs would only cost them the reloads of C.  (One row against
 * a 128-wide value tile is one block on AVX-512 too, but there the slabs'
 * prefetch kept 8-bit caches 2-3% faster.)  docs/BENCHMARKS.md has the
 * measurements.)
 */
MK_INLINE void panel(const int R, const int mode, const int T, int slabs,
                     int N, int K, const float *A, int lda, int ska,
                     const bsrc *B, float *C, int ldc)
{
    /* (stacked rows whose columns fit one block read each row of B
     * whole anyway; one row keeps its measured rule) */
    const int one_block =
        R == 1 ? N <= 64 : N <= VL * (R == 2 ? TIER_W2 : TIER_WM);
    if (!TIER_SLABS || !slabs || one_block || (mode & ADD) ||
        (mode & EXACT) || K <= KSLAB) {
        cols(R, mode, T, 0, N, 0, K, A, lda, ska, B, C, ldc);
        return;
    }
    const size_t row = (size_t)B->ld * (T == B_F32 ? 4 : T <= B_BF16 ? 2 : 1);
    const char *base = (const char *)B->x;
    /* The next slab is prefetched, in address order, while this one is
     * worked on; but not one row's 16-bit value slab (the value side is
     * the accumulating one, FROM_C): worked on in about as long as memory
     * takes to deliver it, and the burst of prefetches in front of it held
     * up its own loads (slower: docs/BENCHMARKS.md); and 16-bit slabs only
     * where mha_slab_prefetch says (kernels.h). */
    const int half = T == B_F16 || T == B_BF16;
    const int prefetch = (!half || mha_slab_prefetch()) &&
                         !(R == 1 && (mode & FROM_C) && half);
    for (int k0 = 0; k0 < K; k0 += KSLAB) {
        if (prefetch)
            for (size_t at = (size_t)(k0 + KSLAB) * row;
                 at < (size_t)(k0 + 2 * KSLAB) * row; at += 64)
                __builtin_prefetch(base + at, 0, 3);
        cols(R, k0 ? mode | FROM_C : mode, T, 0, N, k0,
             k0 + KSLAB < K ? k0 + KSLAB : K, A, lda, ska, B, C, ldc);
    }
}

/* All M rows against columns j0 <= j < j1 over k0 <= k < k1: blocks of
 * RMAX rows, then one block of the remainder. */
MK_INLINE void rows(const int RMAX, const int mode, const int T, int M,
                    int j0, int j1, int k0, int k1, const float *A, int lda,
                    int ska, const bsrc *B, float *C, int ldc)
{
    int i = 0;
    for (; i + RMAX <= M; i += RMAX)
        cols(RMAX, mode, T, j0, j1, k0, k1, A + (size_t)i * lda, lda, ska, B,
             C + (size_t)i * ldc, ldc);
    const float *Ai = A + (size_t)i * lda;
    float *Ci = C + (size_t)i * ldc;
#define REST(R) cols(R, mode, T, j0, j1, k0, k1, Ai, lda, ska, B, Ci, ldc)
    switch (M - i) {
    case 5: if (RMAX > 5) REST(5); break;
    case 4: if (RMAX > 4) REST(4); break;
    case 3: REST(3); break;
    case 2: REST(2); break;
    case 1: REST(1); break;
    default: break;
    }
#undef REST
}

/* Where B is larger than GEMM_BIG floats (MLA's 512-wide values), every
 * row block passes over one strip of GEMM_NB columns (B's rows of it in
 * L1) before the next: each row block walking all of B read it from L2
 * again and again, 5% slower (docs/BENCHMARKS.md).  (Blocks of K as well
 * were tried: no gain.) */
enum { GEMM_NB = 64, GEMM_BIG = 8192 };

/* All M rows.  A single block (M <= RMAX: decoding) may walk K in slabs;
 * several blocks against a large B, strips of columns.  An element's
 * chain is the same chain either way: the same bits. */
MK_INLINE void gemm(const int RMAX, const int mode, const int T, int M, int N,
                    int K, const float *A, int lda, int ska, const bsrc *B,
                    float *C, int ldc)
{
    if (M > RMAX) {
        const int nb = (int64_t)K * N > GEMM_BIG ? GEMM_NB : N;
        for (int j0 = 0; j0 < N; j0 += nb)
            rows(RMAX, mode, T, M, j0, N - j0 < nb ? N : j0 + nb, 0, K, A,
                 lda, ska, B, C, ldc);
        return;
    }
    /* Four stacked rows accumulating against a value tile that two rows
     * take in one block (AVX-512: 65..128 columns) run as two pairs, each
     * reading the tile's rows whole, once from memory and once from
     * cache, where four rows would cross it in two column blocks by
     * slabs; for elements a load or one conversion makes floats (8-bit
     * codes cost their conversion twice: slower).  docs/KERNELS.md. */
    if (M == 4 && (mode & ~NEXT) == MODE_ACC && T <= B_BF16 &&
        N > VL * TIER_WM && N <= VL * TIER_W2) {
        panel(2, mode, T, 1, N, K, A, lda, ska, B, C, ldc);
        panel(2, mode, T, 1, N, K, A + 2 * (size_t)lda, lda, ska, B,
              C + 2 * (size_t)ldc, ldc);
        return;
    }
    switch (M) {
    case 6: if (RMAX > 5) panel(6, mode, T, 1, N, K, A, lda, ska, B, C, ldc); break;
    case 5: if (RMAX > 4) panel(5, mode, T, 1, N, K, A, lda, ska, B, C, ldc); break;
    case 4: if (RMAX > 3) panel(4, mode, T, 1, N, K, A, lda, ska, B, C, ldc); break;
    case 3: panel(3, mode, T, 1, N, K, A, lda, ska, B, C, ldc); break;
    case 2: panel(2, mode, T, 1, N, K, A, lda, ska, B, C, ldc); break;
    case 1: panel(1, mode, T, 1, N, K, A, lda, ska, B, C, ldc); break;
    default: break;
    }
}

/* The rows of a block for a mode. */
#define RMAX_OF(mode) ((mode) & EXACT ? TIER_RMAX_EXACT : TIER_RMAX)

/* Each storage type and mode a product uses, a function of its own,
 * called by name (GEMM): inlined into their callers' switches, one
 * function held several instantiations and GCC took twice as long over
 * the tier's file (minutes under the sanitizers; docs/TESTING.md).  B by
 * value: a local copy GCC keeps in registers, where through a pointer
 * every store to C reloaded its fields (9% more instructions in a q8
 * value tile's product). */
enum { MODE_SET_NEXT = MODE_SET | NEXT, MODE_ACC_NEXT = MODE_ACC | NEXT };
#define GEMM_FN(T, mode)                                                    \
    static __attribute__((noinline)) void gemm_##T##_##mode(                \
        int M, int N, int K, const float *A, int lda, int ska, bsrc B,      \
        float *C, int ldc)                                                  \
    {                                                                       \
        gemm(RMAX_OF(mode), mode, T, M, N, K, A, lda, ska, &B, C, ldc);     \
    }
GEMM_FN(B_F32, MODE_SET)        GEMM_FN(B_F32, MODE_ACC)
GEMM_FN(B_F32, MODE_ACC_EXACT)  GEMM_FN(B_F32, MODE_ADD)
GEMM_FN(B_F32, MODE_ADD_EXACT)
GEMM_FN(B_F32, MODE_SET_NEXT)   GEMM_FN(B_F32, MODE_ACC_NEXT)
GEMM_FN(B_F16, MODE_SET)        GEMM_FN(B_F16, MODE_SET_NEXT)
GEMM_FN(B_F16, MODE_ACC)        GEMM_FN(B_F16, MODE_ACC_NEXT)
GEMM_FN(B_F16, MODE_ACC_EXACT)
GEMM_FN(B_BF16, MODE_SET)       GEMM_FN(B_BF16, MODE_SET_NEXT)
GEMM_FN(B_BF16, MODE_ACC)       GEMM_FN(B_BF16, MODE_ACC_NEXT)
GEMM_FN(B_BF16, MODE_ACC_EXACT)
GEMM_FN(B_Q8K, MODE_SET)        GEMM_FN(B_Q8V, MODE_ACC)
GEMM_FN(B_Q8K, MODE_SET_NEXT)   GEMM_FN(B_Q8V, MODE_ACC_NEXT)
GEMM_FN(B_Q8V, MODE_ACC_EXACT)
GEMM_FN(B_Q4K, MODE_SET)        GEMM_FN(B_Q4V, MODE_ACC)
GEMM_FN(B_Q4K, MODE_SET_NEXT)   GEMM_FN(B_Q4V, MODE_ACC_NEXT)
GEMM_FN(B_Q4V, MODE_ACC_EXACT)
#undef GEMM_FN
#define GEMM(T, mode, M, N, K, A, lda, ska, B, C, ldc)                      \
    gemm_##T##_##mode(M, N, K, A, lda, ska, *(B), C, ldc)

/* A float B of ld columns. */
MK_INLINE bsrc f32(const float *x, int ld)
{
    const bsrc b = {x, NULL, ld, 0, NULL};
    return b;
}

/* The products over float tiles (kernels.h).  pvt reads p down its
 * columns (A's row stride 1, k stride ldp). */
#define PRODUCT(name, mode, M, N, K, A, lda, ska, Bx, ldb_)                 \
    static void name(int mr, int nc, int dh, const float *a_, int lda_,     \
                     const float *b_, float *c_, int ldc_)                  \
    {                                                                       \
        const bsrc B = f32(Bx, ldb_);                                       \
        GEMM(B_F32, mode, M, N, K, A, lda, ska, &B, c_, ldc_);              \
    }
static void qk_k(int mr, int nc, int dh, const float *q, const float *kt,
                 int ldkt, float *s, int lds)
{
    const bsrc B = f32(kt, ldkt);
    GEMM(B_F32, MODE_SET, mr, nc, dh, q, dh, 1, &B, s, lds);
}
PRODUCT(pv_k, MODE_ACC, mr, dh, nc, a_, lda_, 1, b_, dh)
PRODUCT(pv_exact_k, MODE_ACC_EXACT, mr, dh, nc, a_, lda_, 1, b_, dh)
PRODUCT(pv_add_k, MODE_ADD, mr, dh, nc, a_, lda_, 1, b_, dh)
PRODUCT(pv_add_exact_k, MODE_ADD_EXACT, mr, dh, nc, a_, lda_, 1, b_, dh)
PRODUCT(pvt_k, MODE_ADD, nc, dh, mr, a_, 1, lda_, b_, dh)
PRODUCT(pvt_exact_k, MODE_ADD_EXACT, nc, dh, mr, a_, 1, lda_, b_, dh)
#undef PRODUCT

/* pv on values read where they are (kernels.h); qk_rows_k is below,
 * after the transposition it uses. */
static void pv_rows_k(int exact, int mr, int nc, int dh, const float *p,
                      int ldp, const float *v, int ldv, float *o, int ldo)
{
    const bsrc B = f32(v, ldv);
    if (exact)
        GEMM(B_F32, MODE_ACC_EXACT, mr, dh, nc, p, ldp, 1, &B, o, ldo);
    else
        GEMM(B_F32, MODE_ACC, mr, dh, nc, p, ldp, 1, &B, o, ldo);
}

/* qk and pv on a KV cache's tiles (kernels.h): the same blocking, B
 * converted as it is loaded. */
static void qk_kv_k(mha_kv_dtype dtype, int mr, int nc, int dh,
                    const float *q, const void *kt, int cols,
                    const void *next, float *s, int lds)
{
    const bsrc B = {kt, mha_q8_scales(kt, cols, dh), cols, 0, next};
#define QK_KV_AS(T, mode) GEMM(T, mode, mr, nc, dh, q, dh, 1, &B, s, lds)
#define QK_KV(T) (next ? QK_KV_AS(T, MODE_SET_NEXT) : QK_KV_AS(T, MODE_SET))
    switch (dtype) {
    case MHA_KV_F16: QK_KV(B_F16); break;
    case MHA_KV_BF16: QK_KV(B_BF16); break;
    case MHA_KV_Q8: QK_KV(B_Q8K); break;
    case MHA_KV_Q4: QK_KV(B_Q4K); break;
    default: QK_KV(B_F32);
    }
#undef QK_KV
#undef QK_KV_AS
}

static void pv_kv_k(mha_kv_dtype dtype, int exact, int mr, int nc, int dh,
                    const float *p, int ldp, const void *v, int cols,
                    const void *next, float *o, int ldo)
{
    const bsrc B = {v, mha_q8_scales(v, cols, dh), dh,
                    (int)mha_q8_blocks(dh), next};
#define PV_KV_AS(T, mode) GEMM(T, mode, mr, dh, nc, p, ldp, 1, &B, o, ldo)
    /* (the next tile's prefetch on the fast form only: the exact one is
     * for the rare tile holding NaN or Inf) */
#define PV_KV(T)                                                                (exact  ? PV_KV_AS(T, MODE_ACC_EXACT)                                        : next ? PV_KV_AS(T, MODE_ACC_NEXT)                                                : PV_KV_AS(T, MODE_ACC))
    switch (dtype) {
    case MHA_KV_F16: PV_KV(B_F16); break;
    case MHA_KV_BF16: PV_KV(B_BF16); break;
    case MHA_KV_Q8: PV_KV(B_Q8V); break;
    case MHA_KV_Q4: PV_KV(B_Q4V); break;
    default: PV_KV(B_F32);
    }
#undef PV_KV
#undef PV_KV_AS
}

/* Rows of keys widened and transposed (kernels.h): VL x VL blocks, each
 * row's VL elements converted as loaded (exact), the block transposed in
 * registers; the dims past the last whole block, and keys past the last
 * whole block, element by element.  One instance per dtype: with the
 * dtype a variable in the loop, GCC kept the row addresses on the stack. */
/* VL elements of dtype T at `at`, as floats. */
MK_INLINE vf vf_load_as(const mha_kv_dtype T, const char *at)
{
    return T == MHA_KV_F16    ? vf_load_f16((const uint16_t *)at)
           : T == MHA_KV_BF16 ? vf_load_bf16((const uint16_t *)at)
                              : vf_load((const float *)at);
}

MK_INLINE void widen_t_as(const mha_kv_dtype T, const void *x, int64_t ldx,
                          int n, int dh, float *kt, int ldkt, float *v,
                          int dv, const int pad)
{
    const size_t es = T == MHA_KV_F32 ? 4 : 2, step = (size_t)ldx * es;
    if (!kt) {   /* rows only, converted in order */
        for (int c = 0; c < n; c++) {
            const char *row = (const char *)x + (size_t)c * step;
            float *vr = v + (size_t)c * dv;
            int d = 0;
            for (; d + VL <= dv; d += VL)
                vf_store(vr + d, vf_load_as(T, row + (size_t)d * es));
            for (; d < dv; d++)
                vr[d] = mha_kv_elem(T, row, d);
        }
        return;
    }
    /* pad (kt's columns past n up to a whole block are the caller's
     * scratch, v NULL): the keys' last partial block too, its missing
     * rows zero vectors (never read), whole columns stored */
    const int nv = pad ? (n + VL - 1) / VL * VL : n - n % VL,
              dvec = dh - dh % VL;
    for (int c0 = 0; c0 < nv; c0 += VL) {
        const char *row = (const char *)x + (size_t)c0 * step;
        const int live = n - c0 < VL ? n - c0 : VL;
        if (pad && c0 + VL < n)   /* the next block's rows, asked for now */
            for (int i = 0; i < VL && c0 + VL + i < n; i++)
                for (size_t at = 0; at < (size_t)dh * es; at += 64)
                    __builtin_prefetch(row + (VL + i) * step + at, 0, 3);
        for (int d0 = 0; d0 < dvec; d0 += VL) {
            vf r[VL];
            const char *at = row + (size_t)d0 * es;
            if (live == VL)   /* (a branch-free block: the usual case) */
                for (int i = 0; i < VL; i++, at += step)
                    r[i] = vf_load_as(T, at);
            else
                for (int i = 0; i < VL; i++, at += step)
                    r[i] = i < live ? vf_load_as(T, at) : vf_zero();
            if (v && d0 < dv) {
                const vtail t = vt_make(dv - d0 < VL ? dv - d0 : VL);
                float *vr = v + (size_t)c0 * dv + d0;
                for (int i = 0; i < VL; i++, vr += dv)
                    vf_store_t(vr, r[i], t);
            }
            vf_transpose(r);
            float *kr = kt + (size_t)d0 * ldkt + c0;
            for (int i = 0; i < VL; i++, kr += ldkt)
                vf_store(kr, r[i]);
        }
    }
    for (int c = 0; c < n; c++)
        for (int d = c < nv ? dvec : 0; d < dh; d++) {   /* the tails */
            const float e = mha_kv_elem(T, x, (int64_t)c * ldx + d);
            kt[(size_t)d * ldkt + c] = e;
            if (v && d < dv)
                v[(size_t)c * dv + d] = e;
        }
}

/* Rows of a q8 or q4 tile in the value layout (n rows of dh codes, the
 * scales before them, kernels.h), each code times its block's scale:
 * the first dv floats of each row, the bits of mha_v_load's. */
MK_INLINE void widen_rows_q(const int T, const void *x, int n, int dh,
                            float *v, int dv)
{
    const bsrc b = {x, mha_q8_scales(x, n, dh), dh, (int)mha_q8_blocks(dh),
                    NULL};
    const vtail all = vt_make(VL);
    for (int c = 0; c < n; c++) {
        float *vr = v + (size_t)c * dv;
        int d = 0;
        for (; d + VL <= dv; d += VL)
            vf_store(vr + d, ldb(T, &b, c, d, 0, all, VL));
        for (; d < dv; d++)
            vr[d] = bsrc_elem(T, &b, c, d);
    }
}

static void widen_t_k(mha_kv_dtype dtype, const void *x, int64_t ldx, int n,
                      int dh, float *kt, int ldkt, float *v, int dv)
{
    if (dtype == MHA_KV_Q8 || dtype == MHA_KV_Q4)   /* (kt NULL) */
        widen_rows_q(dtype == MHA_KV_Q8 ? B_Q8V : B_Q4V, x, n, dh, v, dv);
    else if (dtype == MHA_KV_F16)
        widen_t_as(MHA_KV_F16, x, ldx, n, dh, kt, ldkt, v, dv, 0);
    else if (dtype == MHA_KV_BF16)
        widen_t_as(MHA_KV_BF16, x, ldx, n, dh, kt, ldkt, v, dv, 0);
    else
        widen_t_as(MHA_KV_F32, x, ldx, n, dh, kt, ldkt, v, dv, 0);
}

/* qk on keys where they lie (kernels.h): the keys in blocks of QK_COLS
 * keys and slabs of QK_SLAB elements, each slab transposed into a packed
 * block on the stack (VL x VL transposes in registers, where gathering
 * each column cost half of a short decoding call) and its product
 * carried into s, stored and reloaded exactly: the chains of qk on the
 * whole packed tile, the same bits. */
enum { QK_SLAB = 64, QK_COLS = 64 };
static void qk_rows_k(int mr, int nc, int dh, const float *q, const float *k,
                      int ldk, float *s, int lds)
{
    float kt[QK_SLAB * QK_COLS] __attribute__((aligned(64)));
    const bsrc B = f32(kt, QK_COLS);
    for (int j0 = 0; j0 < nc; j0 += QK_COLS) {
        const int n = nc - j0 < QK_COLS ? nc - j0 : QK_COLS;
        for (int d0 = 0; d0 < dh; d0 += QK_SLAB) {
            const int w = dh - d0 < QK_SLAB ? dh - d0 : QK_SLAB;
            widen_t_as(MHA_KV_F32, k + (size_t)j0 * ldk + d0, ldk, n, w, kt,
                       QK_COLS, NULL, 0, 1);
            if (d0)
                GEMM(B_F32, MODE_ACC, mr, n, w, q + d0, dh, 1, &B, s + j0, lds);
            else
                GEMM(B_F32, MODE_SET, mr, n, w, q + d0, dh, 1, &B, s + j0, lds);
        }
    }
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
 * neighbours, nor on the tier.  -inf -> 0, NaN -> NaN, 0 -> exactly 1.
 */
MK_INLINE vf exp_poly(vf x, vf *t)
{
    const vf magic = vf_set1(0x1.8p23f);
    *t = vf_fma(x, vf_set1(1.44269504088896341f), magic);
    const vf n = vf_sub(*t, magic);
    vf f = vf_fnma(n, vf_set1(0.693147182464599609375f), x);
    f = vf_fnma(n, vf_set1(-1.904654299957768e-09f), f);

    vf P = vf_set1(1.9875691500e-4f);
    P = vf_fma(P, f, vf_set1(1.3981999507e-3f));
    P = vf_fma(P, f, vf_set1(8.3334519073e-3f));
    P = vf_fma(P, f, vf_set1(4.1665795894e-2f));
    P = vf_fma(P, f, vf_set1(1.6666665459e-1f));
    P = vf_fma(P, f, vf_set1(5.0000001201e-1f));
    return vf_add(vf_fma(P, vf_mul(f, f), f), vf_set1(1.0f));
}

/* The general path (a rare branch, inlined: a call cost exp_sum a stack
 * frame and the spills around it). */
MK_INLINE vf exp_general(vf x)
{
    /* The smallest float whose exp is >= FLT_MIN: -0x1.5d589ep+6 =
     * -87.33654022 (ln FLT_MIN = -87.33654475 lies between it and the next
     * float down, whose exp is already denormal). */
    const vf flush = vf_set1(-0x1.5d589ep+6f);
    const vf xc = vf_clamp(x, flush, vf_set1(89.0f));   /* NaN stays NaN */
    const vm below = vf_cmp_lt(x, flush);
    vf t;
    const vf y = exp_poly(xc, &t);

    /* n is an integer in [-126, 129] (garbage for NaN: y is NaN then). */
    const vi ni = vi_sub(vf_as_vi(t), vi_set1(0x4B400000));
    const vi n1 = vi_sra(ni, 1);
    const vi n2 = vi_sub(ni, n1);
    const vf s1 = vi_as_vf(vi_sll(vi_add(n1, vi_set1(127)), 23));
    const vf s2 = vi_as_vf(vi_sll(vi_add(n2, vi_set1(127)), 23));
    return vf_select(below, vf_zero(), vf_mul(vf_mul(y, s1), s2));
}

/* Whether every lane of x takes the fast path (NaN compares false). */
MK_INLINE int vexp_fast_ok(vf x)
{
    return vm_all(vf_cmp_le(vf_abs(x), vf_set1(86.0f)));
}

/* The fast path: |x| <= 86 in every lane. */
MK_INLINE vf vexp_fast(vf x)
{
    vf t;
    const vf y = exp_poly(x, &t);
    return vi_as_vf(vi_add(vf_as_vi(y), vi_sll(vf_as_vi(t), 23)));
}

MK_INLINE vf vexp(vf x)
{
    if (__builtin_expect(!vexp_fast_ok(x), 0))
        return exp_general(x);
    return vexp_fast(x);
}

/* ---- tanh -----------------------------------------------------------------
 *
 * tanh|x| = (1 - e) / (1 + e), e = exp(-2|x|), for |x| >= 0.25; below, the
 * Taylor series x (1 + x^2 P(x^2)) to x^11, whose first omitted term is
 * < 1.3e-11 |x| there (the quotient would lose bits to 1 - e).  The sign
 * of x is put back last.  +-Inf -> +-1, NaN -> NaN.
 */
MK_INLINE vf vtanh(vf x)
{
    const vf a = vf_abs(x), one = vf_set1(1.0f);
    const vf e = vexp(vf_mul(a, vf_set1(-2.0f)));
    const vf big = vf_div(vf_sub(one, e), vf_add(one, e));
    const vf a2 = vf_mul(a, a);
    vf P = vf_set1(-1382.0f / 155925.0f);
    P = vf_fma(P, a2, vf_set1(62.0f / 2835.0f));
    P = vf_fma(P, a2, vf_set1(-17.0f / 315.0f));
    P = vf_fma(P, a2, vf_set1(2.0f / 15.0f));
    P = vf_fma(P, a2, vf_set1(-1.0f / 3.0f));
    const vf small = vf_fma(vf_mul(P, a2), a, a);
    return vf_or_sign(vf_select(vf_cmp_lt(a, vf_set1(0.25f)), small, big), x);
}

static void softcap_k(float *x, int n, float c, float *dcap)
{
    const vf cv = vf_set1(c), inv = vf_set1(1.0f / c), one = vf_set1(1.0f);
    for (int k = 0; k < n; k += VL) {
        const int w = n - k < VL ? n - k : VL;
        const vtail t = vt_make(w);
        const vf th = vtanh(vf_mul(vf_load_t(x + k, t), inv));
        vf_store_t(x + k, vf_mul(cv, th), t);
        if (dcap)
            vf_store_t(dcap + k, vf_fnma(th, th, one), t);
    }
}

/* VL lanes of sums, the tail's lanes added as zeros where n ends, then
 * vf_hsum: an order fixed by n. */
static float exp_sum_k(float *x, int n, float m)
{
    const vf mv = vf_set1(m);
    vf acc = vf_zero();
    int c = 0;
    for (; c + VL <= n; c += VL) {
        const vf e = vexp(vf_sub(vf_load(x + c), mv));
        vf_store(x + c, e);
        acc = vf_add(acc, e);
    }
    if (c < n) {   /* the tail's lanes only: no read or write past n */
        const vtail t = vt_make(n - c);
        const vf e = vexp(vf_sub(vf_load_t(x + c, t), mv));
        vf_store_t(x + c, e, t);
        acc = vf_add(acc, vf_keep_t(e, t));
    }
    return vf_hsum(acc);
}

static void scale_k(float *dst, const float *src, int n, float a)
{
    const vf av = vf_set1(a);
    int c = 0;
    for (; c + 2 * VL <= n; c += 2 * VL) {
        vf_store(dst + c, vf_mul(vf_load(src + c), av));
        vf_store(dst + c + VL, vf_mul(vf_load(src + c + VL), av));
    }
    for (; c < n; c += VL) {
        const vtail t = vt_make(n - c < VL ? n - c : VL);
        vf_store_t(dst + c, vf_mul(vf_load_t(src + c, t), av), t);
    }
}

/* Finite: |x| <= FLT_MAX (NaN compares false), lane by lane. */
static int copy_finite_k(float *dst, const float *src, int n)
{
    const vf big = vf_set1(FLT_MAX);
    int finite = 1, c = 0;
    for (; c + VL <= n; c += VL) {   /* (whole vectors unmasked) */
        const vf x = vf_load(src + c);
        vf_store(dst + c, x);
        finite &= vm_all(vf_cmp_le(vf_abs(x), big));
    }
    if (c < n) {
        const vtail t = vt_make(n - c);
        const vf x = vf_load_t(src + c, t);   /* (lanes past n: 0, finite) */
        vf_store_t(dst + c, x, t);
        finite &= vm_all(vf_cmp_le(vf_abs(x), big));
    }
    return finite;
}

/* |x| where finite, else 0 (NaN compares false), folded into m; the
 * lanes' all-finite test into *fin. */
MK_INLINE vf amax_step(vf x, vf m, int *fin)
{
    const vf a = vf_abs(x);
    const vm ok = vf_cmp_le(a, vf_set1(FLT_MAX));
    *fin &= vm_all(ok);
    return vf_max_ign(vf_select(ok, a, vf_zero()), m);
}

/* First the fast pass: the integer max of the bits of |x| (one load, an
 * and, a max a vector; four chains), which on finite data is the bits of
 * the largest |x| itself, Inf and NaN patterns being the largest.  Only
 * when it meets one does the careful pass run: |x| where finite, else 0,
 * two vectors at a time (lanes past a row's tail read as 0, finite); no
 * NaN ever enters m, so its lanes' max is exact. */
static float amax_k(const float *x, int64_t rows, int64_t cols, int64_t ld,
                    int *finite)
{
    vi a0 = vf_as_vi(vf_zero()), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ld;
        int64_t c = 0;
        for (; c + 4 * VL <= cols; c += 4 * VL) {
            a0 = vi_max(a0, vf_as_vi(vf_abs(vf_load(xr + c))));
            a1 = vi_max(a1, vf_as_vi(vf_abs(vf_load(xr + c + VL))));
            a2 = vi_max(a2, vf_as_vi(vf_abs(vf_load(xr + c + 2 * VL))));
            a3 = vi_max(a3, vf_as_vi(vf_abs(vf_load(xr + c + 3 * VL))));
        }
        for (; c < cols; c += VL) {
            const vtail t = vt_make(cols - c < VL ? (int)(cols - c) : VL);
            a0 = vi_max(a0, vf_as_vi(vf_abs(vf_load_t(xr + c, t))));
        }
    }
    const vf all = vi_as_vf(vi_max(vi_max(a0, a1), vi_max(a2, a3)));
    if (vm_all(vf_cmp_le(all, vf_set1(FLT_MAX)))) {   /* (NaN: false) */
        *finite = 1;
        return vf_hmax(all);
    }
    vf m0 = vf_zero(), m1 = vf_zero();
    int fin = 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ld;
        int64_t c = 0;
        for (; c + 2 * VL <= cols; c += 2 * VL) {
            m0 = amax_step(vf_load(xr + c), m0, &fin);
            m1 = amax_step(vf_load(xr + c + VL), m1, &fin);
        }
        for (; c < cols; c += VL) {
            const vtail t = vt_make(cols - c < VL ? (int)(cols - c) : VL);
            m0 = amax_step(vf_load_t(xr + c, t), m0, &fin);
        }
    }
    *finite = fin;
    return vf_hmax(vf_max_ign(m0, m1));
}

/* vf_max_ign(x, m) keeps m where x is NaN: NaN is ignored, as the
 * contract asks; so does the tail's comparison.  A max is exact, so the
 * order of the lanes is free. */
static float max_k(const float *x, int n)
{
    vf m = vf_set1(-INFINITY);
    int c = 0;
    for (; c + VL <= n; c += VL)
        m = vf_max_ign(vf_load(x + c), m);
    float r = vf_hmax(m);
    for (; c < n; c++)
        if (x[c] > r)
            r = x[c];
    return r;
}

/* The online softmax's step (kernels.h), VL rows at a time: the rows'
 * maxima as vectors, folded to one lane each together (vf_hmax_rows,
 * then the tail's scalars, NaN ignored as in max_k); each row's new max,
 * alpha = exp(m - mn) (exp(0) is exactly 1), l and m on the vector of
 * rows; each row's exponentials summed in a vector as exp_sum_k does, and
 * the VL sums folded together (vf_hsum_rows: vf_hsum's order, so the
 * bits of exp_sum_k).  Row by row, each row's fold was a chain of
 * dependent shuffles and adds, and whether its max moved a branch that
 * random scores mispredict: half of the step's time on Zen 5. */
MK_INLINE vf load_rows(const float *x, int nr, vtail t)
{
    return nr == VL ? vf_load(x) : vf_load_t(x, t);   /* (lanes past: 0) */
}
MK_INLINE void store_rows(float *x, vf v, int nr, vtail t)
{
    if (nr == VL)   /* (a masked store cost Zen 5 more than a plain one) */
        vf_store(x, v);
    else
        vf_store_t(x, v, t);
}

static void softmax_rows_k(int mr, int nc, float *s, int lds, float *m,
                           float *l, float *alpha)
{
    const int nv = nc / VL * VL;   /* whole vectors; then the tail */
    const vf ninf = vf_set1(-INFINITY);
    for (int r0 = 0; r0 < mr; r0 += VL) {
        const int nr = mr - r0 < VL ? mr - r0 : VL;
        const vtail t = vt_make(nr);
        float *const s0 = s + (size_t)r0 * lds;
        vf v[VL];
        for (int r = 0; r < VL; r++) {
            vf x = ninf;
            for (int c = 0; r < nr && c < nv; c += VL)
                x = vf_max_ign(vf_load(s0 + (size_t)r * lds + c), x);
            v[r] = x;
        }
        vf mt = vf_hmax_rows(v);
        if (nv < nc) {
            float b[VL];
            vf_store(b, mt);
            for (int r = 0; r < nr; r++)
                for (int c = nv; c < nc; c++)
                    if (s0[(size_t)r * lds + c] > b[r])
                        b[r] = s0[(size_t)r * lds + c];
            mt = vf_load(b);
        }
        /* mn = mt > m ? mt : m (a NaN m stays); d = 0 where it held */
        const vf mo = load_rows(m + r0, nr, t);
        const vf mn = vf_select(vf_cmp_lt(mo, mt), mt, mo);
        const vf al = vexp(vf_select(vf_cmp_eq(mn, mo), vf_zero(),
                                     vf_sub(mo, mn)));
        float mnr[VL];
        vf_store(mnr, mn);
        for (int r = 0; r < VL; r++) {
            vf acc = vf_zero();
            if (r < nr && mnr[r] != -INFINITY) {
                float *x = s0 + (size_t)r * lds;
                const vf mv = vf_set1(mnr[r]);
                int c = 0;
                /* four vectors, one test of their range, four
                 * independent polynomials the compiler interleaves (one
                 * at a time, each waited on its own chain); the sum in
                 * order of c */
                for (; c + 4 * VL <= nv; c += 4 * VL) {
                    vf e[4];
                    UNROLL
                    for (int u = 0; u < 4; u++)
                        e[u] = vf_sub(vf_load(x + c + u * VL), mv);
                    if (__builtin_expect(vexp_fast_ok(e[0]) &
                                             vexp_fast_ok(e[1]) &
                                             vexp_fast_ok(e[2]) &
                                             vexp_fast_ok(e[3]),
                                         1)) {
                        UNROLL
                        for (int u = 0; u < 4; u++)
                            e[u] = vexp_fast(e[u]);
                    } else {
                        UNROLL
                        for (int u = 0; u < 4; u++)
                            e[u] = vexp(e[u]);
                    }
                    UNROLL
                    for (int u = 0; u < 4; u++) {
                        vf_store(x + c + u * VL, e[u]);
                        acc = vf_add(acc, e[u]);
                    }
                }
                for (; c < nv; c += VL) {
                    const vf e = vexp(vf_sub(vf_load(x + c), mv));
                    vf_store(x + c, e);
                    acc = vf_add(acc, e);
                }
                if (nv < nc) {   /* the tail's lanes only, as exp_sum_k */
                    const vtail tt = vt_make(nc - nv);
                    const vf e = vexp(vf_sub(vf_load_t(x + nv, tt), mv));
                    vf_store_t(x + nv, e, tt);
                    acc = vf_add(acc, vf_keep_t(e, tt));
                }
            }
            v[r] = acc;
        }
        /* rows with no live score yet (mn -inf): m, l as they were,
         * alpha -1 (the driver's); the others l alpha + sum, two
         * roundings */
        const vm none = vf_cmp_eq(mn, ninf);
        const vf lo = load_rows(l + r0, nr, t);
        const vf ln = vf_add(vf_mul(lo, al), vf_hsum_rows(v));
        store_rows(l + r0, vf_select(none, lo, ln), nr, t);
        store_rows(m + r0, vf_select(none, mo, mn), nr, t);
        store_rows(alpha + r0, vf_select(none, vf_set1(-1.0f), al), nr, t);
    }
}

/* dot_nonzero: VL products at a time, converted to float64 half by half
 * (each exact there: 24 x 24 bits), summed in two vectors (dot_step);
 * their lanes added by halving, then the tail in order (dot_fold).  A
 * lane whose p is zero adds p * 0 (its d zeroed first), never p * d. */
MK_INLINE void dot_step(vf p, vf d, vd *s0, vd *s1)
{
    const vf dv = vf_select(vf_cmp_nz(p), d, vf_zero());
    *s0 = vd_add(*s0, vd_mul(vd_lo(p), vd_lo(dv)));
    *s1 = vd_add(*s1, vd_mul(vd_hi(p), vd_hi(dv)));
}

MK_INLINE double dot_fold(vd s0, vd s1, const float *p, const float *d,
                          int c, int n)
{
    double l[VL / 2];
    vd_store(l, vd_add(s0, s1));
    for (int w = VL / 4; w >= 1; w /= 2)
        for (int i = 0; i < w; i++)
            l[i] += l[i + w];
    double s = l[0];
    for (; c < n; c++)
        if (p[c] != 0.0f)
            s += (double)p[c] * d[c];
    return s;
}

static double dot_nonzero_k(const float *p, const float *d, int n)
{
    vd s0 = vd_zero(), s1 = vd_zero();
    int c = 0;
    for (; c + VL <= n; c += VL)
        dot_step(vf_load(p + c), vf_load(d + c), &s0, &s1);
    return dot_fold(s0, s1, p, d, c, n);
}

/* exp_sum's exponentials (no sum), each times a as scale multiplies it,
 * and dot_nonzero's steps on them while they are in registers. */
MK_INLINE double probs_as(const int dot, float *x, int n, float m, float a,
                          const float *d)
{
    const vf mv = vf_set1(m), av = vf_set1(a);
    vd s0 = vd_zero(), s1 = vd_zero();
    int c = 0;
    for (; c + VL <= n; c += VL) {
        const vf p = vf_mul(vexp(vf_sub(vf_load(x + c), mv)), av);
        vf_store(x + c, p);
        if (dot)
            dot_step(p, vf_load(d + c), &s0, &s1);
    }
    if (c < n) {   /* the tail's lanes only */
        const vtail t = vt_make(n - c);
        vf_store_t(x + c, vf_mul(vexp(vf_sub(vf_load_t(x + c, t), mv)), av),
                   t);
    }
    return dot ? dot_fold(s0, s1, x, d, c, n) : 0.0;
}

static double probs_k(float *x, int n, float m, float a, const float *d)
{
    return d ? probs_as(1, x, n, m, a, d) : probs_as(0, x, n, m, a, NULL);
}

static void dscore_k(const float *p, const float *d, float delta, float *ds,
                     int n)
{
    const vf dl = vf_set1(delta);
    int c = 0;
    for (; c + VL <= n; c += VL) {
        const vf pv = vf_load(p + c);
        const vf v = vf_mul(pv, vf_sub(vf_load(d + c), dl));
        vf_store(ds + c, vf_select(vf_cmp_eq(pv, vf_zero()), vf_zero(), v));
    }
    for (; c < n; c++)
        ds[c] = p[c] == 0.0f ? 0.0f : p[c] * (d[c] - delta);
}

/* kernels.h.  f16 by the ISA's conversion, VL at a time (F16C's
 * vcvtps2ph, NEON's fcvtn: ties to even, NaN quieted with its payload's
 * top bits, as half.h's), then the tail in plain C; bf16 in plain C,
 * whose branch-free loop the compiler vectorises. */
static void narrow_k(int bf, const float *x, int n, const float *mult,
                     uint16_t *y)
{
    const float m = mult ? *mult : 1.0f;
    int i = 0;
    if (bf) {
        if (mult)
            for (; i < n; i++)
                y[i] = mha_bf16_from_float(x[i] * m);
        else
            for (; i < n; i++)
                y[i] = mha_bf16_from_float(x[i]);
        return;
    }
    const vf mv = vf_set1(m);
    for (; i + VL <= n; i += VL) {
        const vf v = vf_load(x + i);
        vf_store_f16(y + i, mult ? vf_mul(v, mv) : v);
    }
    for (; i < n; i++)
        y[i] = mha_f16_from_float(mult ? x[i] * m : x[i]);
}

const mha_microkernels TIER_TABLE = {
    TIER_NAME,   qk_k,      pv_k,       pv_exact_k,    pv_add_k,
    pv_add_exact_k,         pvt_k,      pvt_exact_k,   exp_sum_k,
    probs_k,     scale_k,     copy_finite_k,         max_k,         softmax_rows_k,
    softcap_k,
    qk_kv_k,     pv_kv_k,   dot_nonzero_k,             dscore_k,
    qk_rows_k,   pv_rows_k, widen_t_k,     amax_k,
    narrow_k,    TIER_LATENT_SLAB};
