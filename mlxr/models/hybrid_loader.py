"""Map qwen3_5 / qwen3_5_moe / qwen3_next / gemma4 checkpoint tensors onto their decoders,
checking every name and shape against the config (the dense loader's `_Builder` does the
reading, quantization and checks; `moe_loader.build_moe` the MoE blocks).

Names are mlx-lm's after its `sanitize`: the text weights under `language_model.model.` (the
wrappers' files) or `model.` (gemma4_text). Tensors of the vision / audio towers and of
qwen3_5's multi-token-prediction head are skipped, and the loader logs that it did; any other
tensor the model does not use is an error.
"""

from __future__ import annotations

import logging

import torch

from ..checkpoint import Checkpoint
from ..config import ModelConfig
from ..config.hybrid import QWEN_HYBRID, GatedDeltaSpec, Gemma4Spec
from ..errors import ModelFormatError
from ..layers import Embedding
from .gated_delta import GatedDeltaMixer
from ..ops.recurrent.reference import _scalar
from .gemma4 import Gemma4Decoder, Gemma4Experts, Gemma4Layer, PerLayerEmbedding
from .loader import RawQuant, _Builder
from .moe_loader import build_moe
from .qwen3_5 import GatedAttention, HybridLayer, Qwen35Decoder

log = logging.getLogger(__name__)

# what mlx-lm's sanitize drops: other modalities, the MTP head, precomputed / clipping buffers
SKIPPED_PREFIXES = ("vision_tower.", "model.visual.", "audio_tower.", "embed_audio.",
                    "embed_vision.", "multi_modal_projector.", "vision_embedder.", "mtp.",
                    "model.vision_tower.", "model.audio_tower.", "model.embed_audio.",
                    "model.embed_vision.", "model.multi_modal_projector.")
SKIPPED_PARTS = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min",
                 ".mtp.")


class Parts:
    """Name helpers over one checkpoint: the text model's prefix and the builder."""

    def __init__(self, ckpt: Checkpoint, config: ModelConfig, dtype: torch.dtype, device,
                 dry_run: bool):
        names = set(ckpt.tensors)
        self.names = names
        wrapped = any(n.startswith("language_model.model.") for n in names)
        self.model = "language_model.model." if wrapped else "model."
        self.head = "language_model.lm_head" if wrapped else "lm_head"
        self.b = _Builder(ckpt, config, dtype, device, dry_run)
        self.dtype, self.device, self.dry_run = dtype, device, dry_run
        self.skipped = {n for n in names if n.startswith(SKIPPED_PREFIXES)
                        or any(p in n for p in SKIPPED_PARTS)}

    def linear(self, *parts: tuple[str, int, int], bias: bool = False, **kw):
        return self.b.linear([(self.model + p, o, i, bias) for p, o, i in parts], **kw)

    def norm(self, path: str, size: int) -> torch.Tensor:
        return self.b.float_tensor(self.model + path + ".weight", (size,))

    def vector(self, path: str, shape: tuple, float32: bool = False) -> torch.Tensor:
        """A raw parameter tensor (compute dtype, or float32 as mlx-lm keeps A_log)."""
        if not float32:
            return self.b.float_tensor(self.model + path, shape)
        name = self.model + path
        info = self.b._info(name)
        self.b._expect(info, shape, {"BF16", "F16", "F32"})
        t = self.b.load(name)
        return t.float() if self.dry_run else t.to(device=self.device, dtype=torch.float32)

    def finish(self, family: str, ignored: set[str] = frozenset()) -> None:
        """Fail on tensors nothing read; log what was skipped on purpose."""
        unexpected = sorted(self.names - self.b.used - self.skipped - set(ignored))
        if unexpected:
            more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
            raise ModelFormatError(
                f"unexpected tensors not used by a {family} model with this config.json: "
                f"{', '.join(unexpected[:5])}{more}")
        if self.skipped and not self.dry_run:
            log.info("%s: %d tensors of other modalities / auxiliary heads not loaded "
                     "(text generation only)", family, len(self.skipped))


def _rows(w: torch.Tensor | RawQuant, idx: torch.Tensor) -> torch.Tensor | RawQuant:
    """Output rows idx of a float or packed weight (quantization groups run along the input:
    rows move with their scales and biases)."""
    def pick(t: torch.Tensor) -> torch.Tensor:  # a float weight is on the device already
        return t.index_select(0, idx.to(t.device))

    if isinstance(w, torch.Tensor):
        return pick(w)
    return w._replace(weight=pick(w.weight), scales=pick(w.scales),
                      biases=None if w.biases is None else pick(w.biases))


