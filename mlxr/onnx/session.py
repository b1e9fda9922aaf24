"""`mlxr.onnx.InferenceSession`: the onnxruntime session API over mlxr's decoder.

Code written against onnxruntime feeds the decoder graph's own inputs (`input_ids` [B, S],
`attention_mask` [B, P+S], `past_key_values.i.key/value` [B, kv heads, P, head dim], and
`position_ids` where the graph has one) and gets the graph's outputs (`logits` [B, S, V],
`present.i.*` [B, kv heads, P+S, head dim]) in the graph's dtypes. mlxr computes every row
of a growing-cache step (mask all ones, positions P..P+S-1); feeds outside that (padding,
GenAI's shared max-length buffers) and graphs mlxr does not claim run on onnxruntime's CPU
provider (as do graphs with window-sized KV buffers), so the answer is always the graph's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from ..engine.kv_cache import new_cache
from ..errors import MlxrError, ModelFormatError
from .fallback import ort_run, ort_session
from .graph import type_name
from .load import build_translated, inspect

NP_OF = {1: np.float32, 10: np.float16, 6: np.int32, 7: np.int64}


class SessionInput:
    """What onnxruntime's NodeArg says about a graph input or output."""

    def __init__(self, name: str, dims: tuple, elem: int):
        self.name, self.shape = name, list(dims)
        self.type = f"tensor({np.dtype(NP_OF[elem]).name if elem in NP_OF else elem})"


class InferenceSession:
    """An ONNX decoder graph run by mlxr (`providers` is accepted and ignored: mlxr picks its
    device; dtype "float32" is the exact mode, the default)."""

    def __init__(self, path, providers: Sequence[str] | None = None, device: str = "cpu",
                 dtype: str = "float32"):
        from ..model import DTYPES

        self._ins = inspect(path)
        self._lock = threading.Lock()
        self._ort = None
        self._decoder = None
        g = self._ins.graph
        if self._ins.translation is not None:
            for k in self._ins.kv:
                for name in (self._ins.logits, k.present_key, k.present_value):
                    if g.outputs[name].elem not in (1, 10):
                        raise ModelFormatError(f"{g.path.name}: output '{name}' is "
                                               f"{type_name(g.outputs[name].elem)}, not "
                                               "float32/16")
            self._decoder = build_translated(self._ins, DTYPES[dtype], torch.device(device))
        # window-sized KV buffers (gpt-oss's sliding layers): past/present are not mlxr's
        # growing cache, so the graph's own feeds go to onnxruntime
        self._window_cache = any(
            n.op_type == "GroupQueryAttention" and any(
                a.name == "sliding_window_cache" and a.i for a in n.attribute) for n in g.nodes)
        self._inputs = [SessionInput(v.name, v.dims, v.elem) for v in g.inputs.values()]
        self._outputs = [SessionInput(v.name, v.dims, v.elem) for v in g.outputs.values()]

    @property
    def claimed(self) -> bool:
        """Whether mlxr's decoder runs this graph (else onnxruntime runs all of it)."""
        return self._decoder is not None

    def get_inputs(self) -> list[SessionInput]:
        return list(self._inputs)

    def get_outputs(self) -> list[SessionInput]:
        return list(self._outputs)

    def run(self, output_names: Sequence[str] | None, input_feed: dict,
            run_options=None) -> list[np.ndarray]:
        if not self._lock.acquire(blocking=False):
            raise MlxrError("mlxr.onnx.InferenceSession.run: this session is already running in "
                            "another thread; use one session per thread")
        try:
            g = self._ins.graph
            names = list(output_names) if output_names else list(g.outputs)
            unknown = [n for n in names if n not in g.outputs]
            if unknown:
                raise MlxrError(f"run: unknown output names {unknown}")
            feeds = self._check_feeds(input_feed)
            out = self._run_mlxr(feeds) if self._fits(feeds) else self._run_ort(names, feeds)
            return [out[n] for n in names]
        finally:
            self._lock.release()

    def _check_feeds(self, feed: dict) -> dict[str, np.ndarray]:
        g = self._ins.graph
        extra = sorted(set(feed) - set(g.inputs))
        missing = sorted(set(g.inputs) - set(feed))
        if extra or missing:
            raise MlxrError(f"run: feeds {extra} are not graph inputs; missing {missing}")
        out = {}
        for name, v in feed.items():
            a = np.asarray(v)
            info = g.inputs[name]
            want = NP_OF.get(info.elem)
            if want is not None and a.dtype != want:
                raise MlxrError(f"run: input '{name}' is {a.dtype}, the graph wants "
                                f"{np.dtype(want).name}")
            if len(info.dims) != a.ndim or any(isinstance(d, int) and d != s
                                               for d, s in zip(info.dims, a.shape)):
                raise MlxrError(f"run: input '{name}' has shape {list(a.shape)}, the graph "
                                f"wants {list(info.dims)}")
            out[name] = a
        return out

    def _fits(self, feeds: dict[str, np.ndarray]) -> bool:
        """Whether mlxr's decoder computes exactly what the graph would for these feeds."""
        if self._decoder is None or self._window_cache:
            return False
        ids, mask = feeds["input_ids"], feeds["attention_mask"]
        past = feeds[self._ins.kv[0].past_key]
        if ids.ndim != 2 or past.ndim != 4:
            return False
        b, s = ids.shape
        p = past.shape[2]
        c = self._decoder.config
        if mask.shape != (b, p + s) or not (mask == 1).all() \
                or past.shape != (b, c.num_kv_heads, p, c.head_dim) \
                or any(feeds[n].shape != past.shape for k in self._ins.kv
                       for n in (k.past_key, k.past_value)):
            return False
        pos = self._ins.translation.position_ids
        if pos is not None and (feeds[pos].shape not in ((b, s), (1, s))
                                or not (feeds[pos] == np.arange(p, p + s)).all()):
            return False
        return (p + s <= c.context_length and bool((ids >= 0).all())
                and bool((ids < c.vocab_size).all()))

    def _run_mlxr(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        dec, ins = self._decoder, self._ins
        ids = feeds["input_ids"]
        b, s = ids.shape
        p = feeds[ins.kv[0].past_key].shape[2]
        logits, present = [], {n: [] for k in ins.kv for n in (k.present_key, k.present_value)}
        with torch.inference_mode():
            for row in range(b):
                cache = new_cache(dec, p + s)
                for i, k in enumerate(ins.kv):
                    for src, pool in ((k.past_key, cache.pool.k), (k.past_value, cache.pool.v)):
                        pool[i][:, :p] = torch.from_numpy(feeds[src][row]).to(pool[i].dtype)
                cache.length = p
                logits.append(dec.forward(torch.from_numpy(ids[row]).long(), cache))
                for i, k in enumerate(ins.kv):
                    present[k.present_key].append(cache.pool.k[i][:, :p + s].float())
                    present[k.present_value].append(cache.pool.v[i][:, :p + s].float())
        g = ins.graph
        out = {ins.logits: torch.stack(logits).numpy().astype(NP_OF[g.outputs[ins.logits].elem])}
        for name, rows in present.items():
            out[name] = torch.stack(rows).numpy().astype(NP_OF[g.outputs[name].elem])
        return out

    def _run_ort(self, names: list[str], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._ort is None:
            self._ort = ort_session(self._ins.graph.path)
        return dict(zip(names, ort_run(self._ort, self._ins.graph.path, names, feeds)))
