/*
 * q8_decode_probe.c -- a standalone experiment, not part of libmha: how
 * fast could one decoding step on an 8-bit KV cache be on this machine,
 * and what arithmetic would it take?  (The Inference issue asks for an
 * 8-bit step at >= 1.6x the f16 step's speed; docs/BENCHMARKS.md, "The
 * 8-bit cache", has the figures and what they mean.)
 *
 * One query row of H heads of d_h = 128 against Lk keys, the keys in
 * tiles of 64 as libmha's cache keeps them: a key tile transposed,
 * [d][64], a value tile [64][d].  Each variant streams every tile once:
 * the scores s = q k^T of the tile, then o += p v with p = s / 1000 (no
 * softmax: its exp is the same for every variant and small beside the
 * products).  2 threads share the heads (OMP_NUM_THREADS).  Variants:
 *
 *   f16     f16 codes, vcvtph2ps then an FMA (libmha's f16 arithmetic)
 *   q8      int8 codes widened, converted, multiplied by their scale
 *           (one per 32 d of a key or a value), then an FMA: libmha's
 *           q8 arithmetic, whose result is bitwise the f32 attention on
 *           the values a read returns
 *   q8fac   the same codes, the scale factored out of each block of 32:
 *           q kept in float; a different rounding, not those bits
 *   q8int   q quantised too (int8, a scale per 32 d, as ggml does), the
 *           key codes stored 4 d at a time per key ([d/4][64][4]) so that
 *           vpmaddubsw/vpmaddwd form 4-term integer dot products; the
 *           value side as q8
 *   q8int+  q8int with the value scales factored out as in q8fac
 *   bytes   the q8 tiles' codes and scales read and summed as bytes:
 *           the floor set by memory
 *   q8strips  q8 with the value tile walked as libmha's one-row kernel
 *           walks it: two passes of 64 columns (one cache line of each
 *           row per pass)
 *   q8int16 q8int's keys, and the values summed in integers too: each
 *           tile's weights p * (value scale) rounded to int16 against
 *           the tile's largest, the codes stored two keys per d so that
 *           vpmaddwd forms two keys' products at once
 *   q8lay   q8's arithmetic on tiles laid out as libmha's cache laid them
 *           out before e6d5fa4: each tile its codes, then its
 *           scales (9 KiB at d_h 128), tile after tile
 *   q8layS  the same with each tile's scales first (the cache's layout
 *           since): read forward only
 *   q8layP  codes then scales, the tiles padded to 12 KiB (4 KiB-aligned)
 *
 * Build and run (outside the library's build; HUGE=1 asks for
 * transparent huge pages, as libmha's cache does):
 *
 *   gcc -O2 -mavx2 -mfma -mf16c -fopenmp bench/q8_decode_probe.c -lm \
 *       -o /tmp/q8probe && HUGE=1 OMP_NUM_THREADS=2 /tmp/q8probe [Lk]
 *
 * Prints each variant's median over 11 rounds (the variants interleaved
 * round by round), its range, and f16's median over it.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { DH = 128, BC = 64, NB = DH / 32, HEADS = 32, ROUNDS = 11 };

static int T;                         /* tiles per head */
static uint16_t *kf, *vf;             /* f16 tiles, [HEADS][T][...] */
static int8_t *kl, *vl;               /* q8lay: tiles of codes + scales */
static int8_t *kc, *vc, *k4, *v2;     /* q8 codes; k4: [d/4][64][4],
                                         v2: [32 pairs][d][2] */
static float *ks, *vs;                /* q8 scales: k [NB][64], v [64][NB] */
static float q[DH], out[HEADS][DH];

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return 1e3 * (double)t.tv_sec + 1e-6 * (double)t.tv_nsec;
}

static void *big(size_t n)
{
    const size_t huge = (size_t)2 << 20;
    n = (n + huge - 1) / huge * huge;
    void *p = aligned_alloc(huge, n);
    if (!p) {
        fprintf(stderr, "q8probe: out of memory\n");
        exit(1);
    }
    if (getenv("HUGE"))
        madvise(p, n, MADV_HUGEPAGE);
    return p;
}

