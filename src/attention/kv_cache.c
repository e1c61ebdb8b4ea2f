/*
 * kv_cache.c -- the KV cache: per sequence, the keys and values of the
 * tokens seen so far, already projected, kept in the layout the kernels
 * read (keys transposed by tiles of MHA_BC, values in rows; attention.h)
 * and in the cache's dtype (f32, f16, bf16 or q8; kernels.h), so
 * decoding never repacks, converts or copies them:
 *
 *   k       [B][H_kv][tiles] kt tiles, kt[d][c], of tile_bytes each
 *           (q8: each tile's scales, then its codes; kernels.h)
 *   v       [B][H_kv][tiles] v tiles, v[c][d]
 *   finite  [B][H_kv][tiles] 1.0f if every value the tile holds is finite
 *
 * (A module's extra keys, bias_k and the zero key, are packed by each
 * run into its own workspace: a cache is only read by attention.)
 *
 * tiles = ceil(capacity / tw); key position p of sequence b is column
 * p % tw of tile p / tw, tw = MHA_BC (a paged cache's pages of 16 or 32
 * positions: tw = the page, so a kernel's tile is several of them).
 * Converting to the dtype happens once, when a token is appended (round to nearest even; q8 as kernels.h
 * defines it); reading converts back in registers.
 *
 * A sliding-window cache (window W) is a ring: position p goes to slot
 * p % capacity (column slot % tw of tile slot / tw), overwriting
 * position p - capacity, and start[b] remembers the oldest position the
 * ring still holds (truncation does not bring back what was
 * overwritten).  The attention reads the slots as they lie and masks
 * each by the position it holds (tiles.c).
 */
#define _DEFAULT_SOURCE   /* madvise, MADV_HUGEPAGE (Linux) */
#include "engine.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The widest head a rotated cache turns (store_turned's stack buffers). */
enum { MAX_TURNED = 4096 };

static const char *dtype_name(mha_kv_dtype t)
{
    return t == MHA_KV_F32 ? "f32" : t == MHA_KV_F16 ? "f16"
         : t == MHA_KV_BF16 ? "bf16" : t == MHA_KV_Q8 ? "q8" : "q4";
}

/*
 * Asks Linux to back the cache with transparent huge pages (2 MiB) where
 * it is allowed to (THP "madvise" mode, the common default): a decoding
 * step streams the whole cache, and 4 KiB pages cost a TLB miss every
 * 4 KiB of it.  Only the 2 MiB-aligned interior of the (untouched,
 * calloc'ed) block is advised; a refusal changes nothing but speed.
 */
static void advise_huge_pages(void *data, int64_t bytes)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    const uintptr_t lo = ((uintptr_t)data + huge - 1) & ~(huge - 1);
    const uintptr_t hi = ((uintptr_t)data + (uintptr_t)bytes) & ~(huge - 1);
    if (hi > lo)
        (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)data;
    (void)bytes;
#endif
}

