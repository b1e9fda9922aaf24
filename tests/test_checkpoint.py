"""mlxr.checkpoint: bit-exact round trips against MLX / safetensors writers, and hostile files."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import save_file as torch_save_file

from mlxr.checkpoint import Checkpoint, TensorInfo, open_checkpoint, read_header
from mlxr.errors import ModelFormatError

# ---------------------------------------------------------------------------- helpers


def _bits(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a CPU tensor, for bit-for-bit comparison."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _mx_bits(a: mx.array) -> bytes:
    return np.array(mx.view(a.reshape(-1), mx.uint8)).tobytes()


def _raw_file(path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    """Write a safetensors file by hand: u64 LE header length, JSON header (or raw bytes), data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def _expect_error(fn, *parts: str) -> str:
    """Call fn, require a ModelFormatError quickly, whose message contains every part."""
    start = time.monotonic()
    with pytest.raises(ModelFormatError) as info:
        fn()
    assert time.monotonic() - start < 2.0
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


def _single(name: str, dtype: object, shape: object, offsets: list) -> dict:
    return {name: {"dtype": dtype, "shape": shape, "data_offsets": offsets}}


# ---------------------------------------------------------------------------- round trips


def test_mlx_roundtrip_bit_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ref = {
        # odd sizes so data offsets end up misaligned, even to the element size
        "a.u8": mx.array(rng.integers(0, 256, (3, 7)), dtype=mx.uint8),
        "b.bf16": mx.array(rng.standard_normal((5, 3)), dtype=mx.bfloat16),
        "c.u32": mx.array(rng.integers(0, 2**32, (4, 3), dtype=np.uint64), dtype=mx.uint32),
        "d.f16": mx.array(rng.standard_normal((11,)), dtype=mx.float16),
        "e.f32": mx.array(rng.standard_normal((2, 3, 5)), dtype=mx.float32),
        "f.scalar": mx.array(2.5, dtype=mx.bfloat16),
        "g.empty": mx.zeros((0, 4), dtype=mx.float32),
        "h.i8": mx.array(rng.integers(-128, 128, (9,)), dtype=mx.int8),
        "i.i32": mx.array(rng.integers(-(2**31), 2**31, (3,)), dtype=mx.int32),
    }
    ref["c.u32"][0, 0] = 0xFFFFFFFF  # top bit set: must survive the int32 view
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(str(path), ref, metadata={"format": "mlx"})

    tensors, metadata = read_header(path)
    assert metadata == {"format": "mlx"}
    assert set(tensors) == set(ref)
    assert any(t.offset % 2 for t in tensors.values() if t.nbytes)  # really misaligned
    assert tensors["f.scalar"].shape == () and tensors["g.empty"].nbytes == 0

    expected_dtype = {"a.u8": torch.uint8, "b.bf16": torch.bfloat16, "c.u32": torch.int32,
                      "f.scalar": torch.bfloat16, "h.i8": torch.int8, "i.i32": torch.int32}
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.metadata == {"format": "mlx"} and ckpt.files == [path]
        for name, a in ref.items():
            t = ckpt.load(name)
            assert tuple(t.shape) == tuple(a.shape), name
            assert t.dtype == expected_dtype.get(name, t.dtype), name
            assert _bits(t) == _mx_bits(a), name
            assert t.data_ptr() % 16 == 0  # own aligned memory, despite the file offset
        assert ckpt.load("c.u32")[0, 0].item() == -1
        assert ckpt.load("f.scalar").item() == 2.5