/* 8 int8 codes as floats. */
static inline __m256 widen(const int8_t *p)
{
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static void zero(__m256 *x, int n)
{
    for (int w = 0; w < n; w++)
        x[w] = _mm256_setzero_ps();
}

static void store_o(__m256 *acc, float *o)
{
    for (int w = 0; w < 16; w++)
        _mm256_storeu_ps(o + 8 * w, acc[w]);
}

/* p = s / 1000 of the tile's 64 scores. */
static void scores(const __m256 *acc, float *s)
{
    for (int w = 0; w < 8; w++)
        _mm256_storeu_ps(s + 8 * w,
                         _mm256_mul_ps(acc[w], _mm256_set1_ps(1e-3f)));
}

static void head_f16(int h)
{
    __m256 o[16];
    zero(o, 16);
    for (int t = 0; t < T; t++) {
        const size_t at = ((size_t)h * T + t) * DH * BC;
        const uint16_t *K = kf + at, *V = vf + at;
        __m256 acc[8];
        zero(acc, 8);
        for (int k = 0; k < DH; k++) {
            const __m256 a = _mm256_set1_ps(q[k]);
            for (int w = 0; w < 8; w++)
                acc[w] = _mm256_fmadd_ps(a, _mm256_cvtph_ps(_mm_loadu_si128(
                             (const __m128i *)(K + k * BC + 8 * w))), acc[w]);
        }
        float s[BC];
        scores(acc, s);
        for (int j = 0; j < BC; j++) {
            const __m256 a = _mm256_set1_ps(s[j]);
            for (int w = 0; w < 16; w++)
                o[w] = _mm256_fmadd_ps(a, _mm256_cvtph_ps(_mm_loadu_si128(
                           (const __m128i *)(V + j * DH + 8 * w))), o[w]);
        }
    }
    store_o(o, out[h]);
}

/* The value side of q8 and q8int (factored = 0) or q8fac and q8int+. */
static void pv_q8(const float *s, const int8_t *V, const float *VS,
                  int factored, __m256 *o)
{
    for (int j = 0; j < BC; j++) {
        if (factored) {
            for (int b = 0; b < NB; b++) {
                const __m256 a = _mm256_set1_ps(s[j] * VS[j * NB + b]);
                for (int w = 4 * b; w < 4 * b + 4; w++)
                    o[w] = _mm256_fmadd_ps(a, widen(V + j * DH + 8 * w), o[w]);
            }
        } else {
            const __m256 a = _mm256_set1_ps(s[j]);
            for (int w = 0; w < 16; w++)
                o[w] = _mm256_fmadd_ps(
                    a, _mm256_mul_ps(widen(V + j * DH + 8 * w),
                                     _mm256_broadcast_ss(VS + j * NB + w / 4)),
                    o[w]);
        }
    }
}

/* libmha's order for one row: a 64-column strip over all 64 keys, then
 * the other (each output's chain is the same). */
static void pv_q8_strips(const float *s, const int8_t *V, const float *VS,
                         __m256 *o)
{
    for (int half = 0; half < 2; half++)
        for (int j = 0; j < BC; j++) {
            const __m256 a = _mm256_set1_ps(s[j]);
            for (int w = 8 * half; w < 8 * half + 8; w++)
                o[w] = _mm256_fmadd_ps(
                    a, _mm256_mul_ps(widen(V + j * DH + 8 * w),
                                     _mm256_broadcast_ss(VS + j * NB + w / 4)),
                    o[w]);
        }
}

/* factored: 0 q8, 1 q8fac, 2 q8strips. */
static void head_q8(int h, int factored)
{
    __m256 o[16];
    zero(o, 16);
    for (int t = 0; t < T; t++) {
        const size_t tile = (size_t)h * T + t;
        const int8_t *K = kc + tile * DH * BC, *V = vc + tile * DH * BC;
        const float *KS = ks + tile * NB * BC, *VS = vs + tile * NB * BC;
        __m256 acc[8];
        zero(acc, 8);
        for (int b = 0; b < NB; b++) {
            __m256 part[8];
            zero(part, 8);
            for (int k = 32 * b; k < 32 * b + 32; k++) {
                const __m256 a = _mm256_set1_ps(q[k]);
                for (int w = 0; w < 8; w++) {
                    const __m256 c = widen(K + k * BC + 8 * w);
                    if (factored == 1)
                        part[w] = _mm256_fmadd_ps(a, c, part[w]);
                    else
                        acc[w] = _mm256_fmadd_ps(
                            a, _mm256_mul_ps(c, _mm256_loadu_ps(
                                                    KS + b * BC + 8 * w)),
                            acc[w]);
                }
            }
            for (int w = 0; factored == 1 && w < 8; w++)
                acc[w] = _mm256_fmadd_ps(
                    part[w], _mm256_loadu_ps(KS + b * BC + 8 * w), acc[w]);
        }
        float s[BC];
        scores(acc, s);
        if (factored == 2)
            pv_q8_strips(s, V, VS, o);
        else
            pv_q8(s, V, VS, factored, o);
    }
    store_o(o, out[h]);
}

/* q to int8, a scale per 32 d (as ggml's q8_0). */
static void quantise_q(int8_t *qi, float *sq)
{
    for (int b = 0; b < NB; b++) {
        float m = 0.0f;
        for (int d = 32 * b; d < 32 * b + 32; d++)
            m = fabsf(q[d]) > m ? fabsf(q[d]) : m;
        sq[b] = m / 127.0f;
        for (int d = 32 * b; d < 32 * b + 32; d++)
            qi[d] = (int8_t)lrintf(m > 0.0f ? q[d] * (127.0f / m) : 0.0f);
    }
}

/* p of a key tile stored 4 d at a time ([d/4][64][4]) from the rounded
 * q: integer sums per block of 32 d, times both scales. */
static void scores_int(const int8_t *K, const float *KS, const int8_t *qi,
                       const float *sq, float *s)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[8];
    zero(acc, 8);
    for (int b = 0; b < NB; b++) {
        __m256i isum[8];
        for (int w = 0; w < 8; w++)
            isum[w] = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {   /* 4 d of 64 keys: 256 bytes */
            int32_t q4;
            memcpy(&q4, qi + 32 * b + 4 * g, 4);
            const __m256i qq = _mm256_set1_epi32(q4);
            const __m256i qa = _mm256_abs_epi8(qq);
            const int8_t *row = K + (size_t)(8 * b + g) * BC * 4;
            for (int w = 0; w < 8; w++) {
                const __m256i c =
                    _mm256_loadu_si256((const __m256i *)(row + 32 * w));
                /* |q| (unsigned) times c with q's sign: pairs summed to
                 * int16 (|.| <= 2 * 127 * 127), then to int32 */
                const __m256i p =
                    _mm256_maddubs_epi16(qa, _mm256_sign_epi8(c, qq));
                isum[w] = _mm256_add_epi32(isum[w],
                                           _mm256_madd_epi16(p, ones));
            }
        }
        const __m256 sqb = _mm256_set1_ps(sq[b]);
        for (int w = 0; w < 8; w++)
            acc[w] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(isum[w]),
                _mm256_mul_ps(sqb, _mm256_loadu_ps(KS + b * BC + 8 * w)),
                acc[w]);
    }
    scores(acc, s);
}

