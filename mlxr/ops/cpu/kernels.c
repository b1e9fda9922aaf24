/* mlxr's own CPU kernels: the quantized GEMV / small-M matmul straight from MLX's packed layout,
 * and decode attention over a bf16 / f32 KV cache.
 *
 * Why hand-written (docs/perf.md, "CPU decode"): torch's packed-int4 kernel runs ~1.6x off the
 * read-bandwidth bound in place and takes only affine 4-bit (other widths go through nibble
 * planes at 2x the bytes); decode attention in torch needs float32 copies of the bf16 K/V
 * (bf16 bmm rounds the scores, out_dtype=float32 bmm is not on the CPU); and every torch op
 * costs a dispatch of a few microseconds. Here each matmul is one call that reads the MLX words
 * once, and attention reads bf16 K/V directly with float32 math.
 *
 * A plain CPython extension: tensors arrive as data_ptr() integers and sizes (no torch headers,
 * so the build is fast and independent of torch's C++ ABI); the caller (mlxr/ops/cpu/native.py)
 * checks shapes, dtypes and contiguity. The GIL is released while a kernel runs. OpenMP (the
 * libgomp torch has already loaded, by soname) parallelises over output rows / kv heads.
 *
 * Numerics: float32 accumulation everywhere, the output rounded to its dtype once (bf16: round
 * to nearest even). Quantized matmul per group g of a row: s_g * (x_g . q_g) + b_g * sum(x_g),
 * the same algebra as mlx's qmv; only the summation order differs from the torch twin.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MLXR_AVX512 1
#else
#define MLXR_AVX512 0
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_U8 = 3 };
enum { MODE_AFFINE = 0, MODE_MXFP4 = 1, MODE_NVFP4 = 2, MODE_MXFP8 = 3 };

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static float E4M3[256];

static void init_e4m3(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m / 8.0f, -6) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if ((b & 0x7F) == 0x7F) v = NAN;
        E4M3[b] = b >= 128 ? -v : v;
    }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline uint16_t f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}

static inline float load_elem(const void *p, int dt, int64_t i) {
    switch (dt) {
    case DT_F32: return ((const float *)p)[i];
    case DT_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case DT_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return (float)((const uint8_t *)p)[i];
    }
}

static inline void store_elem(void *p, int dt, int64_t i, float v) {
    if (dt == DT_F32) ((float *)p)[i] = v;
    else if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((uint16_t *)p)[i] = f32_to_f16(v);
}

static inline float e8m0(uint8_t e) {
    uint32_t u = e == 0 ? 0x00400000u : (uint32_t)e << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ------------------------------------------------------------------ quantized matmul */

typedef struct {
    const void *x; int x_dt; int64_t m, k;
    const uint8_t *w; int64_t n; int mode, bits, group;
    const void *s; int s_dt; const void *b; int b_dt; float gmul;
    void *y; int y_dt;
    float *xf;   /* [m, k] x widened to float32, natural order */
    float *xs;   /* [m, k / group] per-group sums of x */
    uint16_t *xp; /* [m, k] bf16 x with each 64-chunk's even entries then its odd ones */
} QArgs;

/* A row's group scales (and biases) as float32: affine from bf16/f16/f32, mx* from E8M0
 * bytes, nvfp4 from E4M3 bytes times global_scale / 2688 (`gmul`, 1 when absent). */
static void row_scales(const QArgs *a, int64_t row, float *sf, float *bf) {
    int64_t ng = a->k / a->group, o = row * ng;
    for (int64_t g = 0; g < ng; g++) {
        if (a->mode == MODE_AFFINE) {
            sf[g] = load_elem(a->s, a->s_dt, o + g);
            bf[g] = load_elem(a->b, a->b_dt, o + g);
        } else {
            uint8_t e = ((const uint8_t *)a->s)[o + g];
            sf[g] = a->mode == MODE_NVFP4 ? E4M3[e] * a->gmul : e8m0(e);
        }
    }
}

