/*
 * fuzz_cache.c -- fuzz target for the KV cache's operation sequences:
 * create, then any sequence of append, truncate, reset, read, fork and
 * decoding steps (mha_attention on the cache), driven by the input bytes,
 * against a model kept here of what each sequence must hold.
 *
 * The first bytes choose the cache (batch 1..3, H_kv 1..2, d_h 1..40 --
 * q8's blocks of 32 split in two past 32 --, capacity 1..40 (pages of 16
 * fill, so that forks share whole pages), dtype f32,
 * f16, bf16, q8 or q4 (d_h made even), rotated or not (d_h made even),
 * a window 0 or 1..capacity, pages of 64 or 16 in a pool of 1..batch
 * tiles' worth, or a window on pages of 16 -- capacity 16 or 32, whole
 * pages); each next byte pair is an
 * operation and its argument.  Values come from a generator seeded by the
 * input's hash.  Contract checks (trap if broken):
 *   - a call either succeeds or fails with a message; a refused call
 *     changes no length and no stored value;
 *   - every length is the model's: an append past the capacity (ordinary
 *     cache) is refused, one within it adds n; truncate to at most the
 *     length works unless the window's ring no longer holds the positions
 *     the last kept token attends to; reset empties;
 *   - a paged cache's append may also be refused because its pool is
 *     full (and then changes nothing); its pages are all counted after
 *     each operation (used + free = the pool), and all free after a reset
 *     of every sequence;
 *   - a fork makes the target hold what the source holds (reads and
 *     decoding then check it); onto itself it is refused;
 *   - a read returns what the append stored: for f32 exactly the values
 *     given (unrotated); for every dtype the same values on every read
 *     until the
 *     positions are truncated or overwritten (the model keeps the first
 *     read after each append);
 *   - a window cache refuses reads of positions its ring no longer holds
 *     (the model follows the oldest one: appends move it, a truncation
 *     keeps it, a reset or a truncation to 0 clears it); a paged one
 *     holds at most that (it gives back the pages that fell out of the
 *     window): a read or a rollback the ring would refuse it refuses, one
 *     the ring would take it may refuse too (with a message, nothing
 *     changed), and what it reads is what was stored, as above;
 *   - a decoding step on an ordinary cache gives, for each sequence, the
 *     bits of mha_attention on the keys read back (causal bottom-right;
 *     within 1e-4 of them on a rotated cache, which turns q and out),
 *     and a finite output from finite data on a window cache;
 *   - so does a ragged step (mha_attention_decode with q_start: 0, 1 or
 *     2 new queries a sequence, as many as it holds at most), and with
 *     share_prefix (a paged cache's forks read their shared pages once,
 *     a merge of two parts: not those bits, which the replay of the
 *     seeded mutants shows) within 1e-5 of them.
 *
 * Built two ways, as the other targets (fuzz/CMakeLists.txt); CTest's
 * fuzz_replay_cache replays fuzz/corpus/cache.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

static const char *fuzz_who(void) { return "fuzz_cache"; }
#include "fuzz_common.h"

enum { BMAX = 3, CAPMAX = 40, ROWMAX = 2 * 41, OPS = 64 };

/* Uniform in [-2, 2): finite in every dtype. */
static float rng_value(void)
{
    return (float)(2.0 * rng_unit());
}

/* What sequence s must hold: its length, and (for the positions the ring
 * or buffer still has) the K/V rows a read returned after their append. */
typedef struct model {
    int64_t len[BMAX];
    int64_t lo[BMAX];          /* the oldest position the ring holds */
    float k[BMAX][CAPMAX][ROWMAX], v[BMAX][CAPMAX][ROWMAX];
    int known[BMAX][CAPMAX];   /* slot holds the values in k/v above */
} model;

typedef struct setup {
    mha_kv_cache_config c;
    int64_t row;
    int paged_window;   /* a window on pages: holds at most the ring's */
} setup;

