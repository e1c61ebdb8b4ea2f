/*
 * cmd_example.c -- `mha example`: the seeds' worked example, computed by
 * libmha with its true values and explained (the scale, a zero query, a
 * causal mask, two tiles of keys merged as flash attention merges them),
 * then a larger self-attention at random initialisation.
 */
#include "commands.h"
#include "fail.h"
#include "heatmap.h"
#include "mha.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the worked example of seeds/003 (h = 2, d = 4, d_k = d_v = 2) ---- */

static const float X[3][4] = {{1, 0, 1, 0}, {0, 1, 0, 1}, {1, 1, 0, 0}};

/* W[head][q,k,v] as the seed writes them: (d_in = 4) x (d_k = 2), used as
 * X @ W.  libmha stores the transpose, [out, in], as PyTorch does.  The
 * seed numbers its heads 1 and 2; mha numbers them 0 and 1 everywhere
 * (head_mask, --keep, mha viz), and so does this output. */
static const float W[2][3][4][2] = {
    {{{1, 0}, {0, 1}, {0, 0}, {0, 0}},     /* W1_Q */
     {{0, 1}, {1, 0}, {0, 0}, {0, 0}},     /* W1_K */
     {{1, 0}, {0, 0}, {1, 0}, {0, 0}}},    /* W1_V */
    {{{0, 0}, {0, 0}, {1, 0}, {0, 1}},     /* W2_Q */
     {{0, 0}, {0, 0}, {0, 1}, {1, 0}},     /* W2_K */
     {{0, 1}, {0, 1}, {0, 0}, {0, 0}}}};   /* W2_V */

/* What the seed prints, kept only to point out where it slipped. */
static const float SEED_PROJ[2][3][3][2] = {
    {{{1, 0}, {0, 1}, {1, 1}}, {{0, 1}, {1, 0}, {1, 1}},
     {{2, 0}, {0, 0}, {1, 0}}},
    {{{1, 0}, {0, 1}, {0, 0}}, {{0, 1}, {1, 0}, {0, 0}},
     {{0, 1}, {0, 1}, {0, 0}}}};
static const float SEED_SCORES1[3][3] = {
    {0.71f, 0.00f, 1.41f}, {0.00f, 0.71f, 0.71f}, {0.71f, 0.71f, 1.41f}};
static const float SEED_SOFTMAX1[3][3] = {
    {0.30f, 0.15f, 0.55f}, {0.21f, 0.37f, 0.42f}, {0.21f, 0.21f, 0.58f}};

static void print_matrix(const char *title, const float *a, int rows,
                         int cols, int ld)
{
    printf("  %s\n", title);
    for (int i = 0; i < rows; i++) {
        printf("    [");
        for (int j = 0; j < cols; j++)
            printf(" %7.4f", (double)a[i * ld + j]);
        printf(" ]\n");
    }
}

/* Lists each entry where the seed's table differs from the true value by
 * more than its own rounding (0.005). */
static int report_slips(const char *what, const float *seed,
                        const float *truth, int rows, int cols, int ld)
{
    int n = 0;
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float s = seed[i * cols + j], t = truth[i * ld + j];
            if (fabsf(s - t) > 0.0051f) {
                printf("    %s[%d][%d]: the seed prints %.2f, the true value "
                       "is %.4f\n", what, i, j, (double)s, (double)t);
                n++;
            }
        }
    return n;
}

/* The online softmax of flash attention, on head 0: key 1 forms one
 * tile and keys 2-3 another; each tile gives per row its max m, its sum
 * l = sum exp(s - m) and o = sum exp(s - m) v, and the two merge by
 * rescaling both to the larger max.  The result equals the softmax over
 * all three keys. */