/* Codes j0..j0+cnt of a row's little-endian bit stream as their float values. */
static void decode_codes(const QArgs *a, const uint8_t *row, int64_t j0, int cnt, float *out) {
    int bits = a->bits;
    uint32_t mask = (1u << bits) - 1u;
    int64_t row_bytes = a->k * bits / 8;
    for (int j = 0; j < cnt; j++) {
        int64_t bit = (j0 + j) * bits, byte = bit >> 3;
        uint64_t win = 0;
        int avail = row_bytes - byte < 8 ? (int)(row_bytes - byte) : 8;
        memcpy(&win, row + byte, (size_t)avail);
        uint32_t c = (uint32_t)(win >> (bit & 7)) & mask;
        out[j] = a->mode == MODE_AFFINE ? (float)c
               : a->mode == MODE_MXFP8 ? E4M3[c] : E2M1[c];
    }
}

/* Any mode, width and group: one group's codes decoded to floats, dotted with x in float32. */
static void qrow_generic(const QArgs *a, int64_t row, float *sf, float *bf, float *qv,
                         float *acc) {
    int64_t ng = a->k / a->group, g = a->group;
    const uint8_t *wr = a->w + row * (a->k * a->bits / 8);
    row_scales(a, row, sf, bf);
    for (int64_t i = 0; i < a->m; i++) acc[i] = 0.0f;
    for (int64_t gi = 0; gi < ng; gi++) {
        decode_codes(a, wr, gi * g, (int)g, qv);
        for (int64_t i = 0; i < a->m; i++) {
            const float *xr = a->xf + i * a->k + gi * g;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < g; j++) dot += qv[j] * xr[j];
            acc[i] += sf[gi] * dot + (a->mode == MODE_AFFINE ? bf[gi] * a->xs[i * ng + gi] : 0.0f);
        }
    }
}

#if MLXR_AVX512
/* 4-bit codes (affine, mxfp4, nvfp4), bf16 x: 64 codes (32 bytes) per step. Each byte's low
 * nibble is an even code, its high nibble the next odd one; both become bf16 through a
 * 16-entry table (exact: 0..15 or E2M1 values) and meet x's even / odd entries (`xp`) in
 * vdpbf16ps (float32 sums of exact products). f32 lane l of a step holds codes 4l..4l+3, so
 * its group is (4l) / group: the scale vector is a gather of the row's scales (group < 64) or
 * one broadcast. */
static void qrow_nib(const QArgs *a, int64_t row, float *sf, float *bf, float *acc) {
    int64_t k = a->k, ng = k / a->group, g = a->group, nchunk = k / 64;
    const uint8_t *wr = a->w + row * (k / 2);
    row_scales(a, row, sf, bf);
    __m512i tab;
    {
        uint16_t t[32];
        for (int c = 0; c < 16; c++) {
            float v = a->mode == MODE_AFFINE ? (float)c : E2M1[c];
            t[c] = t[c + 16] = f32_to_bf16(v);
        }
        tab = _mm512_loadu_si512(t);
    }
    int32_t gi_idx[16];
    for (int l = 0; l < 16; l++) gi_idx[l] = g < 64 ? (int32_t)((4 * l) / g) : 0;
    const __m512i gidx = _mm512_loadu_si512(gi_idx);
    const __m512i lo4 = _mm512_set1_epi16(0x0F);
    for (int64_t i0 = 0; i0 < a->m; i0 += 4) {
        int mb = a->m - i0 < 4 ? (int)(a->m - i0) : 4;
        __m512 acc4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                          _mm512_setzero_ps()};
        for (int64_t c = 0; c < nchunk; c++) {
            __m512i by = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wr + 32 * c)));
            __m512i qlo = _mm512_permutexvar_epi16(_mm512_and_si512(by, lo4), tab);
            __m512i qhi = _mm512_permutexvar_epi16(_mm512_srli_epi16(by, 4), tab);
            int64_t g0 = (c * 64) / g;
            __m512 sv = g >= 64 ? _mm512_set1_ps(sf[g0])
                                : _mm512_permutexvar_ps(gidx, _mm512_loadu_ps(sf + g0));
            for (int i = 0; i < mb; i++) {
                const uint16_t *xr = a->xp + (i0 + i) * k + 64 * c;
                __m512 v = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qlo,
                                            (__m512bh)_mm512_loadu_si512(xr));
                v = _mm512_dpbf16_ps(v, (__m512bh)qhi, (__m512bh)_mm512_loadu_si512(xr + 32));
                acc4[i] = _mm512_fmadd_ps(v, sv, acc4[i]);
            }
        }
        for (int i = 0; i < mb; i++) {
            float r = _mm512_reduce_add_ps(acc4[i]);
            if (a->mode == MODE_AFFINE) {
                const float *xs = a->xs + (i0 + i) * ng;
                for (int64_t gi = 0; gi < ng; gi++) r += bf[gi] * xs[gi];
            }
            acc[i0 + i] = r;
        }
    }
}

