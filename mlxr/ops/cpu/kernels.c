/* mlxr's own CPU kernels, the Python module (qmm.c: quantized matmul straight from MLX's
 * packed layout; i4mm.c: the affine decode GEMV over torch's int4 copy; attend.c: one-token
 * attention over a bf16 / f32 KV cache; layer.c: a decode layer's norms, RoPE, cache write
 * and activation, the torch path's values bit for bit).
 *
 * Why hand-written (docs/perf.md, "CPU decode"): torch reads mxfp4 through two int4 nibble
 * planes (twice the bytes, x twice) and nvfp4 / mxfp8 through a bf16 copy (2 B per weight);
 * decode attention in torch needs float32 copies of the bf16 K/V (a bf16 bmm rounds the
 * scores, an out_dtype=float32 bmm is not on the CPU); and every torch op costs a dispatch of
 * a few microseconds. Here a matmul is one call that reads the MLX words once, and attention
 * reads the bf16 K/V in place with float32 math. (For affine weights qmm lost to torch's int4
 * kernel; i4mm reads that kernel's own copy ~1.5-2x faster: quant/cpu.py says where.)
 *
 * A plain CPython extension: tensors arrive as data_ptr() integers and sizes (no torch headers,
 * so the build is fast and independent of torch's C++ ABI); the caller (mlxr/ops/cpu/native.py)
 * checks shapes, dtypes and contiguity. The GIL is released while a kernel runs. OpenMP (the
 * libgomp torch has already loaded, by soname) parallelises over output rows / kv heads.
 *
 * Numerics: float32 accumulation everywhere, the output rounded to its dtype once (bf16: round
 * to nearest even). Quantized matmul per group g of a row: s_g * (x_g . q_g) + b_g * sum(x_g),
 * the same algebra as mlx's qmv; only the summation order (and, for affine codes, an offset of
 * 128 per code taken off per group, qmm.c) differs from the torch twin.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"

const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
float E4M3[256];

void init_e4m3(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m / 8.0f, -6) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if ((b & 0x7F) == 0x7F) v = NAN;
        E4M3[b] = b >= 128 ? -v : v;
    }
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

/* i4mm_run's / i4moe_run's return code as Python's result: 0 None; -2 not compiled for this
 * CPU; -3 an expert id out of range; else out of memory. */