static mha_status mha_kv_cache_create_impl(const mha_kv_cache_config *cfg,
                                           mha_kv_cache **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output cache is NULL");
    *out = NULL;
    if (!cfg)
        return mha_set_error(MHA_ERR_NULL_POINTER, "cache config is NULL");
    if (cfg->batch < 1 || cfg->num_kv_heads < 1 || cfg->head_dim < 1 ||
        cfg->capacity < 1)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cache batch, num_kv_heads, head_dim and "
                             "capacity must be >= 1, got %lld, %lld, %lld, "
                             "%lld", (long long)cfg->batch,
                             (long long)cfg->num_kv_heads,
                             (long long)cfg->head_dim,
                             (long long)cfg->capacity);
    if (cfg->dtype != MHA_KV_F32 && cfg->dtype != MHA_KV_F16 &&
        cfg->dtype != MHA_KV_BF16 && cfg->dtype != MHA_KV_Q8 &&
        cfg->dtype != MHA_KV_Q4)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cache dtype %d: expected MHA_KV_F32, _F16, "
                             "_BF16, _Q8 or _Q4", (int)cfg->dtype);
    const int64_t dv = cfg->v_head_dim ? cfg->v_head_dim : cfg->head_dim;
    if (cfg->v_head_dim < 0 || dv > INT32_MAX / (4 * MHA_BC))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cache v_head_dim must be >= 1 (0: head_dim) "
                             "and at most %d, got %lld",
                             INT32_MAX / (4 * MHA_BC),
                             (long long)cfg->v_head_dim);
    if (cfg->dtype == MHA_KV_Q4 && (cfg->head_dim % 2 || dv % 2))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "a q4 cache packs two codes a byte: head_dim "
                             "must be even, got %lld (v_head_dim %lld)",
                             (long long)cfg->head_dim, (long long)dv);
    if (cfg->latent && (dv > cfg->head_dim || cfg->rotate))
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "a latent cache (values the first v_head_dim "
                             "elements of the keys) takes v_head_dim <= "
                             "head_dim and no rotation; got v_head_dim "
                             "%lld, head_dim %lld, rotate %d",
                             (long long)dv, (long long)cfg->head_dim,
                             cfg->rotate);
    if (cfg->rotate && dv != cfg->head_dim)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "a rotated cache with v_head_dim %lld != "
                             "head_dim %lld is not supported yet",
                             (long long)dv, (long long)cfg->head_dim);
    if (cfg->rotate && (cfg->head_dim % 2 || cfg->head_dim > MAX_TURNED))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "a rotated cache turns blocks of a power of "
                             "two >= 2 dividing head_dim, up to %d: "
                             "head_dim %lld", MAX_TURNED,
                             (long long)cfg->head_dim);
    if (cfg->window < 0 || cfg->window > cfg->capacity)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cache window %lld: expected 0 (no window) or "
                             "1 .. the capacity %lld (the ring holds at "
                             "least the window's keys)",
                             (long long)cfg->window,
                             (long long)cfg->capacity);
    const int64_t P = cfg->page_size;
    if (P < 0 || (P % MHA_BC != 0 && P != 16 && P != 32) || P > INT32_MAX)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cache page_size %lld: expected 0 (contiguous), "
                             "16, 32 or a multiple of %d (the kernels' tile "
                             "of keys) up to %d", (long long)P, MHA_BC,
                             INT32_MAX / MHA_BC * MHA_BC);
    /* a stored tile's columns: pages of 16 or 32 are a tile each */
    const int64_t tw = P && P < MHA_BC ? P : MHA_BC;
    if (P && cfg->window && cfg->capacity % P != 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "a paged window cache's capacity %lld (its "
                             "ring) must be whole pages of page_size %lld",
                             (long long)cfg->capacity, (long long)P);
    if (!P && cfg->num_pages)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cache num_pages %lld without a page_size",
                             (long long)cfg->num_pages);
    /* (ceilings without x + d - 1, which overflows near INT64_MAX) */
    const int64_t table_len =
        P ? cfg->capacity / P + (cfg->capacity % P != 0) : 0;
    int64_t pages = cfg->num_pages;
    if (P && !pages && !mha_mul_ok(cfg->batch, table_len, &pages))
        pages = INT64_MAX;   /* (refused just below) */
    if (P && (pages < 1 || pages > INT32_MAX - 1))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cache num_pages %lld: expected 1 .. %d (0: "
                             "batch x ceil(capacity / page_size))",
                             (long long)pages, INT32_MAX - 1);
    /* d_h bounded so a tile's bytes fit the kernels' int widths (a tile
     * has 64 keys; the other dimensions stay in int64), then every
     * product checked.  Tiles per (b, g) (contiguous) or per sequence
     * (paged), and the planes' tiles: [B][Hkv][tiles], or one null page
     * past the pool's. */
    int64_t bg, tiles, tiles_all, bytes, table_all = 0;
    int sized = mha_mul_ok(cfg->batch, cfg->num_kv_heads, &bg);
    if (P) {   /* (pages + 1) * tpp < 2^31 * 2^25: no overflow */
        sized = sized && mha_mul_ok(table_len, P / tw, &tiles) &&
                mha_mul_ok(cfg->batch, table_len, &table_all) &&
                mha_mul_ok((pages + 1) * (P / tw), cfg->num_kv_heads,
                           &tiles_all);
    } else {
        tiles = cfg->capacity / MHA_BC + (cfg->capacity % MHA_BC != 0);
        sized = sized && mha_mul_ok(bg, tiles, &tiles_all);
    }
    const int64_t dmax = dv > cfg->head_dim ? dv : cfg->head_dim;
    if (!sized || cfg->head_dim > INT32_MAX / (4 * MHA_BC) ||
        !mha_mul_ok(tiles_all,
                    (cfg->latent ? 1 : 2) *
                        mha_kv_tile_bytes(cfg->dtype, tw, dmax),
                    &bytes) ||
        bytes > INT64_MAX / 2)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "a cache of %lld sequences x %lld tokens x "
                             "%lld heads x %lld overflows",
                             (long long)cfg->batch, (long long)cfg->capacity,
                             (long long)cfg->num_kv_heads,
                             (long long)cfg->head_dim);
    mha_kv_cache *c = calloc(1, sizeof *c);
    int64_t *len = calloc((size_t)cfg->batch, sizeof *len);
    int64_t *start = calloc((size_t)cfg->batch, sizeof *start);
    /* Zeroed: a tile's unused columns hold finite values (0 in every
     * dtype, a q8 scale of 0 too). */
    /* A paged cache's planes start on a boundary of 4 KiB, so that a page
     * of 4 KiB (16 f16 keys of 128) is one page of memory, not two
     * halves: pages of 16 1.3x faster, of 64 1.1x (docs/BENCHMARKS.md).
     * (A contiguous cache's, aligned, was 2% slower: left as calloc's.) */
    const int64_t pad = P ? 4096 : 0;
    unsigned char *block = (uint64_t)bytes <= SIZE_MAX - 4096
                               ? calloc((size_t)(bytes + pad), 1) : NULL;
    unsigned char *data = block;
    if (block && pad)
        data += (4096 - (uintptr_t)block % 4096) % 4096;
    float *finite = calloc((size_t)tiles_all, sizeof *finite);
    int32_t *table = P ? malloc((size_t)table_all * sizeof *table) : NULL;
    if (c)
        c->page = P;   /* (the pool's runs: mha_kv_pages_init) */
    if (!c || !len || !start || !block || !finite || (P && !table) ||
        (P && mha_kv_pages_init(c, pages) != MHA_OK)) {
        free(c);
        free(len);
        free(start);
        free(block);
        free(finite);
        free(table);
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "cannot allocate a %s cache of %lld bytes",
                             dtype_name(cfg->dtype), (long long)bytes);
    }
    for (int64_t t = 0; t < tiles_all; t++)
        finite[t] = 1.0f;
    for (int64_t i = 0; i < table_all; i++)
        table[i] = (int32_t)pages;   /* the null page */
    c->tpp = P / tw;
    c->tw = tw;
    c->table_len = table_len;
    c->table = table;
    advise_huge_pages(data, bytes);
    c->B = cfg->batch;
    c->Hkv = cfg->num_kv_heads;
    c->dh = cfg->head_dim;
    c->dv = dv;
    c->capacity = cfg->capacity;
    c->window = cfg->window;
    c->start = start;
    c->tiles = tiles;
    c->dtype = cfg->dtype;
    c->rot_block = 0;
    if (cfg->rotate)   /* the largest power of two dividing d_h */
        c->rot_block = cfg->head_dim & -cfg->head_dim;
    c->tile_bytes = mha_kv_tile_bytes(cfg->dtype, tw, dmax);
    c->len = len;
    c->latent = cfg->latent != 0;
    c->k = data;
    c->block = block;
    c->v = c->latent ? data : data + bytes / 2;   /* (latent: one plane) */
    c->finite = finite;
    *out = c;
    return MHA_OK;
}