def test_mlx_null_metadata(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(str(path), {"w": mx.arange(5, dtype=mx.float32)})
    assert b'"__metadata__":null' in path.read_bytes()
    tensors, metadata = read_header(path)
    assert metadata == {}
    assert tensors["w"] == TensorInfo("w", "F32", (5,), path, tensors["w"].offset, 20)
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.load("w").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_safetensors_torch_roundtrip(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    ref = {
        "bool": torch.rand(7, generator=g) > 0.5,
        "i16": torch.randint(-(2**15), 2**15, (3, 3), generator=g, dtype=torch.int16),
        "i64": torch.randint(-(2**62), 2**62, (5,), generator=g, dtype=torch.int64),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "bf16": torch.randn(2, 9, generator=g).bfloat16(),
        "f16": torch.randn(1, 1, 3, generator=g).half(),
        "empty": torch.zeros(2, 0, dtype=torch.int8),
    }
    torch_save_file(ref, str(tmp_path / "model.safetensors"), metadata={"k": "v"})
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.metadata == {"k": "v"}
        for name, t in ref.items():
            got = ckpt.load(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert _bits(got) == _bits(t), name


def test_safetensors_numpy_roundtrip(tmp_path: Path) -> None:
    ref = {"u32": np.array([[0, 1, 2**31, 2**32 - 1]], dtype=np.uint32),
           "f32": np.linspace(-1, 1, 13, dtype=np.float32)}
    path = tmp_path / "model-00001-of-00001.safetensors"
    np_save_file(ref, str(path))
    with open_checkpoint(tmp_path) as ckpt:
        u32 = ckpt.load("u32")
        assert u32.dtype == torch.int32
        assert np.array_equal(u32.numpy().view(np.uint32), ref["u32"])
        assert np.array_equal(ckpt.load("f32").numpy(), ref["f32"])


def test_sharded_with_index(tmp_path: Path) -> None:
    a = {"model.embed.weight": mx.arange(6, dtype=mx.bfloat16).reshape(2, 3),
         "model.layers.0.w": mx.array([7], dtype=mx.uint32)}
    b = {"lm_head.weight": mx.ones((3,), dtype=mx.float16)}
    mx.save_safetensors(str(tmp_path / "model-00001-of-00002.safetensors"), a, {"format": "mlx"})
    mx.save_safetensors(str(tmp_path / "model-00002-of-00002.safetensors"), b, {"format": "mlx"})
    wm = {k: "model-00001-of-00002.safetensors" for k in a}
    wm |= {k: "model-00002-of-00002.safetensors" for k in b}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    (tmp_path / "config.json").write_text("{}")

    ckpt = open_checkpoint(tmp_path)
    with ckpt:
        assert [p.name for p in ckpt.files] == sorted(set(wm.values()))
        assert set(ckpt.tensors) == set(wm) and "lm_head.weight" in ckpt and "nope" not in ckpt
        for name, file in wm.items():
            assert ckpt.tensors[name].file.name == file
        assert ckpt.load("model.embed.weight").float().tolist() == [[0, 1, 2], [3, 4, 5]]
        assert ckpt.load("lm_head.weight").tolist() == [1.0, 1.0, 1.0]
        _expect_error(lambda: ckpt.load("nope"), "nope")
    with pytest.raises(ValueError, match="closed"):
        ckpt.load("lm_head.weight")


# ---------------------------------------------------------------------------- hostile single files


def _good(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(str(path), {"w": mx.arange(64, dtype=mx.float32)}, {"format": "mlx"})
    return path


def test_truncated_in_data_section(tmp_path: Path) -> None:
    path = _good(tmp_path)
    path.write_bytes(path.read_bytes()[:-10])
    _expect_error(lambda: read_header(path), path.name, "'w'", "truncated")


def test_shorter_than_8_bytes(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    _expect_error(lambda: read_header(path), path.name, "too short")


@pytest.mark.parametrize("n", [10_000, 2**63, 2**64 - 1])
def test_header_length_too_large(tmp_path: Path, n: int) -> None:
    path = _raw_file(tmp_path / "model.safetensors", {}, header_len=n)
    _expect_error(lambda: read_header(path), path.name, str(n))


@pytest.mark.parametrize(
    "raw", [b"{not json", b"\xff\xfe{}", b'{"a": [' + b"9" * 5000 + b"]}", b"[" * 100_000]
)
def test_invalid_json(tmp_path: Path, raw: bytes) -> None:
    path = _raw_file(tmp_path / "model.safetensors", raw)
    _expect_error(lambda: read_header(path), path.name, "JSON")


@pytest.mark.parametrize("header", [[], "x", 3, None])
def test_header_not_object(tmp_path: Path, header: object) -> None:
    path = _raw_file(tmp_path / "model.safetensors", header)
    _expect_error(lambda: read_header(path), path.name, "not a JSON object")


@pytest.mark.parametrize(
    ("entry", "data", "words"),
    [
        (_single("t", "F32", [4], [0, 16]), b"\0" * 8, ["outside"]),  # beyond the data
        (_single("t", "F32", [1], [-4, 0]), b"\0" * 8, ["outside"]),  # negative begin
        (_single("t", "F32", [0], [8, 4]), b"\0" * 8, ["outside"]),  # end < begin
        (_single("t", "F32", [2**40] * 3, [0, 8]), b"\0" * 8, ["too large"]),
        (_single("t", "F32", [2**31] * 8, [0, 8]), b"\0" * 8, ["too large"]),
        (_single("t", "F32", [2**41], [0, 8]), b"\0" * 8, ["dimension"]),
        (_single("t", "F32", [-2], [0, 8]), b"\0" * 8, ["dimension", "-2"]),
        (_single("t", "F32", [2.0], [0, 8]), b"\0" * 8, ["dimension", "2.0"]),
        (_single("t", "F32", [True], [0, 4]), b"\0" * 8, ["dimension"]),
        (_single("t", "F32", "2", [0, 8]), b"\0" * 8, ["shape"]),
        (_single("t", "F32", [1] * 9, [0, 4]), b"\0" * 8, ["shape"]),
        (_single("t", "F32", [2], [0.0, 8]), b"\0" * 8, ["data_offsets"]),
        (_single("t", "F32", [2], [0, 8, 9]), b"\0" * 9, ["data_offsets"]),
        (_single("t", "Q4", [2], [0, 8]), b"\0" * 8, ["dtype", "Q4"]),
        (_single("t", 32, [2], [0, 8]), b"\0" * 8, ["dtype"]),
        (_single("t", "F32", [3], [0, 8]), b"\0" * 12, ["8 bytes", "12"]),  # shape x itemsize
        (_single("t", "BF16", [3], [0, 8]), b"\0" * 8, ["needs 6"]),
        ({"t": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, ["data_offsets"]),
        ({"t": [1, 2]}, b"", ["not an object"]),
        ({"__metadata__": {"t": 1}}, b"", ["__metadata__"]),
    ],
)
def test_bad_entry(tmp_path: Path, entry: dict, data: bytes, words: list[str]) -> None:
    path = _raw_file(tmp_path / "model.safetensors", entry, data)
    _expect_error(lambda: read_header(path), path.name, "'t'", *words)


def test_metadata_not_object(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "model.safetensors", {"__metadata__": ["x"]})
    _expect_error(lambda: read_header(path), path.name, "'__metadata__'", "object or null")


def test_overlapping_tensors(tmp_path: Path) -> None:
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
              "e": {"dtype": "F32", "shape": [0], "data_offsets": [2, 2]}}  # empty: owns no byte
    path = _raw_file(tmp_path / "model.safetensors", header, b"\0" * 12)
    _expect_error(lambda: read_header(path), path.name, "'a'", "'b'", "overlaps")
    header["b"]["data_offsets"] = [8, 16]
    path = _raw_file(path, header, b"\0" * 16)
    assert set(read_header(path)[0]) == {"a", "b", "e"}


def test_duplicate_tensor_name(tmp_path: Path) -> None:
    entry = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    raw = ('{"t":%s,"t":%s}' % (entry, entry)).encode()
    path = _raw_file(tmp_path / "model.safetensors", raw, b"\0" * 4)
    _expect_error(lambda: read_header(path), path.name, "duplicate", "'t'")


def test_bad_bool_bytes(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "model.safetensors", _single("t", "BOOL", [2], [0, 2]), b"\x01\x07")
    with open_checkpoint(tmp_path) as ckpt:
        _expect_error(lambda: ckpt.load("t"), path.name, "'t'", "BOOL")


def test_file_truncated_after_open(tmp_path: Path) -> None:
    path = _good(tmp_path)
    with open_checkpoint(tmp_path) as ckpt:
        path.write_bytes(path.read_bytes()[:-10])
        _expect_error(lambda: ckpt.load("w"), path.name, "'w'", "truncated")


# ---------------------------------------------------------------------------- hostile directories


def _two_shards(tmp_path: Path) -> dict[str, str]:
    mx.save_safetensors(str(tmp_path / "model-00001-of-00002.safetensors"),
                        {"a": mx.zeros((2,))}, {"format": "mlx"})
    mx.save_safetensors(str(tmp_path / "model-00002-of-00002.safetensors"),
                        {"b": mx.zeros((3,))}, {"format": "mlx"})
    return {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}


def _write_index(tmp_path: Path, weight_map: object) -> Path:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def test_index_malformed(tmp_path: Path) -> None:
    _two_shards(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": ')
    _expect_error(lambda: open_checkpoint(tmp_path), index.name, "JSON")
    index.write_text('{"weight_map": ["a"]}')
    _expect_error(lambda: open_checkpoint(tmp_path), index.name, "weight_map")


def test_index_missing_shard(tmp_path: Path) -> None:
    wm = _two_shards(tmp_path) | {"c": "model-00003-of-00003.safetensors"}
    index = _write_index(tmp_path, wm)
    _expect_error(lambda: open_checkpoint(tmp_path), index.name, "model-00003-of-00003", "'c'")


@pytest.mark.parametrize("bad", ["../model.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_index_path_traversal(tmp_path: Path, bad: str) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    wm = _two_shards(model_dir)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"c": mx.zeros((1,))})
    index = _write_index(model_dir, wm | {"c": bad})
    _expect_error(lambda: open_checkpoint(model_dir), index.name, "'c'", bad)


def test_index_tensor_absent_from_shard(tmp_path: Path) -> None:
    wm = _two_shards(tmp_path)
    index = _write_index(tmp_path, wm | {"a": wm["b"]})  # 'a' really lives in shard 1
    _expect_error(lambda: open_checkpoint(tmp_path), index.name, "'a'", wm["b"])
    index = _write_index(tmp_path, wm | {"ghost": wm["b"]})
    _expect_error(lambda: open_checkpoint(tmp_path), index.name, "'ghost'", wm["b"])


def test_same_tensor_in_two_shards(tmp_path: Path) -> None:
    _two_shards(tmp_path)
    mx.save_safetensors(str(tmp_path / "model-extra.safetensors"), {"b": mx.zeros((3,))})
    _expect_error(lambda: open_checkpoint(tmp_path), "model-extra.safetensors",
                  "model-00002-of-00002.safetensors", "'b'")


def test_only_pytorch_bin(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04")
    (tmp_path / "config.json").write_text("{}")
    _expect_error(lambda: open_checkpoint(tmp_path), str(tmp_path), "pytorch_model.bin",
                  "PyTorch .bin / GGUF checkpoints are not supported")


def test_empty_dir_and_not_a_dir(tmp_path: Path) -> None:
    msg = _expect_error(lambda: open_checkpoint(tmp_path), str(tmp_path), "no model*.safetensors")
    assert "GGUF" not in msg
    _expect_error(lambda: open_checkpoint(tmp_path / "missing"), "missing", "not a directory")


def test_checkpoint_is_public_api() -> None:
    assert Checkpoint.load.__doc__ and "int32" in Checkpoint.load.__doc__