/* q8 as libmha's cache lays it out: each tile its codes then its scales
 * (9 KiB for d_h 128), the tiles of a head one after another; or the
 * scales first; or the tiles padded to 12 KiB (a multiple of 4 KiB). */
enum { LAY_CODES_FIRST, LAY_SCALES_FIRST, LAY_PADDED };
static size_t lay_stride(int how)
{
    return how == LAY_PADDED ? 3 * 4096 : DH * BC + NB * BC * 4;
}

static void head_q8lay(int h, int how)
{
    const size_t stride = lay_stride(how);
    const size_t codes = how == LAY_SCALES_FIRST ? NB * BC * 4 : 0;
    const size_t scales = how == LAY_SCALES_FIRST ? 0 : DH * BC;
    __m256 o[16];
    zero(o, 16);
    for (int t = 0; t < T; t++) {
        const size_t at = ((size_t)h * T + t) * stride;
        const int8_t *K = kl + at + codes, *V = vl + at + codes;
        const float *KS = (const float *)(kl + at + scales);
        const float *VS = (const float *)(vl + at + scales);
        __m256 acc[8];
        zero(acc, 8);
        for (int k = 0; k < DH; k++) {
            const __m256 a = _mm256_set1_ps(q[k]);
            for (int w = 0; w < 8; w++)
                acc[w] = _mm256_fmadd_ps(
                    a, _mm256_mul_ps(widen(K + k * BC + 8 * w),
                                     _mm256_loadu_ps(KS + k / 32 * BC +
                                                     8 * w)),
                    acc[w]);
        }
        float s[BC];
        scores(acc, s);
        pv_q8(s, V, VS, 0, o);
    }
    store_o(o, out[h]);
}

