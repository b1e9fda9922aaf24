"""Regressions for what tests/fuzz_onnx.py found (session 23): each hostile graph, config or
session feed once raised a non-mlxr exception (IndexError, KeyError, RecursionError, a raw
onnxruntime error, ...); now it is a one-line mlxr error naming the file and the node,
initializer or key at fault."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import mlxr
from mlxr.errors import MlxrError, ModelFormatError, TokenizerError
from mlxr.onnx import InferenceSession
from mlxr.onnx.mask import constant_value
from onnx_ref import copy_folder
from test_onnx_errors import edit, init, node, set_attr, set_external

MASK = "/model/attn_mask_reformat/attn_mask_subgraph/"


@pytest.fixture
def folder(onnx_exports, tmp_path):
    return copy_folder(onnx_exports / "llama_int4_cpu", tmp_path / "m")


@pytest.fixture
def gptoss(onnx_exports, tmp_path):
    return copy_folder(onnx_exports / "gptoss_int4_cpu", tmp_path / "g")


def load(folder):
    return mlxr.load(folder, device="cpu", dtype="float32")


def one_line(e: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(e.value), str(e.value)


def test_constant_of_another_attribute_type(folder):
    """Constant `value` given as an int: was AttributeError inside numpy_helper; now the mask
    probe declines it and onnxruntime's verdict comes as one line."""
    def change(g, m):
        n = node(g, "Constant", "INT64/[1]")
        del n.attribute[:]
        n.attribute.append(onnx.helper.make_attribute("value", 1))

    edit(folder, change)
    with pytest.raises(ModelFormatError, match="onnxruntime failed running.*ReduceSum") as e:
        list(load(folder).generate([1, 2, 3], max_tokens=2))
    one_line(e)


def test_constant_with_external_data_is_not_read():
    t = onnx.helper.make_tensor("c", onnx.TensorProto.INT64, [1], [1])
    t.data_location = onnx.TensorProto.EXTERNAL
    e = t.external_data.add()
    e.key, e.value = "location", "elsewhere.bin"
    assert constant_value({"value": t}) is None
    huge = onnx.helper.make_tensor("c", onnx.TensorProto.INT64, [0], [])
    huge.dims[:] = [1 << 40]
    assert constant_value({"value": huge}) is None


def test_cycle_in_the_mask_subgraph(folder):
    """ReduceSum fed by its own Sub: was RecursionError in the mask probe."""
    edit(folder, lambda g, m: node(g, "ReduceSum").input.__setitem__(0, MASK + "Sub/output_0"))
    with pytest.raises(ModelFormatError, match="not acyclic"):
        load(folder)


def test_gqa_without_rotary_caches(folder):
    """do_rotary=1 with the cos/sin inputs cut off: was IndexError in the translator; now
    declined, and onnxruntime's verdict comes as one line."""
    edit(folder, lambda g, m: node(g, "GroupQueryAttention", "layers.0").input.__delitem__(
        slice(7, None)))
    with pytest.raises(ModelFormatError, match="onnxruntime failed.*GroupQueryAttention") as e:
        list(load(folder).generate([1, 2, 3], max_tokens=2))
    one_line(e)


@pytest.mark.parametrize("op,part", [("MatMulNBits", "o_proj"), ("Shape", ""),
                                     ("GroupQueryAttention", "layers.1")])
def test_missing_required_inputs(folder, op, part):
    """A node with its inputs cut: was IndexError in the translator / mask probe."""
    edit(folder, lambda g, m: node(g, op, part).input.__delitem__(slice(0, None)))
    with pytest.raises(ModelFormatError, match=rf"\({op}\): required input\(s\) \[0"):
        load(folder)


def test_contrib_op_in_the_default_domain(folder):
    """MatMulNBits in ai.onnx: was KeyError('block_size') reading it as a projection."""
    def change(g, m):
        n = node(g, "MatMulNBits", "o_proj")
        n.domain = ""
        del n.attribute[:]

    edit(folder, change)
    with pytest.raises(ModelFormatError, match="domain 'ai.onnx' has no MatMulNBits"):
        load(folder)


@pytest.mark.parametrize("where,value,match", [
    ("inputs", 5, "'model.decoder.inputs' must be an object, got int"),
    ("outputs", [1], "'model.decoder.outputs' must be an object, got list"),
    ("outputs", {"logits": ["logits"]}, "'model.decoder.outputs.logits' must be an output"),
])
def test_genai_config_io_section_types(folder, where, value, match):
    path = folder / "genai_config.json"
    cfg = json.loads(path.read_text())
    cfg["model"]["decoder"][where] = value
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=match):
        load(folder)


@pytest.mark.parametrize("location,match", [
    ("model.onnx.data\0", "not a relative path"),
    ("a" * 300, "missing or not a regular file"),
])
def test_external_location_unusable_by_the_os(folder, location, match):
    """A NUL byte or a too-long name: was ValueError / OSError from pathlib."""
    edit(folder, lambda g, m: set_external(init(g, "lm_head.MatMul.weight_Q4"), "location",
                                           location))
    with pytest.raises(ModelFormatError, match="initializer 'lm_head.MatMul.weight_Q4'.*"
                                               + match):
        load(folder)