mha_status mha_kv_cache_create_sized(const mha_kv_cache_config *config,
                                     size_t config_size, mha_kv_cache **out)
{
    MHA_STRUCT_IN(mha_kv_cache_config, config);
    return mha_kv_cache_create_impl(config ? &config_ : NULL, out);
}

void mha_kv_cache_free(mha_kv_cache *c)
{
    if (!c)
        return;
    free(c->len);
    free(c->start);
    free(c->block);   /* the one allocation of both planes */
    free(c->finite);
    free(c->table);
    free(c->refs);   /* (the pool's one allocation: kv_pages.c) */
    free(c);
}

int64_t mha_kv_cache_length(const mha_kv_cache *c, int64_t seq)
{
    if (!c) {
        mha_set_error(MHA_ERR_NULL_POINTER, "cache is NULL");
        return -1;
    }
    if (seq < 0 || seq >= c->B) {
        mha_set_error(MHA_ERR_INVALID_ARGUMENT, "seq %lld is outside the "
                      "cache's %lld sequences", (long long)seq,
                      (long long)c->B);
        return -1;
    }
    return c->len[seq];
}

/* ---- the rotation ---------------------------------------------------------
 * The normalized Walsh-Hadamard transform of n = 2^m floats, in place: m
 * butterfly passes (a, b) -> (a + b, a - b), then a product by 2^(-m/2)
 * (the matrix H / sqrt(n) is symmetric and orthogonal).  The same
 * operations in the same order on every call: deterministic.
 */
static void hadamard(float *x, int64_t n)
{
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float norm = (float)(1.0 / sqrt((double)n));
    for (int64_t i = 0; i < n; i++)
        x[i] *= norm;
}

void mha_kv_cache_turn(const mha_kv_cache *c, float *x, int64_t rows,
                       int64_t heads, int64_t ld)
{
    const int64_t blk = c->rot_block;
    for (int64_t r = 0; blk && r < rows; r++)
        for (int64_t d = 0; d < heads * c->dh; d += blk)
            hadamard(x + r * ld + d, blk);
}

/* ---- storing one element -------------------------------------------------
 * x[i * stride], i < n: one key's (or value's) elements along d, stored at
 * codes[i * cstride] in the cache's dtype.  For q8 and q4, the n <=
 * MHA_Q8_BLOCK elements are one block and the scale is returned: amax /
 * qmax (127 or 7), the codes x / s rounded to nearest even (|code| <=
 * qmax); NaN or Inf anywhere makes the scale NaN (the block reads as
 * NaN), an all-zero block, or one so small that amax / qmax is 0, has
 * scale 0.
 */
static float quant_block(const float *x, int n, int qmax, int8_t *codes,
                         int64_t cstride)
{
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < n; i++) {
        finite &= isfinite(x[i]) != 0;
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    }
    const float qm = (float)qmax;
    float s = !finite ? NAN : amax / qm;
    /* The largest code reads back as fl(qmax s), which must stay finite:
     * for amax near FLT_MAX, s rounded up makes it Inf.  One ulp down
     * costs qmax ulp(s) at most, far inside the bound max|x| / 2 qmax. */
    if (isinf(qm * s))
        s = nextafterf(s, 0.0f);
    /* x / s in float64 is within 2^-53 of the exact quotient, and an
     * exact quotient that is not a half-integer lies at least ~2^-24 from
     * one (x and s have 24-bit significands): rint then rounds the exact
     * quotient, ties to even, with no double rounding. */
    for (int i = 0; i < n; i++) {
        double q = finite && s > 0.0f ? rint((double)x[i] / (double)s) : 0.0;
        q = q > qmax ? qmax : q < -qmax ? -qmax : q;
        codes[i * cstride] = (int8_t)q;
    }
    return s;
}