/* 8-bit codes (affine, mxfp8), float32 x: 32 codes per step, one group of >= 32 codes at a
 * time (codes widened to float32: ints exactly, E4M3 through its table). */
static void qrow_byte(const QArgs *a, int64_t row, float *sf, float *bf, float *acc) {
    int64_t k = a->k, ng = k / a->group, g = a->group;
    const uint8_t *wr = a->w + row * k;
    row_scales(a, row, sf, bf);
    int fp8 = a->mode == MODE_MXFP8;
    for (int64_t i0 = 0; i0 < a->m; i0 += 4) {
        int mb = a->m - i0 < 4 ? (int)(a->m - i0) : 4;
        __m512 acc4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                          _mm512_setzero_ps()};
        for (int64_t gi = 0; gi < ng; gi++) {
            __m512 v4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                            _mm512_setzero_ps()};
            for (int64_t j = gi * g; j < (gi + 1) * g; j += 16) {
                __m512i ci = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wr + j)));
                __m512 q = fp8 ? _mm512_i32gather_ps(ci, E4M3, 4) : _mm512_cvtepi32_ps(ci);
                for (int i = 0; i < mb; i++)
                    v4[i] = _mm512_fmadd_ps(q, _mm512_loadu_ps(a->xf + (i0 + i) * k + j), v4[i]);
            }
            __m512 sv = _mm512_set1_ps(sf[gi]);
            for (int i = 0; i < mb; i++) acc4[i] = _mm512_fmadd_ps(v4[i], sv, acc4[i]);
        }
        for (int i = 0; i < mb; i++) {
            float r = _mm512_reduce_add_ps(acc4[i]);
            if (a->mode == MODE_AFFINE) {
                const float *xs = a->xs + (i0 + i) * ng;
                for (int64_t gi = 0; gi < ng; gi++) r += bf[gi] * xs[gi];
            }
            acc[i0 + i] = r;
        }
    }
}
#endif

/* Which row routine serves these arguments: 2 nibble, 1 byte, 0 generic. */
static int qpath(const QArgs *a) {
#if MLXR_AVX512
    if (a->bits == 4 && a->x_dt == DT_BF16 && a->k % 64 == 0 && a->group >= 16) return 2;
    if (a->bits == 8 && a->group % 16 == 0) return 1;
#endif
    (void)a;
    return 0;
}

static int qmm_run(QArgs *a, int nthreads) {
    int64_t m = a->m, k = a->k, ng = k / a->group;
    int path = qpath(a);
    a->xf = malloc(sizeof(float) * (size_t)(m * k));
    a->xs = malloc(sizeof(float) * (size_t)(m * ng));
    a->xp = path == 2 ? malloc(sizeof(uint16_t) * (size_t)(m * k)) : NULL;
    if (!a->xf || !a->xs || (path == 2 && !a->xp)) {
        free(a->xf); free(a->xs); free(a->xp);
        return -1;
    }
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < k; j++) a->xf[i * k + j] = load_elem(a->x, a->x_dt, i * k + j);
        for (int64_t gi = 0; gi < ng; gi++) {
            float s = 0.0f;
            for (int64_t j = 0; j < a->group; j++) s += a->xf[i * k + gi * a->group + j];
            a->xs[i * ng + gi] = s;
        }
        if (a->xp) {
            const uint16_t *xb = (const uint16_t *)a->x + i * k;
            uint16_t *o = a->xp + i * k;
            for (int64_t c = 0; c < k; c += 64)
                for (int l = 0; l < 32; l++) {
                    o[c + l] = xb[c + 2 * l];
                    o[c + 32 + l] = xb[c + 2 * l + 1];
                }
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* scales padded by 16: the nibble path loads 16 from a group index */
        float *sf = malloc(sizeof(float) * (size_t)(2 * ng + 32 + a->group + m));
        if (!sf) {
#pragma omp atomic write
            failed = 1;
        } else {
            float *bf = sf + ng + 16, *qv = bf + ng + 16, *acc = qv + a->group;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < a->n; r++) {
#if MLXR_AVX512
                if (path == 2) qrow_nib(a, r, sf, bf, acc);
                else if (path == 1) qrow_byte(a, r, sf, bf, acc);
                else qrow_generic(a, r, sf, bf, qv, acc);
#else
                qrow_generic(a, r, sf, bf, qv, acc);
#endif
                for (int64_t i = 0; i < m; i++) store_elem(a->y, a->y_dt, i * a->n + r, acc[i]);
            }
            free(sf);
        }
    }
    free(a->xf); free(a->xs); free(a->xp);
    return failed ? -1 : 0;
}