/* o += p v of a value tile stored two keys per d ([32][d][2]), summed in
 * integers: the tile's weights w = p * (value scale) rounded to int16
 * against its largest |w| (one scale per tile), then one vpmaddwd forms
 * w_j c_j + w_j+1 c_j+1 for 8 d in int32 (|sum| over a tile <= 64 *
 * 32767 * 127 < 2^31), converted and scaled once per tile. */
static void pv_int16(const float *s, const int8_t *V, const float *VS,
                     __m256 *o)
{
    float wf[NB * BC];   /* [NB][64] */
    __m256 big8 = _mm256_setzero_ps();
    const __m256 absmask =
        _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i every4th = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    for (int b = 0; b < NB; b++)
        for (int j = 0; j < BC; j += 8) {
            /* VS is [64][NB]: the block's scales of 8 keys */
            const __m256 sc =
                _mm256_i32gather_ps(VS + j * NB + b, every4th, 4);
            const __m256 w = _mm256_mul_ps(_mm256_loadu_ps(s + j), sc);
            _mm256_storeu_ps(wf + b * BC + j, w);
            big8 = _mm256_max_ps(big8, _mm256_and_ps(w, absmask));
        }
    float m8[8], m = 0.0f;
    _mm256_storeu_ps(m8, big8);
    for (int i = 0; i < 8; i++)
        m = m8[i] > m ? m8[i] : m;
    const __m256 inv = _mm256_set1_ps(m > 0.0f ? 32767.0f / m : 0.0f);
    int16_t wq[NB * BC];
    for (int i = 0; i < NB * BC; i += 16) {
        const __m256i lo =
            _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(wf + i), inv));
        const __m256i hi = _mm256_cvtps_epi32(
            _mm256_mul_ps(_mm256_loadu_ps(wf + i + 8), inv));
        _mm256_storeu_si256(
            (__m256i *)(wq + i),
            _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8));
    }
    __m256i vi[16];
    for (int w = 0; w < 16; w++)
        vi[w] = _mm256_setzero_si256();
    for (int pr = 0; pr < BC / 2; pr++) {
        const int8_t *row = V + (size_t)pr * DH * 2;
        for (int b = 0; b < NB; b++) {
            int32_t pair;
            memcpy(&pair, wq + b * BC + 2 * pr, 4);
            const __m256i ww = _mm256_set1_epi32(pair);
            for (int w = 4 * b; w < 4 * b + 4; w++) {
                const __m256i c = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(row + 16 * w)));
                vi[w] = _mm256_add_epi32(vi[w], _mm256_madd_epi16(c, ww));
            }
        }
    }
    const __m256 u = _mm256_set1_ps(m / 32767.0f);
    for (int w = 0; w < 16; w++)
        o[w] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(vi[w]), u, o[w]);
}

/* q8int's integer scores; the values as q8 (values 0), q8fac (1) or
 * summed in integers (2: q8int16). */
static void head_q8int(int h, int values)
{
    int8_t qi[DH];
    float sq[NB];
    quantise_q(qi, sq);
    __m256 o[16];
    zero(o, 16);
    for (int t = 0; t < T; t++) {
        const size_t tile = (size_t)h * T + t;
        float s[BC];
        scores_int(k4 + tile * DH * BC, ks + tile * NB * BC, qi, sq, s);
        if (values == 2)
            pv_int16(s, v2 + tile * DH * BC, vs + tile * NB * BC, o);
        else
            pv_q8(s, vc + tile * DH * BC, vs + tile * NB * BC, values, o);
    }
    store_o(o, out[h]);
}

