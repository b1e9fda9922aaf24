"""Embeddings of a decoder embedding model against transformers: a tiny random Qwen3-shaped
checkpoint built here (tied embeddings, a byte-level BPE tokenizer whose post-processor appends
the end-of-text token as Qwen3-Embedding's does, sentence-transformers' last-token pooling
config), pooled and L2-normalised by `model.embed` and by transformers' Qwen3Model with the
pooling Qwen3-Embedding's model card gives. Then the server: /v1/embeddings and /api/embed, a
400 for a model that is not an embedding model."""

import base64
import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from test_server_helpers import Server

import mlxr
from mlxr.embed import is_embedding_model, with_instruction

TEXTS = ["a tiny decoder says hello", "the quick brown fox", "1 2 3 4 5 6 7 8 9 10 hello fox",
         "hello"]


def tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["a tiny decoder says hello to the quick brown fox", "1 2 3 4 5 6 7 8 9 10",
            "Instruct: find\nQuery:"] * 30
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>",
        special_tokens=[("<|endoftext|>", eot)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            pad_token="<pad>").save_pretrained(out)


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory) -> Path:
    import transformers as T

    out = tmp_path_factory.mktemp("models") / "tiny-qwen3-embedding"
    cfg = T.Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = T.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # default init is tiny (std 0.02): widen it so states spread
        for p in model.parameters():
            p.mul_(2.5) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    tokenizer(out)
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}))
    return out


def reference(path: Path, texts: list[str]) -> torch.Tensor:
    """transformers, as Qwen3-Embedding's card does it: left padding, last token, L2 norm."""
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(path, padding_side="left")
    model = T.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    return torch.nn.functional.normalize(h[:, -1], dim=-1)


def test_matches_transformers_and_batch_equals_single(embed_dir):
    assert is_embedding_model(embed_dir)
    model = mlxr.load(embed_dir, device="cpu", dtype="float32")
    ids = model.tokenizer.encode("hello")
    assert ids[-1] == model.tokenizer.encode("<|endoftext|>", add_special_tokens=False)[0]
    ours = model.embed(TEXTS)
    ref = reference(embed_dir, TEXTS)
    assert ours.shape == (len(TEXTS), 64) and ours.dtype == torch.float32
    cos = (ours * ref).sum(-1)
    assert cos.min() >= 0.9999, cos
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    single = torch.cat([model.embed(t) for t in TEXTS])
    assert torch.allclose(single, ours, atol=1e-5)  # batch == one text at a time
    # the instruction goes in front of the query as Qwen3-Embedding documents
    q = model.embed("fox", instruction="find")
    ref_q = reference(embed_dir, [with_instruction("fox", "find")])
    assert (q * ref_q).sum() >= 0.9999


def test_passes_bounded_by_their_scratch(embed_dir, monkeypatch):
    """The batch is split where a pass's scratch K/V would pass MAX_SCRATCH_BYTES (2 layers x
    K and V x 2 heads x 16 x 4 bytes = 512 per token here), with the same embeddings; a text
    longer than the bound runs alone."""
    import mlxr.embed as emb

    model = mlxr.load(embed_dir, device="cpu", dtype="float32")
    seqs = [[5 + i] * n for i, n in enumerate((4, 5, 9, 3, 12))]
    whole = emb.embed_ids(model, seqs)
    passes = []
    inner = emb._forward
    monkeypatch.setattr(emb, "_forward", lambda d, b: passes.append(sum(map(len, b)))
                        or inner(d, b))
    monkeypatch.setattr(emb, "MAX_SCRATCH_BYTES", 10 * 512 + 511)  # 10 tokens a pass
    assert emb.tokens_per_pass(model.decoder) == 10
    split = emb.embed_ids(model, seqs)
    assert passes == [4 + 5, 9, 3, 12]  # 9 + 3 would pass 10; 12 alone
    assert (split - whole).abs().max() <= 1e-5


def test_not_an_embedding_model():
    from test_server_helpers import BUNDLED

    assert not is_embedding_model(BUNDLED)


@pytest.fixture(scope="module")
def server(embed_dir, tmp_path_factory):
    from test_model_manager import cache_model, hub_env

    env = hub_env(tmp_path_factory.mktemp("hf"))
    cache_model(env, "mlxr-test/tiny-qwen3-embedding", embed_dir)
    s = Server(None, "--keep-alive", "30s", env=env)
    yield s
    s.stop()


def test_server_routes(server, embed_dir):
    name = "mlxr-test/tiny-qwen3-embedding"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.embeddings.create(model=name, input=TEXTS)
    got = torch.tensor([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    assert (got * reference(embed_dir, TEXTS)).sum(-1).min() >= 0.9999
    tok = mlxr.load(embed_dir, device="cpu", weights=False).tokenizer
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    b64 = client.embeddings.create(model=name, input=TEXTS[3], encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4")
    assert vec.shape == (64,) and np.allclose(vec, got[3].numpy(), atol=1e-6)
    r = client.embeddings.create(model=name, input=TEXTS[:1], dimensions=16)
    short = torch.tensor(r.data[0].embedding)
    assert short.shape == (16,) and torch.allclose(
        short, torch.nn.functional.normalize(got[0, :16], dim=0), atol=1e-5)
    r = httpx.post(server.url + "/api/embed", json={"model": name, "input": TEXTS[:2]})
    assert r.status_code == 200, r.text
    assert len(r.json()["embeddings"]) == 2 and r.json()["model"] == name
    assert torch.allclose(torch.tensor(r.json()["embeddings"]), got[:2], atol=1e-5)
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "stories260K", "input": "x"})
    assert r.status_code == 400 and "not an embedding model" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/embeddings", json={"model": name, "input": []})
    assert r.status_code == 400


def test_throughput_cpu(embed_dir, capsys):
    """Reported, not asserted: texts per second of the tiny model on this CPU."""
    model = mlxr.load(embed_dir, device="cpu", dtype="float32")
    texts = [f"the quick brown fox {i} says hello" for i in range(64)]
    model.embed(texts[:4])
    t0 = time.perf_counter()
    model.embed(texts)
    dt = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nembeddings (tiny model, CPU): {len(texts) / dt:.0f} texts/s")
