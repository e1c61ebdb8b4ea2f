/*
 * convert_probe.c -- a standalone experiment, not part of libmha: what one
 * core's arithmetic costs per cached element in a decoding step, with
 * nothing else in the way (no memory traffic: 8 KiB of elements in L1;
 * no softmax, no partial sums stored).  docs/BENCHMARKS.md uses it to
 * tell a step bound by its arithmetic from one bound by memory: a step
 * cannot read its cache faster than this loop consumes it.
 *
 * Each variant multiplies-and-adds every element into independent
 * accumulators (eight chains, more than the FMA latency needs):
 *
 *   f32      a float load and an FMA                (an f32 cache's element)
 *   f16      vcvtph2ps, then an FMA                 (libmha's f16 element)
 *   f16int   the same value formed with integers: zero-extended, shifted
 *            into a float's exponent and mantissa (exact for finite f16
 *            once scaled by 2^112, which a kernel would fold into q):
 *            whether integer lanes convert faster than vcvtph2ps
 *   bf16     a 16-bit widening shift, then an FMA    (libmha's bf16 element)
 *   q8       an 8-bit code widened, converted, times its scale, then an
 *            FMA                                     (libmha's q8 element)
 *   f16x4    vcvtph2ps once, then four FMAs: a grouped-query step's four
 *            stacked query heads sharing each converted vector
 *   f32x4    the same with float loads
 *
 * Build and run (outside the library's build; one core):
 *
 *   gcc -O3 -mavx2 -mfma -mf16c bench/convert_probe.c -o /tmp/convprobe \
 *       && /tmp/convprobe
 *
 * Prints each variant's median over 7 rounds (interleaved round by round)
 * in nanoseconds per 8 cached elements, and its range.
 */
#define _POSIX_C_SOURCE 200112L
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { N = 4096, REPS = 50000, ROUNDS = 7 };   /* N elements: 8 KiB f16 */

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static float hsum8(const __m256 *a)
{
    __m256 s = a[0];
    for (int i = 1; i < 8; i++)
        s = _mm256_add_ps(s, a[i]);
    float o[8];
    _mm256_storeu_ps(o, s);
    return o[0] + o[1] + o[2] + o[3] + o[4] + o[5] + o[6] + o[7];
}

/* One row: element vector j of each 64 goes to accumulator j. */
#define ONE_ROW(NAME, LOAD)                                                 \
    static __attribute__((noinline)) float NAME(const void *x)             \
    {                                                                       \
        __m256 a[8];                                                        \
        const __m256 q = _mm256_set1_ps(1.0001f);                           \
        for (int i = 0; i < 8; i++)                                         \
            a[i] = _mm256_setzero_ps();                                     \
        for (int r = 0; r < REPS; r++)                                      \
            for (int i = 0; i < N; i += 64) {                               \
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)         \
                    a[j] = _mm256_fmadd_ps(LOAD(x, i + 8 * j), q, a[j]);    \
            }                                                               \
        return hsum8(a);                                                    \
    }

static inline __m256 ld_f32(const void *x, int i)
{
    return _mm256_loadu_ps((const float *)x + i);
}

static inline __m256 ld_f16(const void *x, int i)
{
    return _mm256_cvtph_ps(
        _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
}

static inline __m256 ld_f16int(const void *x, int i)
{
    const __m256i w = _mm256_cvtepu16_epi32(
        _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
    const __m256i sign = _mm256_slli_epi32(
        _mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16);
    const __m256i mag = _mm256_slli_epi32(
        _mm256_and_si256(w, _mm256_set1_epi32(0x7fff)), 13);
    return _mm256_castsi256_ps(_mm256_or_si256(sign, mag));
}

static inline __m256 ld_bf16(const void *x, int i)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))),
        16));
}

/* q8: a code widened and converted, times its scale (libmha's q8 value
 * element: one rounding of code x scale, then the FMA).  The scale sits
 * in a register here, where libmha loads it: if anything this undercounts
 * q8's cost. */
static inline __m256 ld_q8(const void *x, int i)
{
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64((const __m128i *)((const int8_t *)x + i))));
    return _mm256_mul_ps(c, _mm256_set1_ps(0.0078125f));
}

ONE_ROW(row_f32, ld_f32)
ONE_ROW(row_f16, ld_f16)
ONE_ROW(row_f16int, ld_f16int)
ONE_ROW(row_bf16, ld_bf16)
ONE_ROW(row_q8, ld_q8)

/* Four rows (a GQA group of four heads) x 16 columns: two vectors loaded,
 * four broadcasts of q, eight FMAs per step of 16 elements. */
#define FOUR_ROWS(NAME, LOAD)                                               \
    static __attribute__((noinline)) float NAME(const void *x,             \
                                                const float *q)            \
    {                                                                       \
        __m256 a[8];                                                        \
        for (int i = 0; i < 8; i++)                                         \
            a[i] = _mm256_setzero_ps();                                     \
        for (int r = 0; r < REPS; r++)                                      \
            for (int i = 0; i < N; i += 16) {                               \
                const __m256 b0 = LOAD(x, i), b1 = LOAD(x, i + 8);          \
                _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++)         \
                {                                                           \
                    const __m256 qh =                                       \
                        _mm256_broadcast_ss(q + 4 * ((i / 16) & 15) + h);   \
                    a[2 * h] = _mm256_fmadd_ps(qh, b0, a[2 * h]);           \
                    a[2 * h + 1] = _mm256_fmadd_ps(qh, b1, a[2 * h + 1]);   \
                }                                                           \
            }                                                               \
        return hsum8(a);                                                    \
    }

FOUR_ROWS(rows4_f32, ld_f32)
FOUR_ROWS(rows4_f16, ld_f16)

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void)
{
    static const char *names[] = {"f32",   "f16",   "f16int", "bf16",
                                  "q8",    "f16x4", "f32x4"};
    enum { V = sizeof names / sizeof *names };
    float *x32 = aligned_alloc(64, N * sizeof(float));
    uint16_t *x16 = aligned_alloc(64, N * sizeof(uint16_t));
    float q[64];
    if (!x32 || !x16)
        return 1;
    for (int i = 0; i < N; i++) {
        x32[i] = 1.0f;
        x16[i] = 0x3c00;   /* 1.0 in f16; as bf16 a tiny normal float */
    }
    for (int i = 0; i < 64; i++)
        q[i] = 1.0001f;

    double t[V][ROUNDS];
    volatile float sink = 0.0f;
    for (int r = 0; r < ROUNDS; r++)
        for (int v = 0; v < V; v++) {
            const double t0 = now();
            switch (v) {
            case 0: sink += row_f32(x32); break;
            case 1: sink += row_f16(x16); break;
            case 2: sink += row_f16int(x16); break;
            case 3: sink += row_bf16(x16); break;
            case 4: sink += row_q8(x16); break;   /* (any bytes will do) */
            case 5: sink += rows4_f16(x16, q); break;
            default: sink += rows4_f32(x32, q); break;
            }
            t[v][r] = (now() - t0) / ((double)REPS * N / 8) * 1e9;
        }
    printf("ns per 8 cached elements, one core (median of %d, range)\n",
           ROUNDS);
    for (int v = 0; v < V; v++) {
        qsort(t[v], ROUNDS, sizeof **t, cmp);
        printf("%-7s %6.3f (%.3f-%.3f)\n", names[v], t[v][ROUNDS / 2],
               t[v][0], t[v][ROUNDS - 1]);
    }
    return sink == 12345.0f;   /* keeps the sums */
}
