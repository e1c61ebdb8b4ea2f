/*
 * serving.c -- a toy server's attention layer: requests arrive over time,
 * join and leave a running batch, one forks, all in one paged KV cache,
 * each step one ragged call.
 *
 * Eleven requests share six sequence slots and a pool of 20 pages of 64
 * positions (f16).  A request joins when a slot is free and the pool has
 * room for it; its prompt is read in chunks of at most 96 tokens per step
 * (chunked prefill), then it generates one token per step until done, and
 * leaves (mha_kv_cache_reset gives its pages back).  Request 3, at its
 * first generated token, forks: a new request takes another slot with the
 * same prompt by sharing its pages (mha_kv_cache_fork), then continues on
 * its own (parallel sampling).  Every step is one mha_attention_decode
 * call with q_start: prefill chunks and single tokens side by side.
 *
 * The layer is attention on heads: a token's q, k and v are made up here
 * from (request, position), as a model's projections would give them.
 * At the end every request is run again alone -- its own contiguous cache,
 * the same chunks -- and its outputs must be the same bits; each request's
 * last output is also checked against float64 attention.
 *
 * Exit status 0 when every request agrees, 1 otherwise.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mha.h>

enum { H = 8, HKV = 2, DH = 32, E = H * DH, EKV = HKV * DH, SLOTS = 6,
       PAGES = 20, CHUNK = 96, NREQ = 11, MAXLEN = 600, MAXSTEPS = 400 };

typedef struct request {
    int arrive, prompt, gen;   /* step it arrives, tokens in, tokens out */
    int parent, fork_at;       /* a fork: of whom, at which length       */
    int slot, done, len;       /* its slot (-1: waiting), tokens so far  */
    int chunks[MAXSTEPS], nchunks;
    float out[MAXLEN * E];     /* its output row for every position      */
} request;

static request req[NREQ];

/* Token p of request r: made-up projections, the same for a fork's
 * prompt as for its parent's (they share it), its own after. */
static void token(int r, int p, float *q, float *k, float *v)
{
    const int who = req[r].parent >= 0 && p < req[r].fork_at ? req[r].parent
                                                              : r;
    for (int i = 0; i < E; i++)
        q[i] = sinf(0.013f * (float)(who * 7919 + p * 31 + i));
    for (int i = 0; i < EKV; i++) {
        k[i] = cosf(0.017f * (float)(who * 104729 + p * 17 + i));
        v[i] = sinf(0.023f * (float)(who * 1299709 + p * 13 + 3 * i));
    }
}

/* The pages request r takes at its full length. */
static int pages_of(int r)
{
    return (req[r].prompt + req[r].gen + 63) / 64;
}

static int fail(const char *what)
{
    fprintf(stderr, "%s: %s\n", what, mha_last_error());
    return 1;
}

/* Request r alone: its own cache, its chunks again; the same bits? */
static int alone(int r, double *worst)
{
    mha_kv_cache_config c = {0};
    c.batch = 1, c.num_kv_heads = HKV, c.head_dim = DH, c.capacity = MAXLEN;
    c.dtype = MHA_KV_F16;
    mha_kv_cache *kv = NULL;
    if (mha_kv_cache_create(&c, &kv) != MHA_OK)
        return fail("alone: a cache");
    static float q[CHUNK * E], out[CHUNK * E], k[CHUNK * EKV], v[CHUNK * EKV];
    int p = 0, same = 1;
    for (int c0 = 0; c0 < req[r].nchunks; c0++) {
        const int n = req[r].chunks[c0];
        for (int i = 0; i < n; i++)
            token(r, p + i, q + i * E, k + i * EKV, v + i * EKV);
        mha_attention_decode_args d = {0};
        d.batch = 1, d.num_heads = H, d.head_dim = DH, d.q_len = n;
        d.q = q, d.out = out, d.cache = kv;
        if (mha_kv_cache_append(kv, 0, k, v, n) != MHA_OK ||
            mha_attention_decode(&d) != MHA_OK)
            return fail("alone: a step");
        same &= !memcmp(out, req[r].out + p * E, (size_t)n * E * 4);
        p += n;
    }
    /* float64: the last position's heads over the keys the cache holds */
    static float ks[MAXLEN * EKV], vs[MAXLEN * EKV];
    if (mha_kv_cache_read(kv, 0, 0, p, ks, vs) != MHA_OK)
        return fail("alone: read");
    token(r, p - 1, q, k, v);
    for (int h = 0; h < H; h++) {
        const int g = h / (H / HKV);
        double s[MAXLEN], m = -INFINITY, l = 0.0;
        for (int j = 0; j < p; j++) {
            double dot = 0.0;
            for (int e = 0; e < DH; e++)
                dot += (double)q[h * DH + e] * ks[j * EKV + g * DH + e];
            s[j] = dot / sqrt((double)DH);
            m = s[j] > m ? s[j] : m;
        }
        for (int j = 0; j < p; j++)
            l += exp(s[j] - m);
        for (int e = 0; e < DH; e++) {
            double o = 0.0;
            for (int j = 0; j < p; j++)
                o += exp(s[j] - m) / l * vs[j * EKV + g * DH + e];
            const double err = fabs(o - req[r].out[(p - 1) * E + h * DH + e]);
            *worst = err > *worst ? err : *worst;
        }
    }
    mha_kv_cache_free(kv);
    return same ? 0 : 1;
}

