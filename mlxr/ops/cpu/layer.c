/* The elementwise and per-row work of a decode layer around its GEMVs, in C (layer.h says
 * what each computes; mlxr/ops/cpu/fused.py wraps them, twins.py has their torch twins).
 *
 * Why: after i4mm a decode step of the 0.6B shape still made ~70 torch calls per layer
 * (RMSNorm alone is eight: float, pow, mean, add, rsqrt, mul, to, mul), each a few
 * microseconds of dispatch for a few KB of data (docs/perf.md, session 21).
 *
 * Bit for bit the torch path's values, so no greedy token can move: every float32 operation
 * the reference does is done here in the same order and rounded at the same places (products
 * and sums one IEEE operation each: this file is compiled without contracting a * b + c into
 * an FMA, which the reference never does), and the one reduction, the RMSNorm's mean of
 * squares, follows torch's CPU sum (aten/src/ATen/native/cpu/SumKernel.cpp, `cascade_sum`
 * over a contiguous row: `vectorized_inner_sum` of `lanes`-wide vectors, four of them side by
 * side (`row_sum`'s ilp factor), chunked in levels of 16 (`multi_row_sum`), the scalar tail
 * first and then the lanes in order; rows shorter than a vector take `row_sum` over scalars).
 * `lanes` is torch's Vectorized<float>::size() for its dispatched CPU capability (16 for
 * AVX512, 8 for AVX2); fused.py checks the result against torch once per process before
 * using any of this, and takes the torch path when they differ.
 */
#pragma GCC optimize("fp-contract=off")
#include "kernels.h"

#define MAXL 16  /* widest vector emulated */

/* utils::CeilLog2 of SumKernel's levels */
static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t b = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) b++;
    return b;
}

/* `row_sum` with ilp factor 4 over `size` elements of width w (w floats each, `x` contiguous):
 * out[0..w) = the elementwise sum as torch's multi_row_sum + tail + partials order gives. */
static void row_sum(const float *x, int64_t size, int w, float *out) {
    const int64_t size_ilp = size / 4;
    const int64_t lp = ceil_log2(size_ilp) / 4 > 4 ? ceil_log2(size_ilp) / 4 : 4;
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    float acc[4][4][MAXL];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + step <= size_ilp) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < w; l++) acc[0][k][l] += x[(i * 4 + k) * w + l];
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < w; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * lp))) != 0) break;
        }
    }
    for (; i < size_ilp; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < w; l++) acc[0][k][l] += x[(i * 4 + k) * w + l];
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < w; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t t = size_ilp * 4; t < size; t++)
        for (int l = 0; l < w; l++) acc[0][0][l] += x[t * w + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < w; l++) acc[0][0][l] += acc[0][k][l];
    memcpy(out, acc[0][0], sizeof(float) * (size_t)w);
}

/* torch's float32 sum of a contiguous row x[0..n) (cascade_sum, inner reduction) */
float torch_row_sum(const float *x, int64_t n, int lanes) {
    float part[MAXL];
    if (n < lanes) {
        row_sum(x, n, 1, part);
        return part[0];
    }
    const int64_t nv = n / lanes;
    row_sum(x, nv, lanes, part);
    float acc = 0.0f;
    for (int64_t t = nv * lanes; t < n; t++) acc += x[t];
    for (int l = 0; l < lanes; l++) acc += part[l];
    return acc;
}

/* rms_norm of one row s (float32, e values, `sq` scratch of e): bf16(s * rsqrt(mean(s^2) +
 * eps)) * w, each step as ops.reference.rms_norm does it */
static void norm_row(const float *s, float *sq, int64_t e, const uint16_t *w, float eps,
                     int lanes, uint16_t *out) {
    for (int64_t j = 0; j < e; j++) sq[j] = s[j] * s[j];
    const float mean = torch_row_sum(sq, e, lanes) / (float)e;
    const float r = 1.0f / sqrtf(mean + eps);
    for (int64_t j = 0; j < e; j++)
        out[j] = f32_to_bf16(bf16_to_f32(f32_to_bf16(s[j] * r)) * bf16_to_f32(w[j]));
}

