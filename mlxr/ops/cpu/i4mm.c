/* Decode GEMV / small GEMM over torch's packed int4 CPU copy (`QuantWeight.i4`, `i4_sz`).
 *
 * Why this layout and not MLX's words: mlxr already keeps torch's int4 copy of every affine
 * weight on the CPU (prefill and the tiles read it), so reading it here costs no extra memory
 * (by default; the exact pairs below: +4 B per group of a row, 1/16 B per weight at G = 64),
 * and its block layout suits a GEMV: a block of 64 output rows is one contiguous stream of
 * K * 32 bytes, byte j of column k holding row j (low nibble) and row j + 32 (high nibble)
 * (mlxr/quant/int4pack.py probes that this torch build packs that way; otherwise this kernel
 * is not routed). Pairs [K / G, N, 2] bf16 per group of a row, by `zero` (`native.I4_PAIRS`,
 * env MLXR_CPU_I4_PAIRS at load, quant/cpu.py `i4_pairs`): 1 (default) torch's scales and
 * zeros (`QuantWeight.i4_sz`; zero = bias + 8 * scale rounded to bf16 at load: the weights
 * torch's own kernel computes with); 0 MLX's own scales and biases in that layout
 * (`int4pack.scales_and_biases`, built beside): w = q * s + b exactly, mlx-lm's Metal qmv's
 * weights; 2 the same pairs, each weight formed as the prefill tiles (i4deq.c) and mlx's CPU
 * backend form it, bf16(bf16(q * s) + b), so decode after a tiled prefill computes with the
 * prefill's weights (docs/perf.md, "Session 21: i4mm on the exact weights": 2.7x slower).
 *
 * Per block and group g, per x row: the codes q (0..15, exact in bf16 through a 16-entry
 * table, vpermw) of columns k, k + 1 sit in one 32-bit lane per output row (vpermb gathers the
 * two columns' bytes), so vdpbf16ps adds q_k x_k + q_k+1 x_k+1 per row exactly (bf16 x bf16
 * products are exact in float32) into float32 lanes = output rows: no horizontal sums. Then
 * y += s * dot + b * sum(x_g) per row (b = z - 8 s from torch's zero), 16 rows per vector
 * (mlx-lm's Metal qmv's algebra, float32); the output rounds once. Mode 2 turns each lane's
 * two codes into the two bf16 weights (four float32 ops and four roundings per vector)
 * before the dot, and adds the dots without scale or bias.
 * OpenMP over blocks of 64 rows; more than 4 x rows re-read the block from cache per 4 rows.
 * A row's summation order does not depend on M (torch's kernel has that property too, and
 * the batch-equals-single tests rely on it).
 */
#include "kernels.h"

#if MLXR_I4MM
/* vpermb indices: 32-bit lane r of P = bytes (r, r, 32 + r, 32 + r) of a 64-byte load of
 * columns k (bytes 0..31) and k + 1 (32..63); the low nibble of each 16-bit half is then
 * row r's code at k and at k + 1 (rows 16..31: r + 16; the high nibbles: rows + 32). */
static const uint8_t PAIR_IDX[64] = {
    0, 0, 32, 32, 1, 1, 33, 33, 2, 2, 34, 34, 3, 3, 35, 35, 4, 4, 36, 36, 5, 5, 37, 37,
    6, 6, 38, 38, 7, 7, 39, 39, 8, 8, 40, 40, 9, 9, 41, 41, 10, 10, 42, 42, 11, 11, 43, 43,
    12, 12, 44, 44, 13, 13, 45, 45, 14, 14, 46, 46, 15, 15, 47, 47};

/* Software prefetch distance in bytes of the block's stream (-DI4_PF=... to sweep). Swept
 * on the dev box, 1 thread, weights from DRAM, best of 3 alternated runs, against a plain
 * 64-byte read loop over the same bytes: 0: 0.77-0.88 of it; 2048: 0.89-0.93; 4096:
 * 0.95-1.06; 8192: 0.98-1.10; 16384: 0.93-0.98. */
#ifndef I4_PF
#define I4_PF 8192
#endif
/* Groups ahead whose pairs are prefetched (-DSB_PF=...). A block's pairs of one group are
 * 256 bytes, one row of `sb` [K / G, N, 2] apart from the next group's (N * 4 bytes: beyond
 * the hardware prefetchers' strides), so each group's epilogue waited on DRAM. Swept on the
 * session-22 box (78 MB matrix from DRAM, 1 thread, alternated): none 10.8-14.3 GB/s, 2 ahead
 * +15%, 4 +16%, 8 +10-19%, 12 +18%, 16 +11%; in L2 the same. */