static void head_bytes(int h)
{
    __m256i a = _mm256_setzero_si256();
    for (int t = 0; t < T; t++) {
        const size_t tile = (size_t)h * T + t;
        const __m256i *K = (const __m256i *)(kc + tile * DH * BC);
        const __m256i *V = (const __m256i *)(vc + tile * DH * BC);
        const __m256i *KS = (const __m256i *)(ks + tile * NB * BC);
        const __m256i *VS = (const __m256i *)(vs + tile * NB * BC);
        for (int i = 0; i < DH * BC / 32; i++)
            a = _mm256_add_epi8(a, _mm256_add_epi8(_mm256_loadu_si256(K + i),
                                                   _mm256_loadu_si256(V + i)));
        for (int i = 0; i < NB * BC * 4 / 32; i++)
            a = _mm256_add_epi8(a, _mm256_add_epi8(_mm256_loadu_si256(KS + i),
                                                   _mm256_loadu_si256(VS + i)));
    }
    _mm256_storeu_si256((__m256i *)out[h], a);
}

enum { F16, Q8, Q8FAC, Q8INT, Q8INTF, BYTES, Q8STRIPS, Q8INT16, Q8LAY, Q8LAYS,
       Q8LAYP, KINDS };
static const char *const NAME[KINDS] = {"f16",   "q8",     "q8fac",
                                        "q8int", "q8int+", "bytes",
                                        "q8strips", "q8int16", "q8lay",
                                        "q8layS", "q8layP"};

static double step(int kind)
{
    const double t0 = now_ms();
#pragma omp parallel for schedule(static)
    for (int h = 0; h < HEADS; h++) {
        switch (kind) {
        case F16: head_f16(h); break;
        case Q8: head_q8(h, 0); break;
        case Q8FAC: head_q8(h, 1); break;
        case Q8INT: head_q8int(h, 0); break;
        case Q8INTF: head_q8int(h, 1); break;
        case BYTES: head_bytes(h); break;
        case Q8INT16: head_q8int(h, 2); break;
        case Q8LAY: head_q8lay(h, LAY_CODES_FIRST); break;
        case Q8LAYS: head_q8lay(h, LAY_SCALES_FIRST); break;
        case Q8LAYP: head_q8lay(h, LAY_PADDED); break;
        default: head_q8(h, 2); break;
        }
    }
    return now_ms() - t0;
}

static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    const int lk = argc > 1 ? atoi(argv[1]) : 32768;
    if (lk < BC || lk % BC) {
        fprintf(stderr, "q8probe: Lk must be a positive multiple of %d\n", BC);
        return 1;
    }
    T = lk / BC;
    const size_t n = (size_t)HEADS * (size_t)lk * DH;
    kf = big(n * 2), vf = big(n * 2);
    kc = big(n), vc = big(n), k4 = big(n), v2 = big(n);
    kl = big(n / 2 * 3), vl = big(n / 2 * 3);   /* the padded stride */
    ks = big(n / 32 * sizeof(float)), vs = big(n / 32 * sizeof(float));
    /* Any codes will do (the time does not depend on them); finite f16. */
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) {
        kf[i] = (uint16_t)(0x3c00 ^ (i & 0xff));
        vf[i] = (uint16_t)(0x3800 ^ (i & 0x7f));
        kc[i] = (int8_t)(i * 7), vc[i] = (int8_t)(i * 13);
        k4[i] = (int8_t)(i * 5), v2[i] = (int8_t)(i * 11);
    }
    for (size_t i = 0; i < n / 32; i++)
        ks[i] = 0.01f, vs[i] = 0.02f;
    /* q8lay's tiles: any codes; every 4-byte word of the scale region
     * (wherever a layout puts it) a scale */
    for (size_t i = 0; i < n / 2 * 3; i += 4) {
        const float k = 0.01f, v = 0.02f;
        memcpy(kl + i, &k, 4);
        memcpy(vl + i, &v, 4);
    }
    for (int d = 0; d < DH; d++)
        q[d] = (float)(d % 17) - 8.0f;

    double ms[KINDS][ROUNDS];
    for (int r = 0; r < ROUNDS; r++)
        for (int k = 0; k < KINDS; k++)
            ms[k][r] = step(k);
    for (int k = 0; k < KINDS; k++)
        qsort(ms[k], ROUNDS, sizeof(double), by_value);
    printf("Lk %d, %d heads of d_h %d, one query row\n", lk, HEADS, DH);
    for (int k = 0; k < KINDS; k++)
        printf("%-8s %7.2f ms (%.2f-%.2f)  f16/this %.2fx\n", NAME[k],
               ms[k][ROUNDS / 2], ms[k][0], ms[k][ROUNDS - 1],
               ms[F16][ROUNDS / 2] / ms[k][ROUNDS / 2]);
    return 0;
}
