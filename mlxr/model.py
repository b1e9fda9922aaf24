"""The public model object: `mlxr.load(path)` returns a Model that scripts and the CLI drive."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from .harness import trace
from .checkpoint import open_checkpoint
from .config import ModelConfig, load_config
from .errors import MlxrError, ModelFormatError
from .engine.kv_cache import new_cache
from .generate import Chunk, check_prompt, stream_generate
from .models.hybrid_loader import build_hybrid
from .models.loader import build_decoder, check_checkpoint
from .names import resolve_model
from .onnx.folder import is_onnx_model
from .text.sampling import SamplingParams
from .text.tokenizer_checks import check_token_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _pick_device(device: str | torch.device | None) -> torch.device:
    """None -> CUDA when available, else the CPU; a CUDA device without a usable GPU (a CPU-only
    torch build, or no driver/GPU) is refused in one line instead of failing inside torch."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise MlxrError(f"device {device!r}: not a device (use 'cpu' or 'cuda')") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "no CUDA GPU or driver is visible")
        raise MlxrError(f"device {str(device)!r}: CUDA is not available ({why}, torch "
                        f"{torch.__version__}): use the CPU (--device cpu)")
    return dev


class Model:
    """A loaded model: config, tokenizer, teacher-forced logits and streaming generation.
    (`decoder` is None when loaded with weights=False: config and tokenizer only.)"""

    def __init__(self, path: Path, config: ModelConfig, generation_config: dict, decoder,
                 dtype: torch.dtype, device: torch.device):
        self.path, self.config, self.generation_config = path, config, generation_config
        self.decoder, self.dtype, self.device = decoder, dtype, device
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The model directory's tokenizer (loaded on first use, ids checked against the
        embedding table)."""
        if self._tokenizer is None:
            from .text.tokenizer import load_tokenizer

            tok = load_tokenizer(self.path)
            check_token_ids(tok, self.config.vocab_size, self.path.name)
            self._tokenizer = tok
        return self._tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from config.json, generation_config.json and the tokenizer."""
        ids = list(self.config.eos_token_ids)
        try:
            ids += [i for i in sorted(self.tokenizer.eos_token_ids) if i not in ids]
        except (OSError, ValueError):
            pass
        return tuple(ids)

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits of every position: float32 [T, vocab] on the CPU."""
        ids = [int(i) for i in token_ids]
        check_prompt(ids, self.config.vocab_size, self.config.context_length + 1)
        decoder = self._decoder()
        cache = new_cache(decoder, len(ids))
        with torch.inference_mode():
            return decoder.forward(torch.tensor(ids), cache).float().cpu()

    def _decoder(self):
        if self.decoder is None:
            raise MlxrError(f"{self.path.name} was loaded with weights=False: it cannot compute")
        return self.decoder

    def close(self) -> None:
        """Release what the model holds beyond memory: a tensor-parallel model's worker
        processes (a no-op otherwise)."""
        close = getattr(self.decoder, "close", None)
        if close is not None:
            close()

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(i) for i in prompt]

    def sampling_params(self, params: SamplingParams | None = None, **kw) -> SamplingParams:
        """SamplingParams from keyword overrides, with generation_config.json defaults."""
        params = params or SamplingParams(**kw)
        return params.with_defaults(self.generation_config)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               **kw) -> Iterator[Chunk]:
        """Stream Chunks (token ids, text piece, finish reason, stats) for a text or id prompt.

        Keyword arguments are SamplingParams fields (max_tokens, temperature, top_p, stop, seed…).
        """
        ids = self.encode_prompt(prompt)
        params = self.sampling_params(params, **kw)
        try:
            detok = self.tokenizer.detokenizer(skip_special_tokens=True)
        except (OSError, ValueError):
            if isinstance(prompt, str):
                raise
            detok = None  # id prompts work without tokenizer files; text is then empty
        eos = self.eos_token_ids if detok is not None else self.config.eos_token_ids
        return stream_generate(self._decoder(), ids, params, eos, detok)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 **kw) -> Iterator[int]:
        """Yield generated token ids as they come (greedy by default: temperature=0).

        `prompt` is text (encoded with the model's tokenizer, BOS added as it specifies) or ids.
        """
        kw.setdefault("temperature", 0.0)
        for chunk in self.stream(prompt, params, **kw):
            yield from chunk.token_ids


def load(path: str | Path, device: str | torch.device | None = None,
         dtype: str | torch.dtype | None = None, weights: bool = True,
         tensor_parallel: int = 1) -> Model:
    """Load a model: a directory, or a name as the CLI takes it (a bundled model such as
    "stories260K", an alias such as "qwen3", or a pulled Hub name ORG/REPO; see mlxr.names).

    device: "cpu", "cuda" or None (CUDA when available). dtype: "float32" computes everything in
    float32 with the quantized codes untouched (the exact mode tests use); the default is
    bfloat16, the fast dtype on both CPU and GPU. weights=False reads config.json and
    generation_config.json only (the tokenizer loads on first use): no decoder is built and the
    safetensors are not opened -- what a server process needs whose engine runs elsewhere.
    tensor_parallel=N > 1 splits the model over N processes that this one starts (one GPU
    each on CUDA, N CPU processes on the CPU; see mlxr.parallel): `Model.close()` (or the
    interpreter's exit) stops them.
    """
    path = resolve_model(path)
    onnx = is_onnx_model(path)
    dev = _pick_device(device)
    if dtype is None:
        dt = torch.bfloat16
    elif isinstance(dtype, torch.dtype):
        dt = dtype
    elif dtype in DTYPES:
        dt = DTYPES[dtype]
    else:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if tensor_parallel != 1:
        from .parallel import check_world

        check_world(tensor_parallel, dev)
        if onnx:
            raise MlxrError(f"{path.name}: tensor parallelism does not cover ONNX decoders")
    if onnx:  # an ONNX decoder folder or file (needs the `onnx` extra)
        from .onnx.load import load_onnx

        return Model(*load_onnx(path, dev, dt, weights))
    config, gen = load_config(path)
    _check_generation_config(gen, config.vocab_size)
    if not weights:
        return _with_tokenizer(Model(path, config, gen, None, dt, dev))
    if tensor_parallel != 1:
        from .parallel import load_decoder

        decoder = load_decoder(path, config, dt, dev, tensor_parallel)
    else:
        build = build_decoder if config.arch is None else build_hybrid
        with open_checkpoint(path) as ckpt:
            decoder = build(ckpt, config, dt, dev)
    trace.instrument(decoder)  # prefill/decode spans when MLXR_TRACE is set; else a no-op
    return _with_tokenizer(Model(path, config, gen, decoder, dt, dev))


def _check_generation_config(gen: dict, vocab_size: int) -> None:
    """The sampling defaults of generation_config.json must be values the sampler computes
    with: checked at load, not at the first request that uses them."""
    try:
        SamplingParams().with_defaults(gen).validate(vocab_size)
    except MlxrError as e:
        msg = str(e)
        raise ModelFormatError(msg if msg.startswith("generation_config.json") else
                               f"generation_config.json: {msg}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _with_tokenizer(model: Model) -> Model:
    """Load the folder's tokenizer now when it has one, so that a bad tokenizer file (or a
    token id past the embedding table) fails the load, not the first request. A folder with
    no tokenizer files still loads: id prompts work without one."""
    if any((model.path / f).is_file() for f in TOKENIZER_FILES):
        model.tokenizer  # noqa: B018 -- load and check it
    return model


def validate(path: str | Path) -> ModelConfig:
    """Check a model directory (config, every safetensors header, every tensor's name, shape and
    dtype against the config) without reading weight data. Returns the parsed config. `path` is
    a directory or a model name, as for `load`."""
    path = resolve_model(path)
    config, _ = load_config(path)
    with open_checkpoint(path) as ckpt:
        if config.arch is None:
            check_checkpoint(ckpt, config)
        else:
            build_hybrid(ckpt, config, torch.float32, torch.device("cpu"), dry_run=True)
    return config
