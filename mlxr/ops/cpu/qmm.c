/* Quantized matmul from MLX's packed layout (see kernels.c for why, and the numerics). */
#include "kernels.h"

/* A row's group scales (and biases) as float32: affine from bf16/f16/f32, mx* from E8M0
 * bytes, nvfp4 from E4M3 bytes times global_scale / 2688 (`gmul`, 1 when absent). */
static void to_f32(const void *p, int dt, int64_t o, int64_t n, float *out) {
    if (dt == DT_BF16) {
        const uint16_t *h = (const uint16_t *)p + o;
        for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(h[i]);
    } else if (dt == DT_F32) {
        memcpy(out, (const float *)p + o, sizeof(float) * (size_t)n);
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = load_elem(p, dt, o + i);
    }
}

static void row_scales(const QArgs *a, int64_t row, float *sf, float *bf) {
    int64_t ng = a->k / a->group, o = row * ng;
    const uint8_t *e = (const uint8_t *)a->s + o;
    if (a->mode == MODE_AFFINE) {
        to_f32(a->s, a->s_dt, o, ng, sf);
        to_f32(a->b, a->b_dt, o, ng, bf);
    } else if (a->mode == MODE_NVFP4) {
        for (int64_t g = 0; g < ng; g++) sf[g] = E4M3[e[g]] * a->gmul;
    } else {
        for (int64_t g = 0; g < ng; g++) sf[g] = e8m0(e[g]);
    }
}

/* An affine row's group terms outside the code dot products: sum_g b_g * sum(x_g), minus
 * the nibble path's offset s_g * 128 * sum(x'_g) (xo NULL: none). */
static inline float bias_term(const QArgs *a, const float *sf, const float *bf, int64_t i,
                              const float *xo) {
    int64_t ng = a->k / a->group;
    const float *xs = a->xs + i * ng;
    float r = 0.0f;
    if (a->mode != MODE_AFFINE) return r;
    if (xo) {
        xo += i * ng;
#pragma omp simd reduction(+ : r)
        for (int64_t g = 0; g < ng; g++) r += bf[g] * xs[g] - sf[g] * xo[g];
    } else {
#pragma omp simd reduction(+ : r)
        for (int64_t g = 0; g < ng; g++) r += bf[g] * xs[g];
    }
    return r;
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
            acc[i] += sf[gi] * dot;
        }
    }
    for (int64_t i = 0; i < a->m; i++) acc[i] += bias_term(a, sf, bf, i, NULL);
}

#if MLXR_AVX512
/* The nibble path (affine 4/8-bit, mxfp4, nvfp4; bf16 x): 128 nibbles (64 bytes, one load)
 * per step, no shuffles. 16-bit lane l of the step holds nibbles 4l..4l+3; shifting by 4j
 * and masking gives nibble 4l + j in every lane, for j = 0..3. Affine nibbles become bf16
 * by OR-ing 0x4300 (= 128 + n exactly: bf16 spacing in [128, 256) is 1), so the dot
 * products carry an offset of 128 * sum(x') per group, taken off in `bias_term`; fp4 codes
 * go through a 16-entry bf16 table (vpermw). x' (`xp`) is laid out to match: step entry
 * 32j + l = x'[4l + j]. vdpbf16ps pairs lanes 2i, 2i + 1: f32 lane i covers nibbles
 * 8i..8i+7, in group (8i) / gn of the step. 8-bit codes are two nibbles, the low one
 * against x, the high one against 16 x (exact in bf16). */