def test_session_output_of_a_non_float_type(folder):
    """logits declared INT16: was KeyError in the session's output conversion."""
    edit(folder, lambda g, m: setattr(
        next(o for o in g.output if o.name == "logits").type.tensor_type, "elem_type",
        onnx.TensorProto.INT16))
    with pytest.raises(ModelFormatError, match="output 'logits' is INT16"):
        InferenceSession(folder)


def feeds(sess, past: dict[str, int]) -> dict:
    out = {"input_ids": np.ones((1, 3), np.int64)}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            out[i.name] = np.zeros((1, 2, past.get(i.name, 0), 32), np.float32)
    out["attention_mask"] = np.ones((1, 3), np.int64)
    return out


def test_session_layers_with_different_past_lengths(folder):
    """Layer 1's past longer than layer 0's: was a torch expand RuntimeError in mlxr's
    decoder; now onnxruntime's verdict, as one line."""
    sess = InferenceSession(folder)
    assert sess.claimed
    with pytest.raises(MlxrError, match="onnxruntime failed running the graph") as e:
        sess.run(None, feeds(sess, {"past_key_values.1.key": 2}))
    one_line(e)


def test_session_window_buffers_too_small(gptoss):
    """gpt-oss's window-sized KV buffers fed empty: was onnxruntime's InvalidArgument."""
    sess = InferenceSession(gptoss)
    with pytest.raises(ModelFormatError, match="GroupQueryAttention.*sliding_window_cache") as e:
        sess.run(None, feeds(sess, {}))
    one_line(e)


def test_head_sink_not_an_initializer(gptoss):
    """head_sink wired to an activation: was KeyError in the translator; now declined (the
    layer is onnxruntime's, which refuses the graph)."""
    def change(g, m):
        gqa = node(g, "GroupQueryAttention", "layers.1")
        gqa.input[11] = gqa.input[6]

    edit(gptoss, change)
    with pytest.raises(ModelFormatError, match="onnxruntime"):
        list(load(gptoss).generate([1, 2, 3], max_tokens=2))


def test_qmoe_router_bias_of_the_wrong_size(gptoss):
    """The router's bias wired to fc1's ([4, 256], not [4]): was a torch reshape
    RuntimeError."""
    def change(g, m):
        add = node(g, "Add", "layers.0/moe/router")
        j = list(add.input).index("model.layers.0.moe.router.Add.bias")
        add.input[j] = "model.layers.0.moe.experts.gate_up_proj.bias"

    edit(gptoss, change)
    with pytest.raises(ModelFormatError, match="initializer 'model.layers.0.moe.experts."
                                               r"gate_up_proj.bias' is FLOAT\[4, 256\]"):
        load(gptoss)


def test_special_token_with_a_lone_surrogate(folder):
    """tokenizer_config's eos_token "\\ud800" (valid JSON): was UnicodeEncodeError; now a
    TokenizerError naming the file and key (the MLX path's check, shared by ONNX folders)."""
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["eos_token"] = "\ud800"
    path.write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="tokenizer_config.json: eos_token"):
        load(folder).tokenizer


@pytest.mark.parametrize("limit", [-1.0, -float("inf"), float("nan")])
@pytest.mark.parametrize("beta", [1.0, 0.5])  # mlxr's MoE block; declined to onnxruntime
def test_qmoe_swiglu_limit_out_of_range(gptoss, limit, beta):
    """A negative QMoE swiglu_limit: onnxruntime's std::clamp(u, -limit, limit) asserts and
    aborts the process (SIGABRT), also where mlxr declines the QMoE to it (activation_beta
    0.5); NaN clamps nothing there but everything in torch. Now refused at load."""
    def change(g, m):
        for n in g.node:
            if n.op_type == "QMoE":
                set_attr(n, "swiglu_limit", limit)
                set_attr(n, "activation_beta", beta)

    edit(gptoss, change)
    with pytest.raises(ModelFormatError, match=r"\(QMoE\): attribute swiglu_limit=.* is "
                                               r"invalid \(a float in \[0, inf\]\)") as e:
        load(gptoss)
    one_line(e)


@pytest.mark.parametrize("attr,value", [("k", [2, 2]), ("activation_alpha", b"x"),
                                        ("expert_weight_bits", 4.0)])
def test_qmoe_attribute_of_another_type(gptoss, attr, value):
    """QMoE attributes of the wrong type: k as a list was a TypeError comparing it to the
    expert count, activation_alpha as a string a ValueError in float()."""
    def change(g, m):
        set_attr(node(g, "QMoE", "layers.0"), attr, value)

    edit(gptoss, change)
    with pytest.raises(ModelFormatError, match=rf"\(QMoE\): attribute {attr}=.* is "
                                               "(out of range|invalid)") as e:
        load(gptoss)
    one_line(e)