def _grouped_in_proj(p: Parts, s: GatedDeltaSpec, pre: str, e: int):
    """qwen3_next's in_proj_qkvz [Hk * (2Dk + 2rDv), E] and in_proj_ba [Hk * 2r, E] (r =
    Hv / Hk; rows grouped per key head as [q k v z] and [b a]) reordered to qwen3_5's one
    projection [q | k | v | z | b | a] (what mlx-lm's fix_query_key_value_ordering splits
    out), so the mixer is the same."""
    hk, dk, r, dv = s.num_k_heads, s.k_head_dim, s.num_v_heads // s.num_k_heads, s.v_head_dim
    qkvz = p.b.weight(p.model + pre + "in_proj_qkvz", 2 * s.key_dim + 2 * s.value_dim, e)
    ba = p.b.weight(p.model + pre + "in_proj_ba", 2 * s.num_v_heads, e)
    if not p.dry_run:
        rows = torch.arange(qkvz_rows := 2 * s.key_dim + 2 * s.value_dim).reshape(hk, -1)
        cuts = [0, dk, 2 * dk, 2 * dk + r * dv, qkvz_rows // hk]
        qkvz = _rows(qkvz, torch.cat([rows[:, a:z].flatten() for a, z in zip(cuts, cuts[1:])]))
        rows = torch.arange(2 * s.num_v_heads).reshape(hk, 2 * r)
        ba = _rows(ba, torch.cat([rows[:, :r].flatten(), rows[:, r:].flatten()]))
    return p.b.stack([qkvz, ba], [None, None])


def _gated_delta(p: Parts, c: ModelConfig, s: GatedDeltaSpec, pre: str) -> GatedDeltaMixer:
    e = c.hidden_size
    conv = p.vector(pre + "conv1d.weight", (s.conv_dim, s.conv_kernel, 1))
    in_proj = (_grouped_in_proj(p, s, pre, e) if s.qkvz_grouped else
               p.linear((pre + "in_proj_qkv", s.conv_dim, e), (pre + "in_proj_z", s.value_dim, e),
                        (pre + "in_proj_b", s.num_v_heads, e),
                        (pre + "in_proj_a", s.num_v_heads, e)))
    return GatedDeltaMixer(
        spec=s,
        in_proj=in_proj,
        conv=conv.reshape(s.conv_dim, s.conv_kernel),
        a_log=p.vector(pre + "A_log", (s.num_v_heads,), float32=True),
        dt_bias=p.vector(pre + "dt_bias", (s.num_v_heads,)),
        norm=p.norm(pre + "norm", s.v_head_dim),
        out_proj=p.linear((pre + "out_proj", e, s.value_dim)),
        eps=c.rms_norm_eps)


def build_qwen3_5(ckpt: Checkpoint, c: ModelConfig, dtype: torch.dtype, device,
                  dry_run: bool = False) -> Qwen35Decoder | None:
    s: GatedDeltaSpec = c.arch
    p = Parts(ckpt, c, dtype, device, dry_run)
    e, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    hd, kd = c.num_heads * d, c.num_kv_heads * d
    layers = []
    for i, kind in enumerate(s.layer_types):
        pre = f"layers.{i}."
        if kind == "linear_attention":
            mixer = _gated_delta(p, c, s, pre + "linear_attn.")
        else:
            a = pre + "self_attn."
            if c.qkv_bias != c.o_bias:
                raise ModelFormatError("attention_bias covers q/k/v/o together")
            mixer = GatedAttention(
                qkv=p.linear((a + "q_proj", 2 * hd, e), (a + "k_proj", kd, e),
                             (a + "v_proj", kd, e), bias=c.qkv_bias),
                o_proj=p.linear((a + "o_proj", e, hd), bias=c.o_bias),
                q_norm=p.norm(a + "q_norm", d), k_norm=p.norm(a + "k_norm", d))
        if c.moe is not None and c.moe.sparse_layers[i]:
            mlp = dict(gate_up=None, down_proj=None, moe=build_moe(p.b, c, i, p.model))
        else:
            mlp = dict(gate_up=p.linear((pre + "mlp.gate_proj", f, e),
                                        (pre + "mlp.up_proj", f, e), glu=True),
                       down_proj=p.linear((pre + "mlp.down_proj", e, f)))
        layers.append(HybridLayer(
            input_norm=p.norm(pre + "input_layernorm", e), mixer=mixer,
            mlp_norm=p.norm(pre + "post_attention_layernorm", e), **mlp))
    tied = c.tie_word_embeddings
    embed = p.linear(("embed_tokens", c.vocab_size, e), matmul=tied, gathered=True)
    lm_head = None if tied else p.b.linear([(p.head, c.vocab_size, e, False)])
    norm = p.norm("norm", e)
    p.finish(c.model_type, {n for n in p.names if n.startswith(p.head + ".")} if tied else set())
    if dry_run:
        return None
    return Qwen35Decoder(c, Embedding(embed.weight), layers, norm, lm_head, dtype, device)


def _gemma4_experts(p: Parts, c: ModelConfig, i: int) -> Gemma4Experts | None:
    """Layer i's MoE branch (enable_moe_block), None without one or on a dry run."""
    if c.moe is None:
        return None
    pre, e = f"layers.{i}.", c.hidden_size
    block = build_moe(p.b, c, i, p.model)
    scale = p.vector(pre + "router.scale", (e,))
    per_expert = p.vector(pre + "router.per_expert_scale", (c.moe.num_experts,))
    norms = [p.norm(pre + n, e) for n in ("pre_feedforward_layernorm_2",
                                          "post_feedforward_layernorm_1",
                                          "post_feedforward_layernorm_2")]
    if block is None:
        return None
    return Gemma4Experts(block, _scalar(scale, e**-0.5), per_expert, *norms)


def build_gemma4(ckpt: Checkpoint, c: ModelConfig, dtype: torch.dtype, device,
                 dry_run: bool = False) -> Gemma4Decoder | None:
    s: Gemma4Spec = c.arch
    p = Parts(ckpt, c, dtype, device, dry_run)
    e, h, dim = c.hidden_size, c.num_heads, s.ple_dim
    layers, shared_kv = [], set()
    for i in range(c.num_layers):
        pre, d, kh, f = f"layers.{i}.", s.head_dims[i], s.kv_heads[i], s.mlp_sizes[i]
        a = pre + "self_attn."
        own = s.kv_source[i] == i
        kv = None
        if own:
            parts = [(a + "k_proj", kh * d, e)] + ([] if s.k_eq_v[i] else [(a + "v_proj",
                                                                             kh * d, e)])
            kv = p.linear(*parts)
        else:  # mlx-lm's sanitize drops a shared layer's own K/V weights if a file has them
            shared_kv |= {n for n in p.names
                          if n.startswith(tuple(p.model + a + m for m in
                                                ("k_proj.", "v_proj.", "k_norm.")))}
        ple = dict(ple_gate=p.linear((pre + "per_layer_input_gate", dim, e)),
                   ple_proj=p.linear((pre + "per_layer_projection", e, dim)),
                   ple_norm=p.norm(pre + "post_per_layer_input_norm", e)) if dim else {}
        layers.append(Gemma4Layer(
            input_norm=p.norm(pre + "input_layernorm", e), q_proj=p.linear((a + "q_proj",
                                                                             h * d, e)),
            kv=kv, o_proj=p.linear((a + "o_proj", e, h * d)), q_norm=p.norm(a + "q_norm", d),
            k_norm=p.norm(a + "k_norm", d) if own else None,
            post_attn_norm=p.norm(pre + "post_attention_layernorm", e),
            pre_mlp_norm=p.norm(pre + "pre_feedforward_layernorm", e),
            gate_up=p.linear((pre + "mlp.gate_proj", f, e), (pre + "mlp.up_proj", f, e),
                             glu=True),
            down_proj=p.linear((pre + "mlp.down_proj", e, f)),
            post_mlp_norm=p.norm(pre + "post_feedforward_layernorm", e),
            scalar=p.vector(pre + "layer_scalar", (1,)), moe=_gemma4_experts(p, c, i), **ple))
    tied = c.tie_word_embeddings
    embed = p.linear(("embed_tokens", c.vocab_size, e), matmul=tied, gathered=True)
    ple_mod = None
    if dim:
        table = p.linear(("embed_tokens_per_layer", s.ple_vocab, c.num_layers * dim),
                         matmul=False, gathered=True)
        ple_mod = PerLayerEmbedding(
            Embedding(table.weight), p.linear(("per_layer_model_projection",
                                               c.num_layers * dim, e)),
            p.norm("per_layer_projection_norm", dim))
    lm_head = None if tied else p.b.linear([(p.head, c.vocab_size, e, False)])
    norm = p.norm("norm", e)
    p.finish(c.model_type, shared_kv)
    if dry_run:
        return None
    return Gemma4Decoder(c, Embedding(embed.weight), ple_mod, layers, norm, lm_head, dtype,
                         device)


def build_hybrid(ckpt: Checkpoint, c: ModelConfig, dtype: torch.dtype, device,
                 dry_run: bool = False):
    """The decoder of a hybrid-family config (`c.arch` set), or None with dry_run (names,
    shapes and dtypes checked, no data read)."""
    if c.model_type in QWEN_HYBRID:
        return build_qwen3_5(ckpt, c, dtype, device, dry_run)
    return build_gemma4(ckpt, c, dtype, device, dry_run)