/* n floats rounded to bf16 or f16 (half.h's bits), elements `stride`
 * apart at dst: by the tier's narrow kernel (F16C / NEON for f16, where
 * half.h's plain C took 5 ns an element: most of an f16 append), then
 * placed.  (A tier that cannot be had, a bad MHA_ISA, leaves it to the
 * scalar table: an append does not depend on the tier.) */
static void store_half(int bf, const float *x, int64_t n, uint16_t *dst,
                       int64_t stride)
{
    enum { PIECE = 256 };
    mha_isa isa;
    const mha_microkernels *uk = NULL;
    if (mha_isa_get(&isa, &uk) != MHA_OK || !uk)
        uk = &mha_microkernels_scalar;
    uint16_t h[PIECE];
    for (int64_t d0 = 0; d0 < n; d0 += PIECE) {
        const int w = (int)(n - d0 < PIECE ? n - d0 : PIECE);
        uk->narrow(bf, x + d0, w, NULL, stride == 1 ? dst + d0 : h);
        for (int i = 0; stride != 1 && i < w; i++)
            dst[(d0 + i) * stride] = h[i];
    }
}

static void store(mha_kv_dtype t, const float *x, int64_t n, void *dst,
                  int64_t stride)
{
    if (t == MHA_KV_F16 || t == MHA_KV_BF16) {
        store_half(t == MHA_KV_BF16, x, n, dst, stride);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        ((float *)dst)[i * stride] = x[i];
}

/* The q4 and q8 rows (kernels.h): each block of 32 elements quantised
 * (quant_block, qmax 7 or 127) with its scale.  A key is a column of its
 * kt tile: q4 pairs of dims whole bytes; a value a row of its v tile: q4
 * codes one nibble each of bytes its key shares with the key beside it
 * (whose nibble is kept). */
static void put_q4_key(int64_t tw, int64_t dh, int64_t col, const float *kr,
                       unsigned char *kt)
{
    float *ks = (float *)mha_q8_scales(kt, tw, dh);
    int8_t kc[MHA_Q8_BLOCK];
    for (int64_t k = 0; k < mha_q8_blocks(dh); k++) {
        const int64_t d0 = k * MHA_Q8_BLOCK;
        const int n = (int)(dh - d0 < MHA_Q8_BLOCK ? dh - d0 : MHA_Q8_BLOCK);
        ks[k * tw + col] = quant_block(kr + d0, n, 7, kc, 1);
        for (int i = 0; i < n; i += 2)   /* (d0 and n even: whole pairs) */
            kt[(d0 + i) / 2 * tw + col] =
                (unsigned char)((kc[i] & 0x0F) | (kc[i + 1] & 0x0F) << 4);
    }
}

static void put_q8_key(int64_t tw, int64_t dh, int64_t col, const float *kr,
                       unsigned char *kt)
{
    float *ks = (float *)mha_q8_scales(kt, tw, dh);
    for (int64_t k = 0; k < mha_q8_blocks(dh); k++) {
        const int64_t d0 = k * MHA_Q8_BLOCK;
        const int n = (int)(dh - d0 < MHA_Q8_BLOCK ? dh - d0 : MHA_Q8_BLOCK);
        ks[k * tw + col] = quant_block(kr + d0, n, 127,
                                       (int8_t *)kt + d0 * tw + col, tw);
    }
}

static void put_q4_row(int64_t tw, int64_t dv, int64_t col, const float *vr,
                       unsigned char *vt)
{
    float *vs = (float *)mha_q8_scales(vt, tw, dv);
    int8_t vc[MHA_Q8_BLOCK];
    const int64_t vblocks = mha_q8_blocks(dv);
    for (int64_t k = 0; k < vblocks; k++) {
        const int64_t d0 = k * MHA_Q8_BLOCK;
        const int n = (int)(dv - d0 < MHA_Q8_BLOCK ? dv - d0 : MHA_Q8_BLOCK);
        vs[col * vblocks + k] = quant_block(vr + d0, n, 7, vc, 1);
        unsigned char *vb = vt + col / 2 * dv + d0;
        for (int i = 0; i < n; i++)
            vb[i] = col & 1 ? (unsigned char)((vb[i] & 0x0F) |
                                              (vc[i] & 0x0F) << 4)
                            : (unsigned char)((vb[i] & 0xF0) |
                                              (vc[i] & 0x0F));
    }
}

static void put_q8_row(int64_t tw, int64_t dv, int64_t col, const float *vr,
                       unsigned char *vt)
{
    float *vs = (float *)mha_q8_scales(vt, tw, dv);
    const int64_t vblocks = mha_q8_blocks(dv);
    for (int64_t k = 0; k < vblocks; k++) {
        const int64_t d0 = k * MHA_Q8_BLOCK;
        const int n = (int)(dv - d0 < MHA_Q8_BLOCK ? dv - d0 : MHA_Q8_BLOCK);
        vs[col * vblocks + k] =
            quant_block(vr + d0, n, 127, (int8_t *)vt + col * dv + d0, 1);
    }
}

/* A value (dv floats) as row col of a value tile, in the cache's dtype. */
static void put_value_row(mha_kv_dtype dtype, int64_t tw, int64_t dv,
                          int64_t col, const float *vr, unsigned char *vt)
{
    if (dtype == MHA_KV_Q4)
        put_q4_row(tw, dv, col, vr, vt);
    else if (dtype == MHA_KV_Q8)
        put_q8_row(tw, dv, col, vr, vt);
    else
        store(dtype, vr, dv, vt + col * dv * (dtype == MHA_KV_F32 ? 4 : 2),
              1);
}

/* Key (dh floats) and value (dv) `col` of tile t of (b, g) from kr and
 * vr, as they are.  A latent cache's key is stored as a value row of dh
 * (its value is its prefix: no values of its own). */
static void store_column(mha_kv_cache *c, int64_t b, int64_t g, int64_t t,
                         int64_t col, const float *kr, const float *vr)
{
    unsigned char *kt = (unsigned char *)mha_kv_cache_k_tile(c, b, g, t);
    if (c->latent) {
        put_value_row(c->dtype, c->tw, c->dh, col, kr, kt);
        return;
    }
    if (c->dtype == MHA_KV_Q4)
        put_q4_key(c->tw, c->dh, col, kr, kt);
    else if (c->dtype == MHA_KV_Q8)
        put_q8_key(c->tw, c->dh, col, kr, kt);
    else
        store(c->dtype, kr, c->dh, kt + col * (c->dtype == MHA_KV_F32 ? 4 : 2),
              c->tw);
    put_value_row(c->dtype, c->tw, c->dv, col, vr,
                  (unsigned char *)mha_kv_cache_v_tile(c, b, g, t));
}

/* The same on a rotated cache (dv = dh there): turned first, in buffers
 * of this call's own, so that an ordinary append's frame stays small. */
__attribute__((noinline)) static void
store_turned(mha_kv_cache *c, int64_t b, int64_t g, int64_t t, int64_t col,
             const float *kr, const float *vr)
{
    float turned[2][MAX_TURNED];
    memcpy(turned[0], kr, (size_t)c->dh * sizeof *kr);
    memcpy(turned[1], vr, (size_t)c->dh * sizeof *vr);
    mha_kv_cache_turn(c, turned[0], 2, 1, MAX_TURNED);
    store_column(c, b, g, t, col, turned[0], turned[1]);
}

static void put_column(mha_kv_cache *c, int64_t b, int64_t g, int64_t t,
                       int64_t col, const float *kr, const float *vr)
{
    if (c->rot_block)
        store_turned(c, b, g, t, col, kr, vr);
    else
        store_column(c, b, g, t, col, kr, vr);
}

/* Whether every value of columns c0 .. c1-1 of tile t of (b, g) is
 * finite as stored (f16 may overflow to Inf, a q8 block be NaN): the flag
 * the kernels read to take the fast pv. */
static float tile_finite(const mha_kv_cache *c, int64_t b, int64_t g,
                         int64_t t, int64_t c0, int64_t c1)
{
    const unsigned char *v = mha_kv_cache_v_tile(c, b, g, t);
    for (int64_t col = c0; col < c1; col++)
        for (int64_t d = 0; d < c->dv; d++)
            if (!isfinite(mha_kv_cache_value_at(c, v, col, d)))
                return 0.0f;
    return 1.0f;
}

mha_status mha_kv_cache_check_values(const mha_kv_cache *c, int64_t b,
                                     const float *k, int64_t ldk,
                                     const float *v, int64_t ldv, int64_t n)
{
    if (c->dtype != MHA_KV_F16)
        return MHA_OK;
    /* (a latent cache has no values of its own) */
    const int64_t w = c->Hkv * c->dh, wv = c->latent ? 0 : c->Hkv * c->dv;
    for (int64_t r = 0; r < n; r++)
        for (int64_t e = 0; e < w + wv; e++) {
            const float x = e < w ? k[r * ldk + e] : v[r * ldv + e - w];
            /* 65520 is the midpoint of 65504 and 65536: it and all above
             * round to Inf; Inf and NaN given stay what they are. */
            if (isfinite(x) && fabsf(x) >= 65520.0f)
                return mha_set_error(
                    MHA_ERR_INVALID_ARGUMENT,
                    "%s %g (token %lld of this append to sequence %lld, K/V "
                    "head %lld, element %lld) is outside f16's range "
                    "(|x| < 65520, stored as at most 65504): an f16 cache "
                    "would hold Inf; use a bf16 or f32 cache",
                    e < w ? "key" : "value", (double)x, (long long)r,
                    (long long)b,
                    (long long)(e < w ? e / c->dh : (e - w) / c->dv),
                    (long long)(e < w ? e % c->dh : (e - w) % c->dv));
        }
    return MHA_OK;
}

void mha_kv_cache_put(mha_kv_cache *c, int64_t b, const float *k,
                      int64_t ldk, const float *v, int64_t ldv, int64_t n)
{
    const int64_t dh = c->dh;
    for (int64_t r = 0; r < n; r++) {
        const int64_t pos = c->len[b] + r;
        const int64_t slot = c->window ? pos % c->capacity : pos;
        const int64_t t = slot / c->tw, col = slot % c->tw;
        for (int64_t g = 0; g < c->Hkv; g++) {
            put_column(c, b, g, t, col, k + r * ldk + g * dh,
                       v ? v + r * ldv + g * c->dv : NULL);
            const double ka = mha_max_abs_finite(k + r * ldk + g * dh, 1,
                                                 dh, dh, 1, NULL);
            c->key_amax = ka > c->key_amax ? ka : c->key_amax;
            float *flag = c->finite + mha_kv_tile_index(c, b, g, t);
            const float mine = tile_finite(c, b, g, t, col, col + 1);
            if (!c->window)   /* finite only if every column so far is */
                *flag = col == 0 ? mine : *flag * mine;
            else if (mine == 0.0f)
                *flag = 0.0f;
            else if (*flag == 0.0f)   /* the bad column may be gone */
                *flag = tile_finite(c, b, g, t, 0, c->tw);
        }
    }
    c->len[b] += n;
    if (c->window && c->len[b] - c->capacity > c->start[b])
        c->start[b] = c->len[b] - c->capacity;   /* overwritten */
}

int64_t mha_kv_cache_keys(const mha_kv_cache *c, int64_t more)
{
    int64_t longest = 0;
    for (int64_t b = 0; b < c->B; b++) {
        int64_t n = c->len[b] + more;
        if (c->window && n > c->capacity)
            n = c->capacity;   /* the ring's slots */
        longest = n > longest ? n : longest;
    }
    return longest;
}

mha_status mha_kv_cache_window_args(const mha_mask *attn_mask,
                                    const mha_mask *key_padding_mask,
                                    const int64_t *key_lengths,
                                    mha_weights_mode need_weights,
                                    int64_t kv_len)
{
    const char *no = attn_mask->kind ? "attn_mask"
                   : key_padding_mask->kind ? "key_padding_mask"
                   : key_lengths ? "key_lengths"
                   : need_weights ? "need_weights"
                   : kv_len ? "kv_len" : NULL;
    if (no)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "with a sliding-window KV cache, %s must be "
                             "unset: its keys are the last window positions "
                             "of each sequence, held in a ring", no);
    return MHA_OK;
}

