/*
 * test_thread_knobs.c -- the module's output and every gradient (input,
 * parameter and head-mask gradients) bitwise identical whatever sets the
 * thread count: num_threads in the API (1, 2, 4 and 0), OMP_NUM_THREADS
 * (1, 2, 4) and OPENBLAS_NUM_THREADS (1, 2, 4, alone and against
 * OMP_NUM_THREADS).
 *
 * Shapes where every path runs threaded: B=4, L=256, E=512, H=8, so that
 * every projection GEMM spans several blocks of the fixed grid
 * (src/module/linear.c) and the attention has work for every thread.
 * Three cases: self-attention (one fused q|k|v GEMM each way), cross-
 * attention with kdim != vdim != E and bias_k / bias_v (three GEMMs), and
 * a head mask with key == value (the k|v GEMM, the per-head output
 * projection, dL/d head_mask).
 *
 * The thread variables are read when OpenMP and the BLAS load, so the test
 * re-executes itself (posix_spawn of itself with --child) once per
 * environment, with exactly the variables under test set.  Each child
 * prints one FNV-1a hash per (case, num_threads, tensor); the parent
 * compares every hash with that of the first run (no variable set,
 * num_threads 1) and names each tensor that differs.
 */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

extern char **environ;

/* ---- the child: run the cases, print hashes ------------------------------ */

typedef struct kcase {
    const char *name;
    int64_t B, Lq, Lk, E, H, kdim, vdim;
    int cross;       /* key, value: 0 NULL (self), 1 apart, 2 key == value */
    int bias_kv;
    int head_mask;
} kcase;

static const kcase CASES[] = {
    {"self", 4, 256, 256, 512, 8, 0, 0, 0, 0, 0},
    {"cross", 4, 256, 320, 512, 8, 384, 320, 1, 1, 0},
    {"head_mask", 4, 256, 192, 512, 8, 0, 0, 2, 0, 1},
};
enum { NCASES = sizeof CASES / sizeof CASES[0] };

static const char *const TENSORS[] = {"out", "grad_query", "grad_key",
                                      "grad_value", "grad_params",
                                      "grad_head_mask"};
enum { NTENSORS = sizeof TENSORS / sizeof TENSORS[0] };

static uint64_t fnv1a(const float *x, int64_t n)
{
    const unsigned char *p = (const unsigned char *)x;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t k = 0; k < (size_t)n * sizeof(float); k++)
        h = (h ^ p[k]) * 0x100000001b3ULL;
    return h;
}

static float *filled(int64_t n, uint64_t seed, float lo, float hi)
{
    float *x = malloc((size_t)n * sizeof *x);
    if (x)
        tu_fill(x, n, seed, lo, hi);
    return x;
}

