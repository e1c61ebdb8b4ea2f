/*
 * induction.c -- a two-layer attention-only transformer, built on libmha
 * and trained from scratch, whose heads specialise: one becomes a
 * previous-token head, another an induction head.
 *
 * The task.  A sequence holds a segment of n random tokens twice, with
 * random filler around: [p fillers] [segment] [G - p fillers] [segment],
 * every token distinct but for the repeat ("x c q f k a j w q f k a").
 * In the second copy the next token is always predictable by induction:
 * the current token appeared once before, and the answer is the token
 * that followed it then ([A][B] ... [A] -> [B]).  Only those n - 1
 * predictions are trained and scored; the rest is random.  p is drawn per
 * sequence, so the distance between the copies varies: no head can find
 * the answer by position alone.
 *
 * Why two layers.  An induction head in layer 2 must find "the position
 * after the earlier copy of my token".  Its keys can only match that
 * position if each position's residual stream already carries the token
 * *before* it -- which is what a previous-token head in layer 1 writes.
 * One layer cannot solve the task; two can, and training finds the circuit.
 *
 * The model (no MLPs, no layer norm):
 *   x0 = tok_emb[token] + pos_emb[position]
 *   x1 = x0 + MHA_1(x0)          (causal self-attention, libmha)
 *   x2 = x1 + MHA_2(x1)
 *   logits = x2 W_u^T + b_u
 * trained with cross-entropy and Adam (PyTorch's formula, below).  The
 * attention layers' forward and backward are mha_plan_forward /
 * mha_plan_backward; everything else is the few loops in this file.
 *
 * After training it measures, on held-out sequences, per head: the
 * previous-token score (mean weight on key i-1), the induction score (mean
 * weight on the key after the earlier copy of the current token), and the
 * accuracy when the head alone is ablated (head_mask 0).  Then it prunes
 * greedily: again and again the head whose removal (with those already
 * removed, by head_mask) costs least, while the accuracy stays within one
 * point of the full model's; builds that smaller model with
 * mha_prune_heads, and measures it (accuracy, speed).  It generates:
 * held-out prompts are continued token by token through a KV cache per
 * layer, as an inference engine runs a model, and every step must equal
 * recomputing the whole prefix.  It prints the
 * clearest previous-token and induction heads as text heatmaps; with
 * --out DIR it writes what `mha viz` needs to draw every head as a PNG
 * (scripts/induction_demo.sh does all of it in one command).
 *
 * Usage: example_induction [--quick] [--seed S] [--steps N] [--target ACC]
 *                          [--out DIR]
 * Exit status 0 when the held-out accuracy at the end is >= the target
 * (0.95) and the pruned model scores what the ablated one does.
 */
#define _POSIX_C_SOURCE 200809L   /* clock_gettime */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <mha_io.h>

enum { LAYERS = 2, MAX_HEADS = 16 };

/* ---- configuration -------------------------------------------------------- */

typedef struct config {
    int vocab;        /* V tokens, shown as letters: V >= n + G */
    int seg;          /* n: the repeated segment */
    int gap;          /* G: filler tokens, split at random around copy 1 */
    int d;            /* residual width = embed_dim of each layer */
    int heads;
    int batch;        /* training sequences per step */
    int eval_batch;   /* held-out sequences */
    int steps;        /* training steps */
    int eval_every;
    float lr;
    double target;    /* held-out accuracy to reach */
    double prune_loss;/* pruning stops before accuracy falls this much */
    uint64_t seed;
    const char *out_dir;
} config;

static const config FULL = {26, 10, 10, 64, 4, 64, 512, 1500, 100, 3e-3f,
                            0.95, 0.01, 1, NULL};
static const config QUICK = {16, 6, 6, 32, 2, 32, 256, 400, 50, 1e-2f, 0.95,
                             0.01, 1, NULL};

/* ---- random numbers: splitmix64 -------------------------------------------- */

static uint64_t next_u64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *s) { return (next_u64(s) >> 11) * 0x1p-53; }