static void tiles_step(float proj[3][3 * 4], const float *out, float scale)
{
    enum { E = 4, L = 3, DH = 2 };
    const int first[2] = {0, 1}, last[2] = {1, 3};
    double m[2][L], l[2][L], o[2][L][DH], merged[L][DH];
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < L; i++) {
            double s[L], mx = -INFINITY;
            for (int j = first[t]; j < last[t]; j++) {
                s[j] = 0.0;
                for (int d = 0; d < DH; d++)
                    s[j] += (double)proj[0][i * E + d] * proj[1][j * E + d];
                s[j] *= scale;
                mx = s[j] > mx ? s[j] : mx;
            }
            m[t][i] = mx;
            l[t][i] = 0.0;
            o[t][i][0] = o[t][i][1] = 0.0;
            for (int j = first[t]; j < last[t]; j++) {
                const double e = exp(s[j] - mx);
                l[t][i] += e;
                for (int d = 0; d < DH; d++)
                    o[t][i][d] += e * proj[2][j * E + d];
            }
        }
    double worst = 0.0;
    for (int i = 0; i < L; i++) {
        const double mx = m[0][i] > m[1][i] ? m[0][i] : m[1][i];
        const double a0 = exp(m[0][i] - mx), a1 = exp(m[1][i] - mx);
        const double sum = l[0][i] * a0 + l[1][i] * a1;
        for (int d = 0; d < DH; d++) {
            merged[i][d] = (o[0][i][d] * a0 + o[1][i][d] * a1) / sum;
            const double diff = fabs(merged[i][d] - out[i * E + d]);
            worst = diff > worst ? diff : worst;
        }
    }
    printf("\n-- Two tiles of keys, merged (head 0): how flash attention "
           "avoids the L x L matrix --\n");
    printf("  Tile A = key 1, tile B = keys 2-3.  Per tile and row: m = the "
           "largest score,\n  l = sum exp(s - m), o = sum exp(s - m) V.  "
           "Merged: M = max(m_A, m_B),\n  output = (o_A e^(m_A-M) + o_B "
           "e^(m_B-M)) / (l_A e^(m_A-M) + l_B e^(m_B-M)).\n");
    for (int i = 0; i < L; i++)
        printf("    row %d: A (m %7.4f, l %6.4f)  B (m %7.4f, l %6.4f)\n",
               i + 1, m[0][i], l[0][i], m[1][i], l[1][i]);
    float mf[L * DH];
    for (int i = 0; i < L; i++)
        for (int d = 0; d < DH; d++)
            mf[i * DH + d] = (float)merged[i][d];
    print_matrix("head 0 output from the two tiles:", mf, L, DH, DH);
    printf("  largest difference from head 0's output above: %.1e (float "
           "rounding):\n  the same softmax, never holding a whole row of "
           "scores (docs/LEARN.md, step 5).\n", worst);
}