int add_rms_norm_run(const NormArgs *a) {
    float *buf = malloc(sizeof(float) * 2 * (size_t)a->e);
    if (!buf) return -1;
    float *s = buf, *sq = buf + a->e;
    for (int64_t i = 0; i < a->n; i++) {
        const uint16_t *h = a->h + i * a->e;
        uint16_t *ho = a->h_out ? a->h_out + i * a->e : NULL;
        for (int64_t j = 0; j < a->e; j++) {
            float v = bf16_to_f32(h[j]);
            if (a->r) {  /* (h + r) rounded to bf16, as the residual add stores it */
                uint16_t sb = f32_to_bf16(v + bf16_to_f32(a->r[i * a->e + j]));
                if (ho) ho[j] = sb;
                v = bf16_to_f32(sb);
            }
            s[j] = v;
        }
        norm_row(s, sq, a->e, a->w, a->eps, a->lanes, a->out + i * a->e);
    }
    free(buf);
    return 0;
}

int qk_rope_run(const RopeArgs *a) {
    const int64_t d = a->d, hk = a->h + a->kh, r2 = a->r2, r = r2 / 2;
    const int64_t row = (a->h + 2 * a->kh) * d;
    float *buf = malloc(sizeof(float) * 3 * (size_t)d);
    if (!buf) return -1;
    float *s = buf, *sq = buf + d, *xr = buf + 2 * d;
    uint16_t *nb = malloc(sizeof(uint16_t) * (size_t)d);
    if (!nb) { free(buf); return -1; }
    for (int64_t i = 0; i < a->n; i++) {
        const uint16_t *src = a->qkv + i * row;
        const float *c = a->cos + a->pos[i] * r2, *sn = a->sin + a->pos[i] * r2;
        for (int64_t hd = 0; hd < hk; hd++) {
            const uint16_t *x = src + hd * d;
            const uint16_t *xn = x;
            if (a->w) {  /* the per-head RMSNorm (q_norm's or k_norm's row of w) */
                for (int64_t j = 0; j < d; j++) s[j] = bf16_to_f32(x[j]);
                norm_row(s, sq, d, a->w + hd * d, a->eps, a->lanes, nb);
                xn = nb;
            }
            uint16_t *dst = hd < a->h ? a->q_out + (i * a->h + hd) * d
                : a->kc + (hd - a->h) * a->head_stride + a->slots[i] * d;
            for (int64_t j = 0; j < r2; j++) xr[j] = bf16_to_f32(xn[j]);
            for (int64_t j = 0; j < r2; j++) {  /* x * [c, c] + swap(x) * [-s, s] */
                int64_t o = a->traditional ? (j ^ 1) : (j < r ? j + r : j - r);
                dst[j] = f32_to_bf16(xr[j] * c[j] + xr[o] * sn[j]);
            }
            for (int64_t j = r2; j < d; j++) dst[j] = xn[j];
        }
        const uint16_t *v = src + hk * d;
        for (int64_t hd = 0; hd < a->kh; hd++)
            memcpy(a->vc + hd * a->head_stride + a->slots[i] * d, v + hd * d,
                   sizeof(uint16_t) * (size_t)d);
    }
    free(nb);
    free(buf);
    return 0;
}

#if MLXR_AVX512
/* f32_to_bf16 in 16 lanes (software round to nearest even, as torch converts: no flush of
 * denormals, which vcvtneps2bf16 would do) */
static inline __m256i bf16_round16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, lsb),
                                                   _mm512_set1_epi32(0x7FFF)), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(0x7F800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* tab has 65536 entries and one more (a 32-bit gather at the last index reads it) */
void act_mul_run(const uint16_t *gu, int64_t n, int64_t inter, const uint16_t *tab,
                 uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *g = gu + i * 2 * inter, *u = g + inter;
        uint16_t *o = out + i * inter;
        int64_t j = 0;
#if MLXR_AVX512
        for (; j + 16 <= inter; j += 16) {
            __m512i gi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + j)));
            __m512i t = _mm512_i32gather_epi32(gi, (const void *)tab, 2);
            __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(t, 16));
            __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(u + j))), 16));
            _mm256_storeu_si256((__m256i *)(o + j), bf16_round16(_mm512_mul_ps(a, b)));
        }
#endif
        for (; j < inter; j++)
            o[j] = f32_to_bf16(bf16_to_f32(tab[g[j]]) * bf16_to_f32(u[j]));
    }
}
