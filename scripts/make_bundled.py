"""Regenerate mlxr's bundled default model directories from Karpathy's llama2.c stories260K.

    python scripts/make_bundled.py [ASSET_DIR]

ASSET_DIR holds stories260K.bin, tok512.bin and LLAMA2C-LICENSE (default: the repository's own
copy, tests/assets/models/stories260K). Writes:

  mlxr/bundled/stories260K/         fp32 HF llama directory (mlxr.convert.llama2c)
  mlxr/bundled/stories260K-<N>bit/  an MLX-quantized variant made with mlx-lm's own code
                                    (needs mlx and mlx-lm), the first recipe of QUANT_LADDER
                                    whose greedy output from BOS equals the fp32 model's for
                                    FAITHFUL_TOKENS tokens. If none is faithful, none is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxr.convert.llama2c import convert  # noqa: E402

BUNDLED = ROOT / "mlxr" / "bundled"
FP32_NAME = "stories260K"
TINYLLAMAS_REV = "0bd21da7698eaf29a0d7de3992de8a46ef624add"
SOURCES = {  # file -> sha256 (huggingface.co/karpathy/tinyllamas @ TINYLLAMAS_REV, stories260K/)
    "stories260K.bin": "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696",
    "tok512.bin": "037cb335abb25d1fa9e8ecae30ed2a3a8ace9302862ebcdc05d51a6bbb10c312",
}
LICENSE_SHA256 = "e87b912002f04cdfa837eaf7f70548ab79b9cb62a285495edf575f3da875aec4"
FAITHFUL_TOKENS = 256  # greedy tokens from BOS that must equal the fp32 model's

# The bundled models' chat_template.jinja: llama2.c ships none, and without one every chat API
# (mlxr run's chat, /v1/chat/completions, /v1/responses, /api/chat) refuses the only model that
# works offline. Shipping it with the model (rather than a server-side default for every
# template-less model) keeps it visible to every tool that reads the directory (transformers,
# mlx-lm) and leaves other base models' refusal explicit.
CHAT_TEMPLATE = """\
{#- The chat format of a story model (TinyStories, llama2.c): the model continues text and
    follows no instructions, so a chat is one story told in turns. The prompt is BOS, then the
    text of the user and assistant turns, trimmed and joined by single spaces: the model goes on
    with the story. A single user message therefore gives exactly the plain completion of its
    text. System and tool messages are left out (an instruction would only derail the story);
    there is nothing to add for the generation prompt. -#}
{{- bos_token -}}
{%- for m in messages if m.role in ('user', 'assistant') and m.content is string
    and m.content | trim -%}
{{- ' ' if not loop.first else '' }}{{ m.content | trim -}}
{%- endfor -%}
"""

# (bits, group_size, keep_embedding_fp32), most compressed first. At dim=64 the model is very
# sensitive: measured with mlx 0.32.4 / mlx-lm 0.32.2 (first greedy token that differs from fp32):
#   4-bit g64: 20, 4-bit g32: 27, 8-bit g64: 71, 8-bit g32: 61,
#   8-bit g64 + fp32 embedding: 71, 8-bit g32 + fp32 embedding: none in 256.
QUANT_LADDER = [
    (4, 64, False),
    (4, 32, False),
    (8, 64, False),
    (8, 32, False),
    (8, 64, True),
    (8, 32, True),
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_sources(src: Path) -> dict[str, str]:
    digests = {}
    for name, want in {**SOURCES, "LLAMA2C-LICENSE": LICENSE_SHA256}.items():
        got = sha256(src / name)
        if got != want:
            raise SystemExit(f"{src / name}: sha256 {got} != expected {want}")
        digests[name] = got
    return digests


def reset_dir(d: Path) -> None:
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)


def readme_fp32(digests: dict[str, str]) -> str:
    return f"""# stories260K (mlxr bundled default model)

Andrej Karpathy's TinyStories `stories260K` llama2.c model (~260K parameters: dim 64, hidden 172,
5 layers, 8 heads, 4 KV heads, 512-token SentencePiece BPE vocabulary, context 512), converted to an
ordinary Hugging Face llama directory (float32). MIT licence, see `LICENSE` (llama2.c).

## Provenance

Source: `huggingface.co/karpathy/tinyllamas`, revision `{TINYLLAMAS_REV}`, folder `stories260K/`:

| file | sha256 |
|---|---|
| `stories260K.bin` (llama2.c legacy version 0 checkpoint) | `{digests["stories260K.bin"]}` |
| `tok512.bin` (llama2.c tokenizer) | `{digests["tok512.bin"]}` |

## Conversion

    python -m mlxr.convert.llama2c stories260K.bin tok512.bin mlxr/bundled/stories260K