@pytest.mark.parametrize("attr", ["qk_norm_epsilon", "q_norm_epsilon", "k_norm_epsilon"])
def test_gqa_norm_epsilon_of_another_type(onnx_exports, tmp_path, attr):
    """qwen3's GQA q/k-norm epsilon as a string: was a TypeError sorting the set of the
    graph's epsilons (bytes beside floats) in the translator."""
    folder = copy_folder(onnx_exports / "qwen3_fp16", tmp_path / "q")

    def change(g, m):
        set_attr(node(g, "GroupQueryAttention", "layers.1"), attr, b"PER_TENSOR")

    edit(folder, change)
    with pytest.raises(ModelFormatError, match=rf"\(GroupQueryAttention\): attribute "
                                               rf"{attr}=b'PER_TENSOR' is invalid") as e:
        load(folder)
    one_line(e)


@pytest.mark.parametrize("i", [2, 3])  # scales, zero points
def test_embedding_scales_computed_at_run_time(onnx_exports, tmp_path, i):
    """GatherBlockQuantized's scales / zero points wired to an activation: was KeyError
    reading them as initializers; now the embedding is declined and onnxruntime's verdict
    (this graph has a cycle) comes as one line."""
    folder = copy_folder(onnx_exports / "llama_tied_shared", tmp_path / "t")

    def change(g, m):
        n = node(g, "GatherBlockQuantized")
        while len(n.input) <= i:
            n.input.append("")
        n.input[i] = "present.0.value"

    edit(folder, change)
    with pytest.raises(ModelFormatError, match="onnxruntime") as e:
        list(load(folder).generate([1, 2, 3], max_tokens=2))
    one_line(e)


def test_tensor_of_a_value_that_is_no_initializer(folder):
    """graph.tensor asked for an activation (what the case above reached): was KeyError."""
    from mlxr.onnx.graph import OnnxGraph

    with pytest.raises(ModelFormatError, match="'present.0.value' is not an initializer"):
        OnnxGraph(folder / "model.onnx").tensor("present.0.value")


@pytest.mark.parametrize("attr", ["k_quant_type", "v_quant_type"])
def test_gqa_string_attribute_not_utf8(folder, attr):
    """A GQA k/v_quant_type of bytes that are not UTF-8: was UnicodeDecodeError."""
    edit(folder, lambda g, m: set_attr(node(g, "GroupQueryAttention", "layers.1"), attr,
                                       b"\xff\xfe"))
    with pytest.raises(ModelFormatError, match=rf"{attr}='..' is unknown") as e:
        load(folder)
    one_line(e)


def test_qmoe_expert_weights_computed_at_run_time(gptoss):
    """QMoE's fc1 weights wired to a graph input: the claim declines the node, but the
    translator walked the layer and read it as an initializer (KeyError)."""
    def change(g, m):
        node(g, "QMoE", "layers.1").input[2] = "past_key_values.1.key"

    edit(gptoss, change)
    with pytest.raises(ModelFormatError, match="onnxruntime cannot load") as e:
        list(load(gptoss).generate([1, 2, 3], max_tokens=2))
    one_line(e)


def test_fallback_logits_of_another_rank(folder):
    """Logits declared [batch, sequence, 384, 1] in a graph onnxruntime runs whole (the LM
    head's scales computed): its vocabulary was read as 1, and generating failed with
    a ValueError on the prompt."""
    def change(g, m):
        m.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 1
        node(g, "MatMulNBits", "lm_head").input[2] = "/model/layers.0/mlp/act_fn/Mul/output_0"

    edit(folder, change)
    with pytest.raises(ModelFormatError, match=r"output 'logits' is declared \['batch_size', "
                                               r"'sequence_length', \d+, 1\]") as e:
        load(folder)
    one_line(e)


@pytest.mark.parametrize("a", [{"value_int": float("inf")}, {"value_ints": [1.0, 2.0]},
                               {"value_ints": b"x"}])
def test_constant_value_int_of_another_type(a):
    """A mask-probe Constant whose value_int(s) is a float or string: was OverflowError /
    ValueError in np.asarray; now not a constant (the probe declines)."""
    assert constant_value(a) is None


def test_zero_points_of_another_size():
    """An embedding's zero points rewired to another uint8 initializer: was a torch reshape
    RuntimeError in the repack."""
    import torch

    from mlxr.onnx.repack import block_affine

    data, scales = torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 4)
    with pytest.raises(ModelFormatError, match=r"node 'e': zero points \[3, 16\] do not fit "
                                               "8 rows of 4 blocks"):
        block_affine(data, scales, torch.zeros(3, 16, dtype=torch.uint8), 4, 32, 8.0,
                     "node 'e'")
    with pytest.raises(ModelFormatError, match=r"scales \[8, 3\] do not fit"):
        block_affine(data, torch.ones(8, 3), None, 4, 32, 8.0, "node 'e'")
