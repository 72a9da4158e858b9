from pathlib import Path

import graphs
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import onnx_nmm
from onnx_nmm.passes import LinearLayer, find_linear_layers, unmatched_products
from onnx_nmm.passes.linear_layers import LINEAR_LAYER_RULES, GemmLayer, MatMulLayer, NBitsLayer
from onnx_nmm.passes.rules import Mismatch

FORMATS = Path(__file__).parent / "data" / "formats"


def _layers(proto):
    return find_linear_layers(ir.serde.deserialize_model(proto))


def test_plain_matmul():
    (layer,) = _layers(graphs.matmul(16, 24))
    assert (layer.k, layer.n, layer.weight.transposed, layer.bias) == (16, 24, False, None)
    np.testing.assert_array_equal(layer.weight_matrix(), graphs.weight(16, 24))


def test_transposed_weight_is_read_through_the_transpose():
    (layer,) = _layers(graphs.matmul_transposed(16, 24))
    assert (layer.k, layer.n, layer.weight.transposed) == (16, 24, True)
    assert [node.op_type for node in layer.weight.path] == ["Transpose"]
    np.testing.assert_array_equal(layer.weight_matrix(), graphs.weight(24, 16).T)


def test_identity_and_cast_are_followed():
    (layer,) = _layers(graphs.matmul_identity_cast())
    assert [node.op_type for node in layer.weight.path] == ["Identity", "Cast"]
    assert layer.dtype == ir.DataType.FLOAT16 and layer.weight.cast_to == ir.DataType.FLOAT


@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_then_add_folds_the_bias(bias_first):
    (layer,) = _layers(graphs.matmul_bias(bias_first=bias_first))
    assert layer.bias is not None and layer.bias_node.op_type == "Add"
    assert layer.output is layer.bias_node.outputs[0]


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_applies_trans_b_alpha_and_beta(trans_b):
    (layer,) = _layers(graphs.gemm(16, 24, trans_b=trans_b, alpha=0.5, beta=2.0))
    assert (layer.k, layer.n) == (16, 24)
    np.testing.assert_allclose(layer.weight_matrix(), 0.5 * graphs.weight(16, 24), rtol=1e-6)
    expected_bias = 2.0 * np.random.default_rng(4).standard_normal(24).astype(np.float32)
    np.testing.assert_allclose(layer.bias_vector(), expected_bias, rtol=1e-6)


def test_constant_node_weight():
    (layer,) = _layers(graphs.constant_weight())
    assert not layer.weight.is_initializer and (layer.k, layer.n) == (16, 24)


@pytest.mark.parametrize("builder", [graphs.activation_product, graphs.vector_input, graphs.no_linear_layers])
def test_not_linear_layers(builder):
    assert _layers(builder()) == []


@pytest.mark.parametrize("names", [True, False])
def test_swiglu_roles_from_names_and_from_structure(names):
    roles = [(layer.group, layer.role) for layer in _layers(graphs.swiglu_mlp(names=names))]
    assert roles == [("mlp", "gate"), ("mlp", "up"), ("mlp", "down")]


LLAMA_LIKE = ["q", "k", "v", "o", "gate", "up", "down"] * 2 + ["lm_head"]
GPT2 = ["qkv", "o", "fc1", "fc2"] * 2 + ["lm_head"]


@pytest.mark.parametrize("architecture, expected", [
    ("llama", LLAMA_LIKE), ("qwen3", LLAMA_LIKE), ("mistral", LLAMA_LIKE), ("llama-tied", LLAMA_LIKE),
    ("gpt2", GPT2),
])
@pytest.mark.parametrize("exporter", ["dynamo", "dynamo-noopt", "torchscript"])
def test_roles_in_real_exports(export, architecture, expected, exporter):
    layers = find_linear_layers(ir.load(export(architecture, exporter)))
    assert [layer.role for layer in layers] == expected
    assert all(layer.module_path for layer in layers)
    if architecture == "gpt2":
        assert all(layer.bias is not None for layer in layers[:-1])


@pytest.mark.parametrize("exporter", ["dynamo", "dynamo-noopt"])
def test_tied_lm_head_is_shared_with_the_embedding(export, exporter):
    lm_head = find_linear_layers(ir.load(export("llama-tied", exporter)))[-1]
    assert lm_head.weight.transposed
    assert lm_head.shared_with  # the embedding Gather reads the same initializer


@pytest.mark.parametrize(("builder", "rule"), [
    (graphs.matmul, MatMulLayer), (graphs.matmul_transposed, MatMulLayer), (graphs.constant_weight, MatMulLayer),
    (graphs.gemm, GemmLayer), (lambda: onnx.load(FORMATS / "genai-int4" / "model.onnx", load_external_data=False),
                               NBitsLayer)])
def test_each_linear_layer_rule_reads_its_own_form_and_no_other(builder, rule):
    model = ir.serde.deserialize_model(builder())
    products = [node for node in model.graph if node.op_type in ("MatMul", "Gemm", "MatMulNBits")]
    matched = [node for node in products if isinstance(rule().match(node, model), LinearLayer)]
    assert matched and len(matched) == len(find_linear_layers(model))
    for node in matched:
        assert all(isinstance(other.match(node, model), Mismatch) for other in LINEAR_LAYER_RULES
                   if not isinstance(other, rule))


def _weight_given_at_run_time(k=16, n=24):
    w = helper.make_tensor_value_info("W", TensorProto.FLOAT, [k, n])
    return graphs.model([helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")], {}, k=k, extra_inputs=[w])


def _computed_operand(k=16):
    nodes = [helper.make_node("Relu", ["X"], ["R"], name="relu"),
             helper.make_node("Transpose", ["R"], ["Rt"], perm=[0, 2, 1], name="t"),
             helper.make_node("MatMul", ["X", "Rt"], ["Y"], name="scores")]
    return graphs.model(nodes, {}, k=k)


@pytest.mark.parametrize(("builder", "reason"), [
    (_computed_operand, "its second operand is computed (a product of two activations), not a stored weight"),
    (_weight_given_at_run_time, "its second operand is a graph input, not a stored weight"),
    (graphs.vector_input, "its input is missing or a vector"),
    (lambda: graphs.gemm(trans_b=0, trans_a=1), "transA=1: it multiplies a transposed X"),
])
def test_a_product_that_is_no_linear_layer_says_why(builder, reason):
    model = ir.serde.deserialize_model(builder())
    assert [why for _, why in unmatched_products(model)] == [reason]
    assert find_linear_layers(model) == []


def test_inspect_counts_the_products_that_are_not_layers(export):
    inspection = onnx_nmm.inspect(export("llama", "dynamo", cache=True))
    assert inspection.not_layers == {
        "its second operand is computed (a product of two activations), not a stored weight": 2 * 2}  # QKᵀ, PV
    with pytest.raises(onnx_nmm.ModelError, match="1 where its second operand is a graph input, not a stored weight"):
        onnx_nmm.inspect(ir.serde.deserialize_model(_weight_given_at_run_time()))
