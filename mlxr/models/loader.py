"""Map checkpoint tensors onto the decoder, validating every name and shape against the config.

The table of modules below is the whole "conversion": names are the checkpoint's own. Quantized
modules are detected as mlx-lm does (a `.scales` tensor exists) and their bits / group size /
mode come from the config's per-module entry or, failing that, from the tensor shapes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..checkpoint import DTYPES, Checkpoint, TensorInfo
from ..config import QuantSpec, ModelConfig
from ..errors import ModelFormatError
from ..layers import Embedding, Linear
from ..quant import QuantWeight
from ..quant.cuda_copies import COPY_MODES, decode_copy_bytes
from ..quant.weight import dense_bytes
from .decoder import Decoder, Fused, Layer
from .moe_loader import build_moe

log = logging.getLogger(__name__)

FLOAT_DTYPES = {"BF16", "F16", "F32"}
QUANT_MODES = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
# GPU memory a CUDA load leaves free after the file's tensors and the decode copies: at least
# this, or a tenth of the device (activations, the KV cache, CUDA graphs)
COPY_RESERVE = 2 << 30


def module_table(c: ModelConfig, tied: bool) -> dict[str, tuple[str, int, int, bool]]:
    """Every module the checkpoint must hold: path -> (kind, out, in, has_bias).

    kind is "linear", "embedding" or "norm" (norms: out = size, in = 0).
    """
    e, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    mods: dict[str, tuple[str, int, int, bool]] = {
        "model.embed_tokens": ("embedding", c.vocab_size, e, False),
        "model.norm": ("norm", e, 0, False),
    }
    if not tied:
        mods["lm_head"] = ("linear", c.vocab_size, e, False)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        q_size = c.heads(i) * d
        if c.fused_qkv:
            mods[p + "self_attn.qkv_proj"] = ("linear", q_size + 2 * c.kv_size, e, False)
        else:
            mods[p + "self_attn.q_proj"] = ("linear", q_size, e, c.qkv_bias)
            mods[p + "self_attn.k_proj"] = ("linear", c.kv_size, e, c.qkv_bias)
            mods[p + "self_attn.v_proj"] = ("linear", c.kv_size, e, c.qkv_bias)
        mods[p + "self_attn.o_proj"] = ("linear", e, q_size, c.o_bias)
        if c.attn_head_gate:
            mods[p + "self_attn.g_proj"] = ("linear", c.heads(i), e, False)
        if c.moe is not None and c.moe.sparse_layers[i]:
            pass  # the MoE block's tensors: moe_loader.build_moe
        elif c.fused_gate_up:
            mods[p + "mlp.gate_up_proj"] = ("linear", 2 * f, e, False)
        else:
            mods[p + "mlp.gate_proj"] = ("linear", f, e, c.mlp_bias)
            mods[p + "mlp.up_proj"] = ("linear", f, e, c.mlp_bias)
        mods[p + "mlp.down_proj"] = ("linear", e, f, c.mlp_bias)
        mods[p + "input_layernorm"] = ("norm", e, 0, False)
        mods[p + "post_attention_layernorm"] = ("norm", e, 0, False)
        if c.sandwich_norm:
            mods[p + "pre_feedforward_layernorm"] = ("norm", e, 0, False)
            mods[p + "post_feedforward_layernorm"] = ("norm", e, 0, False)
        if c.qk_norm:
            mods[p + "self_attn.q_norm"] = ("norm", d, 0, False)
            mods[p + "self_attn.k_norm"] = ("norm", d, 0, False)
    return mods


class RawQuant(NamedTuple):
    """A quantized module's tensors as stored (weight is the int32 view of the packed uint32)."""

    weight: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor | None
    spec: QuantSpec
    global_scale: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