mha_status mha_kv_cache_check_window(const mha_kv_cache *c, int64_t q_len,
                                     int64_t more)
{
    if (!c->window)
        return MHA_OK;
    const int64_t W = c->window, C = c->capacity;
    if (q_len > C - W + 1)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%lld queries with a window of %lld need the "
                             "ring to hold %lld keys (q_len + window - 1), "
                             "more than its capacity %lld",
                             (long long)q_len, (long long)W,
                             (long long)(q_len + W - 1), (long long)C);
    for (int64_t b = 0; b < c->B; b++) {
        /* The queries are the last q_len positions once `more` are in;
         * the first sees from its position - W + 1. */
        const int64_t n = c->len[b] + more;
        int64_t need = n - q_len - W + 1, held = c->start[b];
        need = need > 0 ? need : 0;
        held = n - C > held ? n - C : held;
        if (need < held)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "sequence %lld: its queries at positions "
                                 "%lld .. %lld see keys from position %lld, "
                                 "but the ring holds positions %lld .. %lld "
                                 "only (window %lld, capacity %lld)",
                                 (long long)b, (long long)(n - q_len),
                                 (long long)(n - 1), (long long)need,
                                 (long long)held, (long long)(n - 1),
                                 (long long)W, (long long)C);
    }
    return MHA_OK;
}

