/*
 * Training with libmha: a student module learns to imitate a teacher.
 *
 * Each step is one forward and one backward on a plan (no allocation in
 * the loop), then plain SGD on every parameter.  The loss is the mean
 * squared error between the student's output and the teacher's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <mha.h>

enum { B = 4, L = 12, E = 32, H = 4, STEPS = 300 };

static int fail(const char *what)
{
    fprintf(stderr, "%s: %s\n", what, mha_last_error());
    return 1;
}

int main(void)
{
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    mha_module *teacher = NULL, *student = NULL;
    cfg.seed = 1;
    if (mha_create(&cfg, &teacher) != MHA_OK)
        return fail("mha_create");
    cfg.seed = 2;
    if (mha_create(&cfg, &student) != MHA_OK)
        return fail("mha_create");

    static float x[B * L * E], target[B * L * E], out[B * L * E];
    static float grad_out[B * L * E];
    for (int i = 0; i < B * L * E; i++)
        x[i] = (float)((i * 7919) % 1000) / 500.0f - 1.0f;   /* any input */

    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    a.query = x;                      /* self-attention */
    a.causal = MHA_CAUSAL_TOP_LEFT;
    a.out = target;
    if (mha_forward(teacher, &a) != MHA_OK)
        return fail("teacher forward");

    /* The gradients of all parameters, one flat buffer (info.offset). */
    const int64_t n_params = mha_param_numel(student);
    float *grads = malloc((size_t)n_params * sizeof *grads);
    float *p = malloc((size_t)n_params * sizeof *p);
    mha_plan *plan = NULL;
    a.out = out;
    if (!grads || !p || mha_plan_create(student, &a, &plan) != MHA_OK)
        return fail("setup");
    mha_backward_args g = {0};
    g.grad_out = grad_out;
    g.grad_params = grads;            /* overwritten at each step */

    const float lr = 0.5f;
    double first = 0.0, loss = 0.0;
    for (int step = 0; step <= STEPS; step++) {
        if (mha_plan_forward(plan, &a) != MHA_OK)
            return fail("forward");
        loss = 0.0;                   /* mean squared error, and its grad */
        for (int i = 0; i < B * L * E; i++) {
            const float d = out[i] - target[i];
            loss += (double)d * d / (B * L * E);
            grad_out[i] = 2.0f * d / (B * L * E);
        }
        if (step == 0)
            first = loss;
        if (step % 50 == 0)
            printf("step %3d  loss %.6f\n", step, loss);
        if (mha_plan_backward(plan, &a, &g) != MHA_OK)
            return fail("backward");
        for (int k = 0; k < mha_param_count(student); k++) {   /* SGD */
            mha_param_info info;
            mha_param_info_at(student, k, &info);
            float *w = p + info.offset;
            mha_param_get(student, info.name, w, info.numel);
            for (int64_t i = 0; i < info.numel; i++)
                w[i] -= lr * grads[info.offset + i];
            if (mha_param_set(student, info.name, w, info.numel) != MHA_OK)
                return fail("mha_param_set");
        }
    }
    printf("loss %.6f -> %.6f\n", first, loss);
    mha_plan_free(plan);
    free(p);
    free(grads);
    mha_free(student);
    mha_free(teacher);
    return loss < first / 4 ? 0 : 1;  /* the student must have learned */
}