static PyObject *i4_result(int rc) {
    if (rc == -2) {
        PyErr_SetString(PyExc_RuntimeError, "mlxr.ops.cpu: i4mm not compiled for this CPU");
        return NULL;
    }
    if (rc == -3) {
        PyErr_SetString(PyExc_ValueError, "mlxr.ops.cpu: expert id out of range");
        return NULL;
    }
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_i4mm(PyObject *self, PyObject *args) {
    (void)self;
    I4Args a;
    unsigned long long x, w, sb, y;
    long long m, k, n;
    int nthreads;
    memset(&a, 0, sizeof a);
    if (!PyArg_ParseTuple(args, "KLLKKLiiKii", &x, &m, &k, &w, &sb, &n, &a.group, &a.zero, &y,
                          &a.y_dt, &nthreads))
        return NULL;
    a.x = (const void *)(uintptr_t)x; a.w = (const uint8_t *)(uintptr_t)w;
    a.sb = (const uint16_t *)(uintptr_t)sb; a.y = (void *)(uintptr_t)y;
    a.m = m; a.k = k; a.n = n;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = i4mm_run(&a, nthreads < 1 ? 1 : nthreads);
    Py_END_ALLOW_THREADS
    return i4_result(rc);
}

static PyObject *py_i4moe(PyObject *self, PyObject *args) {
    (void)self;
    I4XArgs a;
    unsigned long long x, ids, ptrs, tab, y;
    long long k, nx, e, f;
    int nthreads;
    memset(&a, 0, sizeof a);
    if (!PyArg_ParseTuple(args, "KKLLKLLiiKKi", &x, &ids, &k, &nx, &ptrs, &e, &f, &a.group,
                          &a.zero, &tab, &y, &nthreads))
        return NULL;
    a.x = (const uint16_t *)(uintptr_t)x; a.ids = (const int64_t *)(uintptr_t)ids;
    a.ptrs = (const int64_t *)(uintptr_t)ptrs; a.tab = (const uint16_t *)(uintptr_t)tab;
    a.y = (uint16_t *)(uintptr_t)y;
    a.k = k; a.n_experts = nx; a.e = e; a.f = f;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = i4moe_run(&a, nthreads < 1 ? 1 : nthreads);
    Py_END_ALLOW_THREADS
    return i4_result(rc);
}

static PyObject *py_i4deq(PyObject *self, PyObject *args) {
    (void)self;
    I4DArgs a;
    unsigned long long w, s, b, y;
    long long k, b0, b1;
    int nthreads;
    memset(&a, 0, sizeof a);
    if (!PyArg_ParseTuple(args, "KKKKLLLii", &w, &s, &b, &y, &k, &b0, &b1, &a.group,
                          &nthreads))
        return NULL;
    a.w = (const uint8_t *)(uintptr_t)w; a.s = (const uint16_t *)(uintptr_t)s;
    a.bias = (const uint16_t *)(uintptr_t)b; a.y = (uint16_t *)(uintptr_t)y;
    a.k = k; a.b0 = b0; a.b1 = b1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = i4deq_run(&a, nthreads < 1 ? 1 : nthreads);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_SetString(PyExc_RuntimeError, "mlxr.ops.cpu: i4deq not compiled for this CPU");
        return NULL;
    }
    Py_RETURN_NONE;
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

static PyObject *py_add_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    NormArgs a;
    unsigned long long h, r, ho, w, out;
    memset(&a, 0, sizeof a);
    if (!PyArg_ParseTuple(args, "KKKKfKLLi", &h, &r, &ho, &w, &a.eps, &out, &a.n, &a.e,
                          &a.lanes))
        return NULL;
    a.h = (const uint16_t *)(uintptr_t)h; a.r = (const uint16_t *)(uintptr_t)r;
    a.h_out = (uint16_t *)(uintptr_t)ho; a.w = (const uint16_t *)(uintptr_t)w;
    a.out = (uint16_t *)(uintptr_t)out;
    if (add_rms_norm_run(&a)) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_qk_rope(PyObject *self, PyObject *args) {
    (void)self;
    RopeArgs a;
    unsigned long long qkv, w, c, s, pos, slots, q, kc, vc;
    memset(&a, 0, sizeof a);
    if (!PyArg_ParseTuple(args, "KLLLLLiKfiKKKKKKKL", &qkv, &a.n, &a.h, &a.kh, &a.d, &a.r2,
                          &a.traditional, &w, &a.eps, &a.lanes, &c, &s, &pos, &slots, &q,
                          &kc, &vc, &a.head_stride))
        return NULL;
    a.qkv = (const uint16_t *)(uintptr_t)qkv; a.w = (const uint16_t *)(uintptr_t)w;
    a.cos = (const float *)(uintptr_t)c; a.sin = (const float *)(uintptr_t)s;
    a.pos = (const int64_t *)(uintptr_t)pos; a.slots = (const int64_t *)(uintptr_t)slots;
    a.q_out = (uint16_t *)(uintptr_t)q; a.kc = (uint16_t *)(uintptr_t)kc;
    a.vc = (uint16_t *)(uintptr_t)vc;
    if (qk_rope_run(&a)) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_act_mul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long gu, tab, out;
    long long n, inter;
    if (!PyArg_ParseTuple(args, "KLLKK", &gu, &n, &inter, &tab, &out)) return NULL;
    act_mul_run((const uint16_t *)(uintptr_t)gu, n, inter, (const uint16_t *)(uintptr_t)tab,
                (uint16_t *)(uintptr_t)out);
    Py_RETURN_NONE;
}

static PyObject *py_row_sum(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x;
    long long n;
    int lanes;
    if (!PyArg_ParseTuple(args, "KLi", &x, &n, &lanes)) return NULL;
    return PyFloat_FromDouble(torch_row_sum((const float *)(uintptr_t)x, n, lanes));
}

static PyObject *py_gdn_step(PyObject *self, PyObject *args) {
    (void)self;
    GdnArgs a;
    unsigned long long proj, cs, ssm, cw, nd, dtb, nw, si, sg, sp, s32, out;
    int nthreads;
    memset(&a, 0, sizeof a);
    if (!PyArg_ParseTuple(args, "KLLLLLLLLKKKKKKKKKKffffiKi", &proj, &a.proj_stride, &a.n,
                          &a.hk, &a.hv, &a.dk, &a.dv, &a.c, &a.w, &cs, &ssm, &cw, &nd, &dtb,
                          &nw, &si, &sg, &sp, &s32, &a.q_scale, &a.k_scale, &a.qk_eps, &a.eps,
                          &a.lanes, &out, &nthreads))
        return NULL;
    a.proj = (const uint16_t *)(uintptr_t)proj; a.conv_state = (uint16_t *)(uintptr_t)cs;
    a.ssm = (float *)(uintptr_t)ssm; a.conv_w = (const float *)(uintptr_t)cw;
    a.neg_decay = (const float *)(uintptr_t)nd; a.dt_bias = (const uint16_t *)(uintptr_t)dtb;
    a.norm_w = (const uint16_t *)(uintptr_t)nw; a.silu = (const uint16_t *)(uintptr_t)si;
    a.sigmoid = (const uint16_t *)(uintptr_t)sg; a.softplus = (const uint16_t *)(uintptr_t)sp;
    a.silu32 = (const float *)(uintptr_t)s32; a.out = (uint16_t *)(uintptr_t)out;
    if (gdn_step_run(&a, nthreads)) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_features(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
#ifdef _OPENMP
    int omp = 1;
#else
    int omp = 0;
#endif
    return Py_BuildValue("{s:i,s:i,s:i}", "avx512", MLXR_AVX512, "openmp", omp, "i4mm",
                         MLXR_I4MM);
}

static PyMethodDef methods[] = {
    {"qmm", py_qmm, METH_VARARGS, "quantized x @ W^T from MLX's packed layout"},
    {"i4mm", py_i4mm, METH_VARARGS, "x @ W^T from torch's packed int4 CPU copy"},
    {"i4moe", py_i4moe, METH_VARARGS, "one token's selected experts over their int4 copies"},
    {"i4deq", py_i4deq, METH_VARARGS, "bf16 rows of torch's int4 copy, MLX's arithmetic"},
    {"attend", py_attend, METH_VARARGS, "one-token attention over a KV cache"},
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS, "residual add + RMSNorm, torch's values"},
    {"qk_rope", py_qk_rope, METH_VARARGS, "q/k norm + RoPE + the K/V cache write"},
    {"act_mul", py_act_mul, METH_VARARGS, "act(gate) * up through a bf16 table"},
    {"gdn_step", py_gdn_step, METH_VARARGS, "a gated DeltaNet step between projections"},
    {"row_sum", py_row_sum, METH_VARARGS, "torch's float32 sum order of one row"},
    {"features", py_features, METH_NOARGS, "how this build was compiled"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
    init_e4m3();
    return PyModule_Create(&module);
}