void mha_attn_use_cache(mha_attn *at, const mha_kv_cache *kv,
                        mha_mask_plan *mask)
{
    const int64_t longest = mha_kv_cache_keys(kv, 0);
    const int64_t extra = (at->bias_k != NULL) + (at->zero_attn != 0);
    at->Lk = longest;
    at->Lt = longest + extra;
    at->k = at->v = NULL;
    at->ldk = at->ldv = 0;
    at->kv = kv;
    at->packed_tiles = 1;   /* (packed: the extra keys' tile of each (b, g),
                               in the run's workspace: mha_attn_layout) */
    at->prepacked = 1;
    /* The caller's masks (for Lk = longest) stay; causal becomes
     * bottom-right per sequence: new query i of sequence b sees keys
     * j <= len_b - Lq + i, so never a key past its length, whatever the
     * masks allow.  An empty cache (longest 0) leaves every row with no
     * key. */
    mask->causal = MHA_CAUSAL_BOTTOM_RIGHT;
    mask->seq_lengths = kv->len;
    mask->qpos_shift += kv->view_shift;   /* (0 but in a cascade's view) */
    /* A window: key column j is slot j, masked by the position it holds
     * (the callers refused explicit masks and key lengths). */
    mask->window = kv->window;
    mask->ring = kv->capacity;
    at->mask = mask;
}

static mha_status check_seq(const mha_kv_cache *c, int64_t seq)
{
    if (!c)
        return mha_set_error(MHA_ERR_NULL_POINTER, "cache is NULL");
    if (seq < 0 || seq >= c->B)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "sequence %lld is not in the cache (0 .. %lld)",
                             (long long)seq, (long long)(c->B - 1));
    return MHA_OK;
}

