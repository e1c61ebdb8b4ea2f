/*
 * amx_linear.c -- the two pieces of a bf16 linear layer y = x W^T + b
 * that need AVX-512 BF16 instructions: W packed as AMX's B operand,
 * rounded from the module's float32 parameters on the way, and the
 * float32 accumulators rounded to bf16 with the bias added.  The product
 * between them is amx.c's tile GEMM (mha_amx_gemm32); the grid of blocks
 * and the threads are the linear layer's (module/linear.c).
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
void mha_amx_pack_wt(const float *w, int64_t n_in, int64_t n_out,
                     int64_t nt0, int64_t nt1, uint32_t *dst)
{
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
}

void mha_amx_round_rows(const float *C, int ldc, int rows, int cols,
                        const float *bias, uint16_t *y, int64_t ldy)
{
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c += 16) {
            const __mmask16 in = first(cols - c);
            __m512 x = _mm512_maskz_loadu_ps(in, C + (int64_t)r * ldc + c);
            if (bias)
                x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(in, bias + c));
            _mm256_mask_storeu_epi16(y + r * ldy + c, in,
                                     (__m256i)_mm512_cvtneps_pbh(x));
        }
}
