/* One-token decode attention over a bf16 / f32 KV cache (see kernels.c). */
#include "kernels.h"

static inline float dot_kv(const void *base, int dt, int64_t off, const float *q, int64_t d) {
    float acc = 0.0f;
    if (dt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)base + off;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < d; j++) acc += q[j] * bf16_to_f32(p[j]);
    } else {
        const float *p = (const float *)base + off;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < d; j++) acc += q[j] * p[j];
    }
    return acc;
}

static inline void axpy_kv(const void *base, int dt, int64_t off, float p, float *o,
                           int64_t d) {
    if (dt == DT_BF16) {
        const uint16_t *v = (const uint16_t *)base + off;
#pragma omp simd
        for (int64_t j = 0; j < d; j++) o[j] += p * bf16_to_f32(v[j]);
    } else {
        const float *v = (const float *)base + off;
#pragma omp simd
        for (int64_t j = 0; j < d; j++) o[j] += p * v[j];
    }
}

#if MLXR_AVX512
/* bf16 cache, D a multiple of 16 (<= 256), up to 8 query heads per kv head: each K / V row is
 * widened to float32 once, in registers, for all the kv head's query heads (the portable loop
 * below widens it once per query head). */
static void attend_kv_avx512(const AArgs *a, int64_t kv, int rep, float *buf) {
    int64_t d = a->d, s = a->s, nv = d / 16, hbase = kv * a->head_stride;
    float *qf = buf + rep * s, *o = qf + rep * d;
    for (int r = 0; r < rep; r++)
        for (int64_t j = 0; j < d; j++)
            qf[r * d + j] = load_elem(a->q, a->q_dt, (kv * rep + r) * d + j) * a->scale;
    float mx[8];
    for (int r = 0; r < rep; r++) mx[r] = -INFINITY;
    for (int64_t t = 0; t < s; t++) {
        int64_t slot = a->slots ? a->slots[t] : a->start + t;
        const uint16_t *kr = (const uint16_t *)a->kc + hbase + slot * d;
        __m512 k[16];
        for (int64_t j = 0; j < nv; j++)
            k[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(kr + 16 * j))), 16));
        for (int r = 0; r < rep; r++) {
            __m512 acc = _mm512_mul_ps(k[0], _mm512_loadu_ps(qf + r * d));
            for (int64_t j = 1; j < nv; j++)
                acc = _mm512_fmadd_ps(k[j], _mm512_loadu_ps(qf + r * d + 16 * j), acc);
            float sc = _mm512_reduce_add_ps(acc);
            buf[r * s + t] = sc;
            mx[r] = sc > mx[r] ? sc : mx[r];
        }
    }
    for (int r = 0; r < rep; r++) {
        float den = 0.0f;
        for (int64_t t = 0; t < s; t++) {
            buf[r * s + t] = expf(buf[r * s + t] - mx[r]);
            den += buf[r * s + t];
        }
        for (int64_t t = 0; t < s; t++) buf[r * s + t] /= den;
        for (int64_t j = 0; j < d; j++) o[r * d + j] = 0.0f;
    }
    for (int64_t t = 0; t < s; t++) {
        int64_t slot = a->slots ? a->slots[t] : a->start + t;
        const uint16_t *vr = (const uint16_t *)a->vc + hbase + slot * d;
        for (int64_t j = 0; j < nv; j++) {
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr + 16 * j))), 16));
            for (int r = 0; r < rep; r++) {
                float *op = o + r * d + 16 * j;
                _mm512_storeu_ps(op, _mm512_fmadd_ps(_mm512_set1_ps(buf[r * s + t]), v,
                                                     _mm512_loadu_ps(op)));
            }
        }
    }
    for (int r = 0; r < rep; r++)
        for (int64_t j = 0; j < d; j++)
            store_elem(a->out, a->q_dt, (kv * rep + r) * d + j, o[r * d + j]);
}
#endif

int attend_run(const AArgs *a, int nthreads) {
    int64_t rep = a->h / a->kh, d = a->d, s = a->s;
    int failed = 0;
#if MLXR_AVX512
    if (a->kv_dt == DT_BF16 && d % 16 == 0 && d <= 256 && rep <= 8) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t kv = 0; kv < a->kh; kv++) {
            float *buf = malloc(sizeof(float) * (size_t)(rep * (s + 2 * d)));
            if (!buf) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            attend_kv_avx512(a, kv, (int)rep, buf);
            free(buf);
        }
        return failed ? -1 : 0;
    }
#endif
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t hh = 0; hh < a->h; hh++) {
        float *buf = malloc(sizeof(float) * (size_t)(s + 2 * d));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *qf = buf + s, *o = qf + d;
        int64_t kv = hh / rep, hbase = kv * a->head_stride;
        for (int64_t j = 0; j < d; j++) qf[j] = load_elem(a->q, a->q_dt, hh * d + j) * a->scale;
        float mx = -INFINITY;
        for (int64_t t = 0; t < s; t++) {
            int64_t slot = a->slots ? a->slots[t] : a->start + t;
            float sc = dot_kv(a->kc, a->kv_dt, hbase + slot * d, qf, d);
            buf[t] = sc;
            mx = sc > mx ? sc : mx;
        }
        float den = 0.0f;
        for (int64_t t = 0; t < s; t++) {
            buf[t] = expf(buf[t] - mx);
            den += buf[t];
        }
        for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
        for (int64_t t = 0; t < s; t++) {
            int64_t slot = a->slots ? a->slots[t] : a->start + t;
            axpy_kv(a->vc, a->kv_dt, hbase + slot * d, buf[t] / den, o, d);
        }
        for (int64_t j = 0; j < d; j++) store_elem(a->out, a->q_dt, hh * d + j, o[j]);
        free(buf);
    }
    return failed ? -1 : 0;
}