mha_status mha_kv_cache_append(mha_kv_cache *c, int64_t seq, const float *k,
                               const float *v, int64_t n)
{
    MHA_CHECK(check_seq(c, seq));
    if (n < 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "n must be >= 0, got %lld", (long long)n);
    if (n > 0 && c->latent && v)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "v must be NULL: a latent cache's values are "
                             "the first %lld elements of its keys",
                             (long long)c->dv);
    if (n > 0 && (!k || (!v && !c->latent)))
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !k ? "k" : "v");
    if (c->window && n > c->capacity)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "appending %lld tokens at once exceeds the "
                             "capacity %lld of the window cache's ring",
                             (long long)n, (long long)c->capacity);
    if (!c->window && n > c->capacity - c->len[seq])
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "appending %lld tokens to sequence %lld of "
                             "length %lld exceeds the capacity %lld",
                             (long long)n, (long long)seq,
                             (long long)c->len[seq], (long long)c->capacity);
    if (c->window && n > INT64_MAX - c->len[seq])
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "sequence %lld's length overflows",
                             (long long)seq);
    const int64_t Ekv = c->Hkv * c->dh, Evkv = c->Hkv * c->dv;
    MHA_CHECK(mha_kv_cache_check_values(c, seq, k, Ekv, v, Evkv, n));
    MHA_CHECK(mha_kv_pages_reserve(c, seq, n));   /* the last check */
    mha_kv_cache_put(c, seq, k, Ekv, v, Evkv, n);
    return MHA_OK;
}

mha_status mha_kv_cache_truncate(mha_kv_cache *c, int64_t seq,
                                 int64_t length)
{
    MHA_CHECK(check_seq(c, seq));
    if (length < 0 || length > c->len[seq])
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cannot truncate sequence %lld of length %lld "
                             "to %lld", (long long)seq,
                             (long long)c->len[seq], (long long)length);
    if (c->window) {
        /* The next token attends to positions length - W + 1 .. length,
         * and a query of the last one kept to length - W .. length - 1:
         * those the ring must still hold.  Its storage is unchanged, and
         * every tile's flag covers every column: nothing else to do.
         * Truncating to 0 needs nothing: the sequence starts again. */
        const int64_t need = length - c->window > 0 ? length - c->window : 0;
        if (length == 0)
            c->start[seq] = 0;
        else if (need < c->start[seq])
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "cannot truncate sequence %lld of length "
                                 "%lld to %lld: a window of %lld needs "
                                 "positions %lld .. %lld, but the oldest "
                                 "position the ring holds is %lld",
                                 (long long)seq, (long long)c->len[seq],
                                 (long long)length, (long long)c->window,
                                 (long long)need, (long long)(length - 1),
                                 (long long)c->start[seq]);
        c->len[seq] = length;
        return MHA_OK;
    }
    c->len[seq] = length;
    /* A paged sequence's pages past its length go back (once no one else
     * holds them). */
    if (c->page)
        mha_kv_pages_release(c, seq, mha_kv_pages_of(c, length));
    /* The tile the sequence now ends in keeps only finite-or-not of its
     * remaining columns; a whole tile is flagged anew by its next put.  A
     * page another sequence also holds keeps its flags: they cover that
     * sequence's columns too, and a 0 only takes the slow path. */
    const int64_t t = length / c->tw, cols = length % c->tw;
    const int shared =   /* (cols > 0: the page of `length` is kept) */
        cols && c->page &&
        c->refs[c->table[seq * c->table_len + length / c->page]] > 1;
    if (cols && !shared)
        for (int64_t g = 0; g < c->Hkv; g++)
            c->finite[mha_kv_tile_index(c, seq, g, t)] =
                tile_finite(c, seq, g, t, 0, cols);
    return MHA_OK;
}

mha_status mha_kv_cache_check_plan(const mha_kv_cache *c,
                                   int64_t plan_capacity)
{
    if (c->capacity > plan_capacity)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "this plan was made for KV caches of capacity "
                             "<= %lld; the cache given holds %lld tokens",
                             (long long)plan_capacity,
                             (long long)c->capacity);
    return MHA_OK;
}

mha_status mha_kv_cache_read(const mha_kv_cache *c, int64_t seq,
                             int64_t start, int64_t n, float *k, float *v)
{
    MHA_CHECK(check_seq(c, seq));
    if (n < 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cannot read %lld tokens: expected n >= 0",
                             (long long)n);
    if (start < 0 || start > c->len[seq] - n) {
        /* (named by their last token only where start + n - 1 does not
         * overflow: not for the absurd values this refuses too) */
        if (n > 0 && start <= INT64_MAX - (n - 1))
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "tokens %lld .. %lld are not in sequence "
                                 "%lld of length %lld", (long long)start,
                                 (long long)(start + (n - 1)),
                                 (long long)seq, (long long)c->len[seq]);
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%lld tokens from token %lld are not in "
                             "sequence %lld of length %lld", (long long)n,
                             (long long)start, (long long)seq,
                             (long long)c->len[seq]);
    }
    if (c->window && n > 0 && start < c->start[seq])
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "tokens %lld .. %lld of sequence %lld: the "
                             "window cache's ring holds positions %lld .. "
                             "%lld only", (long long)start,
                             (long long)(start + n - 1), (long long)seq,
                             (long long)c->start[seq],
                             (long long)(c->len[seq] - 1));
    if (n > 0 && !k && !v)
        return mha_set_error(MHA_ERR_NULL_POINTER, "k and v are both NULL");
    const int64_t dh = c->dh, dv = c->dv, Ekv = c->Hkv * dh,
                  Evkv = c->Hkv * dv;
    for (int64_t r = 0; r < n; r++) {
        const int64_t slot = c->window ? (start + r) % c->capacity
                                       : start + r;
        const int64_t t = slot / c->tw, col = slot % c->tw;
        for (int64_t g = 0; g < c->Hkv; g++) {
            const void *kt = mha_kv_cache_k_tile(c, seq, g, t);
            const void *vt = mha_kv_cache_v_tile(c, seq, g, t);
            for (int64_t d = 0; k && d < dh; d++)
                k[r * Ekv + g * dh + d] = mha_kv_cache_key_at(c, kt, col, d);
            for (int64_t d = 0; v && d < dv; d++)
                v[r * Evkv + g * dv + d] =
                    mha_kv_cache_value_at(c, vt, col, d);
        }
        /* a rotated cache's values turned back (H is its own inverse;
         * dv = dh there) */
        if (k)
            mha_kv_cache_turn(c, k + r * Ekv, 1, c->Hkv, Ekv);
        if (v)
            mha_kv_cache_turn(c, v + r * Evkv, 1, c->Hkv, Evkv);
    }
    return MHA_OK;
}

