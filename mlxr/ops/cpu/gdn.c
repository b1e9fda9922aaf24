/* One gated DeltaNet decode step between the two projections, in C (gdn.py wraps it,
 * twins.gdn_step is its torch twin: the lean step's arithmetic).
 *
 * Why: the lean torch step (mlxr/models/cpu_hybrid_decode.py) spends ~0.6 ms of one core per
 * layer and token outside the projections on the 0.8B shape: ~25 torch calls and four passes
 * over the float32 state [Hv, Dv, Dk] (1 MB per layer: mul_, bmm, baddbmm_, bmm). Here the
 * state is read and written once: per row S[h, i, :] (Dk floats, in registers)
 *     s = g s;  kv = s . k;  d = (v_i - kv) beta;  s = s + d k;  y_i = s . q
 * (mlx-lm's `_gated_delta_step_ops` per row, the reference's ops in its order).
 *
 * Rounding: every elementwise step rounds where the torch step rounds it (this file is
 * compiled without contracting a * b + c into an FMA); the bf16 functions are tables of
 * torch's own outputs (silu and sigmoid of each bf16 value, softplus as logaddexp(x, 0) in
 * bf16, silu of each bf16 value in float32); the L2 and gated norms' mean of squares follows
 * torch's sum order (`torch_row_sum`). What differs: the two dot products over Dk (torch runs
 * them as MKL's bmm, whose order is not reproducible; here 16 lanes, chunks in order, then
 * the lanes' sum) and the decay's exp (libm's expf against torch's vectorised one, both
 * within an ulp). So outputs and states are within float32 summation bounds of the torch
 * step's, not equal (tests/test_cpu_gdn.py). */
#pragma GCC optimize("fp-contract=off")
#include "kernels.h"

/* x . y over n floats: 16 lanes of products summed chunk by chunk, then the lanes */
static inline float dot(const float *x, const float *y, int64_t n) {
    int64_t j = 0;
    float acc = 0.0f;
#if MLXR_AVX512
    if (n >= 16) {
        __m512 a = _mm512_setzero_ps();
        for (; j + 16 <= n; j += 16)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(y + j), a);
        acc = _mm512_reduce_add_ps(a);
    }
#endif
    for (; j < n; j++) acc += x[j] * y[j];
    return acc;
}

/* one state row s [n] (in place): s = g s; d = (v - s . k) beta; s = s + d k; returns s . q */
static inline float row_step(float *s, const float *k, const float *q, float g, float v,
                             float beta, int64_t n) {
    int64_t j = 0;
#if MLXR_AVX512
    if (n % 16 == 0 && n <= 256) {  /* the row stays in registers between the two passes */
        __m512 r[16];
        const __m512 gv = _mm512_set1_ps(g);
        __m512 a = _mm512_setzero_ps();
        const int64_t nv = n / 16;
        for (int64_t c = 0; c < nv; c++) {
            r[c] = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * c), gv);
            a = _mm512_fmadd_ps(r[c], _mm512_loadu_ps(k + 16 * c), a);
        }
        const __m512 dv = _mm512_set1_ps((v - _mm512_reduce_add_ps(a)) * beta);
        __m512 y = _mm512_setzero_ps();
        for (int64_t c = 0; c < nv; c++) {
            r[c] = _mm512_add_ps(r[c], _mm512_mul_ps(dv, _mm512_loadu_ps(k + 16 * c)));
            _mm512_storeu_ps(s + 16 * c, r[c]);
            y = _mm512_fmadd_ps(r[c], _mm512_loadu_ps(q + 16 * c), y);
        }
        return _mm512_reduce_add_ps(y);
    }
#endif
    for (; j < n; j++) s[j] *= g;
    const float d = (v - dot(s, k, n)) * beta;
    for (j = 0; j < n; j++) s[j] = s[j] + d * k[j];
    return dot(s, q, n);
}

/* x [n] float32 -> bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w) (w NULL: the first rounding
 * only) as float32 values, torch's mean order; sq is scratch of n */