int main(void)
{
    static const int arrive[NREQ - 1] = {0, 0, 1, 2, 3, 3, 5, 6, 8, 9};
    static const int prompt[NREQ - 1] = {150, 40, 300, 64, 7, 500, 90, 33,
                                         260, 128};
    static const int gen[NREQ - 1] = {20, 35, 10, 25, 40, 12, 30, 18, 22, 15};
    for (int r = 0; r < NREQ - 1; r++)
        req[r] = (request){arrive[r], prompt[r], gen[r], -1, 0, -1, 0, 0,
                           {0}, 0, {0}};
    /* request 10: request 3's fork, made when 3 generates its first token */
    req[10] = (request){-1, 64, 30, 3, 64, -1, 0, 0, {0}, 0, {0}};

    mha_kv_cache_config cc = {0};
    cc.batch = SLOTS, cc.num_kv_heads = HKV, cc.head_dim = DH;
    cc.capacity = MAXLEN, cc.dtype = MHA_KV_F16;
    cc.page_size = 64, cc.num_pages = PAGES;
    mha_kv_cache *kv = NULL;
    if (mha_kv_cache_create(&cc, &kv) != MHA_OK)
        return fail("mha_kv_cache_create");
    int owner[SLOTS];
    for (int s = 0; s < SLOTS; s++)
        owner[s] = -1;
    static float q[SLOTS * CHUNK * E], out[SLOTS * CHUNK * E],
        k[CHUNK * EKV], v[CHUNK * EKV];
    int finished = 0, steps = 0, peak = 0;
    for (int step = 0; finished < NREQ && step < MAXSTEPS; step++) {
        /* join: waiting requests in order, while a slot is free and the
         * pool can hold every active request whole (each counted at its
         * full length: a fork's shared pages twice, to be safe) */
        int reserved = 0;
        for (int s = 0; s < SLOTS; s++)
            if (owner[s] >= 0)
                reserved += pages_of(owner[s]);
        for (int r = 0; r < NREQ - 1; r++) {
            int s = 0;
            while (s < SLOTS && owner[s] >= 0)
                s++;
            if (req[r].slot >= 0 || req[r].done || req[r].arrive > step ||
                s == SLOTS || reserved + pages_of(r) > PAGES)
                continue;
            req[r].slot = s, owner[s] = r;
            reserved += pages_of(r);
        }
        /* the step: each active slot's new tokens, appended, queries packed */
        int64_t q_start[SLOTS + 1] = {0};
        for (int s = 0; s < SLOTS; s++) {
            const int r = owner[s];
            int n = 0;
            if (r >= 0) {
                const int left = req[r].prompt - req[r].len;
                n = left > 0 ? (left < CHUNK ? left : CHUNK) : 1;
                for (int i = 0; i < n; i++)
                    token(r, req[r].len + i, q + (q_start[s] + i) * E,
                          k + i * EKV, v + i * EKV);
                if (mha_kv_cache_append(kv, s, k, v, n) != MHA_OK)
                    return fail("append");
                req[r].chunks[req[r].nchunks++] = n;
            }
            q_start[s + 1] = q_start[s] + n;
        }
        mha_attention_decode_args d = {0};
        d.batch = SLOTS, d.num_heads = H, d.head_dim = DH;
        d.q = q, d.out = out, d.cache = kv, d.q_start = q_start;
        if (mha_attention_decode(&d) != MHA_OK)
            return fail("the ragged step");
        steps++;
        mha_kv_cache_usage u;
        mha_kv_cache_get_usage(kv, &u);
        peak = u.pages_used > peak ? (int)u.pages_used : peak;
        /* outputs kept; requests that are done leave; the fork is made */
        for (int s = 0; s < SLOTS; s++) {
            const int r = owner[s];
            if (r < 0)
                continue;
            const int n = (int)(q_start[s + 1] - q_start[s]);
            memcpy(req[r].out + req[r].len * E, out + q_start[s] * E,
                   (size_t)n * E * 4);
            req[r].len += n;
            if (r == 3 && req[r].len == req[r].prompt + 1 &&
                req[10].slot < 0) {   /* fork before its first token: */
                int t = 0;            /* the prompt's pages shared      */
                while (t < SLOTS && owner[t] >= 0)
                    t++;
                if (t < SLOTS) {
                    if (mha_kv_cache_fork(kv, s, t) != MHA_OK ||
                        mha_kv_cache_truncate(kv, t, req[r].prompt) != MHA_OK)
                        return fail("fork");
                    owner[t] = 10, req[10].slot = t;
                    req[10].len = req[r].prompt;
                    memcpy(req[10].out, req[r].out,
                           (size_t)req[r].prompt * E * 4);
                    memcpy(req[10].chunks, req[r].chunks,
                           (size_t)(req[r].nchunks - 1) * sizeof(int));
                    req[10].nchunks = req[r].nchunks - 1;
                    req[10].prompt = req[r].prompt;
                }
            }
            if (req[r].len == req[r].prompt + req[r].gen) {
                if (mha_kv_cache_reset(kv, s) != MHA_OK)
                    return fail("reset");
                owner[s] = -1, req[r].slot = -1, req[r].done = 1;
                finished++;
            }
        }
    }
    if (finished < NREQ) {
        fprintf(stderr, "only %d of %d requests finished\n", finished, NREQ);
        return 1;
    }
    mha_kv_cache_usage u;
    mha_kv_cache_get_usage(kv, &u);
    int same = 0;
    double worst = 0.0;
    for (int r = 0; r < NREQ; r++)
        same += alone(r, &worst) == 0;
    printf("%d requests (one a fork of request 3) through %d slots in %d "
           "ragged steps; at most %d of %d pages held, %lld free at the "
           "end\n", NREQ, SLOTS, steps, peak, PAGES,
           (long long)u.pages_free);
    printf("each request's outputs equal it run alone, bit for bit: %d of "
           "%d; last token against float64: %.2g\n", same, NREQ, worst);
    mha_kv_cache_free(kv);
    return same == NREQ && worst < 1e-5 && u.pages_free == PAGES ? 0 : 1;
}