mha_status mha_kv_cache_reset(mha_kv_cache *c, int64_t seq)
{
    if (c && seq == -1) {
        for (int64_t b = 0; b < c->B; b++)
            mha_kv_pages_release(c, b, 0);
        memset(c->len, 0, (size_t)c->B * sizeof *c->len);
        memset(c->start, 0, (size_t)c->B * sizeof *c->start);
        c->key_amax = 0.0;
        return MHA_OK;
    }
    MHA_CHECK(check_seq(c, seq));
    mha_kv_pages_release(c, seq, 0);
    c->len[seq] = 0;
    c->start[seq] = 0;
    return MHA_OK;
}

void mha_kv_cache_view(const mha_kv_cache *c, int64_t b, int64_t n,
                       mha_kv_cache *view)
{
    *view = *c;
    view->B = n;
    view->len = c->len + b;
    view->start = c->start + b;
    if (c->page) {   /* its table; the pool as it is */
        view->table = c->table + b * c->table_len;
    } else {         /* its [Hkv][tiles] of the planes and flags */
        const int64_t tiles = c->Hkv * c->tiles;
        view->k = c->k + b * tiles * c->tile_bytes;
        view->v = c->v + b * tiles * c->tile_bytes;
        view->finite = c->finite + b * tiles;
    }
}

mha_status mha_kv_cache_fork(mha_kv_cache *c, int64_t src, int64_t dst)
{
    MHA_CHECK(check_seq(c, src));
    MHA_CHECK(check_seq(c, dst));
    if (src == dst)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cannot fork sequence %lld onto itself",
                             (long long)src);
    if (c->page) {   /* src's pages, shared (a ring's: all it holds) */
        mha_kv_pages_release(c, dst, 0);
        const int64_t held = c->window ? c->table_len
                                       : mha_kv_pages_of(c, c->len[src]);
        for (int64_t i = 0; i < held; i++) {
            const int32_t pg = c->table[src * c->table_len + i];
            c->table[dst * c->table_len + i] = pg;
            if (pg != c->pages)
                c->refs[pg]++;
        }
    } else {   /* src's tiles (all: a ring holds any of them) and flags */
        const int64_t n = c->Hkv * c->tiles;
        memcpy(c->k + dst * n * c->tile_bytes, c->k + src * n * c->tile_bytes,
               (size_t)(n * c->tile_bytes));
        memcpy(c->v + dst * n * c->tile_bytes, c->v + src * n * c->tile_bytes,
               (size_t)(n * c->tile_bytes));
        memcpy(c->finite + dst * n, c->finite + src * n,
               (size_t)n * sizeof *c->finite);
    }
    c->len[dst] = c->len[src];
    c->start[dst] = c->start[src];
    return MHA_OK;
}

mha_status mha_kv_cache_get_usage_sized(const mha_kv_cache *c,
                                        mha_kv_cache_usage *out,
                                        size_t out_size)
{
    MHA_CHECK(mha_struct_out_size(out, out_size, "mha_kv_cache_usage"));
    if (!c || !out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             c ? "output usage" : "cache");
    mha_kv_cache_usage u = {0};
    for (int64_t b = 0; b < c->B; b++)   /* (a ring: from start[b] on) */
        u.tokens += c->len[b] - (c->window ? c->start[b] : 0);
    /* a key and a value of H_kv heads per token, a tile's share each (a
     * latent cache: the key alone) */
    const int64_t planes = c->latent ? 1 : 2;
    u.token_bytes = u.tokens * planes * c->Hkv * c->tile_bytes / c->tw;
    const int64_t tile_pair = planes * c->tile_bytes;   /* K and V */
    if (c->page) {
        u.page_size = c->page;
        u.pages_free = c->n_free;
        u.pages_used = c->pages - c->n_free;
        u.bytes = u.pages_used * c->Hkv * c->tpp * tile_pair;
        u.bytes_total = (c->pages + 1) * c->Hkv * c->tpp * tile_pair;
    } else {
        u.bytes = u.bytes_total = c->B * c->Hkv * c->tiles * tile_pair;
    }
    memcpy(out, &u, out_size < sizeof u ? out_size : sizeof u);
    return MHA_OK;
}