static inline __attribute__((always_inline)) void nib_rows(
        const QArgs *a, const uint8_t *wr, const float *sf, int64_t sstride, int64_t i0,
        const int R, const int MB, __m512 *acc) {
    /* R (1 or 2) weight rows (rows `kn / 2` bytes apart, scales `sstride` apart) against MB
     * x rows: acc[r * MB + i]. Each x vector loaded serves both weight rows. */
    const __m512i tab = _mm512_loadu_si512(a->tab16);
    const __m512i gidx = _mm512_loadu_si512(a->gidx);
    const __m512i m4 = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(0x4300);
    const int affine = a->mode == MODE_AFFINE, gshift = a->gshift;
    int64_t kn = a->kn, nstep = kn / 128;
    for (int i = 0; i < R * MB; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nstep; c++) {
        __m512i q[2][4];
        __m512 sv[2];
        int64_t g0 = (c * 128) >> gshift;
        for (int r = 0; r < R; r++) {
            const uint8_t *wp = wr + r * (kn / 2) + 64 * c;
            if (i0 == 0) _mm_prefetch((const char *)(wp + PF_ROWS * (kn / 2)), _MM_HINT_T0);
            __m512i w = _mm512_loadu_si512(wp);
            for (int j = 0; j < 4; j++) {
                __m512i nib = j == 3 ? _mm512_srli_epi16(w, 12)
                                     : _mm512_and_si512(_mm512_srli_epi16(w, 4 * j), m4);
                q[r][j] = affine ? _mm512_or_si512(nib, magic)
                                 : _mm512_permutexvar_epi16(nib, tab);
            }
            const float *st = sf + r * sstride;
            sv[r] = gshift >= 7 ? _mm512_set1_ps(st[g0])
                                : _mm512_permutexvar_ps(gidx, _mm512_loadu_ps(st + g0));
        }
        for (int i = 0; i < MB; i++) {
            const uint16_t *xr = a->xp + (i0 + i) * kn + 128 * c;
            __m512bh x[4];
            for (int j = 0; j < 4; j++) x[j] = (__m512bh)_mm512_loadu_si512(xr + 32 * j);
            for (int r = 0; r < R; r++) {
                /* two short chains: vdpbf16ps' latency, not its throughput, bounds one */
                __m512 v0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q[r][0], x[0]);
                __m512 v1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q[r][2], x[2]);
                v0 = _mm512_dpbf16_ps(v0, (__m512bh)q[r][1], x[1]);
                v1 = _mm512_dpbf16_ps(v1, (__m512bh)q[r][3], x[3]);
                acc[r * MB + i] = _mm512_fmadd_ps(_mm512_add_ps(v0, v1), sv[r], acc[r * MB + i]);
            }
        }
    }
}

/* R weight rows from `row` (R = 2 where two are left) against every x row: acc[r * m + i]. */
static void qrows_nib(const QArgs *a, int64_t row, int R, float *sf, float *bf, int64_t sstride,
                      float *acc) {
    const uint8_t *wr = a->w + row * (a->kn / 2);
    for (int r = 0; r < R; r++) row_scales(a, row + r, sf + r * sstride, bf + r * sstride);
    for (int64_t i0 = 0; i0 < a->m; i0 += 4) {
        __m512 v[8];
        int mb = a->m - i0 < 4 ? (int)(a->m - i0) : 4;
#define NIB_CASE(MBV) \
        if (R == 2) nib_rows(a, wr, sf, sstride, i0, 2, MBV, v); \
        else nib_rows(a, wr, sf, sstride, i0, 1, MBV, v); \
        break;
        switch (mb) {  /* constant row counts: the accumulators stay in registers */
        case 1: NIB_CASE(1)
        case 2: NIB_CASE(2)
        case 3: NIB_CASE(3)
        default: NIB_CASE(4)
        }
#undef NIB_CASE
        for (int r = 0; r < R; r++)
            for (int i = 0; i < mb; i++)
                acc[r * a->m + i0 + i] = _mm512_reduce_add_ps(v[r * mb + i])
                    + bias_term(a, sf + r * sstride, bf + r * sstride, i0 + i, a->xo);
    }
}

/* One x row (decode) against four weight rows at once: x's four vectors per step are loaded
 * once for the four rows, and four independent accumulator chains keep the FMA/dot units
 * busy (one row at a time ran ~1.5x slower, bound by its chain and per-row epilogue). */