#ifndef SB_PF
#define SB_PF 8
#endif

/* One block of 64 rows against MB (1..4) x rows, into acc[m * 64 + row] (float32, zeroed by
 * the caller). NV = 4: all 64 rows in one pass (MB <= 2); NV = 2: the rows of one permute
 * (`half` 0: rows 0..15 and 32..47; 1: 16..31 and 48..63), for MB = 3, 4, whose accumulators
 * would not fit the registers otherwise. Two accumulator sets alternate over column pairs
 * (one chain would wait on vdpbf16ps' latency), summed at the end of each group: every row
 * sums in the same order whatever M is, so a row's output does not depend on the batch. */
/* float32 lanes rounded to bf16 values (nearest even, denormals kept: i4deq.c's rne_bf16),
 * kept as float32 */
static inline __m512 rne_keep(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline __attribute__((always_inline)) void i4_block(
        const I4Args *a, const uint8_t *wb, int64_t n0, const uint16_t *x, const float *xs,
        const int MB, const int NV, const int half, float *acc) {
    const __m512i ia = _mm512_loadu_si512(PAIR_IDX);
    const __m512i ib = _mm512_add_epi8(ia, _mm512_set1_epi8(16));
    const __m512i tab = _mm512_loadu_si512(a->tab);
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    const int64_t k_all = a->k, grp = a->group, ng = k_all / grp;
    int vs[4] = {0, 1, 2, 3};  /* vector slot -> 16-row group of the block */
    if (NV == 2) { vs[0] = half; vs[1] = half + 2; }
    const int rnd = a->zero == 2;
    for (int64_t g = 0; g < ng; g++) {
        __m512 ga[2][4][4];
        __m512 sv[4], bv[4];
        {  /* the pairs of group g + SB_PF (past the last group: the next block's) */
            int64_t gp = g + SB_PF, np = n0;
            if (gp >= ng) { gp -= ng; np += 64; }
            const char *q = (const char *)(a->sb + (gp * a->n + np) * 2);
            for (int l = 0; l < 4; l++) _mm_prefetch(q + 64 * l, _MM_HINT_T0);
        }
        if (rnd) {
            const uint16_t *sp = a->sb + (g * a->n + n0) * 2;
            for (int v = 0; v < NV; v++) {
                __m512i l = _mm512_loadu_si512(sp + 32 * vs[v]);
                sv[v] = _mm512_castsi512_ps(_mm512_slli_epi32(l, 16));
                bv[v] = _mm512_castsi512_ps(_mm512_and_si512(l, hi16));
            }
        }
        for (int u = 0; u < 2; u++)
            for (int m = 0; m < MB; m++)
                for (int v = 0; v < NV; v++) ga[u][m][v] = _mm512_setzero_ps();
        /* the loops over u, m and v unrolled: without it GCC kept the M = 1 case's
         * accumulators on the stack (a load and a store around every vdpbf16ps; decode's
         * case, 8% slower in L2, 5% from DRAM); the same operations in the same order */
        for (int64_t k = g * grp; k < (g + 1) * grp; k += 4) {
            #pragma GCC unroll 2
            for (int u = 0; u < 2; u++) {
                const uint8_t *p = wb + (k + 2 * u) * 32;
                _mm_prefetch((const char *)(p + I4_PF), _MM_HINT_T0);
                __m512i w = _mm512_loadu_si512(p);
                /* vpermw reads index bits 0..4: the table repeats over bit 4 (the next
                 * nibble's low bit), so no mask is needed */
                __m512i c[4];
                if (NV == 4 || half == 0) {
                    __m512i lo = _mm512_permutexvar_epi8(ia, w);
                    c[0] = _mm512_permutexvar_epi16(lo, tab);
                    c[NV == 4 ? 2 : 1] =
                        _mm512_permutexvar_epi16(_mm512_srli_epi16(lo, 4), tab);
                }
                if (NV == 4 || half == 1) {
                    __m512i hi = _mm512_permutexvar_epi8(ib, w);
                    c[NV == 4 ? 1 : 0] = _mm512_permutexvar_epi16(hi, tab);
                    c[NV == 4 ? 3 : 1] =
                        _mm512_permutexvar_epi16(_mm512_srli_epi16(hi, 4), tab);
                }
                if (rnd) {
                    for (int v = 0; v < NV; v++) {
                        __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(c[v], 16));
                        __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(c[v], hi16));
                        lo = rne_keep(_mm512_add_ps(rne_keep(_mm512_mul_ps(lo, sv[v])), bv[v]));
                        hi = rne_keep(_mm512_add_ps(rne_keep(_mm512_mul_ps(hi, sv[v])), bv[v]));
                        c[v] = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                               _mm512_castps_si512(hi));
                    }
                }
                #pragma GCC unroll 4
                for (int m = 0; m < MB; m++) {
                    uint32_t xp;
                    memcpy(&xp, x + m * k_all + k + 2 * u, 4);
                    __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp);
                    #pragma GCC unroll 4
                    for (int v = 0; v < NV; v++)
                        ga[u][m][v] = _mm512_dpbf16_ps(ga[u][m][v], (__m512bh)c[v], xv);
                }
            }
        }
        const uint16_t *sp = a->sb + (g * a->n + n0) * 2;
        for (int v = 0; v < NV; v++) {  /* 16 rows: (scale, bias) per 32 bits */
            __m512i l = _mm512_loadu_si512(sp + 32 * vs[v]);
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(l, 16));
            __m512 zz = _mm512_castsi512_ps(_mm512_and_si512(l, hi16));  /* bias or zero */
            if (a->zero == 1) zz = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, zz);  /* 0..15 */
            for (int m = 0; m < MB; m++) {
                float *ar = acc + m * 64 + 16 * vs[v];
                if (rnd) {  /* the weights themselves: no scale, no bias term */
                    _mm512_storeu_ps(ar, _mm512_add_ps(_mm512_add_ps(ga[0][m][v], ga[1][m][v]),
                                                       _mm512_loadu_ps(ar)));
                    continue;
                }
                __m512 r = _mm512_fmadd_ps(s, _mm512_add_ps(ga[0][m][v], ga[1][m][v]),
                                           _mm512_loadu_ps(ar));
                _mm512_storeu_ps(ar, _mm512_fmadd_ps(zz, _mm512_set1_ps(xs[m * ng + g]), r));
            }
        }
    }
}

