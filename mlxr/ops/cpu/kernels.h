/* Shared declarations of mlxr's CPU kernels (kernels.c: the module; qmm.c, attend.c). */
#ifndef MLXR_CPU_KERNELS_H
#define MLXR_CPU_KERNELS_H
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
/* i4mm.c also permutes bytes (vpermb, AVX512-VBMI) */
#if MLXR_AVX512 && defined(__AVX512VBMI__)
#define MLXR_I4MM 1
#else
#define MLXR_I4MM 0
#endif

/* rows ahead the GEMV prefetches (8, 16, 32 tried in the decode step: 16 best) */
#define PF_ROWS 16

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_U8 = 3 };
enum { MODE_AFFINE = 0, MODE_MXFP4 = 1, MODE_NVFP4 = 2, MODE_MXFP8 = 3 };

extern const float E2M1[16];
extern float E4M3[256];  /* filled by init_e4m3() when the module loads */
void init_e4m3(void);

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
    float *xf;    /* [m, k] x widened to float32, natural order (generic and byte paths) */
    float *xs;    /* [m, k / group] per-group sums of x */
    /* the nibble path: a row of `kn` 4-bit codes (8-bit codes as two nibbles each) */
    int64_t kn; int gn, gshift;  /* nibbles per row, per group, log2(gn) */
    uint16_t *xp; /* [m, kn] bf16 x per nibble (8-bit: x, 16x), permuted within 128 (below) */
    float *xo;    /* [m, k / group] 128 * sum of a group's x per nibble (affine's offset) */
    uint16_t tab16[32]; /* fp4 code -> bf16 value (twice: vpermw indexes 32 entries) */
    int32_t gidx[16];   /* f32 lane of a 128-nibble step -> its group within the step */
} QArgs;

int qmm_run(QArgs *a, int nthreads);

/* ------------------------------------------------------------------ torch's int4 copy */

/* y [m, n] = x [m, k] (bf16) @ W^T for W in torch's packed int4 CPU layout with 64-row
 * blocks (`w`: [n / 64, k, 32] bytes) and pairs `sb` [k / group, n, 2] bf16, by `zero`:
 * 0 MLX's scales and biases (w = q * scale + bias), 1 torch's scales and zeros (w = (q - 8)
 * * scale + zero), 2 MLX's, w = bf16(bf16(q * scale) + bias); y float32 or bf16. i4mm.c says
 * why and how. */
typedef struct {
    const void *x; int64_t m, k;
    const uint8_t *w; const uint16_t *sb; int64_t n; int group, zero;
    void *y; int y_dt;
    uint16_t tab[32];  /* code -> bf16 value, twice (vpermw indexes 32 entries) */
} I4Args;

int i4mm_run(I4Args *a, int nthreads);

/* One token's k selected experts (the MoE decode step, i4mm.c): for slot j and expert
 * e = ids[j], gu = x @ GU_e^T [2F] (bf16), h = bf16(act(gate) * up) through `tab`
 * (act_mul_run), y [j] = h @ D_e^T [E] (bf16); each product i4mm_run's M = 1 values.
 * `ptrs` [X, 4] int64: per expert its gate_up's int4 copy and pairs ([2F, E]), then its
 * down's ([E, F]), all in pair mode `zero`. Returns -3 for an id outside 0..X-1. */
typedef struct {
    const uint16_t *x; const int64_t *ids; int64_t k, n_experts;
    const int64_t *ptrs; int64_t e, f; int group, zero;
    const uint16_t *tab; uint16_t *y;
} I4XArgs;

int i4moe_run(const I4XArgs *m, int nthreads);

/* Rows of 64-row blocks b0..b1 of torch's int4 copy dequantized to bf16 with MLX's affine
 * arithmetic, bf16(bf16(q * s) + b) (i4deq.c): y [(b1 - b0) * 64, K]; s, bias [N, K / G]
 * bf16; G a multiple of 32. */
typedef struct {
    const uint8_t *w;
    const uint16_t *s, *bias;
    uint16_t *y;
    int64_t k, b0, b1;
    int group;
} I4DArgs;

int i4deq_run(const I4DArgs *a, int nthreads);

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

int attend_run(const AArgs *a, int nthreads);

/* ------------------------------------------------------------------ layer.c: around the GEMVs */

/* torch's float32 sum of a contiguous row (its cascade order, `lanes` = Vectorized<float>) */
float torch_row_sum(const float *x, int64_t n, int lanes);

/* Per row i of n (bf16, e wide): s = bf16(h + r) (r NULL: s = h), written to h_out when not
 * NULL; out = rms_norm(s) * w as ops.reference.rms_norm rounds it. */
typedef struct {
    const uint16_t *h, *r; uint16_t *h_out; const uint16_t *w; float eps;
    uint16_t *out; int64_t n, e; int lanes;
} NormArgs;

int add_rms_norm_run(const NormArgs *a);

/* From the fused projection qkv [n, (h + 2 kh) * d] (bf16): the q and k heads RMS-normed by
 * w [h + kh, d] (NULL: no norm), their first r2 features rotated by the tables cos / sin
 * [P, r2] float32 ([c, c] and [-s, s]) at row pos[i]; q to q_out [n, h, d], k and v to the
 * caches kc / vc [kh, P, d] at slot slots[i] (a kv head's rows head_stride apart). */
typedef struct {
    const uint16_t *qkv; int64_t n, h, kh, d, r2; int traditional;
    const uint16_t *w; float eps; int lanes;
    const float *cos, *sin; const int64_t *pos, *slots;
    uint16_t *q_out, *kc, *vc; int64_t head_stride;
} RopeArgs;

int qk_rope_run(const RopeArgs *a);

/* out [n, inter] = bf16(tab[gate] * up) for gu [n, 2 * inter] = [gate | up] (bf16), tab the
 * activation of every bf16 bit pattern (built by torch: its own values), plus one padding
 * entry */
void act_mul_run(const uint16_t *gu, int64_t n, int64_t inter, const uint16_t *tab,
                 uint16_t *out);
/* ------------------------------------------------------------------ gdn.c: a DeltaNet step */

/* One gated DeltaNet decode step of n sequences from the input projection's rows proj
 * [n, proj_stride] = [qkv (c) | z (hv dv) | b (hv) | a (hv)] (bf16) to out [n, hv dv] (bf16,
 * before out_proj). conv_state [n, w - 1, c] (bf16) and ssm [n, hv, dv, dk] (float32) are
 * updated in place; conv_w [w, c] float32 (tap j as row j); neg_decay [hv] float32
 * (-exp(A_log)); dt_bias [hv] and norm_w [dv] bf16; silu / sigmoid / softplus: bf16 tables
 * of torch's outputs over every bf16 bit pattern, silu32 the float32 one. */
typedef struct {
    const uint16_t *proj; int64_t proj_stride, n, hk, hv, dk, dv, c, w;
    uint16_t *conv_state; float *ssm; const float *conv_w, *neg_decay;
    const uint16_t *dt_bias, *norm_w, *silu, *sigmoid, *softplus; const float *silu32;
    float q_scale, k_scale, qk_eps, eps; int lanes; uint16_t *out;
} GdnArgs;

int gdn_step_run(const GdnArgs *a, int nthreads);
#endif
