/*
 * amx_linear.c -- the pieces of a bf16 linear layer y = x W^T + b and of
 * its gradients that need AVX-512 BF16 instructions: W packed as AMX's B
 * operand, rounded from the module's float32 parameters on the way (as
 * W^T for y = x W^T, as W for dx = dy W) and dy transposed for dW = dy^T x
 * (the float32 accumulators rounded to bf16 with the bias added are
 * bf16_tier.h's).  The products are amx.c's tile GEMM (mha_bf16_gemm32);
 * the grid of blocks and the threads are the linear layer's
 * (module/linear.c).
 *
 * Compiled with amx.c's instruction sets; called only where
 * mha_bf16_tier() found AVX512-BF16 (with or without the tiles).
 */
#include "kernels.h"

#include <immintrin.h>
#include <stdint.h>

static inline __mmask16 first(int64_t n)   /* the first n of 16 lanes */
{
    return n >= 16 ? (__mmask16)0xFFFF
         : n <= 0  ? (__mmask16)0
                   : (__mmask16)((1u << n) - 1);
}

/*
 * Tile (kt, nt) of W^T's layout holds, in its row r, the 16 words
 * (bf16 W[n][k0], bf16 W[n][k0 + 1]) for n = 16 nt .. 16 nt + 15, k0 =
 * 32 kt + 2 r.  W's row n gives its 32 k's as 16 consecutive words (one
 * vcvtne2ps2bf16), so a tile is 16 such rows turned on their side: word
 * (c, r) of the rows is word (r, c) of the tile, read back by gathers
 * from the 1 KB staging block in L1.
 */
float mha_bf16_pack_wt(const float *w, int64_t n_in, int64_t n_out,
                      int64_t nt0, int64_t nt1, uint32_t *dst)
{
    __m512 top = _mm512_setzero_ps();   /* the largest |w| read */
    const int64_t nkt = (n_in + 31) / 32, nnt = (n_out + 31) / 32 * 2;
    const __m512i by_row = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                          15),
        _mm512_set1_epi32(16));
    uint32_t rows[16 * 16] __attribute__((aligned(64)));
    for (int64_t nt = nt0; nt < nt1; nt++)
        for (int64_t kt = 0; kt < nkt; kt++) {
            const int64_t k0 = 32 * kt;
            for (int c = 0; c < 16; c++) {
                const int64_t n = 16 * nt + c;
                __m512i word = _mm512_setzero_si512();
                if (n < n_out) {
                    const float *src = w + n * n_in + k0;
                    const __m512 lo =
                        _mm512_maskz_loadu_ps(first(n_in - k0), src);
                    const __m512 hi =
                        _mm512_maskz_loadu_ps(first(n_in - k0 - 16), src + 16);
                    word = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                    top = _mm512_max_ps(top, _mm512_max_ps(_mm512_abs_ps(lo),
                                                           _mm512_abs_ps(hi)));
                }
                _mm512_store_si512(rows + 16 * c, word);
            }
            uint32_t *t = dst + (kt * nnt + nt) * 256;
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512(
                    t + 16 * r,
                    _mm512_i32gather_epi32(
                        _mm512_add_epi32(by_row, _mm512_set1_epi32(r)), rows,
                        4));
        }
    return _mm512_reduce_max_ps(top);
}

/*
 * B (k, n) = W[k][n], K = n_out, N = n_in: tile (kt, nt)'s row r holds
 * the pairs (W[k0][n], W[k0 + 1][n]), k0 = 32 kt + 2 r, n = 16 nt .. +15:
 * two rows of 16 floats, each rounded to 16 bf16 by vcvtneps2bf16,
 * widened to 32-bit lanes and interleaved.
 */
void mha_bf16_pack_w(const float *w, int64_t n_in, int64_t n_out,
                    int64_t nt0, int64_t nt1, uint32_t *dst)
{
    const int64_t nkt = (n_out + 31) / 32, nnt = (n_in + 31) / 32 * 2;
    for (int64_t nt = nt0; nt < nt1; nt++) {
        const int64_t n0 = 16 * nt;
        const __mmask16 in = first(n_in - n0);
        for (int64_t kt = 0; kt < nkt; kt++) {
            uint32_t *t = dst + (kt * nnt + nt) * 256;
            for (int r = 0; r < 16; r++) {
                const int64_t k0 = 32 * kt + 2 * r, k1 = k0 + 1;
                __m512i word = _mm512_setzero_si512();
                if (k0 < n_out && in) {
                    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)
                        _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(
                            in, w + k0 * n_in + n0)));
                    const __m512i hi = k1 < n_out
                        ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
                              _mm512_maskz_loadu_ps(in, w + k1 * n_in + n0)))
                        : _mm512_setzero_si512();
                    word = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                }
                _mm512_storeu_si512(t + 16 * r, word);
            }
        }
    }
}

/*
 * The words (src[k0][n], src[k0 + 1][n]) of 16 n's side by side, for
 * the 16 pair rows of a 32 x 16 block, are a 16 x 16 matrix of words
 * whose transpose's row c is dst row n0 + c, k0 .. k0 + 31: staged in
 * L1 and read back by gathers, as mha_bf16_pack_wt does.
 */
void mha_bf16_transpose(const uint16_t *src, int64_t ld, int64_t K,
                       int64_t N, int64_t kt0, int64_t kt1, uint16_t *dst,
                       int64_t ldd)
{
    const int64_t nnt = (N + 31) / 32 * 2;
    const __m512i by_row = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                          15),
        _mm512_set1_epi32(16));
    uint32_t rows[16 * 16] __attribute__((aligned(64)));
    for (int64_t kt = kt0; kt < kt1; kt++)
        for (int64_t nt = 0; nt < nnt; nt++) {
            const int64_t n0 = 16 * nt;
            const __mmask16 in = first(N - n0);
            for (int r = 0; r < 16; r++) {
                const int64_t k0 = 32 * kt + 2 * r, k1 = k0 + 1;
                __m512i word = _mm512_setzero_si512();
                if (k0 < K && in) {
                    const __m512i lo = _mm512_cvtepu16_epi32(
                        _mm256_maskz_loadu_epi16(in, src + k0 * ld + n0));
                    const __m512i hi = k1 < K
                        ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                              in, src + k1 * ld + n0))
                        : _mm512_setzero_si512();
                    word = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                }
                _mm512_store_si512(rows + 16 * r, word);
            }
            for (int c = 0; c < 16; c++)
                _mm512_storeu_si512(
                    dst + (n0 + c) * ldd + 32 * kt,
                    _mm512_i32gather_epi32(
                        _mm512_add_epi32(by_row, _mm512_set1_epi32(c)), rows,
                        4));
        }
}
