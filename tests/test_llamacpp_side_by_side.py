"""The pure-Python parts of the llama.cpp side by side (benchmarks/llamacpp): the HF configs
of the shapes against make_checkpoint's, the random HF checkpoint writer, the tokenizer copy,
argument parsing, the bench output parsers, the table and the source trimming. Nothing here
builds llama.cpp or runs a bench."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from llamacpp import build, cli, compare, hf_checkpoint, shapes  # noqa: E402

# Architectures the vendored converter registers for each shape (conversion/*.py)
ARCH = {"qwen3-0.6b": "Qwen3ForCausalLM", "llama-3.1-8b": "LlamaForCausalLM",
        "qwen3-30b-a3b": "Qwen3MoeForCausalLM", "gpt-oss-20b": "GptOssForCausalLM",
        "qwen3.5-0.8b": "Qwen3_5ForCausalLM", "qwen3.5-2b": "Qwen3_5ForCausalLM",
        "gemma-4-e2b": "Gemma4ForCausalLM"}
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
              "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
              "linear_num_value_heads", "linear_key_head_dim", "global_head_dim",
              "num_kv_shared_layers", "hidden_size_per_layer_input", "sliding_window",
              "rope_theta")


def effective(hf: dict, key: str):
    """The HF config's value of an MLX config key, where transformers 5 moved it: experts
    counts to num_local_experts, rope_theta into rope_parameters, Gemma 4's global_head_dim
    into per_layer_config (one head_dim per full-attention layer)."""
    if key == "num_experts":
        return hf.get("num_experts", hf.get("num_local_experts"))
    if key == "rope_theta":
        return hf.get("rope_theta", hf.get("rope_parameters", {}).get("rope_theta"))
    if key == "global_head_dim" and key not in hf:
        (dim,) = {c["head_dim"] for c in hf["per_layer_config"].values()}
        assert len(hf["per_layer_config"]) == hf["layer_types"].count("full_attention")
        return dim
    return hf[key]


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_hf_config_is_make_checkpoints_shape(name):
    assert set(ARCH) == set(shapes.SHAPES)
    hf = shapes.hf_config(name, None)
    mlx = shapes.mlx_config(name, None)
    text = mlx.get("text_config", mlx)
    assert hf["architectures"] == [ARCH[name]]
    assert hf["tie_word_embeddings"] == mlx.get("tie_word_embeddings", False)
    compared = [k for k in SHAPE_KEYS if k in text]
    assert {"hidden_size", "num_hidden_layers", "vocab_size"} <= set(compared)
    assert {k: effective(hf, k) for k in compared} == {k: text[k] for k in compared}
    json.dumps(hf)  # config.json as written


@pytest.mark.parametrize("name,layers", [("qwen3-0.6b", 3), ("qwen3-30b-a3b", 2),
                                         ("gpt-oss-20b", 2), ("qwen3.5-2b", 4),
                                         ("gemma-4-e2b", 10), ("gemma-4-e2b", 5)])
def test_cut_shapes_agree_and_load_in_transformers(name, layers):
    hf = shapes.hf_config(name, layers)
    mlx = shapes.mlx_config(name, layers)
    text = mlx.get("text_config", mlx)
    assert hf["num_hidden_layers"] == text["num_hidden_layers"] == layers
    if name == "gemma-4-e2b":
        # a full-attention layer stays unshared: transformers refuses the config otherwise
        assert hf["num_kv_shared_layers"] == text["num_kv_shared_layers"] == {10: 5, 5: 0}[layers]
        assert hf["layer_types"][3:5] == ["sliding_attention", "full_attention"]
    if "layer_types" in hf:
        assert len(hf["layer_types"]) == layers
    state = hf_checkpoint.meta_state(hf)  # transformers builds it (meta device: no memory)
    assert sum(k.startswith("model.layers.") and k.endswith(".input_layernorm.weight")
               for k in state) == layers


def tiny(model_type: str, **kw) -> dict:
    return dict(model_type=model_type, hidden_size=64, num_hidden_layers=2,
                intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                vocab_size=128, **kw)


def test_random_tensors_gpt_oss_experts_as_mxfp4():
    cfg = tiny("gpt_oss", num_local_experts=4, num_experts_per_tok=2,
               quantization_config={"quant_method": "mxfp4"})
    t = dict(hf_checkpoint.random_tensors(cfg))
    p = "model.layers.0.mlp.experts."
    # [E, out, in/32, 16] codes and [E, out, in/32] E8M0 scales: gate_up 64 -> 192, down 96 -> 64
    assert t[p + "gate_up_proj_blocks"].shape == (4, 192, 2, 16)
    assert t[p + "gate_up_proj_scales"].shape == (4, 192, 2)
    assert t[p + "down_proj_blocks"].shape == (4, 64, 3, 16)
    assert t[p + "down_proj_blocks"].dtype == torch.uint8
    assert (t[p + "down_proj_scales"] == hf_checkpoint.MXFP4_SCALE).all()
    assert p + "gate_up_proj" not in t and p + "gate_up_proj_bias" in t
    assert t["model.layers.0.self_attn.sinks"].abs().sum() == 0


def test_random_tensors_values_and_tied_head():
    t = dict(hf_checkpoint.random_tensors(tiny("qwen3", tie_word_embeddings=True)))
    assert "lm_head.weight" not in t
    w = t["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == torch.bfloat16 and w.shape == (96, 64)
    assert 0.015 < w.float().std() < 0.025  # N(0, 0.02), 6,144 draws
    assert (t["model.layers.1.self_attn.q_norm.weight"] == 1).all()
    untied = dict(hf_checkpoint.random_tensors(tiny("qwen3", tie_word_embeddings=False)))
    assert untied["lm_head.weight"].shape == (128, 64)


def test_write_hf_shards_and_index(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_checkpoint, "SHARD_BYTES", 40_000)  # several shards
    cfg = tiny("llama", tie_word_embeddings=False)
    out = hf_checkpoint.write_hf(cfg, tmp_path / "hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    assert set(index) == set(hf_checkpoint.meta_state(cfg))
    for name, fname in index.items():
        with safe_open(out / fname, "pt") as f:
            assert name in f.keys()
    assert json.loads((out / "config.json").read_text()) == cfg


def test_copy_tokenizer_unpacks_and_pads(assets, tmp_path):
    src = assets / "tokenizers" / "phi-3-mini-4k"
    names = hf_checkpoint.copy_tokenizer(src, tmp_path, vocab_size=32_100)
    assert "tokenizer.json" in names and not any(n.endswith(".gz") for n in names)
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    ids = sorted(tok["model"]["vocab"].values())
    assert ids == list(range(32_100))
    assert tok["model"]["vocab"]["<|user|>"] == 32_010  # added tokens: vocabulary entries
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 32_100  # nothing appended past it
    plain = tmp_path / "plain"
    plain.mkdir()
    names = hf_checkpoint.copy_tokenizer(assets / "tokenizers" / "qwen3-0.6b-base", plain)
    assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= set(names)
    assert "config.json" not in names


def test_parse_jobs_and_threads():
    jobs = cli.parse_jobs("qwen3-0.6b, qwen3-30b-a3b:16,llama-3.1-8b", None)
    assert [(j.name, j.layers, j.key) for j in jobs] == [
        ("qwen3-0.6b", None, "qwen3-0.6b"), ("qwen3-30b-a3b", 16, "qwen3-30b-a3b-16l"),
        ("llama-3.1-8b", None, "llama-3.1-8b")]
    assert [j.layers for j in cli.parse_jobs("qwen3-0.6b,gemma-4-e2b:35", 4)] == [4, None]
    assert jobs[1].gguf(Path("w")) == Path("w/models/qwen3-30b-a3b-16l-q4_0.gguf")
    assert cli.parse_jobs("gpt-oss-20b", None)[0].gguf(Path("w")).name == \
        "gpt-oss-20b-mxfp4_moe.gguf"
    with pytest.raises(SystemExit, match="unknown shape"):
        cli.parse_jobs("qwen3-7b", None)
    with pytest.raises(SystemExit, match="1..48"):
        cli.parse_jobs("qwen3-30b-a3b:49", None)
    assert cli.parse_threads("2,1") == [2, 1]
    with pytest.raises(SystemExit):
        cli.parse_threads("0")
    a = cli.parser("cpu").parse_args(["--work", "w"])
    assert (a.step, a.threads, a.shapes, a.prompt, a.gen) == ("all", "2,1", "qwen3-0.6b", 512, 128)
    g = cli.parser("cuda").parse_args(["run", "--work", "w"])
    assert g.step == "run" and "gpt-oss-20b" in g.shapes and g.threads == ""


def test_bench_commands():
    cpu = compare.llama_bench_cmd(Path("b"), Path("m.gguf"), "cpu", 2, 3, 512, 128)
    assert cpu[:5] == ["b/llama-bench", "-m", "m.gguf", "-p", "512"]
    assert cpu[-4:] == ["-ngl", "0", "-t", "2"] and "-r" in cpu and "jsonl" in cpu
    gpu = compare.llama_bench_cmd(Path("b"), Path("m.gguf"), "cuda", None, 3, 512, 128)
    assert gpu[-4:] == ["-ngl", "99", "-fa", "1"] and "-t" not in gpu
    m = compare.mlxr_bench_cmd(Path("mlx"), "cpu", 1, 3, 512, 128)
    assert m[1:5] == ["-m", "mlxr", "bench", "mlx"] and m[-2:] == ["--threads", "1"]
    assert "--threads" not in compare.mlxr_bench_cmd(Path("mlx"), "cuda", None, 3, 512, 128)
    assert "--device" in m and m[m.index("--device") + 1] == "cpu"


def test_parse_bench_outputs():
    lb = "\n".join(json.dumps(d) for d in (
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 238.8}, {"n_prompt": 0, "n_gen": 128,
                                                          "avg_ts": 64.6}))
    assert compare.parse_llama_bench("build: x\n" + lb) == (238.8, 64.6)
    with pytest.raises(ValueError, match="no prompt and generation"):
        compare.parse_llama_bench(lb.splitlines()[0])
    out = 'loading\n  prefill ...\n{"prefill_tok_s": 258.4, "decode_tok_s": 27.0}\n'
    assert compare.parse_mlxr_bench(out) == (258.4, 27.0)
    with pytest.raises(ValueError, match="no JSON"):
        compare.parse_mlxr_bench("Traceback ...")


def test_format_table():
    R = compare.Run
    runs = [R("q06", "llama.cpp", 2, 1, 238.8, 64.6, 0.5), R("q06", "mlxr", 2, 1, 258.4, 27.0, 0.7),
            R("q06", "llama.cpp", 2, 2, 237.0, 68.1, 1.1), R("q06", "mlxr", 2, 2, 262.3, 27.6, 1.3),
            R("q06", "llama.cpp", 1, 1, 120.0, 40.0, 0.4),
            R("q06", "mlxr", 1, 1, 12_345.6, 20.0, 0.4)]
    lines = compare.format_table(runs, 512, 128).splitlines()
    assert len(lines) == 2 + 4
    assert lines[2] == ("| q06 | 2 | prefill 512 | 238.8 / 237.0 | 258.4 / 262.3 | 1.09x "
                        "| 0.5 / 1.1; 0.7 / 1.3 |")
    assert lines[3].startswith("| q06 | 2 | decode 128 | 64.6 / 68.1 | 27.0 / 27.6 | 0.41x |")
    assert lines[4].startswith("| q06 | 1 | prefill 512 | 120.0 | 12,346 | 102.88x |")


def fake_tree(root: Path) -> Path:
    for rel in ("CMakeLists.txt", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py",
                "docs/build.md", "tools/ui/index.html", "tools/llama-bench/llama-bench.cpp",
                "ggml/src/ggml-metal/m.m", "ggml/src/ggml-cpu/c.c", "ggml/src/ggml-cuda/k.cu",
                "models/ggml-vocab.gguf"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    return root


def test_make_src_trims_and_extracts(tmp_path):
    tree = fake_tree(tmp_path / "src" / "llama.cpp")
    out = build.make_src(tmp_path / "carry" / "src.tar.xz", tmp_path / "w", tree)
    with tarfile.open(out) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
    assert names == {"llama.cpp/CMakeLists.txt", "llama.cpp/convert_hf_to_gguf.py",
                     "llama.cpp/gguf-py/gguf/__init__.py",
                     "llama.cpp/tools/llama-bench/llama-bench.cpp",
                     "llama.cpp/ggml/src/ggml-cpu/c.c", "llama.cpp/ggml/src/ggml-cuda/k.cu"}
    got = build.source_tree(tmp_path / "w2", out)
    assert got == tmp_path / "w2" / "llama.cpp" and (got / "ggml/src/ggml-cuda/k.cu").is_file()


def test_extract_tree_from_sdist_layout(tmp_path):
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("llama_cpp_python-0.3.36/CMakeLists.txt",
                     "llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt",
                     "llama_cpp_python-0.3.36/vendor/llama.cpp/src/llama.cpp",
                     "llama_cpp_python-0.3.36/vendor/llama.cpp/tests/CMakeLists.txt"):
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tree = build.extract_tree(sdist, tmp_path / "w")
    assert (tree / "src" / "llama.cpp").read_text().endswith("vendor/llama.cpp/src/llama.cpp")
    assert not (tmp_path / "w" / "llama_cpp_python-0.3.36").exists()
    with pytest.raises(SystemExit, match="no llama.cpp/CMakeLists.txt"):
        build.tree_root(["pkg/setup.py"])


def test_cmake_args():
    cpu, gpu = build.cmake_args("cpu"), build.cmake_args("cuda")
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF"):
        assert flag in cpu and flag in gpu
    assert "-DGGML_CUDA=OFF" in cpu and "-DGGML_CUDA=ON" in gpu
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in gpu


def test_cmake_args_without_amx(monkeypatch):
    """--no-amx: a non-native CPU build naming this CPU's ISA options, AMX never on."""
    monkeypatch.setenv("MLXR_LLAMACPP_NO_AMX", "1")
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx", "avx2", "avx512f", "amx_tile"})
    cpu = build.cmake_args("cpu")
    assert "-DGGML_NATIVE=ON" not in cpu and "-DGGML_NATIVE=OFF" in cpu
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=OFF"} <= set(cpu)
    assert not any("AMX" in a and a.endswith("=ON") for a in cpu)
    assert "-DGGML_NATIVE=ON" in build.cmake_args("cuda")
    monkeypatch.delenv("MLXR_LLAMACPP_NO_AMX")
    assert "-DGGML_NATIVE=ON" in build.cmake_args("cpu")