static void qrows4_nib_m1(const QArgs *a, int64_t r0, float *sf, float *bf, float *out) {
    const __m512i tab = _mm512_loadu_si512(a->tab16);
    const __m512i gidx = _mm512_loadu_si512(a->gidx);
    const __m512i m4 = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(0x4300);
    const int affine = a->mode == MODE_AFFINE, gshift = a->gshift;
    int64_t kn = a->kn, nstep = kn / 128, ng = a->k / a->group, stride = ng + 16;
    const uint8_t *wr = a->w + r0 * (kn / 2);
    for (int t = 0; t < 4; t++) row_scales(a, r0 + t, sf + t * stride, bf + t * stride);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (int64_t c = 0; c < nstep; c++) {
        const uint16_t *xr = a->xp + 128 * c;
        __m512bh x0 = (__m512bh)_mm512_loadu_si512(xr), x1 = (__m512bh)_mm512_loadu_si512(xr + 32);
        __m512bh x2 = (__m512bh)_mm512_loadu_si512(xr + 64);
        __m512bh x3 = (__m512bh)_mm512_loadu_si512(xr + 96);
        int64_t g0 = (c * 128) >> gshift;
        for (int t = 0; t < 4; t++) {
            /* PF_ROWS rows ahead, same place: four rows' short streams (one row is a few
             * hundred bytes) are too short for the hardware prefetcher to ramp up */
            _mm_prefetch((const char *)(wr + (t + PF_ROWS) * (kn / 2) + 64 * c), _MM_HINT_T0);
            __m512i w = _mm512_loadu_si512(wr + t * (kn / 2) + 64 * c);
            __m512i n0 = _mm512_and_si512(w, m4);
            __m512i n1 = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
            __m512i n2 = _mm512_and_si512(_mm512_srli_epi16(w, 8), m4);
            __m512i n3 = _mm512_srli_epi16(w, 12);
            if (affine) {
                n0 = _mm512_or_si512(n0, magic); n1 = _mm512_or_si512(n1, magic);
                n2 = _mm512_or_si512(n2, magic); n3 = _mm512_or_si512(n3, magic);
            } else {
                n0 = _mm512_permutexvar_epi16(n0, tab); n1 = _mm512_permutexvar_epi16(n1, tab);
                n2 = _mm512_permutexvar_epi16(n2, tab); n3 = _mm512_permutexvar_epi16(n3, tab);
            }
            __m512 v0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)n0, x0);
            __m512 v1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)n2, x2);
            v0 = _mm512_dpbf16_ps(v0, (__m512bh)n1, x1);
            v1 = _mm512_dpbf16_ps(v1, (__m512bh)n3, x3);
            const float *st = sf + t * stride;
            __m512 sv = gshift >= 7 ? _mm512_set1_ps(st[g0])
                                    : _mm512_permutexvar_ps(gidx, _mm512_loadu_ps(st + g0));
            acc[t] = _mm512_fmadd_ps(_mm512_add_ps(v0, v1), sv, acc[t]);
        }
    }
    for (int t = 0; t < 4; t++)
        out[t] = _mm512_reduce_add_ps(acc[t]) + bias_term(a, sf + t * stride, bf + t * stride, 0,
                                                          a->xo);
}

/* mxfp8 (E4M3 codes through their table), float32 x: 16 codes per step, a group at a time. */
static void qrow_fp8(const QArgs *a, int64_t row, float *sf, float *acc) {
    int64_t k = a->k, ng = k / a->group, g = a->group;
    const uint8_t *wr = a->w + row * k;
    row_scales(a, row, sf, NULL);
    for (int64_t i = 0; i < a->m; i++) {
        const float *xr = a->xf + i * k;
        __m512 tot = _mm512_setzero_ps();
        for (int64_t gi = 0; gi < ng; gi++) {
            __m512 v = _mm512_setzero_ps();
            for (int64_t j = gi * g; j < (gi + 1) * g; j += 16) {
                __m512i ci = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wr + j)));
                v = _mm512_fmadd_ps(_mm512_i32gather_ps(ci, E4M3, 4), _mm512_loadu_ps(xr + j), v);
            }
            tot = _mm512_fmadd_ps(v, _mm512_set1_ps(sf[gi]), tot);
        }
        acc[i] = _mm512_reduce_add_ps(tot);
    }
}
#endif

/* Which row routine serves these arguments: 2 nibble, 1 mxfp8, 0 generic. */
static int qpath(const QArgs *a) {
#if MLXR_AVX512
    int g = a->group;
    int64_t kn = a->bits == 8 ? 2 * a->k : a->k;
    int nib = a->bits == 4 || (a->bits == 8 && a->mode == MODE_AFFINE);
    if (nib && a->x_dt == DT_BF16 && kn % 128 == 0 && g >= 16 && (g & (g - 1)) == 0)
        return 2;
    if (a->mode == MODE_MXFP8 && g % 16 == 0) return 1;
#endif
    (void)a;
    return 0;
}

/* The nibble path's x: x' per nibble (8-bit: x, 16 x), permuted within each 128-step, and
 * the offset sums 128 * sum(x'_g) in float32. */
