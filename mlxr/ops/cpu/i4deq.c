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
 * one gather feeds 8 output rows x 16 columns. Output row-major [rows, K] bf16.
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

static inline __m512 bf16_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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
        const __m512i idx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(32));
        const __m512i m4 = _mm512_set1_epi32(15);
        int64_t rows[8];  /* global rows, in the order of the nibbles below */
        for (int t = 0; t < 4; t++) {
            rows[2 * t] = 64 * b + j + t;
            rows[2 * t + 1] = rows[2 * t] + 32;
        }
        for (int64_t g = 0; g < ng; g++) {
            __m512 s[8], bb[8];
            for (int r = 0; r < 8; r++) {
                s[r] = _mm512_set1_ps(bf16_to_f32(a->s[rows[r] * ng + g]));
                bb[r] = _mm512_set1_ps(bf16_to_f32(a->bias[rows[r] * ng + g]));
            }
            for (int64_t k = g * grp; k < (g + 1) * grp; k += 16) {
                __m512i d = _mm512_i32gather_epi32(idx, (const void *)(wb + k * 32), 1);
                for (int t = 0; t < 4; t++) {
                    __m512i by = _mm512_srli_epi32(d, 8 * t);
                    __m512i q[2] = {_mm512_and_si512(by, m4),
                                    _mm512_and_si512(_mm512_srli_epi32(by, 4), m4)};
                    for (int h = 0; h < 2; h++) {
                        const int r = 2 * t + h;
                        __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(q[h]), s[r]);  /* exact */
                        __m512 w = _mm512_add_ps(bf16_f32(rne_bf16(p)), bb[r]);
                        _mm256_storeu_si256(
                            (__m256i *)(a->y + (rows[r] - 64 * a->b0) * k_all + k), rne_bf16(w));
                    }
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