static float normal(uint64_t *s)
{
    const double u1 = 1.0 - uniform(s), u2 = uniform(s);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static int seq_len(const config *c) { return 2 * c->seg + c->gap; }

/* [p fillers] [segment] [G - p fillers] [segment], n + G distinct tokens:
 * the second copy always starts at n + G, the first at p. */
static void make_batch(const config *c, int B, uint64_t *s, int *tok)
{
    const int T = seq_len(c), n = c->seg, G = c->gap;
    int perm[64];
    for (int b = 0; b < B; b++) {
        for (int v = 0; v < c->vocab; v++)
            perm[v] = v;
        for (int i = 0; i < n + G; i++) {   /* partial Fisher-Yates */
            const int j = i + (int)(uniform(s) * (c->vocab - i));
            const int t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        const int p = (int)(uniform(s) * (G + 1));   /* 0 .. G */
        int *x = tok + b * T, k = 0;
        for (int i = 0; i < p; i++)
            x[k++] = perm[n + i];
        for (int i = 0; i < n; i++)
            x[k++] = perm[i];
        for (int i = p; i < G; i++)
            x[k++] = perm[n + i];
        for (int i = 0; i < n; i++)
            x[k++] = perm[i];
    }
}

/* ---- parameters and Adam ---------------------------------------------------- */

/* One tensor Adam updates: value, gradient and the two moments. */
typedef struct tensor {
    float *w, *g, *m, *v;
    int64_t n;
} tensor;

static int tensor_alloc(tensor *t, int64_t n)
{
    t->n = n;
    t->w = calloc((size_t)n, sizeof(float));
    t->g = calloc((size_t)n, sizeof(float));
    t->m = calloc((size_t)n, sizeof(float));
    t->v = calloc((size_t)n, sizeof(float));
    return t->w && t->g && t->m && t->v ? 0 : -1;
}

static void tensor_free(tensor *t)
{
    free(t->w); free(t->g); free(t->m); free(t->v);
}

/*
 * torch.optim.Adam (no weight decay, no amsgrad), step t >= 1:
 *   m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
 *   w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 */
static void adam(tensor *t, float lr, int step)
{
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    const double bc1 = 1.0 - pow(b1, step), bc2 = 1.0 - pow(b2, step);
    for (int64_t k = 0; k < t->n; k++) {
        const double g = t->g[k];
        t->m[k] = (float)(b1 * t->m[k] + (1.0 - b1) * g);
        t->v[k] = (float)(b2 * t->v[k] + (1.0 - b2) * g * g);
        const double denom = sqrt((double)t->v[k]) / sqrt(bc2) + eps;
        t->w[k] -= (float)(lr / bc1 * t->m[k] / denom);
    }
}

typedef struct model {
    config c;
    int T;
    tensor tok_emb, pos_emb, w_u, b_u;     /* (V,d) (T,d) (V,d) (V) */
    mha_module *attn[LAYERS];
    tensor attn_p[LAYERS];                 /* each module's flat parameters */
} model;

/* Copies a layer's flat parameters (Adam's copy) into its module. */
static int push_params(mha_module *m, const float *flat)
{
    for (int k = 0; k < mha_param_count(m); k++) {
        mha_param_info info;
        mha_param_info_at(m, k, &info);
        if (mha_param_set(m, info.name, flat + info.offset, info.numel) !=
            MHA_OK)
            return -1;
    }
    return 0;
}

static int model_init(model *md, const config *c)
{
    memset(md, 0, sizeof *md);
    md->c = *c;
    md->T = seq_len(c);
    const int V = c->vocab, d = c->d;
    if (tensor_alloc(&md->tok_emb, (int64_t)V * d) ||
        tensor_alloc(&md->pos_emb, (int64_t)md->T * d) ||
        tensor_alloc(&md->w_u, (int64_t)V * d) || tensor_alloc(&md->b_u, V))
        return -1;
    uint64_t s = c->seed * 0x632be59bd9b4e019ULL + 17;
    const float emb_sd = 1.0f / sqrtf((float)d);   /* rows of norm ~1 */
    for (int64_t k = 0; k < md->tok_emb.n; k++)
        md->tok_emb.w[k] = emb_sd * normal(&s);
    for (int64_t k = 0; k < md->pos_emb.n; k++)
        md->pos_emb.w[k] = emb_sd * normal(&s);
    for (int64_t k = 0; k < md->w_u.n; k++)
        md->w_u.w[k] = emb_sd * normal(&s);
    for (int l = 0; l < LAYERS; l++) {
        mha_config mc = {0};
        mc.embed_dim = d;
        mc.num_heads = c->heads;
        mc.seed = c->seed * 31 + (uint64_t)l;   /* Xavier, zero biases */
        if (mha_create(&mc, &md->attn[l]) != MHA_OK ||
            tensor_alloc(&md->attn_p[l], mha_param_numel(md->attn[l])))
            return -1;
        for (int k = 0; k < mha_param_count(md->attn[l]); k++) {
            mha_param_info info;
            mha_param_info_at(md->attn[l], k, &info);
            mha_param_get(md->attn[l], info.name,
                          md->attn_p[l].w + info.offset, info.numel);
        }
    }
    return 0;
}

static void model_free(model *md)
{
    tensor_free(&md->tok_emb); tensor_free(&md->pos_emb);
    tensor_free(&md->w_u); tensor_free(&md->b_u);
    for (int l = 0; l < LAYERS; l++) {
        mha_free(md->attn[l]);
        tensor_free(&md->attn_p[l]);
    }
}

/* ---- forward and backward ------------------------------------------------ */

/* What one batch size needs: plans and activations. */
typedef struct run {
    int B;
    mha_plan *plan[LAYERS];
    mha_forward_args fa[LAYERS];
    float *x[LAYERS + 1];      /* residual stream before each layer, after */
    float *y;                  /* a layer's output */
    float *logits;             /* (B*T, V) */
    float *dx, *dtmp;          /* backward: d residual, d layer input */
    float *weights[LAYERS];    /* (B, H, T, T) when asked, else NULL */
} run;

static int run_init(run *r, const model *md, int B, int with_weights)
{
    memset(r, 0, sizeof *r);
    r->B = B;
    const int64_t n = (int64_t)B * md->T * md->c.d;
    for (int l = 0; l <= LAYERS; l++)
        if (!(r->x[l] = malloc((size_t)n * sizeof(float))))
            return -1;
    r->y = malloc((size_t)n * sizeof(float));
    r->dx = malloc((size_t)n * sizeof(float));
    r->dtmp = malloc((size_t)n * sizeof(float));
    r->logits = malloc((size_t)B * md->T * md->c.vocab * sizeof(float));
    if (!r->y || !r->dx || !r->dtmp || !r->logits)
        return -1;
    for (int l = 0; l < LAYERS; l++) {
        mha_forward_args *a = &r->fa[l];
        a->batch = B;
        a->q_len = md->T;
        a->query = r->x[l];          /* self-attention: key = value = x */
        a->causal = MHA_CAUSAL_TOP_LEFT;
        a->out = r->y;
        if (with_weights) {
            const int64_t nw = (int64_t)B * md->c.heads * md->T * md->T;
            if (!(r->weights[l] = malloc((size_t)nw * sizeof(float))))
                return -1;
            a->need_weights = MHA_WEIGHTS_PER_HEAD;
            a->attn_weights = r->weights[l];
        }
        if (mha_plan_create(md->attn[l], a, &r->plan[l]) != MHA_OK)
            return -1;
    }
    return 0;
}

static void run_free(run *r)
{
    for (int l = 0; l <= LAYERS; l++)
        free(r->x[l]);
    for (int l = 0; l < LAYERS; l++) {
        mha_plan_free(r->plan[l]);
        free(r->weights[l]);
    }
    free(r->y); free(r->logits); free(r->dx); free(r->dtmp);
}

/* The forward pass; head_mask[l] may be NULL. */
static int forward(const model *md, run *r, const int *tok,
                   const float *const *head_mask)
{
    const int T = md->T, d = md->c.d, V = md->c.vocab;
    const int64_t rows = (int64_t)r->B * T;
    for (int64_t i = 0; i < rows; i++) {
        const float *e = md->tok_emb.w + (int64_t)tok[i] * d;
        const float *p = md->pos_emb.w + (i % T) * d;
        for (int k = 0; k < d; k++)
            r->x[0][i * d + k] = e[k] + p[k];
    }
    for (int l = 0; l < LAYERS; l++) {
        r->fa[l].head_mask = head_mask ? head_mask[l] : NULL;
        if (mha_plan_forward(r->plan[l], &r->fa[l]) != MHA_OK)
            return -1;
        for (int64_t k = 0; k < rows * d; k++)
            r->x[l + 1][k] = r->x[l][k] + r->y[k];
    }
    const float *x = r->x[LAYERS];
    for (int64_t i = 0; i < rows; i++)
        for (int v = 0; v < V; v++) {
            const float *w = md->w_u.w + (int64_t)v * d;
            float acc = md->b_u.w[v];
            for (int k = 0; k < d; k++)
                acc += x[i * d + k] * w[k];
            r->logits[i * V + v] = acc;
        }
    return 0;
}

/* Is position t's next token scored?  In the second copy, but its last. */
static int scored(const config *c, int t)
{
    return t >= c->seg + c->gap && t < seq_len(c) - 1;
}

/* Cross-entropy of the scored predictions and their accuracy; with `dlog`
 * also d loss / d logits (mean over the scored predictions). */
static double loss_and_grad(const model *md, const run *r, const int *tok,
                            double *accuracy, float *dlog)
{
    const int T = md->T, V = md->c.vocab;
    double loss = 0.0;
    int64_t right = 0, count = 0;
    const double per = 1.0 / ((double)r->B * (md->c.seg - 1));
    for (int64_t i = 0; i < (int64_t)r->B * T; i++) {
        const int t = (int)(i % T);
        const float *z = r->logits + i * V;
        if (dlog)
            memset(dlog + i * V, 0, (size_t)V * sizeof *dlog);
        if (!scored(&md->c, t))
            continue;
        const int want = tok[i + 1];
        int best = 0;
        float mx = z[0];
        for (int v = 1; v < V; v++)
            if (z[v] > mx) {
                mx = z[v];
                best = v;
            }
        double sum = 0.0;
        for (int v = 0; v < V; v++)
            sum += exp((double)z[v] - mx);
        loss += log(sum) - ((double)z[want] - mx);
        right += best == want;
        count++;
        if (dlog)
            for (int v = 0; v < V; v++)
                dlog[i * V + v] = (float)(per * (exp((double)z[v] - mx) / sum -
                                                 (v == want)));
    }
    *accuracy = (double)right / (double)count;
    return loss / (double)count;
}

/* One training step: forward, backward, Adam.  Returns the loss. */
static double train_step(model *md, run *r, const int *tok, float *dlog,
                         int step, double *accuracy)
{
    const int T = md->T, d = md->c.d, V = md->c.vocab;
    const int64_t rows = (int64_t)r->B * T;
    if (forward(md, r, tok, NULL))
        return NAN;
    const double loss = loss_and_grad(md, r, tok, accuracy, dlog);

    /* The unembedding: dW_u = dlog^T x2, db_u, dx2 = dlog W_u. */
    const float *x = r->x[LAYERS];
    memset(md->w_u.g, 0, (size_t)md->w_u.n * sizeof(float));
    memset(md->b_u.g, 0, (size_t)md->b_u.n * sizeof(float));
    memset(r->dx, 0, (size_t)(rows * d) * sizeof(float));
    for (int64_t i = 0; i < rows; i++)
        for (int v = 0; v < V; v++) {
            const float g = dlog[i * V + v];
            if (g == 0.0f)
                continue;
            md->b_u.g[v] += g;
            for (int k = 0; k < d; k++) {
                md->w_u.g[(int64_t)v * d + k] += g * x[i * d + k];
                r->dx[i * d + k] += g * md->w_u.w[(int64_t)v * d + k];
            }
        }
    /* The layers, last first: x_{l+1} = x_l + MHA_l(x_l), so
     * dx_l = dx_{l+1} + (dMHA_l / dx_l)^T dx_{l+1}. */
    for (int l = LAYERS - 1; l >= 0; l--) {
        mha_backward_args b = {0};
        b.grad_out = r->dx;
        b.grad_query = r->dtmp;   /* key = value = query: the sum */
        b.grad_params = md->attn_p[l].g;
        if (mha_plan_backward(r->plan[l], &r->fa[l], &b) != MHA_OK)
            return NAN;
        for (int64_t k = 0; k < rows * d; k++)
            r->dx[k] += r->dtmp[k];
    }
    /* The embeddings. */
    memset(md->tok_emb.g, 0, (size_t)md->tok_emb.n * sizeof(float));
    memset(md->pos_emb.g, 0, (size_t)md->pos_emb.n * sizeof(float));
    for (int64_t i = 0; i < rows; i++)
        for (int k = 0; k < d; k++) {
            md->tok_emb.g[(int64_t)tok[i] * d + k] += r->dx[i * d + k];
            md->pos_emb.g[(i % T) * d + k] += r->dx[i * d + k];
        }

    const float lr = md->c.lr;
    adam(&md->tok_emb, lr, step);
    adam(&md->pos_emb, lr, step);
    adam(&md->w_u, lr, step);
    adam(&md->b_u, lr, step);
    for (int l = 0; l < LAYERS; l++) {
        adam(&md->attn_p[l], lr, step);
        if (push_params(md->attn[l], md->attn_p[l].w))
            return NAN;
    }
    return loss;
}

/* Held-out accuracy, heads masked as given (NULL: none). */
static double evaluate(const model *md, run *r, const int *tok,
                       const float *const *head_mask)
{
    double acc;
    if (forward(md, r, tok, head_mask))
        return -1.0;
    loss_and_grad(md, r, tok, &acc, NULL);
    return acc;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- what the heads do ------------------------------------------------------ */

/* Mean attention weight, over held-out sequences and positions, on the
 * previous key (prev) and on the key after the earlier copy of the current
 * token (for t in the second copy: j + 1 where tok[j] = tok[t], j < t). */
static void head_scores(const model *md, const run *r, const int *tok, int l,
                        int h, double *prev, double *ind)
{
    const int T = md->T, H = md->c.heads, second = md->c.seg + md->c.gap;
    double sp = 0, si = 0;
    int64_t cp = 0, ci = 0;
    for (int b = 0; b < r->B; b++) {
        const float *w = r->weights[l] + ((int64_t)b * H + h) * T * T;
        const int *x = tok + b * T;
        for (int t = 1; t < T; t++) {
            sp += w[t * T + t - 1];
            cp++;
            if (t >= second) {
                int j = 0;
                while (x[j] != x[t])
                    j++;
                si += w[t * T + j + 1];
                ci++;
            }
        }
    }
    *prev = sp / (double)cp;
    *ind = si / (double)ci;
}

static const char *role(double prev, double ind)
{
    if (ind > 0.5 && ind > prev)
        return "induction";
    if (prev > 0.5)
        return "previous token";
    return "-";
}

/* Head h of layer l on held-out sequence 0, shaded as the seeds draw
 * attention (' ' < 0.1 <= ░ < 0.25 <= ▒ < 0.5 <= ▓ < 0.75 <= █), the
 * tokens on both axes. */
static void print_head(const model *md, const run *r, const int *tok, int l,
                       int h, const char *title)
{
    static const char *shade[] = {" ", "░", "▒", "▓", "█"};
    const int T = md->T;
    const float *w = r->weights[l] + (int64_t)h * T * T;   /* b = 0 */
    printf("\n%s: head %d.%d on a held-out sequence (rows attend to "
           "columns)\n   ", title, l + 1, h);
    for (int j = 0; j < T; j++)
        printf(" %c", 'a' + tok[j]);
    printf("\n");
    for (int i = 0; i < T; i++) {
        printf(" %c [", 'a' + tok[i]);
        for (int j = 0; j < T; j++) {
            const float p = w[i * T + j];
            const int lvl = p < 0.1f ? 0 : p < 0.25f ? 1 : p < 0.5f ? 2
                          : p < 0.75f ? 3 : 4;
            printf(" %s", shade[lvl]);
        }
        printf(" ]\n");
    }
}

/* ---- files for mha viz ------------------------------------------------------- */

static int save_npy(const char *dir, const char *name, const float *x,
                    int64_t T, int64_t d)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    const mha_tensor_view v = {name, MHA_DTYPE_F32, 3, {1, T, d}, x};
    return mha_npy_save(path, &v) == MHA_OK ? 0 : -1;
}

/* One held-out sequence: both layers' inputs, the layers, the tokens. */
static int write_viz_inputs(const model *md, const run *r, const int *tok,
                            const char *dir)
{
    char path[1024];
    for (int l = 0; l < LAYERS; l++) {
        snprintf(path, sizeof path, "%s/layer%d.safetensors", dir, l + 1);
        if (mha_module_save(md->attn[l], path) != MHA_OK)
            return -1;
        char name[32];
        snprintf(name, sizeof name, "x%d.npy", l);
        if (save_npy(dir, name, r->x[l], md->T, md->c.d))
            return -1;
    }
    snprintf(path, sizeof path, "%s/tokens.txt", dir);
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    for (int t = 0; t < md->T; t++)
        fprintf(f, "%c\n", 'a' + tok[t]);
    return fclose(f) == 0 ? 0 : -1;
}

/* ---- generation through KV caches -------------------------------------- */

/* Embeds tokens tok[p0 .. p0+n) at their positions into x (n, d). */
static void embed(const model *md, const int *tok, int p0, int n, float *x)
{
    const int d = md->c.d;
    for (int i = 0; i < n; i++) {
        const float *e = md->tok_emb.w + (int64_t)tok[p0 + i] * d;
        const float *p = md->pos_emb.w + (int64_t)(p0 + i) * d;
        for (int k = 0; k < d; k++)
            x[i * d + k] = e[k] + p[k];
    }
}

/* logits (V) of one residual row x (d). */
static void unembed(const model *md, const float *x, float *logits)
{
    const int d = md->c.d;
    for (int v = 0; v < md->c.vocab; v++) {
        const float *w = md->w_u.w + (int64_t)v * d;
        float acc = md->b_u.w[v];
        for (int k = 0; k < d; k++)
            acc += x[k] * w[k];
        logits[v] = acc;
    }
}

static int argmax(const float *x, int n)
{
    int best = 0;
    for (int k = 1; k < n; k++)
        if (x[k] > x[best])
            best = k;
    return best;
}

/*
 * Greedy generation, the way an inference engine runs a model: the prompt
 * (a held-out sequence up to the first token of its second copy) is
 * prefilled through one KV cache per layer, then the model writes the rest
 * of the copy one token at a time, each step embedding one token, running
 * each layer on it alone (mha_plan_forward with args.cache) and reading
 * the next token off the logits.  *correct counts the generated tokens
 * that continue the segment; *diff is the largest difference between a
 * step's logits and the logits of the full forward recomputed over the
 * generated sequence (which must be float rounding).
 */
static int generate(const model *md, const int *seq, int *correct,
                    double *diff)
{
    const config *c = &md->c;
    const int T = md->T, d = c->d, V = c->vocab, P = c->seg + c->gap + 1;
    int tok[64];
    memcpy(tok, seq, (size_t)P * sizeof *tok);
    mha_kv_cache *kv[LAYERS] = {NULL, NULL};
    mha_plan *step[LAYERS] = {NULL, NULL};
    float *x = malloc((size_t)T * d * sizeof *x);
    float *y = malloc((size_t)T * d * sizeof *y);
    float *logits = malloc((size_t)T * V * sizeof *logits);
    run full;
    int st = !x || !y || !logits || run_init(&full, md, 1, 0);
    for (int l = 0; l < LAYERS && !st; l++)
        st = mha_kv_cache_for_module(md->attn[l], 1, T, &kv[l]) != MHA_OK;
    /* Prefill P tokens, then one at a time: the n tokens from p0 through
     * both layers, the logits of the last. */
    for (int p0 = 0, n = P; !st && p0 + n <= T; p0 += n, n = 1) {
        embed(md, tok, p0, n, x);
        for (int l = 0; l < LAYERS && !st; l++) {
            mha_forward_args a = {0};
            a.batch = 1;
            a.q_len = n;
            a.query = x;
            a.cache = kv[l];
            a.out = y;
            if (n == 1 && !step[l])
                st = mha_plan_create(md->attn[l], &a, &step[l]) != MHA_OK;
            if (!st)
                st = (n == 1 ? mha_plan_forward(step[l], &a)
                             : mha_forward(md->attn[l], &a)) != MHA_OK;
            for (int64_t k = 0; k < (int64_t)n * d; k++)
                x[k] += y[k];
        }
        const int last = p0 + n - 1;
        unembed(md, x + (int64_t)(n - 1) * d, logits + (int64_t)last * V);
        if (last + 1 < T)
            tok[last + 1] = argmax(logits + (int64_t)last * V, V);
    }
    *correct = 0;
    *diff = 0.0;
    if (!st)
        st = forward(md, &full, tok, NULL);
    for (int p = P - 1; !st && p < T - 1; p++) {
        *correct += tok[p + 1] == seq[p + 1];
        for (int v = 0; v < V; v++) {
            const double e = fabs((double)logits[(int64_t)p * V + v] -
                                  full.logits[(int64_t)p * V + v]);
            *diff = e > *diff ? e : *diff;
        }
    }
    for (int l = 0; l < LAYERS; l++) {
        mha_plan_free(step[l]);
        mha_kv_cache_free(kv[l]);
    }
    if (x && y && logits)
        run_free(&full);
    free(x); free(y); free(logits);
    return st ? -1 : 0;
}

/* ---- main ----------------------------------------------------------------------- */

static int usage(void)
{
    fputs("usage: example_induction [--quick] [--seed S] [--steps N]\n"
          "                         [--target ACC] [--out DIR]\n", stderr);
    return 2;
}

static int fail(const char *what)
{
    fprintf(stderr, "example_induction: %s: %s\n", what, mha_last_error());
    return 1;
}

/* Sorts n doubles (insertion sort: n is small). */
static void sort(double *x, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && x[j] < x[j - 1]; j--) {
            const double t = x[j];
            x[j] = x[j - 1];
            x[j - 1] = t;
        }
}

/* Median ms of the attention layers' forward, 21 runs. */
static double time_layers(run *r)
{
    double t[21];
    for (int k = 0; k < 21; k++) {
        const double s = now();
        for (int l = 0; l < LAYERS; l++)
            mha_plan_forward(r->plan[l], &r->fa[l]);
        t[k] = now() - s;
    }
    sort(t, 21);
    return 1e3 * t[10];
}

int main(int argc, char **argv)
{
    config c = FULL;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--quick"))
            c = QUICK;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--quick"))
            continue;
        if (!v)
            return usage();
        if (!strcmp(a, "--seed"))
            c.seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--target"))
            c.target = atof(v);
        else if (!strcmp(a, "--steps"))
            c.steps = atoi(v);
        else if (!strcmp(a, "--out"))
            c.out_dir = v;
        else
            return usage();
        i++;
    }
    if (c.out_dir) {
        /* Before 30 s of training, not after: DIR must take a file. */
        char probe[4096];
        snprintf(probe, sizeof probe, "%s/.example_induction_probe",
                 c.out_dir);
        FILE *f = fopen(probe, "w");
        if (!f) {
            fprintf(stderr, "example_induction: --out %s: cannot write "
                    "there (is it an existing, writable directory?)\n",
                    c.out_dir);
            return 2;
        }
        fclose(f);
        remove(probe);
    }
    const int T = seq_len(&c);
    if (c.steps < 1 || !(c.target > 0 && c.target <= 1) ||
        c.vocab < c.seg + c.gap || c.vocab > 26 || T > 64)
        return usage();

    model md;
    run tr, ev;
    int *tok = malloc((size_t)c.batch * T * sizeof *tok);
    int *eval_tok = malloc((size_t)c.eval_batch * T * sizeof *eval_tok);
    float *dlog = malloc((size_t)c.batch * T * c.vocab * sizeof *dlog);
    if (!tok || !eval_tok || !dlog || model_init(&md, &c) ||
        run_init(&tr, &md, c.batch, 0) || run_init(&ev, &md, c.eval_batch, 1))
        return fail("setup");
    uint64_t train_rng = c.seed * 2 + 1, eval_rng = c.seed * 2 + 0x5eed;
    make_batch(&c, c.eval_batch, &eval_rng, eval_tok);   /* held out */

    printf("induction task: %d tokens, a segment of %d repeated after %d to "
           "%d others (%d tokens in all); %d predictions scored per "
           "sequence\n", c.vocab, c.seg, c.seg, c.seg + c.gap, T, c.seg - 1);
    printf("model: 2 attention layers x %d heads, d_model %d, %lld "
           "parameters; Adam lr %g, batch %d, %d steps; target %.0f%% on %d "
           "held-out sequences\n\n", c.heads, c.d,
           (long long)(md.tok_emb.n + md.pos_emb.n + md.w_u.n + md.b_u.n +
                       md.attn_p[0].n + md.attn_p[1].n),
           (double)c.lr, c.batch, c.steps, 100 * c.target, c.eval_batch);

    const double t0 = now();
    double t_last = t0, acc = 0.0, loss_sum = 0.0, reached_s = -1.0;
    int since = 0, reached_step = 0;
    for (int step = 1; step <= c.steps; step++) {
        make_batch(&c, c.batch, &train_rng, tok);
        double train_acc;
        const double loss = train_step(&md, &tr, tok, dlog, step, &train_acc);
        if (isnan(loss))
            return fail("training step");
        loss_sum += loss;
        since++;
        if (step % c.eval_every == 0 || step == c.steps) {
            acc = evaluate(&md, &ev, eval_tok, NULL);
            if (acc < 0)
                return fail("evaluation");
            const double t = now();
            printf("step %5d  loss %.4f  held-out accuracy %5.1f%%  "
                   "%6.1f steps/s  %5.1f s\n", step, loss_sum / since,
                   100 * acc, since / (t - t_last), t - t0);
            fflush(stdout);
            t_last = t;
            loss_sum = 0.0;
            since = 0;
            if (acc >= c.target && reached_s < 0) {
                reached_s = t - t0;
                reached_step = step;
            }
        }
    }
    if (reached_s >= 0)
        printf("\n%.0f%% first reached at step %d, %.1f s; after %d steps, "
               "%.1f s: %.1f%%\n", 100 * c.target, reached_step, reached_s,
               c.steps, now() - t0, 100 * acc);
    else
        printf("\n%.0f%% NOT reached in %d steps: %.1f%%\n", 100 * c.target,
               c.steps, 100 * acc);

    /* Each head: its scores and the accuracy without it. */
    const int H = c.heads;
    acc = evaluate(&md, &ev, eval_tok, NULL);
    if (c.out_dir && write_viz_inputs(&md, &ev, eval_tok, c.out_dir))
        return fail("writing the heatmap inputs");
    float keep_mask[LAYERS][MAX_HEADS];
    for (int l = 0; l < LAYERS; l++)
        for (int h = 0; h < H; h++)
            keep_mask[l][h] = 1.0f;
    const float *masks[LAYERS] = {keep_mask[0], keep_mask[1]};
    printf("\nheads as layer.head: layers from 1 (layer1.png, layer2.png), "
           "heads from 0\nas in mha viz, head_mask and mha prune --keep\n\n"
           "| head | previous-token score | induction score | role | "
           "accuracy without it |\n|---|---|---|---|---|\n");
    for (int l = 0; l < LAYERS; l++)
        for (int h = 0; h < H; h++) {
            double prev, ind;
            head_scores(&md, &ev, eval_tok, l, h, &prev, &ind);
            keep_mask[l][h] = 0.0f;
            const double a = evaluate(&md, &ev, eval_tok, masks);
            keep_mask[l][h] = 1.0f;
            printf("| %d.%d | %.2f | %.2f | %s | %.1f%% (%+.1f) |\n", l + 1,
                   h, prev, ind, role(prev, ind), 100 * a, 100 * (a - acc));
        }

    /* The clearest previous-token head of layer 1 and induction head of
     * layer 2, in the terminal. */
    int best_prev = 0, best_ind = 0;
    double top_prev = -1, top_ind = -1;
    for (int h = 0; h < H; h++) {
        double prev, ind;
        head_scores(&md, &ev, eval_tok, 0, h, &prev, &ind);
        if (prev > top_prev) {
            top_prev = prev;
            best_prev = h;
        }
        head_scores(&md, &ev, eval_tok, 1, h, &prev, &ind);
        if (ind > top_ind) {
            top_ind = ind;
            best_ind = h;
        }
    }
    evaluate(&md, &ev, eval_tok, NULL);   /* the unablated weights */
    print_head(&md, &ev, eval_tok, 0, best_prev, "previous-token head");
    print_head(&md, &ev, eval_tok, 1, best_ind, "induction head");

    /* A whole layer at once: each role is spread over several heads. */
    for (int l = 0; l < LAYERS; l++) {
        for (int h = 0; h < H; h++)
            keep_mask[l][h] = 0.0f;
        printf("%severy head of layer %d ablated: %.1f%%", l ? "; " : "\n",
               l + 1, 100 * evaluate(&md, &ev, eval_tok, masks));
        for (int h = 0; h < H; h++)
            keep_mask[l][h] = 1.0f;
    }
    printf("\n");

    /* Greedy pruning by head_mask: remove the head that costs least, while
     * the accuracy stays within prune_loss of the full model's and every
     * layer keeps a head. */
    printf("\npruning, the least useful head first:\n");
    double acc_ablated = acc;
    int left[LAYERS] = {H, H};
    for (;;) {
        int bl = -1, bh = -1;
        double best = -1.0;
        for (int l = 0; l < LAYERS; l++)
            for (int h = 0; h < H && left[l] > 1; h++) {
                if (keep_mask[l][h] == 0.0f)
                    continue;
                keep_mask[l][h] = 0.0f;
                const double a = evaluate(&md, &ev, eval_tok, masks);
                keep_mask[l][h] = 1.0f;
                if (a > best) {
                    best = a;
                    bl = l;
                    bh = h;
                }
            }
        if (bl < 0 || best < acc - c.prune_loss)
            break;
        keep_mask[bl][bh] = 0.0f;
        left[bl]--;
        acc_ablated = best;
        printf("  without head %d.%d: %.1f%%\n", bl + 1, bh, 100 * best);
    }

    /* The smaller model: mha_prune_heads on each layer. */
    int64_t keep[LAYERS][MAX_HEADS];
    model pruned = md;   /* the embeddings shared, the layers pruned */
    for (int l = 0; l < LAYERS; l++) {
        int64_t n = 0;
        for (int h = 0; h < H; h++)
            if (keep_mask[l][h] != 0.0f)
                keep[l][n++] = h;
        if (mha_prune_heads(md.attn[l], keep[l], n, &pruned.attn[l]) !=
            MHA_OK)
            return fail("mha_prune_heads");
    }
    run pr;
    if (run_init(&pr, &pruned, c.eval_batch, 0))
        return fail("pruned setup");
    const double acc_pruned = evaluate(&pruned, &pr, eval_tok, NULL);
    for (int l = 0; l < LAYERS; l++) {   /* time like for like */
        ev.fa[l].need_weights = MHA_WEIGHTS_NONE;
        ev.fa[l].head_mask = NULL;
    }
    const double ms_full = time_layers(&ev), ms_pruned = time_layers(&pr);
    printf("pruned model, heads");
    for (int l = 0; l < LAYERS; l++)
        for (int h = 0; h < H; h++)
            if (keep_mask[l][h] != 0.0f)
                printf(" %d.%d", l + 1, h);
    printf(" (%d of %d): %.1f%% held-out accuracy (%.1f%% ablated by "
           "head_mask, %.1f%% unpruned)\n", left[0] + left[1], 2 * H,
           100 * acc_pruned, 100 * acc_ablated, 100 * acc);
    printf("  attention layers: %lld -> %lld parameters, forward on %d "
           "sequences %.2f -> %.2f ms (median of 21)\n",
           (long long)(md.attn_p[0].n + md.attn_p[1].n),
           (long long)(mha_param_numel(pruned.attn[0]) +
                       mha_param_numel(pruned.attn[1])),
           c.eval_batch, ms_full, ms_pruned);

    /* Generation, token by token through KV caches. */
    int gen_ok = 0, gen_n = 0;
    double gen_diff = 0.0;
    for (int q = 0; q < 8 && q < c.eval_batch; q++) {
        int right;
        double diff;
        if (generate(&md, eval_tok + (int64_t)q * T, &right, &diff))
            return fail("generation");
        gen_ok += right;
        gen_n += c.seg - 1;
        gen_diff = diff > gen_diff ? diff : gen_diff;
    }
    printf("generation through a KV cache per layer, token by token: %d of "
           "%d generated tokens continue the segment (8 held-out prompts); "
           "logits equal recomputing the prefix within %.1g\n", gen_ok,
           gen_n, gen_diff);

    int status = acc >= c.target ? 0 : 1;
    if (!(gen_diff <= 1e-3)) {
        printf("generation through the cache disagrees with the forward\n");
        status = 1;
    }
    /* (equal up to rounding: at most a near tie or two may flip) */
    if (fabs(acc_pruned - acc_ablated) > 2.5 / (c.eval_batch * (c.seg - 1))) {
        printf("the pruned model disagrees with the ablated one\n");
        status = 1;
    }
    run_free(&pr);
    for (int l = 0; l < LAYERS; l++)
        mha_free(pruned.attn[l]);
    run_free(&tr);
    run_free(&ev);
    model_free(&md);
    free(tok); free(eval_tok); free(dlog);
    return status;
}