/* Slot of position p: p itself, or p % capacity in a ring. */
static int64_t slot(const setup *s, int64_t p)
{
    return s->c.window ? p % s->c.capacity : p;
}


/* Reads positions [p0, p0 + n) back and checks them against the model. */
static void check_read(mha_kv_cache *kv, const setup *s, model *m, int64_t q,
                       int64_t p0, int64_t n)
{
    float k[CAPMAX * ROWMAX], v[CAPMAX * ROWMAX];
    const mha_status st = mha_kv_cache_read(kv, q, p0, n, k, v);
    /* (no tokens: anywhere up to the length, ring or not) */
    const int held = p0 >= 0 && n >= 0 && p0 + n <= m->len[q] &&
                     (n == 0 || p0 >= m->lo[q]);
    CHECK((st == MHA_OK) == held || (held && s->paged_window),
          "read of %lld at %lld from a length %lld: %s", (long long)n,
          (long long)p0, (long long)m->len[q],
          st == MHA_OK ? "accepted" : mha_last_error());
    if (st != MHA_OK) {
        CHECK(*mha_last_error(), "refused with no message");
        return;
    }
    for (int64_t t = 0; t < n; t++) {
        const int64_t sl = slot(s, p0 + t);
        const float *kr = k + t * s->row, *vr = v + t * s->row;
        if (!m->known[q][sl]) {   /* the first read after the append */
            memcpy(m->k[q][sl], kr, (size_t)s->row * sizeof *kr);
            memcpy(m->v[q][sl], vr, (size_t)s->row * sizeof *vr);
            m->known[q][sl] = 1;
        }
        CHECK(!memcmp(m->k[q][sl], kr, (size_t)s->row * sizeof *kr) &&
              !memcmp(m->v[q][sl], vr, (size_t)s->row * sizeof *vr),
              "position %lld of sequence %lld reads back differently",
              (long long)(p0 + t), (long long)q);
    }
}

static void check_lengths(mha_kv_cache *kv, const setup *s, const model *m)
{
    for (int64_t q = 0; q < s->c.batch; q++)
        CHECK(mha_kv_cache_length(kv, q) == m->len[q],
              "sequence %lld has length %lld, the model %lld", (long long)q,
              (long long)mha_kv_cache_length(kv, q), (long long)m->len[q]);
}

/* The step's rows of sequence b (lq of them, ending at its last key)
 * against mha_attention on the keys read back: the same bits, or within
 * tol (a rotated cache; a cascade's merge). */
static void check_rows(mha_kv_cache *kv, const setup *s, const model *m,
                       int64_t b, int64_t lq, const float *q,
                       const float *out, float tol)
{
    const int64_t hkv = s->c.num_kv_heads, dh = s->c.head_dim, H = 2 * hkv;
    const int64_t L = m->len[b];
    float k[CAPMAX * ROWMAX], v[CAPMAX * ROWMAX], o[3 * 2 * ROWMAX];
    CHECK(mha_kv_cache_read(kv, b, 0, L, k, v) == MHA_OK, "read: %s",
          mha_last_error());
    mha_attention_args e;
    memset(&e, 0, sizeof e);
    e.batch = 1;
    e.num_heads = H;
    e.num_kv_heads = hkv;
    e.head_dim = dh;
    e.q_len = lq;
    e.kv_len = L;
    e.q = q;
    e.k = k;
    e.v = v;
    e.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    e.out = o;
    CHECK(mha_attention(&e) == MHA_OK, "attention: %s", mha_last_error());
    if (tol == 0.0f) {
        CHECK(!memcmp(o, out, (size_t)(lq * H * dh) * sizeof *o),
              "sequence %lld: its step differs from attention on its keys",
              (long long)b);
        return;
    }
    for (int64_t t = 0; t < lq * H * dh; t++)
        CHECK(fabsf(o[t] - out[t]) <= tol,
              "sequence %lld: its step differs from attention on its keys "
              "by %g", (long long)b, (double)fabsf(o[t] - out[t]));
}

