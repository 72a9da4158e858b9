"""Each op the lowering adds, as one node, against onnxruntime (or ONNX's reference implementation where
onnxruntime has no kernel for the op's version); and the coverage of the ops exporters write at every opset."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import defs, helper
from onnx.reference import ReferenceEvaluator

from onnx_nmm.lowering import call_lowered, lower, unsupported_nodes

MS = "com.microsoft"
RNG = np.random.default_rng(0)


def _random(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _node_model(node, inputs: dict, outputs: int, opset: int):
    graph = helper.make_graph(
        [node], "one_op",
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
         for name, value in inputs.items()],
        [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in node.output[:outputs]])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)],
                             ir_version=10 if opset <= 23 else 11)


def _reference(model, inputs: dict, domain: str):
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # onnxruntime has no kernel for this version: ONNX's reference implementation
        assert domain == "", "every com.microsoft op tested here runs on onnxruntime"
        return ReferenceEvaluator(model).run(None, inputs)
    return session.run(None, inputs)


def _assert_lowered_matches(op, inputs: dict, opset=23, domain="", outputs=1, atol=2e-5, **attributes):
    """`op` on `inputs` (a None value leaves that optional input out) gives onnxruntime's outputs."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    node = helper.make_node(op, names, [f"y{i}" for i in range(outputs)], domain=domain, **attributes)
    feeds = {name: value for name, value in inputs.items() if value is not None}
    model = _node_model(node, feeds, outputs, opset)
    expected = _reference(model, feeds, domain)
    import torch

    got = call_lowered(lower(model), *(torch.from_numpy(value) for value in feeds.values()))
    got = got if isinstance(got, (tuple, list)) else (got,)
    for index in range(outputs):
        np.testing.assert_allclose(got[index].numpy(), expected[index], atol=atol, rtol=1e-4,
                                   err_msg=f"{op} output {index}")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_20(approximate):
    _assert_lowered_matches("Gelu", {"x": _random(2, 5, 8)}, opset=20, approximate=approximate)


def test_rms_normalization_23():
    _assert_lowered_matches("RMSNormalization", {"x": _random(2, 5, 8), "scale": _random(8)}, epsilon=1e-6)
    _assert_lowered_matches("RMSNormalization", {"x": _random(2, 5, 8), "scale": _random(5, 8)}, axis=-2)