static void i4_store(const I4Args *a, int64_t row, int64_t n0, const float *acc) {
    for (int v = 0; v < 4; v++) {
        __m512 r = _mm512_loadu_ps(acc + 16 * v);
        if (a->y_dt == DT_F32) {
            _mm512_storeu_ps((float *)a->y + row * a->n + n0 + 16 * v, r);
        } else {  /* round to nearest even, as f32_to_bf16 */
            __m256i h = (__m256i)_mm512_cvtneps_pbh(r);
            _mm256_storeu_si256((__m256i *)((uint16_t *)a->y + row * a->n + n0 + 16 * v), h);
        }
    }
}
/* sum(x_g) per group of G consecutive values of x (float32, 16 lanes then reduced): xs
 * [groups]; the same sums for every caller, so a row's output is the same in every entry */
static void i4_sums(const uint16_t *x, int64_t groups, int64_t group, float *xs) {
    for (int64_t i = 0; i < groups; i++) {
        const uint16_t *xg = x + i * group;
        if (group % 16 == 0) {  /* 16 lanes: a scalar chain cost ~1 µs per 1,000 of K */
            __m512 v = _mm512_setzero_ps();
            for (int64_t j = 0; j < group; j += 16)
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xg + j))), 16)));
            xs[i] = _mm512_reduce_add_ps(v);
        } else {
            float s = 0.0f;
            for (int64_t j = 0; j < group; j++) s += bf16_to_f32(xg[j]);
            xs[i] = s;
        }
    }
}

static void i4_table(I4Args *a) {
    for (int i = 0; i < 32; i++) a->tab[i] = f32_to_bf16((float)(i & 15));
}

/* Block b (64 rows) of one x row against a: i4mm_run's M = 1 case */
static inline void i4_row_block(const I4Args *a, int64_t b, const float *xs, float *acc) {
    memset(acc, 0, sizeof(float) * 64);
    i4_block(a, a->w + b * a->k * 32, 64 * b, (const uint16_t *)a->x, xs, 1, 4, 0, acc);
    i4_store(a, 0, 64 * b, acc);
}
#endif

