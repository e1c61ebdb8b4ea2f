/* Causal self-attention over a batch of two sequences with libmha. */
#include <stdio.h>
#include <mha.h>

enum { B = 2, L = 5, E = 16, H = 4 };  /* batch, length, embed_dim, heads */

static int fail(const char *what, mha_module *m)
{
    fprintf(stderr, "%s: %s\n", what, mha_last_error());
    mha_free(m);
    return 1;
}

int main(void)
{
    mha_config cfg = {0};  /* zero fields take their defaults */
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.seed = 42;
    mha_module *m = NULL;
    if (mha_create(&cfg, &m) != MHA_OK)
        return fail("mha_create", m);

    static float x[B * L * E], out[B * L * E], w[B * H * L * L];
    for (int i = 0; i < B * L * E; i++)
        x[i] = (float)(i % 7) / 7.0f - 0.5f;  /* any input */
    const int64_t lengths[B] = {L, 3};  /* sequence 1 is padded after 3 */

    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;                        /* key, value NULL: self-attention */
    a.query = x;                        /* (B, L, E) */
    a.key_lengths = lengths;
    a.causal = MHA_CAUSAL_TOP_LEFT;     /* query i sees keys j <= i */
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;                 /* (B, H, L, L) */
    a.out = out;                        /* (B, L, E) */
    if (mha_forward(m, &a) != MHA_OK)
        return fail("mha_forward", m);

    printf("out[0, 0, :4] = %.4f %.4f %.4f %.4f\n", out[0], out[1], out[2],
           out[3]);
    /* Each row of weights sums to 1 (a row left with no key would be 0). */
    for (int row = 0; row < B * H * L; row++) {
        float sum = 0.0f;
        for (int j = 0; j < L; j++)
            sum += w[row * L + j];
        if (sum < 0.99999f || sum > 1.00001f) {
            fprintf(stderr, "weights row %d sums to %g\n", row, sum);
            mha_free(m);
            return 1;
        }
    }
    printf("libmha %s: all %d weight rows sum to 1\n", mha_version_string(),
           B * H * L);
    mha_free(m);
    return 0;
}