/* After a step's call (status st, n outputs): a refusal carries a
 * message; else the outputs are finite (from finite data), and its rows
 * are to be compared (1) unless the cache is a window's ring. */
static int stepped(mha_status st, const float *out, int64_t n,
                   const setup *s)
{
    if (st != MHA_OK) {
        CHECK(*mha_last_error(), "a decoding step refused with no message");
        return 0;
    }
    for (int64_t t = 0; t < n; t++)
        CHECK(isfinite(out[t]), "a non-finite output from finite data");
    return !s->c.window;
}

/* A decoding step of lq queries per sequence on heads (H = 2 H_kv). */
static void decode(mha_kv_cache *kv, const setup *s, model *m, int lq)
{
    const int64_t hkv = s->c.num_kv_heads, dh = s->c.head_dim, H = 2 * hkv;
    float q[BMAX * 3 * 2 * ROWMAX], out[BMAX * 3 * 2 * ROWMAX];
    for (int64_t t = 0; t < s->c.batch * lq * H * dh; t++)
        q[t] = rng_value();
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = s->c.batch;
    a.num_heads = H;
    a.num_kv_heads = hkv;
    a.head_dim = dh;
    a.q_len = lq;
    a.q = q;
    a.out = out;
    a.cache = kv;
    if (!stepped(mha_attention(&a), out, s->c.batch * lq * H * dh, s))
        return;
    /* Ordinary cache: each sequence the bits of attention on its keys
     * (a rotated cache, which turns q and out and reads its keys back
     * turned: float rounding of values below 2 in magnitude, d_h <= 41
     * terms, never more than 1e-4) */
    for (int64_t b = 0; b < s->c.batch; b++)
        if (m->len[b] >= lq)   /* (else its first queries see nothing) */
            check_rows(kv, s, m, b, lq, q + b * lq * H * dh,
                       out + b * lq * H * dh, s->c.rotate ? 1e-4f : 0.0f);
}

/* A ragged step: sequence b's n[b] new queries (0 .. 2, at most its
 * length) packed back to back (q_start), share_prefix or not. */