static int worked_example(void)
{
    const int E = 4, H = 2, dh = 2, L = 3;
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.no_bias = 1;    /* the seed's projections have no bias */
    mha_module *m = NULL;
    mha_status st = mha_create(&cfg, &m);
    if (st != MHA_OK)
        return tool_fail_status("example", "mha_create", st);

    /* in_proj_weight [3E, E]: row (p*E + h*dh + o) = column o of W[h][p]. */
    float in_proj[12 * 4], out_proj[16] = {0};
    for (int p = 0; p < 3; p++)
        for (int h = 0; h < H; h++)
            for (int o = 0; o < dh; o++)
                for (int c = 0; c < E; c++)
                    in_proj[(p * E + h * dh + o) * E + c] = W[h][p][c][o];
    for (int k = 0; k < E; k++)
        out_proj[k * E + k] = 1.0f;   /* W^O = I: the output is the concat */
    if ((st = mha_param_set(m, "in_proj_weight", in_proj, 48)) != MHA_OK ||
        (st = mha_param_set(m, "out_proj.weight", out_proj, 16)) != MHA_OK) {
        mha_free(m);
        return tool_fail_status("example", "mha_param_set", st);
    }

    float proj[3][3 * 4], out[3 * 4], weights[2 * 3 * 3];
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = L;
    a.query = &X[0][0];
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = weights;
    a.out = out;
    st = mha_forward(m, &a);
    for (int p = 0; st == MHA_OK && p < 3; p++)
        st = mha_project(m, (mha_projection)p, &X[0][0], L, proj[p]);
    /* The same module under a causal mask: query i sees keys 1..i. */
    float causal_out[3 * 4], causal_w[2 * 3 * 3];
    if (st == MHA_OK) {
        a.causal = MHA_CAUSAL_TOP_LEFT;
        a.attn_weights = causal_w;
        a.out = causal_out;
        st = mha_forward(m, &a);
    }
    mha_config resolved;
    mha_get_config(m, &resolved);
    mha_free(m);
    if (st != MHA_OK)
        return tool_fail_status("example", "forward", st);

    printf("== The worked example of the seeds (section 5.5): h = 2 heads, "
           "d = 4, d_k = d_v = 2 ==\n\n");
    print_matrix("X (3 x 4), one row per position:", &X[0][0], 3, 4, 4);
    printf("\n  Each head projects X with its own W_Q, W_K, W_V (4 x 2), as "
           "in the seed;\n  biases are off and W^O = I (the seed leaves W^O "
           "unspecified),\n  so the module's output is the concatenation of "
           "the heads.\n  Heads are numbered from 0, as everywhere in mha: "
           "head 0 and head 1 are\n  the seed's heads 1 and 2 (its W1_*, "
           "W2_*).\n");

    int slips = 0;
    char buf[96];
    const char *names[3] = {"Q", "K", "V"};
    const char labels[] = "123";
    for (int h = 0; h < H; h++) {
        printf("\n-- Head %d --\n", h);
        for (int p = 0; p < 3; p++) {
            snprintf(buf, sizeof buf, "%s%d = X W%d_%s:", names[p], h, h,
                     names[p]);
            print_matrix(buf, proj[p] + h * dh, L, dh, E);
        }
        float scores[9];
        for (int i = 0; i < L; i++)
            for (int j = 0; j < L; j++) {
                float s = 0.0f;
                for (int d = 0; d < dh; d++)
                    s += proj[0][i * E + h * dh + d] * proj[1][j * E + h * dh + d];
                scores[i * L + j] = s * resolved.scale;
            }
        if (h == 0)
            printf("  Why / sqrt(2): d_k = 2 here.  If q and k have entries "
                   "of variance 1,\n  q . k sums d_k such products and has "
                   "variance d_k; dividing by sqrt(d_k)\n  brings it back "
                   "to 1, so that at d_k = 64 the softmax is not nearly\n"
                   "  one-hot (docs/LEARN.md, step 2).\n");
        snprintf(buf, sizeof buf, "scaled scores Q%d K%d^T / sqrt(2):", h, h);
        print_matrix(buf, scores, L, L, L);
        for (int i = 0; i < L; i++) {
            int zero = 1;
            for (int d = 0; d < dh; d++)
                zero &= proj[0][i * E + h * dh + d] == 0.0f;
            if (zero)
                printf("  Row %d of Q%d is zero (X's row %d has nothing in "
                       "the columns W%d_Q reads),\n  so its scores are all "
                       "0 and its softmax row is uniform: 1/%d each.\n",
                       i + 1, h, i + 1, h, L);
        }
        const float *w = weights + h * L * L;
        print_matrix("softmax weights (each row sums to 1):", w, L, L, L);
        snprintf(buf, sizeof buf, "head %d output = weights V%d:", h, h);
        print_matrix(buf, out + h * dh, L, dh, E);
        printf("  heatmap (rows: query position, columns: key position):\n");
        snprintf(buf, sizeof buf, "  head %d", h);
        const char *title = buf;
        tool_heatmaps(stdout, &w, &title, 1, L, L, labels, labels);

        /* Where the seed's tables disagree with the computation. */
        for (int p = 0; p < 3; p++) {
            snprintf(buf, sizeof buf, "%s%d", names[p], h);
            slips += report_slips(buf, &SEED_PROJ[h][p][0][0],
                                  proj[p] + h * dh, L, dh, E);
        }
        if (h == 0) {
            slips += report_slips("scores0", &SEED_SCORES1[0][0], scores, L,
                                  L, L);
            slips += report_slips("softmax0", &SEED_SOFTMAX1[0][0], w, L, L,
                                  L);
        }
    }
    printf("\n-- Concat(head 0, head 1) (3 x 4) = output, since W^O = I --\n");
    print_matrix("", out, L, E, E);

    printf("\n-- A causal mask: query i may see keys 1..i only --\n"
           "  (a model that predicts the next token must not read it)\n");
    print_matrix("head 0 softmax weights, causal:", causal_w, L, L, L);
    print_matrix("output, causal:", causal_out, L, E, E);
    printf("  Row 1 sees only key 1 (weight 1); row 3 sees every key, so "
           "its row is\n  the same as without the mask.\n");
    tiles_step(proj, out, resolved.scale);
    printf("\nNote: %d entries of the seed's worked example do not follow "
           "from its own X and W\n(listed above under each head); the values "
           "printed here are computed.\n", slips);
    return 0;
}

/* ---- a larger demo: B = 2, L = 16, E = 64, H = 4, random init ----------- */