(or `python scripts/make_bundled.py`, which also writes this README and the quantized variant).
wq/wk rows are permuted from llama2.c's interleaved RoPE layout to HF's rotate-half layout (as
transformers' `convert_llama_weights_to_hf` does); the tokenizer is rebuilt as a `tokenizers` BPE
with byte fallback (merges derived from the piece scores). At temperature 0 from BOS, mlx-lm on
this directory reproduces the reference output of llama2.c's `run.c`:
"Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ..."

## Chat template

llama2.c has none; `chat_template.jinja` is mlxr's (written by `scripts/make_bundled.py`): a
story told in turns. The prompt is BOS and the user and assistant turns' text joined by spaces,
so a single user message gives exactly the plain completion of its text; system and tool
messages are left out (the model follows no instructions).
"""


def readme_quant(bits: int, group_size: int, keep_embed: bool, digests: dict[str, str]) -> str:
    embed = (
        "The token embedding (tied to the output head) is kept in float32 "
        "(quantizing it too breaks faithfulness); "
        if keep_embed
        else ""
    )
    return f"""# stories260K, MLX {bits}-bit (mlxr bundled test model)

`../{FP32_NAME}` (Karpathy's stories260K, MIT, see `LICENSE`; source
`huggingface.co/karpathy/tinyllamas` revision `{TINYLLAMAS_REV}`, `stories260K.bin` sha256
`{digests["stories260K.bin"]}`) quantized with mlx-lm's own code:

    mlx_lm.convert(hf_path="mlxr/bundled/{FP32_NAME}", quantize=True, q_bits={bits},
                   q_group_size={group_size}, q_mode="affine"{", quant_predicate=<not embed_tokens>" if keep_embed else ""})

(`python scripts/make_bundled.py`). Affine {bits}-bit, group size {group_size}. {embed}`mlp.down_proj`
(input dim 172, not divisible by {group_size}) stays float32 as mlx-lm skips it. tokenizer files
and the chat template are copied from `../{FP32_NAME}`.

Faithfulness: its greedy output from BOS equals the float32 model's for the first
{FAITHFUL_TOKENS} tokens (mlx 0.32.4, mlx-lm 0.32.2, CPU). Fully quantized 4-bit and 8-bit variants
were not faithful (they diverge after 20-71 tokens: the 64-wide model is very sensitive) and
are not shipped.
"""  # noqa: E501 (README template text, must stay byte-identical)


def greedy_ids(path: Path, n: int) -> list[int]:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm.load(str(path))
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    return [int(t) for t, _ in generate_step(mx.array([1]), model, max_tokens=n, sampler=sampler)]


def make_quantized(fp32_dir: Path, bits: int, group_size: int, keep_embed: bool, out: Path):
    import mlx_lm

    predicate = (lambda path, module: "embed_tokens" not in path) if keep_embed else None
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm.convert(
            str(fp32_dir),
            str(out),
            quantize=True,
            q_bits=bits,
            q_group_size=group_size,
            q_mode="affine",
            quant_predicate=predicate,
        )
    # mlx-lm re-saves the tokenizer through transformers, which may rewrite its pipeline;
    # ship exactly the converter's tokenizer files instead.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "chat_template.jinja"):
        shutil.copyfile(fp32_dir / name, out / name)
    (out / "README.md").unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else ROOT / "tests/assets/models/stories260K"
    digests = check_sources(src)

    fp32 = BUNDLED / FP32_NAME
    reset_dir(fp32)
    convert(src / "stories260K.bin", src / "tok512.bin", fp32)
    shutil.copyfile(src / "LLAMA2C-LICENSE", fp32 / "LICENSE")
    (fp32 / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    (fp32 / "README.md").write_text(readme_fp32(digests), encoding="utf-8")
    print(f"wrote {fp32.relative_to(ROOT)}")

    for old in BUNDLED.glob(f"{FP32_NAME}-*bit"):
        shutil.rmtree(old)
    ref = greedy_ids(fp32, FAITHFUL_TOKENS)
    for bits, gs, keep_embed in QUANT_LADDER:
        with tempfile.TemporaryDirectory() as tmp:
            cand = Path(tmp) / "q"
            make_quantized(fp32, bits, gs, keep_embed, cand)
            got = greedy_ids(cand, FAITHFUL_TOKENS)
            same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
            label = f"{bits}-bit g{gs}{' + fp32 embedding' if keep_embed else ''}"
            if same < FAITHFUL_TOKENS:
                print(f"{label}: not faithful (greedy differs from fp32 at token {same})")
                continue
            out = BUNDLED / f"{FP32_NAME}-{bits}bit"
            shutil.copytree(cand, out)
        shutil.copyfile(src / "LLAMA2C-LICENSE", out / "LICENSE")
        (out / "README.md").write_text(
            readme_quant(bits, gs, keep_embed, digests), encoding="utf-8"
        )
        print(f"{label}: faithful for {FAITHFUL_TOKENS} tokens; wrote {out.relative_to(ROOT)}")
        return 0
    print("no quantized variant is faithful; none written")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