static void ragged(mha_kv_cache *kv, const setup *s, model *m, int share)
{
    const int64_t hkv = s->c.num_kv_heads, dh = s->c.head_dim, H = 2 * hkv;
    int64_t q_start[BMAX + 1] = {0};
    for (int64_t b = 0; b < s->c.batch; b++) {
        int64_t n = (int64_t)(rng_unit() * 3.0);
        n = n > m->len[b] ? m->len[b] : n;
        q_start[b + 1] = q_start[b] + n;
    }
    const int64_t T = q_start[s->c.batch];
    float q[BMAX * 2 * 2 * ROWMAX], out[BMAX * 2 * 2 * ROWMAX];
    for (int64_t t = 0; t < T * H * dh; t++)
        q[t] = rng_value();
    mha_attention_decode_args d;
    memset(&d, 0, sizeof d);
    d.batch = s->c.batch;
    d.num_heads = H;
    d.head_dim = dh;
    d.q = q;
    d.out = out;
    d.cache = kv;
    d.q_start = q_start;
    d.share_prefix = share;
    if (!stepped(mha_attention_decode(&d), out, T * H * dh, s))
        return;
    for (int64_t b = 0; b < s->c.batch; b++) {
        const int64_t n = q_start[b + 1] - q_start[b];
        if (n)
            check_rows(kv, s, m, b, n, q + q_start[b] * H * dh,
                       out + q_start[b] * H * dh,
                       s->c.rotate ? 1e-4f : share ? 1e-5f : 0.0f);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 6)
        return 0;
    rng_seed_bytes(data, size);
    setup s;
    memset(&s, 0, sizeof s);
    s.c.batch = 1 + data[0] % BMAX;
    s.c.num_kv_heads = 1 + data[1] % 2;
    s.c.head_dim = 1 + data[2] % 40;
    s.c.capacity = 1 + data[3] % CAPMAX;
    s.c.dtype = (mha_kv_dtype)(data[4] % 5);
    s.c.rotate = data[4] / 5 % 2;
    if ((s.c.dtype == MHA_KV_Q4 || s.c.rotate) && s.c.head_dim % 2)
        s.c.head_dim++;   /* two codes a byte; rotation pairs */
    s.c.window = data[5] % 3 ? 0 : 1 + (data[5] / 3) % s.c.capacity;
    if (!s.c.window && data[5] & 8) {   /* paged: pages of 64 or 16 (a */
        s.c.page_size = data[5] & 4 ? 16 : 64;   /* tile is 4 of them), */
        s.c.num_pages =   /* a pool of 1 .. B tiles' worth of pages */
            1 + (data[5] >> 4) % (s.c.batch * (64 / s.c.page_size));
    } else if (s.c.window && data[5] & 64) {   /* a window on pages of */
        s.c.page_size = 16;                    /* 16: the ring whole pages */
        s.c.capacity = s.c.capacity > 16 ? 32 : 16;
        s.c.window = 1 + (data[5] / 3) % s.c.capacity;
        s.c.num_pages =   /* a pool of 1 .. every ring's pages */
            1 + (data[5] >> 4 & 3) % (s.c.batch * (s.c.capacity / 16));
        s.paged_window = 1;
    }
    s.row = s.c.num_kv_heads * s.c.head_dim;
    mha_kv_cache *kv = NULL;
    const mha_status cst = mha_kv_cache_create(&s.c, &kv);
    if (cst != MHA_OK) {
        CHECK(cst == MHA_ERR_UNSUPPORTED && *mha_last_error(),
              "a valid cache refused: %s", mha_last_error());
        return 0;
    }
    static model m;
    memset(&m, 0, sizeof m);
    float k[(CAPMAX + 1) * ROWMAX], v[(CAPMAX + 1) * ROWMAX];  /* n <= cap+1 */
    for (size_t at = 6, ops = 0; at + 1 < size && ops < OPS; at += 2, ops++) {
        const int op = data[at] % 7;
        const int arg = data[at + 1];
        const int64_t q = arg % s.c.batch - (arg % 17 == 16);   /* -1 too */
        if (op == 0) {            /* append n = 0 .. capacity + 1 */
            const int64_t n = (arg / 4) % (s.c.capacity + 2);
            for (int64_t t = 0; t < n * s.row; t++)
                k[t] = rng_value(), v[t] = rng_value();
            const mha_status st = mha_kv_cache_append(kv, q, k, v, n);
            const int fits = q >= 0 && (s.c.window ? n <= s.c.capacity
                                        : m.len[q] + n <= s.c.capacity);
            /* a paged cache's pool may be full: refused, nothing changed
             * (check_lengths below), else as any cache */
            const int pool_full = s.c.page_size && fits &&
                                  st == MHA_ERR_OUT_OF_MEMORY &&
                                  strstr(mha_last_error(), "pool is full");
            CHECK((st == MHA_OK) == fits || pool_full,
                  "append of %lld to %lld: %s", (long long)n, (long long)q,
                  st == MHA_OK ? "accepted" : mha_last_error());
            if (st == MHA_OK) {
                for (int64_t t = 0; t < n; t++) {
                    const int64_t sl = slot(&s, m.len[q] + t);
                    m.known[q][sl] = 0;
                    if (s.c.dtype == MHA_KV_F32 && !s.c.rotate) {
                        /* exact: known now */
                        memcpy(m.k[q][sl], k + t * s.row,
                               (size_t)s.row * sizeof *k);
                        memcpy(m.v[q][sl], v + t * s.row,
                               (size_t)s.row * sizeof *v);
                        m.known[q][sl] = 1;
                    }
                }
                m.len[q] += n;
                /* a ring overwrites position p - capacity with p */
                if (s.c.window && m.len[q] - s.c.capacity > m.lo[q])
                    m.lo[q] = m.len[q] - s.c.capacity;
            }
        } else if (op == 1) {     /* truncate */
            if (q < 0)
                continue;
            const int64_t to = (arg / 4) % (m.len[q] + 2);
            const mha_status st = mha_kv_cache_truncate(kv, q, to);
            const int64_t need = s.c.window ? (to > s.c.window
                                                   ? to - s.c.window : 0)
                                            : 0;
            /* (to 0 keeps no token: nothing to attend to, always kept) */
            const int ok = to <= m.len[q] &&
                           (to == 0 || need >= m.lo[q]);
            CHECK((st == MHA_OK) == ok ||
                      (ok && s.paged_window && *mha_last_error()),
                  "truncate of %lld from %lld to "
                  "%lld: %s", (long long)q, (long long)m.len[q],
                  (long long)to, st == MHA_OK ? "accepted" : mha_last_error());
            if (st == MHA_OK) {
                m.len[q] = to;
                if (to == 0)
                    m.lo[q] = 0;
            }
        } else if (op == 2) {     /* reset one sequence or all */
            CHECK(mha_kv_cache_reset(kv, q) == MHA_OK, "reset %lld: %s",
                  (long long)q, mha_last_error());
            for (int64_t b = 0; b < s.c.batch && b < BMAX; b++)
                if (q < 0 || b == q) {
                    m.len[b] = 0;
                    m.lo[b] = 0;
                    memset(m.known[b], 0, sizeof m.known[b]);
                }
        } else if (op == 3) {     /* read a range, possibly out of bounds */
            if (q < 0)
                continue;
            const int64_t p0 = (int64_t)(arg / 4 % 8) - 1;
            const int64_t n = (int64_t)(arg / 32 % 6);
            check_read(kv, &s, &m, q, m.len[q] > 4 ? m.len[q] - 4 + p0 : p0,
                       n);
        } else if (op == 4) {     /* read all a sequence holds */
            if (q < 0)
                continue;
            check_read(kv, &s, &m, q, m.lo[q], m.len[q] - m.lo[q]);
        } else if (op == 5) {     /* a decoding step, or a ragged one */
            if ((arg & 0xC0) == 0xC0)   /* (a quarter of them) */
                ragged(kv, &s, &m, arg >> 5 & 1);
            else
                decode(kv, &s, &m, 1 + arg % 3);
        } else {                  /* fork q into another sequence */
            const int64_t to = q < 0 ? 0 : (q + 1 + arg / 17) % s.c.batch;
            const mha_status st = mha_kv_cache_fork(kv, q, to);
            CHECK((st == MHA_OK) == (q >= 0 && to != q), "fork of %lld "
                  "onto %lld: %s", (long long)q, (long long)to,
                  st == MHA_OK ? "accepted" : mha_last_error());
            if (st == MHA_OK) {
                m.len[to] = m.len[q];
                m.lo[to] = m.lo[q];
                memcpy(m.k[to], m.k[q], sizeof m.k[to]);
                memcpy(m.v[to], m.v[q], sizeof m.v[to]);
                memcpy(m.known[to], m.known[q], sizeof m.known[to]);
            }
        }
        check_lengths(kv, &s, &m);
        mha_kv_cache_usage u;   /* the pool's pages all counted */
        CHECK(mha_kv_cache_get_usage(kv, &u) == MHA_OK &&
                  u.pages_used + u.pages_free == s.c.num_pages,
              "usage: %lld pages used and %lld free of %lld",
              (long long)u.pages_used, (long long)u.pages_free,
              (long long)s.c.num_pages);
    }
    /* every page back once no sequence holds it */
    mha_kv_cache_usage u;
    CHECK(mha_kv_cache_reset(kv, -1) == MHA_OK &&
              mha_kv_cache_get_usage(kv, &u) == MHA_OK &&
              u.pages_free == s.c.num_pages && u.tokens == 0,
          "after a reset of all: %lld of %lld pages free",
          (long long)u.pages_free, (long long)s.c.num_pages);
    mha_kv_cache_free(kv);
    return 0;
}