int i4mm_run(I4Args *a, int nthreads) {
#if MLXR_I4MM
    int64_t m_all = a->m, k_all = a->k, ng = k_all / a->group;
    float *xs = malloc(sizeof(float) * (size_t)(m_all * ng));
    if (!xs) return -1;
    const uint16_t *x = (const uint16_t *)a->x;
    i4_sums(x, m_all * ng, a->group, xs);
    i4_table(a);
#pragma omp parallel num_threads(nthreads)
    {
        float acc[4 * 64] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < a->n / 64; b++) {
            const uint8_t *wb = a->w + b * k_all * 32;
            for (int64_t m0 = 0; m0 < m_all; m0 += 4) {
                int mb = m_all - m0 < 4 ? (int)(m_all - m0) : 4;
                const uint16_t *xm = x + m0 * k_all;
                const float *xsm = xs + m0 * ng;
                memset(acc, 0, sizeof(float) * 64 * (size_t)mb);
                switch (mb) {  /* constant row counts: the accumulators stay in registers */
                case 1: i4_block(a, wb, 64 * b, xm, xsm, 1, 4, 0, acc); break;
                case 2: i4_block(a, wb, 64 * b, xm, xsm, 2, 4, 0, acc); break;
                case 3:
                    i4_block(a, wb, 64 * b, xm, xsm, 3, 2, 0, acc);
                    i4_block(a, wb, 64 * b, xm, xsm, 3, 2, 1, acc);
                    break;
                default:
                    i4_block(a, wb, 64 * b, xm, xsm, 4, 2, 0, acc);
                    i4_block(a, wb, 64 * b, xm, xsm, 4, 2, 1, acc);
                    break;
                }
                for (int i = 0; i < mb; i++) i4_store(a, m0 + i, 64 * b, acc + 64 * i);
            }
        }
    }
    free(xs);
    return 0;
#else
    (void)a; (void)nthreads;
    return -2;  /* not compiled for this CPU: native.i4mm_available() is False */
#endif
}

int i4moe_run(const I4XArgs *m, int nthreads) {
#if MLXR_I4MM
    const int64_t k = m->k, e = m->e, f = m->f, g = m->group, nx = e / g, nh = f / g;
    for (int64_t j = 0; j < k; j++)
        if (m->ids[j] < 0 || m->ids[j] >= m->n_experts) return -3;
    I4Args *a = calloc((size_t)(2 * k), sizeof(I4Args));
    uint16_t *gu = malloc(sizeof(uint16_t) * (size_t)(k * 3 * f));  /* [k, 2F] then h [k, F] */
    float *xs = malloc(sizeof(float) * (size_t)(nx + k * nh));  /* x's sums, then each h's */
    if (!a || !gu || !xs) {
        free(a); free(gu); free(xs);
        return -1;
    }
    uint16_t *h = gu + k * 2 * f;
    i4_sums(m->x, nx, g, xs);
    for (int64_t j = 0; j < k; j++) {  /* slot j: gate_up a[j], down a[k + j] */
        const int64_t *p = m->ptrs + 4 * m->ids[j];
        I4Args *u = a + j, *d = a + k + j;
        u->x = m->x; u->m = 1; u->k = e; u->n = 2 * f; u->y = gu + j * 2 * f;
        u->w = (const uint8_t *)(uintptr_t)p[0]; u->sb = (const uint16_t *)(uintptr_t)p[1];
        d->x = h + j * f; d->m = 1; d->k = f; d->n = e; d->y = m->y + j * e;
        d->w = (const uint8_t *)(uintptr_t)p[2]; d->sb = (const uint16_t *)(uintptr_t)p[3];
        u->group = d->group = (int)g;
        u->zero = d->zero = m->zero;
        u->y_dt = d->y_dt = DT_BF16;
        i4_table(u);
        i4_table(d);
    }
    const int64_t nb1 = 2 * f / 64, nb2 = e / 64;
#pragma omp parallel num_threads(nthreads)
    {
        float acc[64] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < k * nb1; t++) i4_row_block(a + t / nb1, t % nb1, xs, acc);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < k; j++) {
            act_mul_run(gu + j * 2 * f, 1, f, m->tab, h + j * f);
            i4_sums(h + j * f, nh, g, xs + nx + j * nh);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < k * nb2; t++)
            i4_row_block(a + k + t / nb2, t % nb2, xs + nx + (t / nb2) * nh, acc);
    }
    free(a); free(gu); free(xs);
    return 0;
#else
    (void)m; (void)nthreads;
    return -2;
#endif
}