/* Runs case c with num_threads; prints "case threads tensor hash" lines. */
static int run_case(const kcase *c, int threads)
{
    mha_config cfg = {.embed_dim = c->E, .num_heads = c->H, .kdim = c->kdim,
                      .vdim = c->vdim, .add_bias_kv = c->bias_kv, .seed = 7};
    mha_module *m = NULL;
    if (mha_create(&cfg, &m) != MHA_OK)
        return 1;
    /* Xavier weights; biases random too (their gradients are column sums) */
    for (int k = 0; k < mha_param_count(m); k++) {
        mha_param_info info;
        mha_param_info_at(m, k, &info);
        if (strstr(info.name, "weight"))
            continue;
        float *v = filled(info.numel, 100 + (uint64_t)k, -0.5f, 0.5f);
        mha_param_set(m, info.name, v, info.numel);
        free(v);
    }
    const int64_t kdim = c->kdim ? c->kdim : c->E;
    const int64_t vdim = c->vdim ? c->vdim : c->E;
    const int64_t n_q = c->B * c->Lq * c->E;
    const int64_t n_k = c->B * c->Lk * kdim, n_v = c->B * c->Lk * vdim;
    const int64_t np = mha_param_numel(m);
    float *q = filled(n_q, 1, -1, 1), *k = filled(n_k, 2, -1, 1);
    float *v = filled(n_v, 3, -1, 1), *dy = filled(n_q, 4, -1, 1);
    float *t[NTENSORS] = {malloc((size_t)n_q * 4), malloc((size_t)n_q * 4),
                          malloc((size_t)n_k * 4), malloc((size_t)n_v * 4),
                          malloc((size_t)np * 4), malloc((size_t)c->H * 4)};
    const int64_t n[NTENSORS] = {n_q, n_q, n_k, n_v, np, c->H};
    const float hm[8] = {1.0f, 0.0f, 0.5f, 1.0f, 2.0f, 1.0f, 0.25f, 1.0f};

    mha_forward_args a = {0};
    a.batch = c->B;
    a.q_len = c->Lq;
    a.kv_len = c->Lk;
    a.query = q;
    a.key = c->cross ? k : NULL;
    a.value = c->cross == 1 ? v : NULL;
    a.head_mask = c->head_mask ? hm : NULL;
    a.num_threads = threads;
    a.out = t[0];
    mha_backward_args g = {0};
    g.grad_out = dy;
    g.grad_query = t[1];
    g.grad_key = c->cross ? t[2] : NULL;
    g.grad_value = c->cross == 1 ? t[3] : NULL;
    g.grad_params = t[4];
    g.grad_head_mask = c->head_mask ? t[5] : NULL;
    const int present[NTENSORS] = {1, 1, g.grad_key != NULL,
                                   g.grad_value != NULL, 1, c->head_mask};

    mha_plan *plan = NULL;
    int rc = mha_plan_create(m, &a, &plan) != MHA_OK ||
             mha_plan_forward(plan, &a) != MHA_OK ||
             mha_plan_backward(plan, &a, &g) != MHA_OK;
    if (rc)
        fprintf(stderr, "%s: %s\n", c->name, mha_last_error());
    for (int j = 0; j < NTENSORS && !rc; j++)
        if (present[j])
            printf("%s %d %s %016llx\n", c->name, threads, TENSORS[j],
                   (unsigned long long)fnv1a(t[j], n[j]));
    mha_plan_free(plan);
    for (int j = 0; j < NTENSORS; j++)
        free(t[j]);
    free(q);
    free(k);
    free(v);
    free(dy);
    mha_free(m);
    return rc;
}

static int child_main(int argc, char **argv)
{
    for (int i = 2; i < argc; i++)
        for (int c = 0; c < NCASES; c++)
            if (run_case(&CASES[c], atoi(argv[i])))
                return 1;
    return fflush(stdout) != 0;
}

/* ---- the parent: one child per environment ------------------------------- */

typedef struct config {
    const char *group;       /* which knob it varies                       */
    const char *env[2];      /* the thread variables set (others unset)    */
    const char *threads[4];  /* num_threads values, NULL-terminated        */
} config;

static const config CONFIGS[] = {
    {"api", {NULL, NULL}, {"1", "2", "4", "0"}},
    {"omp", {"OMP_NUM_THREADS=1", NULL}, {"0", NULL}},
    {"omp", {"OMP_NUM_THREADS=2", NULL}, {"0", NULL}},
    {"omp", {"OMP_NUM_THREADS=4", NULL}, {"0", NULL}},
    {"blas", {"OPENBLAS_NUM_THREADS=1", NULL}, {"0", NULL}},
    {"blas", {"OPENBLAS_NUM_THREADS=2", NULL}, {"0", NULL}},
    {"blas", {"OPENBLAS_NUM_THREADS=4", NULL}, {"0", "2", NULL}},
    {"blas", {"OPENBLAS_NUM_THREADS=4", "OMP_NUM_THREADS=1"}, {"0", NULL}},
    {"blas", {"OPENBLAS_NUM_THREADS=1", "OMP_NUM_THREADS=4"}, {"0", NULL}},
};
enum { NCONFIGS = sizeof CONFIGS / sizeof CONFIGS[0] };

/* Every variable that sets a thread count, removed from the children's
 * environment before the config's own are added. */
static const char *const THREAD_VARS[] = {"OMP_NUM_THREADS=",
                                          "OPENBLAS_NUM_THREADS=",
                                          "GOTO_NUM_THREADS=",
                                          "OMP_THREAD_LIMIT="};

enum { MAX_LINES = 256 };
typedef struct result {
    char line[MAX_LINES][96];  /* "case threads tensor hash" */
    int n;
} result;

static result RESULTS[NCONFIGS];

/* This executable: /proc/self/exe read as a path (valgrind gives the
 * client's), else argv[0]. */
static char SELF[4096];