static void nib_prep(QArgs *a, int64_t i) {
    const uint16_t *xb = (const uint16_t *)a->x + i * a->k;
    uint16_t *o = a->xp + i * a->kn;
    int two = a->bits == 8;
    int64_t ng = a->k / a->group;
    for (int64_t c = 0; c < a->kn; c += 128)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int64_t t = c + 4 * l + j;  /* nibble index */
                uint16_t v = two ? xb[t / 2] : xb[t];
                if (two && (t & 1)) v = f32_to_bf16(16.0f * bf16_to_f32(v));
                o[c + 32 * j + l] = v;
            }
    for (int64_t g = 0; g < ng; g++) {
        float sum = 0.0f;
        for (int64_t t = g * a->gn; t < (g + 1) * a->gn; t++) {
            uint16_t v = two ? xb[t / 2] : xb[t];
            sum += (two && (t & 1)) ? 16.0f * bf16_to_f32(v) : bf16_to_f32(v);
        }
        a->xo[i * ng + g] = 128.0f * sum;
    }
}

int qmm_run(QArgs *a, int nthreads) {
    int64_t m = a->m, k = a->k, ng = k / a->group;
    int path = qpath(a);
    a->kn = a->bits == 8 ? 2 * k : k;
    a->gn = a->bits == 8 ? 2 * a->group : a->group;
    while ((1 << a->gshift) < a->gn) a->gshift++;
    a->xf = malloc(sizeof(float) * (size_t)(m * k));
    a->xs = malloc(sizeof(float) * (size_t)(m * ng));
    if (path == 2) {
        a->xp = malloc(sizeof(uint16_t) * (size_t)(m * a->kn));
        a->xo = malloc(sizeof(float) * (size_t)(m * ng));
    }
    if (!a->xf || !a->xs || (path == 2 && (!a->xp || !a->xo))) {
        free(a->xf); free(a->xs); free(a->xp); free(a->xo);
        return -1;
    }
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < k; j++) a->xf[i * k + j] = load_elem(a->x, a->x_dt, i * k + j);
        for (int64_t gi = 0; gi < ng; gi++) {
            float s = 0.0f;
            for (int64_t j = 0; j < a->group; j++) s += a->xf[i * k + gi * a->group + j];
            a->xs[i * ng + gi] = s;
        }
        if (path == 2) nib_prep(a, i);
    }
    for (int c = 0; c < 16; c++)
        a->tab16[c] = a->tab16[c + 16] = f32_to_bf16(E2M1[c]);
    for (int l = 0; l < 16; l++) a->gidx[l] = a->gn < 128 ? (int32_t)((8 * l) / a->gn) : 0;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* scales padded by 16: the nibble path loads 16 from a group index */
        float *sf = malloc(sizeof(float) * (size_t)(8 * (ng + 16) + a->group + 2 * m + 4));
        if (!sf) {
#pragma omp atomic write
            failed = 1;
        } else {
            float *bf = sf + 4 * (ng + 16), *qv = bf + 4 * (ng + 16), *acc = qv + a->group;
            int64_t quads = path == 2 && m == 1 ? a->n / 4 : 0;
#if MLXR_AVX512
#pragma omp for schedule(static) nowait
            for (int64_t qd = 0; qd < quads; qd++) {
                qrows4_nib_m1(a, 4 * qd, sf, bf, acc);
                for (int t = 0; t < 4; t++) store_elem(a->y, a->y_dt, 4 * qd + t, acc[t]);
            }
#endif
            int64_t pairs = path == 2 ? (a->n - 4 * quads) / 2 : 0, r1 = 4 * quads + 2 * pairs;
#if MLXR_AVX512
#pragma omp for schedule(static) nowait
            for (int64_t pr = 0; pr < pairs; pr++) {
                int64_t r = 4 * quads + 2 * pr;
                qrows_nib(a, r, 2, sf, bf, ng + 16, acc);
                for (int t = 0; t < 2; t++)
                    for (int64_t i = 0; i < m; i++)
                        store_elem(a->y, a->y_dt, i * a->n + r + t, acc[t * m + i]);
            }
#endif
#pragma omp for schedule(static)
            for (int64_t r = r1; r < a->n; r++) {
#if MLXR_AVX512
                if (path == 2) qrows_nib(a, r, 1, sf, bf, ng + 16, acc);
                else if (path == 1) qrow_fp8(a, r, sf, acc);
                else qrow_generic(a, r, sf, bf, qv, acc);
#else
                qrow_generic(a, r, sf, bf, qv, acc);
#endif
                for (int64_t i = 0; i < m; i++) store_elem(a->y, a->y_dt, i * a->n + r, acc[i]);
            }
            free(sf);
        }
    }
    free(a->xf); free(a->xs); free(a->xp); free(a->xo);
    return failed ? -1 : 0;
}
