/* Dequantize rows of torch's packed int4 CPU copy (`QuantWeight.i4`) to bf16 with MLX's
 * affine arithmetic: w = bf16(bf16(q * s) + b), q the 0..15 code, s and b the weight's own
 * bf16 scales and biases [N, K / G] (not the copy's folded zeros). That is what
 * `QuantWeight.dequant_rows` computes in torch for bf16 scales and bf16 compute (two bf16 ops,
 * each an exact float32 product or a float32 sum rounded to nearest even), so the tiles
 * `quant.cpu.tiled_linear` feeds to the bf16 GEMM are bit for bit the same; only the
 * decoding is faster (one pass, no uint8 / bf16 intermediates of the whole tile).
 *
 * Layout read (`int4pack.block` == 64): block b of 64 rows is K * 32 bytes, byte j of column
 * k = row j (low nibble) and row j + 32 (high nibble). A 32-bit gather at byte k * 32 + j
 * (j = 0, 4, .., 28) over 16 columns holds rows j..j+3 (and j+32..j+35) of those columns:
 * one gather feeds 8 output rows x 16 columns. Per (row, group) the 16 possible weights are
 * computed once into a vpermw table; every code is then one table lookup (no float
 * arithmetic per weight). Output row-major [rows, K] bf16.
 */
#include "kernels.h"

#if MLXR_AVX512
/* round float32 lanes to bf16, nearest even, as torch's conversion (denormals kept; the
 * hardware vcvtneps2bf16 would flush them) */
static inline __m256i rne_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* The 16 weights a (row, group) can take, w(q) = bf16(bf16(q * s) + b) for q = 0..15 (q * s is
 * exact in float32: 4 x 8 significant bits), as 32 bf16 words (the table twice: vpermw reads
 * index bits 0..4 and bit 4 is the next nibble's, so no mask is needed). */
static inline __m512i row_table(uint16_t s, uint16_t b) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 p = _mm512_mul_ps(q, _mm512_set1_ps(bf16_to_f32(s)));
    p = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rne_bf16(p)), 16));
    __m256i w = rne_bf16(_mm512_add_ps(p, _mm512_set1_ps(bf16_to_f32(b))));
    return _mm512_broadcast_i64x4(w);
}
#endif

int i4deq_run(const I4DArgs *a, int nthreads) {
#if MLXR_AVX512
    const int64_t k_all = a->k, grp = a->group, ng = k_all / grp;
    const int64_t units = (a->b1 - a->b0) * 8;  /* (block, j / 4): 8 output rows each */
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t u = 0; u < units; u++) {
        const int64_t b = a->b0 + u / 8, j = (u % 8) * 4;
        const uint8_t *wb = a->w + b * k_all * 32 + j;
        /* dword c of a gather: byte (k + c) * 32 + j.. of the block, rows j..j+3 of column
         * k + c; vpermt2w then takes the low word of each dword of two gathers (32 columns) */
        const __m512i idx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(32));
        const __m512i even = _mm512_add_epi16(
            _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                             15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                             15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
        int64_t rows[8];  /* r = 2 t + h: byte t of the dword, nibble h (row + 32) */
        for (int t = 0; t < 4; t++) {
            rows[2 * t] = 64 * b + j + t;
            rows[2 * t + 1] = rows[2 * t] + 32;
        }
        for (int64_t g = 0; g < ng; g++) {
            __m512i tab[8];
            for (int r = 0; r < 8; r++)
                tab[r] = row_table(a->s[rows[r] * ng + g], a->bias[rows[r] * ng + g]);
            for (int64_t k = g * grp; k < (g + 1) * grp; k += 32) {
                __m512i d0 = _mm512_i32gather_epi32(idx, (const void *)(wb + k * 32), 1);
                __m512i d1 = _mm512_i32gather_epi32(idx, (const void *)(wb + k * 32 + 512), 1);
                for (int r = 0; r < 8; r++) {
                    const unsigned sh = 8 * (r / 2) + 4 * (r % 2);
                    __m512i c = _mm512_permutex2var_epi16(
                        _mm512_srli_epi32(d0, sh), even, _mm512_srli_epi32(d1, sh));
                    _mm512_storeu_si512(a->y + (rows[r] - 64 * a->b0) * k_all + k,
                                        _mm512_permutexvar_epi16(c, tab[r]));
                }
            }
        }
    }
    return 0;
#else
    (void)a; (void)nthreads;
    return -2;
#endif
}
