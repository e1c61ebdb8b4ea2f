/*
 * run.c -- who runs what: the engine (tier and threads), the workspace
 * layouts, and the scheduling of the forward's and backward's work items
 * on OpenMP threads.
 *
 * Work is split into items that one thread computes alone, in a fixed
 * order: (b, h, query block) for the output, (b, h, key chunk) then (b, h)
 * when decoding, (b, query block) for the weights (heads summed in order
 * for the average), (b, K/V head) for the backward.  Results are therefore
 * bitwise identical for any thread count.
 */
#include "engine.h"

#ifdef _OPENMP
#include <omp.h>
#endif

mha_status mha_check_threads(int num_threads)
{
    if (num_threads < 0 || num_threads > 4096)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "num_threads must be in [0, 4096] (0 = the "
                             "OpenMP default), got %d", num_threads);
    return MHA_OK;
}

mha_status mha_engine_init(mha_engine *e, int num_threads)
{
    MHA_CHECK(mha_check_threads(num_threads));
    MHA_CHECK(mha_isa_get(&e->isa, &e->uk));
    int threads = num_threads;
#ifdef _OPENMP
    if (threads == 0)
        threads = omp_get_max_threads();
#else
    threads = 1;   /* built without OpenMP */
#endif
    e->threads = threads < 1 ? 1 : threads;
    return MHA_OK;
}

mha_status mha_check_weights_mode(mha_weights_mode mode)
{
    if (mode != MHA_WEIGHTS_NONE && mode != MHA_WEIGHTS_AVERAGE &&
        mode != MHA_WEIGHTS_PER_HEAD)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "need_weights must be NONE, AVERAGE or PER_HEAD, "
                             "got %d", (int)mode);
    return MHA_OK;
}

mha_status mha_check_mode_fields(mha_weights_mode need,
                                 const float *attn_weights)
{
    if (need != MHA_WEIGHTS_NONE && !attn_weights)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "need_weights is set but attn_weights is NULL");
    if (need == MHA_WEIGHTS_NONE && attn_weights)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "attn_weights is set but need_weights is "
                             "MHA_WEIGHTS_NONE: nothing would be written "
                             "there; say AVERAGE or PER_HEAD, or pass NULL");
    return MHA_OK;
}

/* n rounded up to a whole number of 64-byte lines of floats. */
static int64_t lines(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* The per-thread part of a layout; sizes below 2^60 are known to add up
 * without overflow (the callers bound their shapes). */
static mha_status finish_layout(const mha_engine *e, int64_t per_thread,
                                mha_attn_layout *l)
{
    int64_t all;
    l->per_thread = lines(per_thread);
    if (!mha_mul_ok(l->per_thread, e->threads, &all) || all > INT64_MAX / 8 ||
        l->scratch > INT64_MAX / 8)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "attention scratch of %d threads overflows",
                             e->threads);
    l->total = l->scratch + all;
    return MHA_OK;
}

mha_status mha_attn_layout_forward(const mha_engine *e, int64_t B, int64_t H,
                                   int64_t Hkv, int64_t Lq, int64_t Lk,
                                   int64_t Lt, int64_t dh, int64_t dv,
                                   int prepacked, mha_attn_layout *l)
{
    const int flash = e->isa != MHA_ISA_REF;
    dh = dv > dh ? dv : dh;   /* (the wider sizes every buffer) */
    l->stats = 0;
    l->partials = lines(2 * B * H * Lq);
    l->packed = l->partials +
                lines(flash ? mha_decode_partials(B, H, Lq, Lk, dh) : 0);
    /* (a cache's run: the extra keys' tile of each (b, g) alone, where
     * there are extra keys; the cache holds the others) */
    l->scratch = l->packed +
                 lines(prepacked ? (Lt > Lk ? mha_packed_floats(B, Hkv, 0, dh)
                                            : 0)
                       : flash   ? mha_packed_floats(B, Hkv, Lk, dh)
                                 : 0);
    /* (a cache's run: room for a latent cache's tile widened, the
     * block's q transposed and the transposed scores: flash_scratch) */
    return finish_layout(e, flash ? mha_flash_scratch_floats(dh) +
                                        (prepacked ? 2 * MHA_BC * dh +
                                                         MHA_BC * MHA_BR
                                                   : 0)
                                  : mha_ref_scratch_floats(dh, Lt), l);
}