static void unit_rms(const float *x, float *sq, int64_t n, float eps, int lanes,
                     const uint16_t *w, float *out) {
    for (int64_t j = 0; j < n; j++) sq[j] = x[j] * x[j];
    const float r = 1.0f / sqrtf(torch_row_sum(sq, n, lanes) / (float)n + eps);
    for (int64_t j = 0; j < n; j++) {
        float t = bf16_to_f32(f32_to_bf16(x[j] * r));
        out[j] = w ? bf16_to_f32(f32_to_bf16(t * bf16_to_f32(w[j]))) : t;
    }
}

int gdn_step_run(const GdnArgs *a, int nthreads) {
    const int64_t hk = a->hk, hv = a->hv, dk = a->dk, dv = a->dv, c = a->c, w = a->w;
    const int64_t kd = hk * dk, rep = hv / hk;
    /* per sequence: silu(conv) [c] float, q / k normed and scaled [2 hk, dk], gates [2 hv],
     * y [hv, dv] float, scratch [max(dk, dv)] */
    const int64_t mx = dk > dv ? dk : dv;
    float *buf = malloc(sizeof(float) * (size_t)(c + 2 * kd + 2 * hv + hv * dv + 2 * mx));
    if (!buf) return -1;
    float *mixed = buf, *qk = mixed + c, *gb = qk + 2 * kd, *y = gb + 2 * hv;
    float *sq = y + hv * dv, *t = sq + mx;
    (void)nthreads;
    for (int64_t b = 0; b < a->n; b++) {
        const uint16_t *x = a->proj + b * a->proj_stride;
        const uint16_t *z = x + c, *bt = z + hv * dv, *at = bt + hv;
        uint16_t *st = a->conv_state + b * (w - 1) * c;
        for (int64_t i = 0; i < c; i++) {  /* the taps in order, tap 0 (oldest) first */
            float acc = bf16_to_f32(st[i]) * a->conv_w[i];
            for (int64_t j = 1; j < w; j++) {
                uint16_t v = j < w - 1 ? st[j * c + i] : x[i];
                acc = acc + bf16_to_f32(v) * a->conv_w[j * c + i];
            }
            mixed[i] = bf16_to_f32(a->silu[f32_to_bf16(acc)]);
        }
        memmove(st, st + c, sizeof(uint16_t) * (size_t)((w - 2) * c));
        memcpy(st + (w - 2) * c, x, sizeof(uint16_t) * (size_t)c);
        for (int64_t h = 0; h < 2 * hk; h++) {  /* q heads then k heads */
            const float sc = h < hk ? a->q_scale : a->k_scale;
            unit_rms(mixed + h * dk, sq, dk, a->qk_eps, a->lanes, NULL, qk + h * dk);
            for (int64_t j = 0; j < dk; j++)
                qk[h * dk + j] = bf16_to_f32(f32_to_bf16(qk[h * dk + j] * sc));
        }
        for (int64_t h = 0; h < hv; h++) {
            uint16_t xa = f32_to_bf16(bf16_to_f32(at[h]) + bf16_to_f32(a->dt_bias[h]));
            gb[h] = expf(a->neg_decay[h] * bf16_to_f32(a->softplus[xa]));
            gb[hv + h] = bf16_to_f32(a->sigmoid[bt[h]]);
        }
        float *ss = a->ssm + b * hv * dv * dk;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
#endif
        for (int64_t h = 0; h < hv; h++) {
            const float *q = qk + (h / rep) * dk, *k = qk + kd + (h / rep) * dk;
            const float *v = mixed + 2 * kd + h * dv;
            for (int64_t i = 0; i < dv; i++)
                y[h * dv + i] = bf16_to_f32(f32_to_bf16(
                    row_step(ss + (h * dv + i) * dk, k, q, gb[h], v[i], gb[hv + h], dk)));
        }
        uint16_t *o = a->out + b * hv * dv;
        for (int64_t h = 0; h < hv; h++) {  /* RMSNormGated: norm(y) w, times silu(z) */
            unit_rms(y + h * dv, sq, dv, a->eps, a->lanes, a->norm_w, t);
            for (int64_t i = 0; i < dv; i++)
                o[h * dv + i] = f32_to_bf16(a->silu32[z[h * dv + i]] * t[i]);
        }
    }
    free(buf);
    return 0;
}