static double gauss(uint64_t *state)
{
    /* SplitMix64 stream -> Box-Muller; enough for demo inputs. */
    uint64_t z[2];
    for (int k = 0; k < 2; k++) {
        uint64_t x = (*state += 0x9e3779b97f4a7c15ULL);
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
        z[k] = x ^ (x >> 31);
    }
    double u1 = ((double)(z[0] >> 11) + 1.0) * 0x1.0p-53;
    double u2 = (double)(z[1] >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static int random_demo(void)
{
    enum { B = 2, L = 16, E = 64, H = 4 };
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.seed = 7;
    mha_module *m = NULL;
    mha_status st = mha_create(&cfg, &m);
    if (st != MHA_OK)
        return tool_fail_status("example", "mha_create", st);

    /* Inputs: random token embeddings plus the sinusoidal positional
     * encoding of "Attention Is All You Need", so heads can key on
     * content, on position, or on both. */
    static float x[B * L * E], out[B * L * E], w[B * H * L * L];
    uint64_t rng = 2024;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < L; t++)
            for (int e = 0; e < E; e++) {
                double freq = pow(10000.0, -(double)(e / 2 * 2) / E);
                double pe = e % 2 ? cos(t * freq) : sin(t * freq);
                x[(b * L + t) * E + e] = (float)(gauss(&rng) + 2.0 * pe);
            }
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    a.query = x;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    a.out = out;
    st = mha_forward(m, &a);
    mha_free(m);
    if (st != MHA_OK)
        return tool_fail_status("example", "mha_forward", st);

    printf("\n== Self-attention, B = 2, L = 16, E = 64, H = 4, Xavier init "
           "(seed 7) ==\n");
    printf("Batch 0, each head's weights (rows: queries, columns: keys), "
           "shaded relative\nto the head's largest weight:\n\n");
    const char *lab = "0123456789abcdef";
    for (int pair = 0; pair < 2; pair++) {
        const float *maps[2] = {w + (2 * pair) * L * L,
                                w + (2 * pair + 1) * L * L};
        char t0[32], t1[32];
        snprintf(t0, sizeof t0, "  head %d", 2 * pair);
        snprintf(t1, sizeof t1, "  head %d", 2 * pair + 1);
        const char *titles[2] = {t0, t1};
        tool_heatmaps(stdout, maps, titles, 2, L, L, lab, lab);
        printf("\n");
    }

    /* How differently the heads attend: mean entropy of each head's rows,
     * and the mean total-variation distance between two heads' rows
     * (0 = identical distributions, 1 = disjoint). */
    printf("Per head (both batches): mean row entropy in nats (uniform over "
           "16 keys = %.3f)\n", log(16.0));
    for (int h = 0; h < H; h++) {
        double ent = 0;
        for (int b = 0; b < B; b++)
            for (int i = 0; i < L; i++)
                for (int j = 0; j < L; j++) {
                    double p = w[((b * H + h) * L + i) * L + j];
                    if (p > 0)
                        ent -= p * log(p);
                }
        printf("  head %d: %.3f\n", h, ent / (B * L));
    }
    printf("Mean total-variation distance between the heads' rows:\n       ");
    for (int g = 0; g < H; g++)
        printf("  head %d", g);
    printf("\n");
    for (int h = 0; h < H; h++) {
        printf("  head %d", h);
        for (int g = 0; g < H; g++) {
            double tv = 0;
            for (int b = 0; b < B; b++)
                for (int i = 0; i < L; i++)
                    for (int j = 0; j < L; j++)
                        tv += 0.5 * fabs(w[((b * H + h) * L + i) * L + j] -
                                         w[((b * H + g) * L + i) * L + j]);
            printf("  %6.3f", tv / (B * L));
        }
        printf("\n");
    }
    printf("These heads differ by chance: the weights are random (Xavier "
           "init), so each\nhead's slice of W_q and W_k compares tokens on "
           "a different random view, and\nevery head's rows stay broad "
           "(entropies not far below the uniform %.3f).\nNothing here has "
           "learned a role.  Heads that specialise by training\n"
           "(previous-token and induction heads): the README's \"Heads "
           "that specialise\",\nbash scripts/induction_demo.sh out.\n",
           log(16.0));
    return 0;
}

int cmd_example(int argc, char **argv)
{
    if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        printf("usage: mha example\n\n"
               "Prints the seeds' worked example (h = 2, d = 4) computed by "
               "libmha: for each\nhead Q, K, V, the scaled scores, the "
               "softmax weights, the head output and a\nheatmap; then the "
               "concatenation, and where the seed's own table slipped.\n"
               "Then a causal mask, the same output from two tiles of keys "
               "(the online\nsoftmax), and a larger random self-attention "
               "(B=2, L=16, E=64, H=4).\n");
        return 0;
    }
    if (argc > 1)
        return tool_fail("example", "unexpected argument '%s'", argv[1]);
    int rc = worked_example();
    return rc ? rc : random_demo();
}
