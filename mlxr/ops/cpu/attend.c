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
/* exp(x) in 16 lanes for softmax's x - max <= 0: Cody-Waite reduction by ln 2 (two
 * constants), a degree-6 polynomial, scaled by 2^n (vscalefps: underflows to 0); Sleef's
 * expf_u10 constants, within 1 ulp. glibc's scalar expf took ~1/3 of the kernel's time. */
static inline __m512 exp16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.442695040888963f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, r, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, r, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, r, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, r, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, r, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(r, r), u, r));
    return _mm512_scalef_ps(u, n);
}

static inline __m512 widen16(const uint16_t *p) {  /* 16 bf16 -> float32, exact */
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* bf16 cache, D = 16 NV (NV 4, 8, 16: D 64, 128, 256), up to 8 query heads per kv head:
 * each K row is widened once, in registers, for all the kv head's query heads; P . V keeps
 * NR query heads' outputs in registers (NR * NV <= 16) over one pass of V per NR heads (V
 * rows stay in cache between passes). */
static inline __attribute__((always_inline)) void attend_kv_nv(
        const AArgs *a, int64_t kv, int rep, float *buf, const int NV) {
    const int NR = 2 * NV <= 16 ? 2 : 1;
    int64_t d = a->d, s = a->s, hbase = kv * a->head_stride;
    float *qf = buf + rep * s;
    for (int r = 0; r < rep; r++)
        for (int64_t j = 0; j < d; j++)
            qf[r * d + j] = load_elem(a->q, a->q_dt, (kv * rep + r) * d + j) * a->scale;
    __m512 mx[8];
    for (int r = 0; r < rep; r++) mx[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < s; t++) {
        int64_t slot = a->slots ? a->slots[t] : a->start + t;
        const uint16_t *kr = (const uint16_t *)a->kc + hbase + slot * d;
        __m512 k[16];
        for (int j = 0; j < NV; j++) k[j] = widen16(kr + 16 * j);
        for (int r = 0; r < rep; r++) {
            __m512 acc = _mm512_mul_ps(k[0], _mm512_loadu_ps(qf + r * d));
            for (int j = 1; j < NV; j++)
                acc = _mm512_fmadd_ps(k[j], _mm512_loadu_ps(qf + r * d + 16 * j), acc);
            buf[r * s + t] = _mm512_reduce_add_ps(acc);
        }
    }
    for (int r = 0; r < rep; r++) {  /* softmax: max, exp, sum, divide */
        float *row = buf + r * s;
        int64_t t = 0;
        __m512 m = mx[r];
        for (; t + 16 <= s; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + t));
        float mxs = _mm512_reduce_max_ps(m);
        for (; t < s; t++) mxs = row[t] > mxs ? row[t] : mxs;
        __m512 vm = _mm512_set1_ps(mxs), den = _mm512_setzero_ps();
        for (t = 0; t + 16 <= s; t += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), vm));
            _mm512_storeu_ps(row + t, e);
            den = _mm512_add_ps(den, e);
        }
        if (t < s) {
            __mmask16 mk = (__mmask16)((1u << (s - t)) - 1);
            __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, row + t), vm));
            e = _mm512_maskz_mov_ps(mk, e);
            _mm512_mask_storeu_ps(row + t, mk, e);
            den = _mm512_add_ps(den, e);
        }
        __m512 vd = _mm512_set1_ps(_mm512_reduce_add_ps(den));
        for (t = 0; t + 16 <= s; t += 16)
            _mm512_storeu_ps(row + t, _mm512_div_ps(_mm512_loadu_ps(row + t), vd));
        for (; t < s; t++) row[t] /= _mm512_cvtss_f32(vd);
    }
    for (int r0 = 0; r0 < rep; r0 += NR) {
        const int nr = rep - r0 < NR ? rep - r0 : NR;
        __m512 o[2][16];
        for (int r = 0; r < NR; r++)
            for (int j = 0; j < NV; j++) o[r][j] = _mm512_setzero_ps();
        for (int64_t t = 0; t < s; t++) {
            int64_t slot = a->slots ? a->slots[t] : a->start + t;
            const uint16_t *vr = (const uint16_t *)a->vc + hbase + slot * d;
            __m512 p0 = _mm512_set1_ps(buf[r0 * s + t]);
            __m512 p1 = _mm512_set1_ps(nr > 1 ? buf[(r0 + 1) * s + t] : 0.0f);
            for (int j = 0; j < NV; j++) {
                __m512 v = widen16(vr + 16 * j);
                o[0][j] = _mm512_fmadd_ps(p0, v, o[0][j]);
                if (NR > 1) o[1][j] = _mm512_fmadd_ps(p1, v, o[1][j]);
            }
        }
        for (int r = 0; r < nr; r++) {
            float of[256] __attribute__((aligned(64)));
            for (int j = 0; j < NV; j++) _mm512_store_ps(of + 16 * j, o[r][j]);
            for (int64_t j = 0; j < d; j++)
                store_elem(a->out, a->q_dt, (kv * rep + r0 + r) * d + j, of[j]);
        }
    }
}

static void attend_kv_avx512(const AArgs *a, int64_t kv, int rep, float *buf) {
    switch (a->d) {
    case 64: attend_kv_nv(a, kv, rep, buf, 4); break;
    case 128: attend_kv_nv(a, kv, rep, buf, 8); break;
    default: attend_kv_nv(a, kv, rep, buf, 16); break;
    }
}
#endif

int attend_run(const AArgs *a, int nthreads) {
    int64_t rep = a->h / a->kh, d = a->d, s = a->s;
    int failed = 0;
#if MLXR_AVX512
    if (a->kv_dt == DT_BF16 && (d == 64 || d == 128 || d == 256) && rep <= 8) {
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