mha_status mha_attn_layout_backward(const mha_engine *e, int64_t B,
                                    int64_t Hkv, int64_t Lk, int64_t Lt,
                                    int64_t dh, int64_t dv, int softcap,
                                    mha_attn_layout *l)
{
    const int flash = e->isa != MHA_ISA_REF;
    dh = dv > dh ? dv : dh;   /* (the wider sizes every buffer) */
    l->stats = l->partials = l->packed = 0;
    l->scratch = lines(flash ? mha_packed_floats(B, Hkv, Lk, dh) : 0);
    return finish_layout(e, flash ? mha_flash_bwd_scratch_floats(dh, Lt, softcap)
                                  : mha_ref_bwd_scratch_floats(dh, Lt), l);
}

static int threads_for(const mha_engine *e, const mha_attn *a)
{
    return (double)a->B * a->H * a->Lq * a->Lt * a->dh < MHA_THREADS_MIN_WORK
               ? 1 : e->threads;
}

void mha_attn_run(const mha_engine *e, const mha_attn *problem,
                  float *scratch, int64_t per_thread)
{
    mha_attn run = *problem;
    run.uk = e->uk;
    run.in_place = mha_attn_reads_in_place(&run);   /* (the same bits) */
    /* Each tile packed by the block that first reads it, still in that
     * core's cache (packed all before the blocks, every tile was written
     * to memory and read back from it: B 8 L 512 from memory, the packing
     * was a tenth of the call).  A cache's run, a backward's packing, the
     * ref tier: as before. */
    run.lazy_pack = !run.prepacked && !run.pack_only && !run.in_place &&
                    e->isa != MHA_ISA_REF;
    const mha_attn *a = &run;
    const int threads = threads_for(e, a);
    (void)threads;   /* (a build without OpenMP ignores the pragma) */
    if (a->prepacked && (a->bias_k || a->zero_attn)) {
        /* A KV cache holds the keys; only the extra keys' tile of every
         * (b, g) is written (in the run's workspace), for every tier (a
         * few rows).  Without extra keys there is none. */
        const int64_t tiles = mha_tiles_of(a);
        for (int64_t bg = 0; bg < a->B * a->Hkv; bg++)
            mha_pack_forward_tile(a, bg * tiles + tiles - 1);
    }
    if (e->isa == MHA_ISA_REF && a->pack_only)
        return;   /* the ref backward reads k and v as they are */
    if (e->isa == MHA_ISA_REF) {
        const int64_t rows = a->B * a->Lq;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
        for (int64_t t = 0; t < rows; t++) {
            int tid = 0;
#ifdef _OPENMP
            tid = omp_get_thread_num();
#endif
            mha_ref_row(a, t / a->Lq, t % a->Lq, scratch + tid * per_thread);
        }
        return;
    }
    const int64_t blocks = (a->Lq + MHA_BR - 1) / MHA_BR;
    const int64_t bh_items = a->B * a->H;
    const int64_t chunks = mha_decode_chunks(a->Lq, a->Lk);
    const int stacked = mha_decode_stacked(a, threads);
    const int64_t tiles = mha_tiles_of(a);
    const mha_packed packed = mha_packed_at(a->packed, a);
    if (a->lazy_pack)
        for (int64_t t = 0; t < a->B * a->Hkv * tiles; t++)
            atomic_init(mha_packed_state(&packed, 0, 0, t), MHA_PACK_NOT);
#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        flash_scratch f =
            mha_flash_scratch_at(scratch + tid * per_thread, mha_dmax(a));
        if (!a->prepacked && !a->lazy_pack) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < a->B * a->Hkv * tiles; t++)
                mha_pack_forward_tile(a, t);
            /* (the implicit barrier: every tile is packed) */
        }
        if (a->pack_only) {
            /* nothing more: a part's backward sets the stats itself */
        } else if (chunks > 1) {
            /* (every thread takes the same branch: it follows the shape) */
            if (stacked) {
                const int64_t items =
                    a->B * a->Hkv * mha_decode_stacks(a, stacked);
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < items * chunks; t++)
                    mha_decode_chunk_stacked(a, stacked, t / chunks,
                                             t % chunks, chunks, &f);
            } else {
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < bh_items * chunks; t++)
                    mha_decode_chunk(a, t / chunks, t % chunks, chunks, &f);
            }
            /* (the implicit barrier: every chunk's partials are written) */