static PyObject *py_qmm(PyObject *self, PyObject *args) {
    (void)self;
    QArgs a;
    unsigned long long x, w, s, b, y;
    long long m, k, n;
    int nthreads;
    memset(&a, 0, sizeof a);
    if (!PyArg_ParseTuple(args, "KiLLKLiiiKiKifKii", &x, &a.x_dt, &m, &k, &w, &n, &a.mode,
                          &a.bits, &a.group, &s, &a.s_dt, &b, &a.b_dt, &a.gmul, &y, &a.y_dt,
                          &nthreads))
        return NULL;
    a.x = (const void *)(uintptr_t)x; a.w = (const uint8_t *)(uintptr_t)w;
    a.s = (const void *)(uintptr_t)s; a.b = (const void *)(uintptr_t)b;
    a.y = (void *)(uintptr_t)y; a.m = m; a.k = k; a.n = n;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = qmm_run(&a, nthreads < 1 ? 1 : nthreads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ decode attention */

/* One token per (sequence, query head): scores = (q * scale) . K in float32 over the S
 * visible positions (read in the cache dtype, never copied), softmax in float32, then P . V;
 * the output rounded to q's dtype once. Query head h reads kv head h / rep (GQA). Positions
 * are the cache slots `slots[0..S)` (or start..start+S when slots is NULL); a kv head's
 * rows are `head_stride` elements apart, a slot's `D` elements. */
typedef struct {
    const void *q; int q_dt; int64_t h, d;
    const void *kc, *vc; int kv_dt; int64_t kh, head_stride;
    const int64_t *slots; int64_t start, s;
    float scale; void *out;
} AArgs;

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

static int attend_run(const AArgs *a, int nthreads) {
    int64_t rep = a->h / a->kh, d = a->d, s = a->s;
    int failed = 0;
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

static PyObject *py_attend(PyObject *self, PyObject *args) {
    (void)self;
    AArgs a;
    unsigned long long q, kc, vc, slots, out;
    long long h, d, kh, hs, start, s;
    int nthreads;
    memset(&a, 0, sizeof a);
    if (!PyArg_ParseTuple(args, "KiLLKKiLLKLLfKi", &q, &a.q_dt, &h, &d, &kc, &vc, &a.kv_dt,
                          &kh, &hs, &slots, &start, &s, &a.scale, &out, &nthreads))
        return NULL;
    a.q = (const void *)(uintptr_t)q; a.kc = (const void *)(uintptr_t)kc;
    a.vc = (const void *)(uintptr_t)vc; a.slots = (const int64_t *)(uintptr_t)slots;
    a.out = (void *)(uintptr_t)out;
    a.h = h; a.d = d; a.kh = kh; a.head_stride = hs; a.start = start; a.s = s;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = attend_run(&a, nthreads < 1 ? 1 : nthreads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_features(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
#ifdef _OPENMP
    int omp = 1;
#else
    int omp = 0;
#endif
    return Py_BuildValue("{s:i,s:i}", "avx512", MLXR_AVX512, "openmp", omp);
}

static PyMethodDef methods[] = {
    {"qmm", py_qmm, METH_VARARGS, "quantized x @ W^T from MLX's packed layout"},
    {"attend", py_attend, METH_VARARGS, "one-token attention over a KV cache"},
    {"features", py_features, METH_NOARGS, "how this build was compiled"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
    init_e4m3();
    return PyModule_Create(&module);
}
