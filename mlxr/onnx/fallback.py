"""Whole-graph fallback: a decoder graph mlxr does not fully claim runs on onnxruntime's CPU
provider behind the same `forward(ids, cache)` the Model and generation loop call.

The KV cache stays in mlxr's SequenceCache (k[layer] [kv heads, slots, head dim]); each step
feeds its filled prefix as the graph's past (B=1, growing cache) and writes the present back.
Window-sized KV buffers (gpt-oss's sliding layers) are run as full-length ones (the session
gets the graph rewritten in memory).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch

from ..config import ModelConfig
from ..engine.kv_cache import SequenceCache
from ..errors import ModelFormatError
from .folder import KVNames
from .graph import OnnxGraph

NP_TYPES = {1: np.float32, 10: np.float16, 16: None}


def ort_session(path, threads: int = 0, model: bytes | None = None):
    """An onnxruntime CPU session on the file `path`, or on the serialized `model` (a subgraph
    of `path`). onnxruntime is imported here: only the ONNX path needs it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(model if model is not None else str(path), so,
                                    providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types for bad graphs
        what = "a region of it" if model is not None else "it"
        raise ModelFormatError(f"{path.name}: onnxruntime cannot load {what} "
                               f"({ort_message(e)})") from None


def ort_message(e: Exception) -> str:
    """onnxruntime's error as one line (its messages carry C++ source lines and newlines)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = " ".join(lines) or type(e).__name__
    return text if len(text) <= 400 else text[:400] + "..."


def ort_run(session, path, names: list[str], feeds: dict) -> list:
    """session.run, with onnxruntime's run-time failures (a node's shape check on a graph
    whose declared I/O disagrees with its nodes, bad feeds) as one-line mlxr errors."""
    try:
        return session.run(names, feeds)
    except Exception as e:  # noqa: BLE001 -- onnxruntime's own exception types
        raise ModelFormatError(f"{path.name}: onnxruntime failed running the graph "
                               f"({ort_message(e)})") from None


class OrtDecoder:
    """The decoder interface (config, dtype, device, forward) over an onnxruntime session."""

    def __init__(self, g: OnnxGraph, config: ModelConfig, kv: list[KVNames], logits: str):
        kv_elem = g.inputs[kv[0].past_key].elem
        if NP_TYPES.get(kv_elem) is None:
            raise ModelFormatError(f"{g.path.name}: KV cache type {kv_elem} is not float32/16")
        self.config, self.kv, self.logits_name = config, kv, logits
        self.dtype = torch.float32 if kv_elem == 1 else torch.float16
        self.device = torch.device("cpu")
        self.position_ids = "position_ids" if "position_ids" in g.inputs else None
        self.path = g.path
        self.session = ort_session(g.path, model=full_cache_model(g))

    def quant_weights(self) -> list:
        return []  # the weights live in onnxruntime's session

    def new_cache(self, capacity: int) -> SequenceCache:
        """One sequence per forward in the serving engine too (its per-sequence caches)."""
        c = self.config
        return SequenceCache(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype,
                             self.device, capacity)

    def forward_batch(self, ids: torch.Tensor, caches: list) -> torch.Tensor:
        return torch.stack([self.forward(ids[j:j + 1], c, last_only=True)[0]
                            for j, c in enumerate(caches)])

    def forward(self, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        t, start = ids.shape[0], cache.length
        cache.reserve(start + t)
        pool = cache.pool
        feeds = {"input_ids": ids.reshape(1, t).to(torch.int64).numpy(),
                 "attention_mask": np.ones((1, start + t), np.int64)}
        if self.position_ids:
            feeds[self.position_ids] = np.arange(start, start + t, dtype=np.int64)[None]
        for i, names in enumerate(self.kv):
            feeds[names.past_key] = pool.k[i][:, :start].unsqueeze(0).numpy()
            feeds[names.past_value] = pool.v[i][:, :start].unsqueeze(0).numpy()
        wanted = [self.logits_name] + [n for k in self.kv for n in (k.present_key,
                                                                     k.present_value)]
        out = dict(zip(wanted, ort_run(self.session, self.path, wanted, feeds)))
        for i, names in enumerate(self.kv):
            pool.k[i][:, :start + t] = torch.from_numpy(out[names.present_key][0])
            pool.v[i][:, :start + t] = torch.from_numpy(out[names.present_value][0])
        cache.length = start + t
        logits = torch.from_numpy(out[self.logits_name][0]).float()
        return logits[-1:] if last_only else logits


MAX_INLINE_BYTES = 1 << 30  # initializers copied into an in-memory graph (protobuf: < 2 GiB)


def full_cache_model(g: OnnxGraph) -> bytes | None:
    """None (run the file as it is), or the graph with window-sized KV buffers turned into
    full-length ones (GroupQueryAttention sliding_window_cache=0: the same attention, fed the
    growing cache `forward` keeps), its initializers inside."""
    windowed = [n for n in g.nodes if n.op_type == "GroupQueryAttention" and any(
        a.name == "sliding_window_cache" and a.i for a in n.attribute)]
    if not windowed:
        return None
    size = sum(i.nbytes for i in g.inits.values())
    if size > MAX_INLINE_BYTES:
        raise ModelFormatError(f"{g.path.name}: node {windowed[0].name!r} keeps a window-sized "
                               f"KV buffer and the graph ({size >> 20} MiB) is too large for "
                               "mlxr to rewrite for onnxruntime")
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    for n in m.graph.node:
        for a in n.attribute:
            if n.op_type == "GroupQueryAttention" and a.name == "sliding_window_cache":
                a.i = 0
    inits = [g.tensor_proto(t.name) for t in m.graph.initializer]
    m.graph.ClearField("initializer")
    m.graph.initializer.extend(inits)
    return m.SerializeToString()


def fallback_config(g: OnnxGraph, meta: dict, kv: list[KVNames], logits: str) -> ModelConfig:
    """What the Model and the KV cache need, from genai_config.json and the graph's I/O."""
    dec = meta.get("decoder") if isinstance(meta.get("decoder"), dict) else {}
    dims = g.inputs[kv[0].past_key].dims if kv else ()
    shape = g.outputs[logits].dims if logits in g.outputs else ()
    if len(shape) not in (0, 3):
        raise ModelFormatError(f"{g.path.name}: output '{logits}' is declared "
                               f"{list(shape)}, not [batch, sequence, vocabulary]")
    vocab = shape[-1] if shape and isinstance(shape[-1], int) else None
    said = meta.get("vocab_size")
    if vocab is not None and isinstance(said, int) and said != vocab:
        raise ModelFormatError(f"{g.path.name}: output '{logits}' declares a vocabulary of "
                               f"{vocab}, genai_config.json's vocab_size is {said}")
    vocab = vocab if vocab is not None else said
    kv_heads = dims[1] if len(dims) == 4 and isinstance(dims[1], int) else \
        dec.get("num_key_value_heads")
    head = dims[3] if len(dims) == 4 and isinstance(dims[3], int) else dec.get("head_size")
    heads = dec.get("num_attention_heads", kv_heads)
    ctx = meta.get("context_length", 4096)
    for key, v in (("vocab_size", vocab), ("num_key_value_heads", kv_heads),
                   ("head_size", head), ("num_attention_heads", heads), ("context_length", ctx)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= 1 << 24:
            raise ModelFormatError(f"{g.path.name}: cannot tell the decoder's {key} from the "
                                   "graph or genai_config.json")
    if not kv:
        raise ModelFormatError(f"{g.path.name}: no past_key_values inputs: not a KV decoder")
    eos = meta.get("eos_token_id")
    eos = tuple(x for x in (eos if isinstance(eos, list) else [eos]) if isinstance(x, int))
    return ModelConfig(model_type=str(meta.get("type") or "onnx"), vocab_size=vocab,
                       hidden_size=dec.get("hidden_size", heads * head), num_layers=len(kv),
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head,
                       intermediate_size=0, rms_norm_eps=0.0, max_position_embeddings=ctx,
                       tie_word_embeddings=False, eos_token_ids=eos,
                       bos_token_id=meta.get("bos_token_id"))