def _ram() -> tuple[int, int]:
    """(available, total) bytes of RAM: /proc/meminfo's MemAvailable (page cache counts as
    free), else the free pages sysconf reports."""
    try:
        with open("/proc/meminfo") as f:
            info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ":" in ln}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class _Builder:
    """Reads and checks module tensors. With dry_run, tensors are shape-only ("meta") so a
    directory can be validated without reading its weights."""

    def __init__(self, ckpt: Checkpoint, config: ModelConfig, dtype: torch.dtype, device,
                 dry_run: bool = False):
        self.ckpt, self.config, self.dtype, self.device = ckpt, config, dtype, device
        self.dry_run = dry_run
        self.used: set[str] = set()
        # bytes of decode copies (QuantWeight's load-time repacks, ~ the weight's own size or
        # twice it; on the CPU the dense nvfp4 / mxfp8 weights, 2 B per weight) that still
        # fit in the device's memory beside the whole file; weights past it load without
        # (slower decode, no out-of-memory at load)
        self.copy_budget: int | None = None
        self.copies_skipped = self.words_dropped = 0
        # where a weight's copy does not fit beside its MLX words, the copy replaces them
        # (`QuantWeight.drop_words`: ~ the same bytes, prefill dequantizes from the copy);
        # env MLXR_WORDS = auto (that) | drop (always: least memory) | keep (never: weights
        # past the budget load without copies)
        self.words = os.environ.get("MLXR_WORDS", "auto").lower()
        if self.words not in ("auto", "drop", "keep"):
            raise ValueError(f"MLXR_WORDS={self.words!r}: expected auto, drop or keep")
        self.cuda = torch.device(device).type == "cuda"
        if not dry_run:
            free, total = (torch.cuda.mem_get_info(torch.device(device)) if self.cuda
                           else _ram())
            files = sum(i.nbytes for i in ckpt.tensors.values())
            self.copy_budget = free - files - max(COPY_RESERVE, total // 10)

    def load(self, name: str) -> torch.Tensor:
        if self.dry_run:
            info = self.ckpt.tensors[name]
            return torch.empty(info.shape, dtype=DTYPES[info.dtype][0], device="meta")
        return self.ckpt.load(name)

    def _info(self, name: str) -> TensorInfo:
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"missing tensor '{name}' (required by config.json)")
        self.used.add(name)
        return info

    def _expect(self, info: TensorInfo, shape: tuple, dtypes: set[str]) -> None:
        if tuple(info.shape) != tuple(shape):
            raise ModelFormatError(
                f"{info.file.name}: tensor '{info.name}' has shape {list(info.shape)}, "
                f"config.json implies {list(shape)}")
        if info.dtype not in dtypes:
            raise ModelFormatError(
                f"{info.file.name}: tensor '{info.name}' has dtype {info.dtype}, "
                f"expected one of {sorted(dtypes)}")

    def float_tensor(self, name: str, shape: tuple) -> torch.Tensor:
        info = self._info(name)
        self._expect(info, shape, FLOAT_DTYPES)
        return self.load(name).to(device="meta" if self.dry_run else self.device,
                                  dtype=self.dtype)

    def quant_spec(self, path: str, out: int, inp: int, rank: int = 2) -> QuantSpec:
        """The module's quantization: config entry if any, else inferred from shapes (mlx-lm).
        rank: of its weight (3 for stacked experts)."""
        q = self.config.quant
        if q is not None and path in q.overrides and q.overrides[path] is not None:
            return q.overrides[path]
        w, s = self._info(path + ".weight"), self._info(path + ".scales")
        if len(w.shape) != rank or len(s.shape) != rank or s.shape[-1] == 0 or inp % s.shape[-1] \
                or (32 * w.shape[-1]) % inp:
            raise ModelFormatError(
                f"{w.file.name}: quantized '{path}' has weight {list(w.shape)} / scales "
                f"{list(s.shape)}, inconsistent with input size {inp} from config.json")
        group, bits = inp // s.shape[-1], 32 * w.shape[-1] // inp
        if s.dtype != "U8":
            return QuantSpec("affine", bits, group)
        mode = QUANT_MODES.get((bits, group))
        if mode is None:
            raise ModelFormatError(f"'{path}': uint8 scales with bits={bits} group={group} "
                                   "match no MLX floating-point mode")
        return QuantSpec(mode, bits, group, path + ".global_scale" in self.ckpt.tensors)

    def weight(self, path: str, out: int, inp: int,
               lead: tuple[int, ...] = ()) -> torch.Tensor | RawQuant:
        """A linear/embedding weight [out, in] (a stack of them [*lead, out, in]: experts):
        float tensor, or the packed tensors (a global scale of shape lead)."""
        q = self.config.quant
        if path + ".scales" not in self.ckpt.tensors:
            if q is not None and q.overrides.get(path, False) is not None and path in q.overrides:
                raise ModelFormatError(f"config.json quantizes '{path}' but its "
                                       f"'{path}.scales' tensor is missing")
            return self.float_tensor(path + ".weight", (*lead, out, inp))
        if q is not None and path in q.overrides and q.overrides[path] is None:
            raise ModelFormatError(f"config.json marks '{path}' unquantized (false) but the "
                                   f"checkpoint has '{path}.scales'")
        spec = self.quant_spec(path, out, inp, 2 + len(lead))
        if inp % spec.group_size or (inp * spec.bits) % 32:
            raise ModelFormatError(f"config.json: quantization of '{path}': input size {inp} "
                                   f"is not a multiple of group size {spec.group_size} (or "
                                   f"of 32 bits at {spec.bits} bits)")
        w_info, s_info = self._info(path + ".weight"), self._info(path + ".scales")
        self._expect(w_info, (*lead, out, inp * spec.bits // 32), {"U32"})
        affine = spec.mode == "affine"
        self._expect(s_info, (*lead, out, inp // spec.group_size),
                     FLOAT_DTYPES if affine else {"U8"})
        biases = gscale = None
        if affine:
            b_info = self._info(path + ".biases")
            self._expect(b_info, tuple(s_info.shape), {s_info.dtype})
            biases = self.load(path + ".biases")
        if spec.global_scale:
            self._expect(self._info(path + ".global_scale"), lead, {"F32"})
            gscale = self.load(path + ".global_scale")
        return RawQuant(self.load(path + ".weight"), self.load(path + ".scales"),
                        biases, spec, gscale)

    def quant(self, raw: RawQuant, matmul: bool = True, glu: bool = False,
              gathered: bool = False) -> QuantWeight | RawQuant:
        """A QuantWeight within the GPU budget: its decode copies if they fit beside the MLX
        words, else (affine, not `gathered`: an embedding's rows are read from the words) the
        copy in place of the words, else (MLXR_WORDS=keep) no copies."""
        if self.dry_run:
            return raw
        copies, keep, need = True, True, 0
        budget = self.copy_budget is not None and matmul
        if budget:
            shape = (raw.spec, raw.weight.shape[0], raw.scales.shape[-1] * raw.spec.group_size)
            need = decode_copy_bytes(*shape) if self.cuda else dense_bytes(*shape, self.dtype)
            short = need > 0 and need > self.copy_budget  # (a weight without copies: never)
            keep = not (need and self.cuda and not gathered
                        and raw.spec.mode in COPY_MODES
                        and (self.words == "drop" or (self.words == "auto" and short)))
            if keep and short:
                copies = False
                self.copies_skipped += 1
        qw = QuantWeight.from_tensors(raw.weight, raw.scales, raw.biases, raw.spec,
                                      global_scale=raw.global_scale, compute_dtype=self.dtype,
                                      device=self.device, matmul=matmul, glu=glu,
                                      decode_copies=copies, keep_words=keep)
        if budget and copies:
            self.copy_budget -= need
            if qw.words_dropped:
                self.copy_budget += raw.weight.numel() * raw.weight.element_size()
                self.words_dropped += 1
        return qw

    def linear(self, parts: list[tuple[str, int, int, bool]], matmul: bool = True,
               glu: bool = False, gathered: bool = False) -> Linear:
        """One Linear for projections of the same input, stacked along the output dim (one
        matmul instead of several) when they share a storage format. `matmul=False`: only
        gathered (an untied embedding; see QuantWeight.from_tensors). `glu`: an MLP's gate
        over its up (`QuantWeight.from_tensors(glu=True)`). `gathered`: its rows are also
        read as an embedding (a tied one), so it keeps its MLX words."""
        ws = [self.weight(path, out, inp) for path, out, inp, _ in parts]
        bs: list = [None] * len(parts)
        if any(p[3] for p in parts):  # a part without a bias contributes zeros
            bs = [self.float_tensor(path + ".bias", (out,)) if has else
                  torch.zeros(out, dtype=self.dtype, device=self.device)
                  for path, out, _, has in parts]
        return self.stack(ws, bs, matmul, glu, gathered)

    def stack(self, ws: list, bs: list, matmul: bool = True, glu: bool = False,
              gathered: bool = False) -> Linear | Fused:
        """One Linear of weights ws (float tensors or RawQuant, each [out_i, in]) and biases
        bs (tensors, or all None) stacked along the output dim, or a Fused of them where
        their storage formats differ."""
        bias = None if bs[0] is None else torch.cat(bs)
        if len(ws) == 1:
            return Linear(ws[0] if isinstance(ws[0], torch.Tensor) else
                          self.quant(ws[0], matmul, glu, gathered), bias)
        if all(isinstance(w, torch.Tensor) for w in ws):
            return Linear(torch.cat(ws), bias)
        if all(isinstance(w, RawQuant) and w.spec == ws[0].spec and w.global_scale is None
               for w in ws):
            cat = RawQuant(torch.cat([w.weight for w in ws]), torch.cat([w.scales for w in ws]),
                           None if ws[0].biases is None else torch.cat([w.biases for w in ws]),
                           ws[0].spec, None)
            return Linear(self.quant(cat, glu=glu), bias)
        return Fused([Linear(w if isinstance(w, torch.Tensor) else self.quant(w), b)
                      for w, b in zip(ws, bs)])


def check_checkpoint(ckpt: Checkpoint, config: ModelConfig) -> None:
    """Validate names, shapes and dtypes of every tensor against the config, reading no data."""
    build_decoder(ckpt, config, torch.float32, torch.device("cpu"), dry_run=True)


def build_decoder(ckpt: Checkpoint, config: ModelConfig, dtype: torch.dtype,
                  device: torch.device, dry_run: bool = False,
                  external: dict[int, Callable] | None = None) -> Decoder | None:
    """Validate the checkpoint against the config and build the decoder's weights.
    `external`: layers computed elsewhere (`Layer.external`); of those only the input norm
    is read."""
    c = config
    names = set(ckpt.tensors)
    # mlx-lm sanitize: drop precomputed rotary tables; gemma3 is tied iff lm_head is absent.
    ignored = {n for n in names if n.endswith("self_attn.rotary_emb.inv_freq")}
    tied = c.tie_word_embeddings
    if tied is None:
        tied = "lm_head.weight" not in names
    if tied and c.model_type in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral",
                                 "laguna"):
        ignored |= {n for n in names if n.startswith("lm_head.")}
    table = module_table(c, tied)
    b = _Builder(ckpt, c, dtype, device, dry_run)

    def linear(*paths: str, matmul: bool = True, glu: bool = False,
               gathered: bool = False) -> Linear | Fused:
        return b.linear([(p, *table[p][1:]) for p in paths], matmul, glu, gathered)

    def norm(path: str) -> torch.Tensor:
        return b.float_tensor(path + ".weight", (table[path][1],))

    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        sandwich = c.sandwich_norm
        sparse = c.moe is not None and c.moe.sparse_layers[i]
        if external and i in external:
            layers.append(Layer(norm(p + "input_layernorm"), None, None, None, None, None,
                                external=external[i]))
            continue
        layers.append(Layer(
            input_norm=norm(p + "input_layernorm"),
            qkv=linear(attn + "qkv_proj") if c.fused_qkv else linear(
                attn + "q_proj", attn + "k_proj", attn + "v_proj"),
            o_proj=linear(attn + "o_proj"),
            mlp_norm=norm(p + ("pre_feedforward_layernorm" if sandwich else
                               "post_attention_layernorm")),
            gate_up=None if sparse else linear(mlp + "gate_up_proj", glu=True)
            if c.fused_gate_up else linear(mlp + "gate_proj", mlp + "up_proj", glu=True),
            down_proj=None if sparse else linear(mlp + "down_proj"),
            moe=build_moe(b, c, i) if sparse else None,
            sinks=b.float_tensor(attn + "sinks", (c.heads(i),)) if c.attn_sinks else None,
            head_gate=linear(attn + "g_proj") if c.attn_head_gate else None,
            q_norm=norm(attn + "q_norm") if c.qk_norm else None,
            k_norm=norm(attn + "k_norm") if c.qk_norm else None,
            post_attn_norm=norm(p + "post_attention_layernorm") if sandwich else None,
            post_mlp_norm=norm(p + "post_feedforward_layernorm") if sandwich else None,
        ))
    embed = linear("model.embed_tokens", matmul=tied, gathered=True)
    lm_head = None if tied else linear("lm_head")
    final_norm = norm("model.norm")
    unexpected = sorted(names - b.used - ignored)
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ModelFormatError(
            f"unexpected tensors not used by a {c.model_type} model with this config.json: "
            f"{', '.join(unexpected[:5])}{more}")
    if dry_run:
        return None
    if b.words_dropped:
        (log.info if b.words == "drop" else log.warning)(
            "GPU memory: %d weights keep only their decode copies, not the file's words "
            "(prefill dequantizes from the copies; prompts of 8-128 tokens lose the fused "
            "GEMM there)", b.words_dropped)
    if b.copies_skipped:
        log.warning("%s memory: %d weights load without their decode copies (their decode "
                    "runs the slower generic kernels)", "GPU" if b.cuda else "CPU",
                    b.copies_skipped)
    return Decoder(c, Embedding(embed.weight), layers, final_norm, lm_head, dtype, device)