#pragma omp for schedule(dynamic, 1)
            for (int64_t bh = 0; bh < bh_items; bh++)
                mha_decode_merge(a, bh, chunks, &f);
        } else if (stacked) {
            const int64_t items =
                a->B * a->Hkv * mha_decode_stacks(a, stacked);
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < items; t++)
                mha_decode_block_stacked(a, stacked, t, &f);
        } else {
            /* Where there are heads enough to go round, a thread takes a
             * head's blocks together: it packs the head's tiles (lazily)
             * and reads them back from its own cache. */
            const int64_t chunk = bh_items >= 4 * threads ? blocks : 1;
#pragma omp for schedule(dynamic, chunk)
            for (int64_t t = 0; t < bh_items * blocks; t++) {
                const int64_t bh = t / blocks, i0 = (t % blocks) * MHA_BR;
                const int mr = (int)(a->Lq - i0 < MHA_BR ? a->Lq - i0
                                                         : MHA_BR);
                mha_flash_block(a, bh / a->H, bh % a->H, i0, mr, &f);
            }
        }
        if (a->lazy_pack) {
            /* The tiles no block read (past every row's keys, outside
             * every window), packed as they were before: a backward reads
             * every tile of the forward's. */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < a->B * a->Hkv * tiles; t++)
                mha_pack_forward_on_use(a, &packed, 0, 0, t);
        }
        if (a->weights != MHA_WEIGHTS_NONE) {
            /* The implicit barrier above: every row's stats are written. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < a->B * blocks; t++) {
                const int64_t i0 = (t % blocks) * MHA_BR;
                const int mr = (int)(a->Lq - i0 < MHA_BR ? a->Lq - i0
                                                         : MHA_BR);
                mha_weights_block(a, t / blocks, i0, mr, &f);
            }
        }
    }
}

void mha_attn_backward(const mha_engine *e, const mha_attn *problem,
                       const mha_attn_grad *g, float *scratch,
                       int64_t per_thread)
{
    mha_attn run = *problem;
    run.uk = e->uk;
    const mha_attn *a = &run;
    const int threads = threads_for(e, a);
    (void)threads;   /* (a build without OpenMP ignores the pragma) */
    const int64_t items = a->B * a->Hkv;   /* (b, K/V head) */
    const int64_t tiles = mha_tiles_of(a);
#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *mine = scratch + tid * per_thread;
        if (e->isa != MHA_ISA_REF) {
            /* the forward's tiles, which it read in place (the same
             * predicate on the same problem), then the backward's */
            if (mha_attn_reads_in_place(a)) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < items * tiles; t++)
                    mha_pack_forward_tile(a, t);
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < items * tiles; t++)
                mha_pack_backward_tile(a, g, t);
        }
        /* (the implicit barrier: every tile is packed) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++) {
            if (e->isa == MHA_ISA_REF)
                mha_ref_bwd_item(a, g, t / a->Hkv, t % a->Hkv, mine);
            else
                mha_flash_bwd_item(a, g, t / a->Hkv, t % a->Hkv, mine);
        }
    }
}

