/*
 * gemm.c -- the GEMM backends under the linear layer, and the only file
 * that calls a BLAS.
 *
 *   cblas    any CBLAS; Debian's OpenBLAS in the default build (its OpenMP
 *            build, so one thread pool: CMakeLists.txt).
 *   onednn   oneDNN's dnnl_sgemm, where the build found oneDNN
 *            (MHA_ONEDNN, Debian's libdnnl-dev).  It picks its kernels
 *            from the CPU at run time (AVX-512 where the CPU has it: the
 *            environment's OPENBLAS_CORETYPE does not pin it) and runs on
 *            OpenMP, libgomp, the pool the attention uses.
 *
 * Chosen once per process, by measurement (docs/BENCHMARKS.md, "GEMM
 * backends"): oneDNN when built in and the CPU has AVX-512, otherwise
 * CBLAS; the environment variable MHA_GEMM=cblas|onednn, read at the
 * first call, overrides the choice (the benchmarks and tests run both
 * this way).
 *
 * Every call is one GEMM on the calling thread only: the callers cut
 * their work into blocks fixed by the shapes and run the blocks on their
 * own threads (linear.c), each thread with its OpenMP count set to one,
 * which a serial CBLAS ignores, OpenBLAS's OpenMP build and oneDNN obey,
 * and OpenBLAS's pthread build is told separately (mha_gemm_serial).  So
 * each block's bits depend on the backend and the CPU, never on a
 * thread count.
 */
#include "module.h"
#include "kernels/kernels.h"

#include <cblas.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#ifdef MHA_HAVE_ONEDNN
#include <dnnl.h>
#endif

/* Where oneDNN is the faster: a CPU with AVX-512F (mha_cpu_has_avx512),
 * whose kernels oneDNN uses (and OpenBLAS, as this environment pins it,
 * does not).  On an AVX2 CPU the two run the blocks' GEMMs at the same
 * speed and oneDNN's training step is slower (docs/BENCHMARKS.md, "GEMM
 * backends"). */

/* -1: not chosen yet; otherwise a backend, or 100 + a status. */
static atomic_int chosen = -1;

static int choose(void)
{
    const char *env = getenv("MHA_GEMM");
#ifdef MHA_HAVE_ONEDNN
    const int onednn = 1;
#else
    const int onednn = 0;
#endif
    if (!env || !*env)
        return onednn && mha_cpu_has_avx512() ? MHA_GEMM_ONEDNN
                                              : MHA_GEMM_CBLAS;
    if (!strcmp(env, "cblas"))
        return MHA_GEMM_CBLAS;
    if (!strcmp(env, "onednn"))
        return onednn ? MHA_GEMM_ONEDNN : 100 + MHA_ERR_UNSUPPORTED;
    return 100 + MHA_ERR_INVALID_ARGUMENT;
}

static int backend(void)
{
    int c = atomic_load(&chosen);
    if (c < 0) {
        c = choose();             /* a race computes the same value twice */
        atomic_store(&chosen, c);
    }
    return c;
}

mha_status mha_gemm_check(void)
{
    const int c = backend();
    if (c < 100)
        return MHA_OK;
    const char *env = getenv("MHA_GEMM");
    return mha_set_error((mha_status)(c - 100),
                         c - 100 == MHA_ERR_UNSUPPORTED
                             ? "MHA_GEMM=%s, but this libmha was built "
                               "without oneDNN (libdnnl-dev)"
                             : "MHA_GEMM=%s: expected cblas or onednn",
                         env ? env : "");
}

const char *mha_gemm_backend(void)
{
    if (mha_gemm_check() != MHA_OK)
        return NULL;   /* (the message says why: mha_last_error) */
    return backend() == MHA_GEMM_ONEDNN ? "onednn" : "cblas";
}

/*
 * OpenBLAS's pthread build keeps a pool of its own that OpenMP's count
 * does not govern: set it to one thread (and leave it there; restoring
 * it would let a GEMM of another thread still inside libmha run
 * threaded).  Not for the OpenMP build, whose openblas_set_num_threads
 * also sets the calling thread's OpenMP count (OpenBLAS 0.3.21), which
 * num_threads = 0 reads.  OpenBLAS's entry points are weak references,
 * NULL with another CBLAS: such a CBLAS must run each call on one thread
 * (a serial build) or take its thread count from OpenMP.
 */
extern int openblas_get_parallel(void) __attribute__((weak));
extern int openblas_get_num_threads(void) __attribute__((weak));
extern void openblas_set_num_threads(int num_threads) __attribute__((weak));

void mha_gemm_serial(void)
{
    if (!openblas_get_parallel || !openblas_get_num_threads ||
        !openblas_set_num_threads)
        return;
    const int parallel = openblas_get_parallel();  /* 1 pthreads, 2 OpenMP */
#ifdef _OPENMP
    const int own_pool = parallel == 1;
#else
    const int own_pool = parallel != 0;   /* nothing sets OpenMP's count */
#endif
    if (own_pool && openblas_get_num_threads() != 1)
        openblas_set_num_threads(1);
}

void mha_sgemm(int trans_a, int trans_b, int m, int n, int k, float alpha,
               const float *a, int lda, const float *b, int ldb, float beta,
               float *c, int ldc)
{
#ifdef MHA_HAVE_ONEDNN
    if (backend() == MHA_GEMM_ONEDNN) {
        /* (row-major, as cblas_sgemm with CblasRowMajor; the shapes and
         * strides are the callers', checked there: no status to lose) */
        dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha,
                   a, lda, b, ldb, beta, c, ldc);
        return;
    }
#endif
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda,
                b, ldb, beta, c, ldc);
}

void mha_sgemv(int m, int n, float alpha, const float *a, int lda,
               const float *x, float beta, float *y)
{
#ifdef MHA_HAVE_ONEDNN
    if (backend() == MHA_GEMM_ONEDNN) {
        /* y^T = x^T a^T: one row against a's m rows */
        dnnl_sgemm('N', 'T', 1, m, n, alpha, x, n, a, lda, beta, y, m);
        return;
    }
#endif
    cblas_sgemv(CblasRowMajor, CblasNoTrans, m, n, alpha, a, lda, x, 1, beta,
                y, 1);
}
