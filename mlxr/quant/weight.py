"""`QuantWeight`: an mlx-quantized 2-D matrix kept quantized in memory.

Storage (chosen at load time, see `from_tensors`):
  * `packed`   - the mlx uint32 words viewed as int32 [out, in*bits/32] (unpacked per tile), or
  * `codes`    - uint8 codes [out, in]: a free byte view for 8-bit weights; a load-time repack
                 for 3/5/6-bit in fast mode (costs 8/bits x the packed size, saves a slow unpack
                 per call), where the int4 copy below is not built, or
  * `i4`       - torch's packed int4 CPU tensor + bf16 scales_and_zeros (fast mode: affine 4-bit
                 codes; 2/3/5/6/8-bit and mxfp4 over their nibble planes, `planes` of them, see
                 `mlxr.quant.affine.planes` and `fp.fp4_planes`; the codes are decoded back
                 from it).
On CUDA `packed` is kept unless the loader drops it (`drop_words`: prefill then reads the `tc`
copy); affine 4-bit adds repacks of it for decode at load: for one row either `tc`
(`mlxr.ops.matmul.decode_gemv_tc`, where `cuda.q4tc_preferred`; it also serves 2-16 rows; an MLP's
gate_up gets it with gate and up rows interleaved, `tc_glu`, so `gated` runs the activation in its
epilogue) or `q4` (`mlxr.ops.matmul.decode_gemv_q4`), each with `q4_sb` (scale, bias pairs); and
`i4`/`i4_sz` (tinygemm, 2-32 rows) only where neither applies. Affine 2/3/5/6/8-bit weights get `tc`
too, over nibble planes (`planes`: 1, or 2 for 5/6/8-bit; `cuda_copies.planes_pack`), and mxfp4 /
nvfp4 weights an fp4 `tc` of their E2M1 codes (`tc_fp4`, `cuda_copies.fp4_tc_pack`), mxfp8 weights
an fp8 `tc` of their E4M3 codes (`tc_fp8`, `cuda_copies.fp8_tc_pack`).
The batching engine asks for the several-row copy (`add_batch_copy`): `tc` where a `q4`
weight lacks it, else tinygemm's.
Scales/biases stay in their file dtype, except in exact mode (compute_dtype float32) where they
are cast to float32 once: dequant then is `q*s + b` in fp32 (two fp32 roundings), exactly what
mlx computes with fp32 params.

`linear` dispatches on device: CPU -> `mlxr.quant.cpu.linear`; CUDA -> the Triton kernels of
`mlxr.ops.matmul.generic_qmm` (GEMV for small batches, tensor-core GEMM for prefill) reading the
packed words as shipped (on CUDA `packed` is always kept, never unpacked codes), after the measured
fast paths of `mlxr.quant.cuda` (q4gemv / tinygemm 4-bit decode, `mlxr.ops.matmul.decode_gemv` for
2/3-bit at M = 1, dequant + cuBLAS prefill; env `MLXR_GEMV=triton` sends all decode to
`mlxr.ops.matmul.decode_gemv`); env `MLXR_KERNELS=torch` (or no triton) selects the generic tiled
torch path instead.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from mlxr.config import QuantSpec
from mlxr.errors import ModelFormatError

from . import cpu, cuda, cuda_copies, int4pack
from .affine import PLANE_BITS, merge_planes, planes_on, unpack_codes
from .dequant import validate
from .fp import code_table, fp4_codes, fp_scales, nibble_planes

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_triton(qw: QuantWeight) -> bool:
    """CUDA matmul backend: Triton unless MLXR_KERNELS=torch or the weight is unsupported."""
    if os.environ.get("MLXR_KERNELS", "").lower() == "torch":
        return False
    from mlxr.ops.matmul import generic_qmm
    return generic_qmm.supported(qw) or qw.words_dropped


DENSE_MODES = ("nvfp4", "mxfp8")  # fp modes torch's int4 kernel cannot take (group 16, 8-bit)


def dense_supported(spec: QuantSpec, compute_dtype: torch.dtype) -> bool:
    """Whether a CPU weight of this spec keeps a dense copy (`dense`: `dequant_rows`' values
    in the compute dtype, 2 B per weight) for `linear`: nvfp4 and mxfp8 in bf16/fp16 (not the
    float32 exact mode). They have no int4 form, and dequantizing every tile on every call
    decoded a Qwen3-0.6B at 0.2-0.8 tok/s (docs/perf.md). Env `MLXR_DENSE=0` keeps the
    tiles."""
    return (spec.mode in DENSE_MODES and compute_dtype != torch.float32
            and os.environ.get("MLXR_DENSE", "") != "0")


def dense_bytes(spec: QuantSpec, out: int, inp: int, compute_dtype: torch.dtype) -> int:
    """RAM the dense copy of such a weight takes on the CPU (0 where none is built)."""
    if not dense_supported(spec, compute_dtype):
        return 0
    return out * inp * compute_dtype.itemsize


class QuantWeight:
    spec: QuantSpec
    in_features: int
    out_features: int
    compute_dtype: torch.dtype
    device: torch.device

    def __init__(self) -> None:
        self.packed: Tensor | None = None
        self.codes: Tensor | None = None
        self.i4: Tensor | None = None
        self.i4_sz: Tensor | None = None
        self.q4: Tensor | None = None
        self.tc: Tensor | None = None
        self.tc_glu = False  # tc (and q4_sb) in decode_gemv_tc.glu_rows' order (`gated`)
        self.tc_gs: float | None = None  # an nvfp4 fp4 copy's global scale / 2688
        self.dense: Tensor | None = None  # CPU nvfp4 / mxfp8: dequant_rows' result, cached
        self.ckern = None  # CPU: mlxr.ops.cpu's kernel (quant.cpu.kernel_for / i4_kernel_for)
        self.planes = 1  # tc / i4 hold this many nibble planes of the codes (`affine.planes`)
        self.q4_sb: Tensor | None = None
        self.matmul = True
        self.scales: Tensor | None = None
        self.biases: Tensor | None = None
        self.global_scale: Tensor | None = None
        self.name = "weight"
        # CPU prefill: the tiles from quant.cpu.I4_MAX_M_DEQ rows on (set by loaders whose
        # reference is not mlx-lm's: quant.cpu.i4_max_m)
        self.tiles_early = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tensors(
        cls, weight: Tensor, scales: Tensor, biases: Tensor | None, spec: QuantSpec, *,
        global_scale: Tensor | None = None, compute_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu", name: str = "weight", matmul: bool = True,
        glu: bool = False, decode_copies: bool = True, keep_words: bool = True,
    ) -> QuantWeight:
        """`matmul=False`: the weight is only gathered (an untied embedding), so no decode
        copies are built for it on CUDA (`linear` still works, by the generic kernels).
        `glu=True`: the rows stack an MLP's gate over its up (F rows each); where q4tc's copy
        is built at load it interleaves them (`tc_glu`), so `gated` computes act(gate) * up in
        the GEMV's launch. Env `MLXR_Q4TC_GLU=0` (at load) keeps the plain order.
        `decode_copies=False`: none either (the loader's GPU memory budget, or on the CPU its
        RAM budget for `dense`), not even the batching engine's (`add_batch_copy`).
        `keep_words=False` (CUDA, the loader's budget or env `MLXR_WORDS=drop`): q4tc's copy is
        built wherever it can serve the weight (also where q4gemv would), the MLX words are
        dropped and prefill dequantizes from the copy (`drop_words`)."""
        in_features = validate(weight, scales, biases, spec, global_scale, name)
        if weight.dim() != 2:
            raise ModelFormatError(
                f"{name}: QuantWeight needs a 2-D weight, got {tuple(weight.shape)}")
        if compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {_COMPUTE_DTYPES}, got {compute_dtype}")
        self = cls()
        self.name = name
        self.matmul = matmul and decode_copies  # False: no decode copies, ever
        self.spec = spec
        self.in_features = in_features
        self.out_features = weight.shape[0]
        self.compute_dtype = compute_dtype
        self.device = dev = torch.device(device)
        exact = compute_dtype == torch.float32
        packed = (weight.view(torch.int32) if weight.dtype == torch.uint32 else weight).to(dev)
        bits = spec.bits

        if spec.mode == "affine":
            sdt = torch.float32 if exact else scales.dtype
            self.scales = scales.to(dev, sdt).contiguous()
            self.biases = biases.to(dev, sdt).contiguous()
        else:
            self.scales = scales.to(dev).contiguous()
            if global_scale is not None:
                self.global_scale = global_scale.to(dev, torch.float32).reshape(())

        i4_mode = ((spec.mode == "affine" and bits == 4)
                   or (planes_on() and (spec.mode == "mxfp4"
                                        or (spec.mode == "affine" and bits in PLANE_BITS))))
        use_i4 = (dev.type == "cpu" and not exact and compute_dtype == torch.bfloat16
                  and i4_mode
                  and int4pack.supported(self.out_features, in_features, spec.group_size))
        if use_i4 and self._int4_copy(packed):
            pass  # torch's int4 kernel serves decode; the codes are read back from its copy
        elif dev.type == "cpu" and self.matmul and dense_supported(spec, compute_dtype):
            if bits == 8:
                self.codes = packed.contiguous().view(torch.uint8)  # [out, in], zero-copy
            else:
                self.packed = packed.contiguous()
            self.dense = self._dense_copy()
        elif dev.type == "cuda":
            self.packed = packed.contiguous()  # Triton kernels read the mlx words as shipped
            cuda.build_copies(self, glu and os.environ.get("MLXR_Q4TC_GLU") != "0", keep_words)
            if not keep_words:
                self.drop_words()
        elif bits == 8:
            self.codes = packed.contiguous().view(torch.uint8)  # [out, in], zero-copy
        elif bits in (3, 5, 6) and not exact:
            self.codes = unpack_codes(packed, bits, in_features).contiguous()
        else:
            self.packed = packed.contiguous()
        if dev.type == "cpu" and self.matmul and cpu.kernel_serves(spec, in_features,
                                                                   compute_dtype):
            self.ckern = cpu.kernel_for(self, packed)  # holds the words where nothing else does
        elif self.i4 is not None and self.matmul and self.spec.mode == "affine":
            self.ckern = cpu.i4_kernel_for(self)  # reads the int4 copy (None where it cannot)
        return self

    def _int4_copy(self, packed: Tensor, chunk_rows: int = 4096) -> bool:
        """CPU: torch's int4 copy (`i4`, `i4_sz`) of a weight's nibble planes (affine 4-bit:
        its codes; 2/3/5/6/8-bit: `affine.planes`; mxfp4: `fp.fp4_planes`; `planes` of them),
        packed in row slices (an 8-bit LM head's int32 codes would otherwise need 8x its size
        of scratch); `packed` is kept only where the codes cannot be decoded from it. False
        (nothing built) where a plane's scale overflows or is not finite."""
        n, k = self.out_features, self.in_features
        parts, scales, biases = [], [], []
        try:
            for r in range(0, n, chunk_rows):
                rows = slice(r, r + chunk_rows)
                c, s, b = nibble_planes(self.spec, packed[rows], self.scales[rows],
                                        None if self.biases is None else self.biases[rows], k)
                parts.append(int4pack.pack(c))
                scales.append(s)
                biases.append(b)
        except ValueError:
            return False
        self.planes = c.shape[1] // k
        self.i4 = parts[0] if len(parts) == 1 else torch.cat(parts)
        self.i4_sz = int4pack.scales_and_zeros(torch.cat(scales), torch.cat(biases))
        if not (n % 64 == 0 and int4pack.layout_ok()):
            self.packed = packed.contiguous()  # cannot decode the int4 layout: keep a copy
        return True

    def drop_words(self) -> int:
        """Drop the MLX words of a weight that has q4tc's copy (affine, mxfp4 / nvfp4's fp4
        copy or mxfp8's fp8 copy; CUDA): decode reads the copy anyway, and prefill
        dequantizes from it (`prefill_dequant.dequant_copy`, the same values), so a weight is
        held once, not twice (4-bit: -0.5 B per weight). Returns the bytes freed (0 where
        kept)."""
        if (self.packed is None or self.tc is None
                or not (self.spec.mode == "affine" or self.tc_fp4 or self.tc_fp8)):
            return 0
        freed = self.packed.numel() * self.packed.element_size()
        self.packed = None
        return freed

    def _dense_copy(self, chunk_rows: int = 4096) -> Tensor:
        """The whole weight in the compute dtype, `dequant_rows`' values (built in row slices:
        its fp32 scratch stays bounded)."""
        n = self.out_features
        out = torch.empty(n, self.in_features, dtype=self.compute_dtype)
        for r in range(0, n, chunk_rows):
            out[r:r + chunk_rows] = self.dequant_rows(slice(r, min(r + chunk_rows, n)))
        return out

    def add_batch_copy(self) -> int:
        """Build the copies that decode of several rows reads (`mlxr.quant.cuda`) where this
        weight takes them and has none; returns the bytes added. Where decode_gemv_tc serves the
        weight: its repack `tc` (2-16 rows; only the small squarish weights whose single row
        takes q4gemv lack it, e.g. Qwen3-0.6B's o projections), plus tinygemm's where
        `cuda.tinygemm_rows` (9-32 rows of small squarish weights); else tinygemm's (2-32
        rows; also with env MLXR_Q4TC_ROWS=0 or MLXR_Q4GEMV=0). At load only tinygemm's is
        built, and only where neither q4gemv nor q4tc serves single-row decode. The batching
        engine (`LLMEngine`) asks before it sizes the KV pool and captures its graphs."""
        if not self.matmul or self.packed is None or self.device.type != "cuda":
            return 0
        added = []
        tc = (cuda.several_rows_on() and os.environ.get("MLXR_Q4GEMV") != "0"
              and cuda.q4tc_supported(self))
        if tc and self.tc is None:
            had = self.q4_sb is not None  # q4gemv's pairs are q4tc's too
            self.tc, self.q4_sb = cuda_copies.q4tc_pack(self.packed, self.scales, self.biases,
                                                        self.q4_sb)
            added += [self.tc] if had else [self.tc, self.q4_sb]
        if (self.i4 is None and cuda.tinygemm_supported(self)
                and (not tc or cuda.tinygemm_rows(self))):
            self.i4, self.i4_sz = cuda_copies.tinygemm_pack(self.packed, self.scales, self.biases)
            added += [self.i4, self.i4_sz]
        return sum(t.numel() * t.element_size() for t in added)

    # ------------------------------------------------------------------ properties
    @property
    def nbytes(self) -> int:
        ts = (self.packed, self.codes, self.i4, self.i4_sz, self.q4, self.tc, self.q4_sb,
              self.dense,
              self.scales, self.biases, self.global_scale)
        w = None if self.ckern is None else self.ckern.words
        if w is not None and (self.packed is None or w.data_ptr() != self.packed.data_ptr()):
            ts = (*ts, w)  # the compiled kernel's words, where `packed` is not them
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    @property
    def words_dropped(self) -> bool:
        """The MLX words went (`drop_words`): q4tc's copy is all the kernels can read."""
        return self.packed is None and self.tc is not None

    @property
    def tc_fp4(self) -> bool:
        """q4tc's copy holds mxfp4's / nvfp4's E2M1 codes (`cuda_copies.fp4_tc_pack`), not affine
        nibbles."""
        return self.tc is not None and self.spec.mode in cuda_copies.FP4_TC_MODES

    @property
    def tc_fp8(self) -> bool:
        """q4tc's copy holds mxfp8's E4M3 codes (`cuda_copies.fp8_tc_pack`)."""
        return self.tc is not None and self.spec.mode == "mxfp8"

    @property
    def exact(self) -> bool:
        return self.compute_dtype == torch.float32

    def __repr__(self) -> str:
        s = self.spec
        return (f"QuantWeight({self.name}, [{self.out_features}, {self.in_features}], {s.mode} "
                f"{s.bits}b g{s.group_size}, compute={self.compute_dtype}, dev={self.device})")

    # ------------------------------------------------------------------ dequantization
    def row_codes(self, rows: slice | Tensor) -> Tensor:
        """uint8 codes of a row range (slice, step 1) or of gathered rows (long tensor)."""
        if self.codes is not None:
            return self.codes[rows]
        if self.packed is not None:
            return unpack_codes(self.packed[rows], self.spec.bits, self.in_features)
        if self.tc is not None:
            return self._copy_codes(rows)
        if self.planes == 1:
            return self._i4_rows(rows, None)
        if self.spec.mode == "mxfp4":
            return fp4_codes(self._i4_rows(rows, torch.add))
        return self._i4_rows(rows, lambda hi, lo: merge_planes(hi, lo, self.spec.bits))

    def _copy_codes(self, rows: slice | Tensor) -> Tensor:
        """Codes uint8 [n, in] of original rows from q4tc's copy (a weight whose words were
        dropped)."""
        from ..ops.matmul.decode_gemv_tc_layout import copy_rows_codes

        idx = (torch.arange(self.out_features, device=self.tc.device)[rows]
               if isinstance(rows, slice) else rows)
        return copy_rows_codes(self.tc, idx, self.planes, self.spec.bits, self.tc_glu,
                               self.tc_fp4, self.tc_fp8).to(torch.uint8)

    def _i4_rows(self, rows: slice | Tensor, combine) -> Tensor:
        """The int4 copy's codes of a row range or of gathered rows, uint8 [n, in]; with two
        planes each code is combine(high nibble, low nibble)."""
        k = self.in_features
        if isinstance(rows, slice):
            r0, r1, _ = rows.indices(self.out_features)
            a0, a1 = r0 // 64 * 64, -(-r1 // 64) * 64
            q = (int4pack.decode_rows(self.i4, k, a0, a1) if self.planes == 1 else
                 int4pack.decode_rows_planes(self.i4, k, a0, a1, combine))
            return q[r0 - a0: r1 - a0]
        q = int4pack.decode_gather(self.i4, k * self.planes, rows)
        return q if self.planes == 1 else combine(q[:, :k], q[:, k:])

    def dequant_rows(self, rows: slice | Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Dequantized rows [n, in] in `dtype` (default compute dtype).

        Affine: `q*s + b` evaluated in the parameter dtype when it equals `dtype` (bf16 scales
        + bf16 compute reproduce mlx's `R(R(q*s)+b)` bit for bit; fp32 exact mode likewise);
        otherwise in fp32, rounded once. fp modes: exact fp32 products, rounded once.
        """
        dtype = dtype or self.compute_dtype
        if self.dense is not None and dtype == self.compute_dtype:
            return self.dense[rows]
        g = self.spec.group_size
        if self.spec.mode == "mxfp4" and self.planes == 2 and self.packed is None:
            # the int4 copy's planes sum to 2v + 12 (`fp.fp4_planes`): the values without two
            # table gathers (same values; a -0 code comes back as +0, as from `row_codes`)
            q = self._i4_rows(rows, torch.add)
            n, k = q.shape
            v = q.to(torch.float32).sub_(12).mul_(0.5).view(n, k // g, g)
            s = fp_scales(self.scales[rows], self.spec.mode, self.global_scale)
            return v.mul_(s.unsqueeze(-1)).view(n, k).to(dtype)
        q = self.row_codes(rows)
        n, k = q.shape
        if self.spec.mode == "affine":
            s, b = self.scales[rows], self.biases[rows]
            wd = s.dtype if s.dtype == dtype else torch.float32
            w = q.to(wd).view(n, k // g, g) * s.to(wd).unsqueeze(-1)
            w = w.add_(b.to(wd).unsqueeze(-1))
        else:
            v = code_table(self.spec.mode, q.device)[q.to(torch.int64)].view(n, k // g, g)
            s = fp_scales(self.scales[rows], self.spec.mode, self.global_scale)
            w = v.mul_(s.unsqueeze(-1))
        return w.view(n, k).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Full [out, in] matrix (tests/reference only)."""
        return self.dequant_rows(slice(0, self.out_features), dtype)

    def tile_rows(self, itemsize: int = 4, target_bytes: int = 4 << 20) -> int:
        """Rows per dequant tile: ~target_bytes of dequantized values, a multiple of 64."""
        rows = max(64, target_bytes // (self.in_features * itemsize) // 64 * 64)
        return min(rows, self.out_features)

    # ------------------------------------------------------------------ compute
    def linear(self, x: Tensor) -> Tensor:
        """y = x @ W^T; x [..., in] -> [..., out] in compute dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input last dim {x.shape[-1]} != {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)
        if self.device.type == "cpu":
            y = cpu.linear(self, x2)
        elif x2.is_cuda and _use_triton(self):
            y = cuda.linear(self, x2)
            if y is None:
                from mlxr.ops.matmul import generic_qmm
                y = generic_qmm.qmatmul(x2, self)
        else:
            # generic torch fallback (MLXR_KERNELS=torch, no triton, ...)
            y = cpu.tiled_linear(self, x2)
        return y.reshape(*lead, self.out_features)

    def gated(self, x: Tensor, act: str) -> Tensor | None:
        """act(gate) * up, x [..., in] -> [..., out / 2], for a weight built with `glu=True`,
        in one launch where the tensor-core GEMV serves x's rows (`cuda.gated`); None
        elsewhere (the caller runs `linear` and `ops.gated_act`: the same result)."""
        if not self.tc_glu or not x.is_cuda or not _use_triton(self):
            return None
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input last dim {x.shape[-1]} != {self.in_features}")
        y = cuda.gated(self, x.reshape(-1, self.in_features).to(self.compute_dtype), act)
        return None if y is None else y.reshape(*x.shape[:-1], self.out_features // 2)

    def embed(self, ids: Tensor) -> Tensor:
        """ids long [...] -> dequantized rows [..., in] in compute dtype."""
        # Range-check host ids only: on the device the check would sync (and break CUDA-graph
        # capture); device ids come from our own sampler or from checked prompts.
        if not ids.is_cuda and ids.numel() and (int(ids.min()) < 0
                                                or int(ids.max()) >= self.out_features):
            raise IndexError(f"{self.name}: token id out of range [0, {self.out_features})")
        flat = ids.reshape(-1).to(self.device, torch.int64)
        if flat.is_cuda and self.packed is not None and self.spec.mode == "affine":
            from mlxr import ops
            from mlxr.ops.layer import embed_rows as te  # one launch, dequant_rows' values

            a = (self.packed, self.scales, self.biases, self.spec.bits, self.spec.group_size,
                 self.compute_dtype)
            if ops.fast_kernels(self.device) and te.supported(*a):
                return te.embed_rows(*a[:3], flat, *a[3:]).reshape(*ids.shape, self.in_features)
        return self.dequant_rows(flat).reshape(*ids.shape, self.in_features)