def test_the_layer_normalizations_onnxruntime_registers_in_the_onnx_domain():
    x, scale, bias = _random(2, 5, 8), _random(8), _random(8)
    _assert_lowered_matches("LayerNormalization", {"x": x, "scale": scale, "bias": bias}, opset=14, epsilon=1e-5)
    _assert_lowered_matches("SimplifiedLayerNormalization", {"x": x, "scale": scale}, opset=17, epsilon=1e-6)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_23(interleaved):
    batch, heads, sequence, head = 2, 3, 5, 8
    angles = _random(batch, sequence, head // 2)
    _assert_lowered_matches("RotaryEmbedding", {"x": _random(batch, heads, sequence, head), "cos": np.cos(angles),
                                                "sin": np.sin(angles)}, interleaved=interleaved)
    table = _random(16, 2)  # a partial rotation (4 of 8 features) indexed by position ids
    _assert_lowered_matches("RotaryEmbedding", {"x": _random(batch, sequence, heads * head), "cos": np.cos(table),
                                                "sin": np.sin(table),
                                                "ids": RNG.integers(0, 16, (batch, sequence))},
                            interleaved=interleaved, num_heads=heads, rotary_embedding_dim=4)


def test_attention_23_grouped_with_a_boolean_mask():
    mask = np.tril(np.ones((5, 5), bool))
    mask[:, 0] = True
    _assert_lowered_matches("Attention", {"q": _random(2, 4, 5, 8), "k": _random(2, 2, 5, 8), "v": _random(2, 2, 5, 8),
                                          "mask": mask}, scale=0.3)


def test_attention_23_flat_causal_with_a_cache_and_softcap():
    inputs = {"q": _random(2, 3, 4 * 8), "k": _random(2, 3, 2 * 8), "v": _random(2, 3, 2 * 8), "mask": _random(3, 7),
              "past_key": _random(2, 2, 4, 8), "past_value": _random(2, 2, 4, 8)}
    _assert_lowered_matches("Attention", inputs, outputs=3, is_causal=1, q_num_heads=4, kv_num_heads=2, softcap=2.0)


def test_attention_24_nonpad_lengths_and_25_windows():
    inputs = {"q": _random(2, 2, 4, 8), "k": _random(2, 2, 6, 8), "v": _random(2, 2, 6, 8), "mask": None,
              "past_key": None, "past_value": None, "lengths": np.array([6, 4], np.int64)}
    _assert_lowered_matches("Attention", inputs, opset=24, is_causal=1)
    _assert_lowered_matches("Attention", {"q": _random(1, 2, 6, 8), "k": _random(1, 2, 6, 8), "v": _random(1, 2, 6, 8)},
                            opset=25, is_causal=1, left_window_size=2)


def test_pad_from_18_without_axes_is_pad_13():
    inputs = {"x": _random(2, 5), "pads": np.array([0, 1, 0, 2], np.int64), "value": np.array(0.5, np.float32)}
    for opset in (18, 19, 21, 23):
        _assert_lowered_matches("Pad", inputs, opset=opset)


def test_trilu_swish_and_swiglu():
    _assert_lowered_matches("Trilu", {"x": _random(2, 5, 5), "k": np.array(1, np.int64)}, opset=14, upper=0)
    _assert_lowered_matches("Swish", {"x": _random(2, 5, 8)}, opset=24, alpha=1.5)
    _assert_lowered_matches("SwiGLU", {"a": _random(2, 5, 8), "b": _random(2, 5, 8)}, opset=28)


@pytest.mark.parametrize("opset", [13, 18, 20])
def test_scatter_elements_as_a_static_cache_writes(opset):
    indices = np.broadcast_to(np.array([5, -1], np.int64).reshape(1, 1, 2, 1), (2, 3, 2, 4)).copy()
    _assert_lowered_matches("ScatterElements", {"data": _random(2, 3, 8, 4), "indices": indices,
                                                "updates": _random(2, 3, 2, 4)}, opset=opset, axis=2)


def test_onnxruntime_optimizer_ops():
    _assert_lowered_matches("FusedMatMul", {"a": _random(2, 8, 5), "b": _random(2, 6, 8)}, domain=MS,
                            transA=1, transB=1, alpha=0.5)
    _assert_lowered_matches("QuickGelu", {"x": _random(2, 5, 8)}, domain=MS, alpha=1.0)
    _assert_lowered_matches("QuickGelu", {"x": _random(2, 5, 8)}, domain=MS)
    _assert_lowered_matches("FastGelu", {"x": _random(2, 5, 8), "bias": _random(8)}, domain=MS, atol=1e-4)
    _assert_lowered_matches("BiasGelu", {"x": _random(2, 5, 8), "bias": _random(8)}, domain=MS)
    _assert_lowered_matches("Gelu", {"x": _random(2, 5, 8)}, domain=MS)


def test_onnxruntime_skip_normalizations_with_every_output():
    x, skip, gamma, beta, bias = _random(2, 5, 8), _random(2, 5, 8), _random(8), _random(8), _random(8)
    _assert_lowered_matches("SkipLayerNormalization", {"x": x, "skip": skip, "gamma": gamma, "beta": beta,
                                                       "bias": bias}, domain=MS, outputs=4, epsilon=1e-5)
    _assert_lowered_matches("SkipSimplifiedLayerNormalization", {"x": x, "skip": skip, "gamma": gamma, "bias": bias},
                            domain=MS, outputs=4, epsilon=1e-6)


def test_onnxruntime_rotary_embedding():
    table = _random(16, 4)
    cos, sin = np.cos(table), np.sin(table)
    _assert_lowered_matches("RotaryEmbedding", {"x": _random(2, 5, 3 * 8), "ids": RNG.integers(0, 11, (2, 5)),
                                                "cos": cos, "sin": sin}, domain=MS, num_heads=3)
    _assert_lowered_matches("RotaryEmbedding", {"x": _random(2, 3, 5, 8), "ids": np.array([4], np.int64),
                                                "cos": cos, "sin": sin}, domain=MS, interleaved=1)


@pytest.mark.parametrize("batch, past, sequence", [(2, 0, 4), (2, 3, 1), (1, 3, 4)])  # prompt, decode, chunk
def test_onnxruntime_group_query_attention_as_genai_writes_it(batch, past, sequence):
    """Packed q|k|v, the cache appended to, rotary inside, as onnxruntime-genai's builder writes it."""
    heads, kv_heads, head = 4, 2, 16  # onnxruntime wants head sizes in multiples of 16
    table = _random(32, head // 2)
    inputs = {"qkv": _random(batch, sequence, (heads + 2 * kv_heads) * head), "key": None, "value": None,
              "past_key": _random(batch, kv_heads, past, head), "past_value": _random(batch, kv_heads, past, head),
              "seqlens_k": np.full(batch, past + sequence - 1, np.int32),
              "total": np.array(past + sequence, np.int32), "cos": np.cos(table), "sin": np.sin(table)}
    attributes = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, scale=0.25)
    _assert_lowered_matches("GroupQueryAttention", inputs, domain=MS, outputs=3, **attributes)
    _assert_lowered_matches("GroupQueryAttention", inputs, domain=MS, outputs=3, local_window_size=2,
                            softcap=3.0, **attributes)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_svd_gated_mlp_body_and_lowering_agree_for_each_activation(activation):
    """onnxruntime runs SvdGatedMLP's function body, the lowering its torch maths: the same numbers."""
    from onnx_nmm.passes import svd_ops

    factors = {name: _random(*shape) * 0.5 for name, shape in
               (("ug", (8, 4)), ("vg", (4, 12)), ("uu", (8, 4)), ("vu", (4, 12)), ("ud", (12, 4)), ("vd", (4, 8)))}
    node = helper.make_node(svd_ops.SVD_GATED_MLP, ["x", *factors], ["y0"], domain=svd_ops.DOMAIN,
                            overload=svd_ops.gated_mlp_overload(activation), activation=activation, ranks=[4, 4, 4])
    _check_body_against_lowering(node, factors, activation)


def _check_body_against_lowering(node, initializers: dict, activation: str):
    import onnx_ir as ir
    import torch

    from onnx_nmm.passes import svd_ops

    graph = helper.make_graph([node], "mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 8])],
                              [helper.make_tensor_value_info("y0", onnx.TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(value, name) for name, value in initializers.items()])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    svd_ops.register_mlp_op(model, node.op_type, activation)
    proto = ir.serde.serialize_model(model)
    x = _random(2, 3, 8) * 3
    expected = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = call_lowered(lower(proto), torch.from_numpy(x))
    np.testing.assert_allclose(got.numpy(), expected[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_svd_mlp_body_and_lowering_agree_for_each_activation(activation):
    """The same for SvdMLP, the non-gated MLP with its two biases."""
    from onnx_nmm.passes import svd_ops

    inputs = {name: _random(*shape) * 0.5 for name, shape in
              (("u1", (8, 4)), ("v1", (4, 12)), ("b1", (12,)), ("u2", (12, 4)), ("v2", (4, 8)), ("b2", (8,)))}
    node = helper.make_node(svd_ops.SVD_MLP, ["x", *inputs], ["y0"], domain=svd_ops.DOMAIN, overload=activation,
                            activation=activation, ranks=[4, 4])
    _check_body_against_lowering(node, inputs, activation)


# The ops the exporters write for the decoder architectures of tests/test_architectures.py (dynamo at
# opsets 18 to 23, TorchScript at 17).
EXPORTED_OPS = ("Add", "And", "Attention", "Cast", "CastLike", "Concat", "Constant", "ConstantOfShape", "Cos", "Div",
                "Equal", "Expand", "Flatten", "Gather", "GatherND", "Gelu", "Gemm", "Greater", "IsNaN",
                "LayerNormalization", "LessOrEqual", "MatMul", "Max", "Mul", "Neg", "Pow", "RMSNormalization", "Range",
                "Reciprocal", "ReduceMean", "Reshape", "RotaryEmbedding", "Shape", "Sigmoid", "Sin", "Slice", "Softmax",
                "Split", "Sqrt", "Squeeze", "Sub", "Tanh", "Transpose", "Trilu", "Unsqueeze", "Where")


@pytest.mark.parametrize("opset", range(17, defs.onnx_opset_version() + 1))
def test_every_op_exporters_write_is_lowered_at_every_opset(opset):
    nodes = [helper.make_node(op, [], [f"y{index}"]) for index, op in enumerate(EXPORTED_OPS) if _exists_at(op, opset)]
    model = helper.make_model(helper.make_graph(nodes, "ops", [], []), opset_imports=[helper.make_opsetid("", opset)])
    assert unsupported_nodes(model) == []


def _exists_at(op: str, opset: int) -> bool:
    try:
        defs.get_schema(op, opset)
        return True
    except defs.SchemaError:  # introduced after this opset (Gelu before 20, Attention before 23)
        return False


@pytest.mark.parametrize("sequence, written", [(4, [3, 4]), (1, [5, 7])])  # a padded prompt, a decode step
def test_onnxruntime_group_query_attention_on_one_cache_buffer(sequence, written):
    """The static cache onnxruntime-genai runs (past_present_share_buffer): the cache as long as the context
    (total_sequence_length), the step written at each sequence's own position, the keys past it masked."""
    heads, kv_heads, head, context = 4, 2, 16, 8
    table = _random(32, head // 2)
    lengths = np.array(written, np.int32)  # each sequence's keys after the step
    past_key, past_value = _random(2, kv_heads, context, head), _random(2, kv_heads, context, head)
    inputs = {"qkv": _random(2, sequence, (heads + 2 * kv_heads) * head), "key": None, "value": None,
              "past_key": past_key, "past_value": past_value, "seqlens_k": lengths - 1,
              "total": np.array(sequence if sequence > 1 else context, np.int32),
              "cos": np.cos(table), "sin": np.sin(table)}
    names = [name if value is not None else "" for name, value in inputs.items()]
    node = helper.make_node("GroupQueryAttention", names, ["y", "present_key", "present_value"], domain=MS,
                            num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, scale=0.25)
    feeds = {name: value for name, value in inputs.items() if value is not None}
    model = _node_model(node, feeds, 3, 23)
    expected = _reference(model, feeds, MS)
    import torch

    got = [tensor.numpy() for tensor in call_lowered(lower(model), *(torch.from_numpy(v) for v in feeds.values()))]
    assert got[1].shape == expected[1].shape == past_key.shape
    for b, length in enumerate(written):  # the rows a sequence attends with: its first `length` positions
        valid = min(length, sequence) if sequence > 1 else 1
        np.testing.assert_allclose(got[0][b, :valid], expected[0][b, :valid], atol=2e-5, rtol=1e-4)
        for index in (1, 2):
            np.testing.assert_allclose(got[index][b, :, :length], expected[index][b, :, :length], atol=2e-5,
                                       rtol=1e-4)