static int spawn_child(const config *cf, result *r)
{
    size_t ne = 0;
    while (environ[ne])
        ne++;
    char **envp = calloc(ne + 3, sizeof *envp);
    size_t k = 0;
    for (size_t i = 0; i < ne; i++) {
        int drop = 0;
        for (size_t j = 0; j < sizeof THREAD_VARS / sizeof *THREAD_VARS; j++)
            drop |= !strncmp(environ[i], THREAD_VARS[j],
                             strlen(THREAD_VARS[j]));
        if (!drop)
            envp[k++] = environ[i];
    }
    for (int j = 0; j < 2; j++)
        if (cf->env[j])
            envp[k++] = (char *)cf->env[j];
    char *argv[8] = {"test_thread_knobs", "--child"};
    int na = 2;
    for (int j = 0; j < 4 && cf->threads[j]; j++)
        argv[na++] = (char *)cf->threads[j];

    int fd[2];
    if (pipe(fd))
        return -1;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd[1], 1);
    posix_spawn_file_actions_addclose(&fa, fd[0]);
    pid_t pid;
    int err = posix_spawn(&pid, SELF, &fa, NULL, argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    free(envp);
    close(fd[1]);
    if (err) {
        close(fd[0]);
        return -1;
    }
    FILE *f = fdopen(fd[0], "r");
    r->n = 0;
    while (r->n < MAX_LINES && fgets(r->line[r->n], 96, f))
        r->n++;
    fclose(f);
    int status;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0)
        return -1;
    return 0;
}

static int spawn_all(void **state)
{
    (void)state;
    for (int c = 0; c < NCONFIGS; c++)
        if (spawn_child(&CONFIGS[c], &RESULTS[c])) {
            fprintf(stderr, "child %d (%s %s) failed\n", c,
                    CONFIGS[c].env[0] ? CONFIGS[c].env[0] : "",
                    CONFIGS[c].env[1] ? CONFIGS[c].env[1] : "");
            return -1;
        }
    return 0;
}

/* The hash of (case, tensor) in line `s`: the text after the threads. */
static void split(const char *s, char *key, char *threads, char *hash)
{
    char name[32], tensor[32];
    sscanf(s, "%31s %15s %31s %31s", name, threads, tensor, hash);
    snprintf(key, 64, "%s %s", name, tensor);
}

/* The environment of config c, for messages. */
static void env_text(const config *cf, char *buf, size_t size)
{
    snprintf(buf, size, "%s%s%s",
             cf->env[0] ? cf->env[0] : "no thread variable set",
             cf->env[1] ? " " : "", cf->env[1] ? cf->env[1] : "");
}

/* Compares every line of the configs of `group` with the first line of
 * config 0 (no variable set, num_threads 1) for the same case and tensor;
 * prints the first differences. */
static void compare_group(const char *group)
{
    int differ = 0, compared = 0;
    for (int c = 0; c < NCONFIGS; c++) {
        if (strcmp(CONFIGS[c].group, group))
            continue;
        char env[96];
        env_text(&CONFIGS[c], env, sizeof env);
        for (int i = 0; i < RESULTS[c].n; i++) {
            char key[64], th[16], hash[32];
            split(RESULTS[c].line[i], key, th, hash);
            for (int j = 0; j < RESULTS[0].n; j++) {
                char key0[64], th0[16], hash0[32];
                split(RESULTS[0].line[j], key0, th0, hash0);
                if (strcmp(key, key0))
                    continue;
                compared++;
                if (strcmp(hash, hash0) && ++differ <= 12)
                    print_message("differs: %s with %s, num_threads %s "
                                  "(against num_threads %s, no thread "
                                  "variable set)\n", key, env, th, th0);
                break;
            }
        }
    }
    if (differ > 12)
        print_message("... %d differences in all\n", differ);
    /* 3 + 5 + 5 tensors of the three cases per num_threads value: out,
     * the inputs' and the parameters' gradients, the head mask's */
    assert_true(compared >= 13);
    assert_int_equal(differ, 0);
}

static void test_api_num_threads(void **state)
{
    (void)state;
    compare_group("api");
}

static void test_omp_num_threads(void **state)
{
    (void)state;
    compare_group("omp");
}

static void test_openblas_num_threads(void **state)
{
    (void)state;
    compare_group("blas");
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--child"))
        return child_main(argc, argv);
    if (tu_backend_unavailable())
        return TU_SKIP;
    const ssize_t n = readlink("/proc/self/exe", SELF, sizeof SELF - 1);
    if (n > 0)
        SELF[n] = '\0';
    else
        snprintf(SELF, sizeof SELF, "%s", argv[0]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_api_num_threads),
        cmocka_unit_test(test_omp_num_threads),
        cmocka_unit_test(test_openblas_num_threads),
    };
    return cmocka_run_group_tests(tests, spawn_all, NULL);
}
