"""What the rewrite writes: SvdMatMul calls with function bodies, factors in W's dtype, nothing lost."""

import graphs
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from rewriting import rewrite_file

import onnx_nmm
from onnx_nmm import ModelError, OnnxNmmError, OptionError, RankOptions, RewriteOptions, Selection
from onnx_nmm.model_io import check_model_file, save_model
from onnx_nmm.passes import svd_ops

EVERY_LAYER = Selection(targets="all", lm_head=True)


def _rewrite(model, ranks, selection=EVERY_LAYER) -> onnx_nmm.RewriteResult:
    return onnx_nmm.rewrite(model, RewriteOptions(ranks=ranks, selection=selection))


def _rewrite_proto(proto, ranks, selection=EVERY_LAYER):
    result = _rewrite(proto, ranks, selection)
    return ir.serde.serialize_model(result.model), result.report


def _run(proto, x):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]


def _x(k=16, seed=5):
    return np.random.default_rng(seed).standard_normal((2, 3, k)).astype(np.float32)


def _svd_nodes(proto):
    return [node for node in proto.graph.node if node.domain == svd_ops.DOMAIN]


@pytest.mark.parametrize("builder", [graphs.matmul, graphs.matmul_transposed, graphs.matmul_bias,
                                     graphs.constant_weight, graphs.matmul_identity_cast, graphs.weight_as_graph_input,
                                     graphs.scan_body, graphs.loop_body])
def test_full_rank_rewrite_of_each_pattern_is_exact(builder):
    original = builder()
    rewritten, _ = _rewrite_proto(original, RankOptions(rank="full"))
    onnx.checker.check_model(rewritten, full_check=True)
    nodes = ir.traversal.RecursiveGraphIterator(ir.serde.deserialize_model(rewritten).graph)
    assert [node.op_type for node in nodes if node.op_type in ("MatMul", "Gemm")] == []
    x = _x()
    tolerance = 2e-3 if builder is graphs.matmul_identity_cast else 2e-5  # fp16 factors
    np.testing.assert_allclose(_run(rewritten, x), _run(original, x), atol=tolerance)


def test_gemm_rewrite_is_exact():
    original = graphs.gemm(trans_b=1, alpha=0.5, beta=2.0)
    rewritten, _ = _rewrite_proto(original, RankOptions(rank="full"))
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    np.testing.assert_allclose(_run(rewritten, x), _run(original, x), atol=2e-5)


def test_the_op_carries_its_function_attributes_and_origin():
    rewritten, _ = _rewrite_proto(graphs.matmul_bias(16, 24), RankOptions(rank=4))
    (node,) = _svd_nodes(rewritten)
    assert node.op_type == svd_ops.SVD_MATMUL and node.overload == svd_ops.BIAS_OVERLOAD
    assert node.name == "mm" and len(node.input) == 4
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes == {"rank": 4, "align": 128, "method": b"svd/exact", "original_weight": b"W"}
    metadata = {entry.key: entry.value for entry in node.metadata_props}
    assert metadata[svd_ops.ORIGINAL_NODE_KEY] == "mm,add"
    functions = {(f.domain, f.name, f.overload): f for f in rewritten.functions}
    body = functions[(svd_ops.DOMAIN, svd_ops.SVD_MATMUL, svd_ops.BIAS_OVERLOAD)]
    assert [n.op_type for n in body.node] == ["MatMul", "MatMul", "Add"]
    assert {o.domain: o.version for o in rewritten.opset_import}[svd_ops.DOMAIN] == svd_ops.DOMAIN_VERSION
    factors = {t.name: numpy_helper.to_array(t).shape for t in rewritten.graph.initializer}
    assert factors == {"W.svd_u": (16, 4), "W.svd_v": (4, 24), "b": (24,)}


def test_low_rank_output_error_matches_the_reported_weight_error():
    original = graphs.matmul(64, 96)
    rewritten, report = _rewrite_proto(original, RankOptions(rank=8))
    w = graphs.weight(64, 96)
    u = numpy_helper.to_array(next(t for t in rewritten.graph.initializer if t.name == "W.svd_u"))
    v = numpy_helper.to_array(next(t for t in rewritten.graph.initializer if t.name == "W.svd_v"))
    measured = np.linalg.norm(w - u @ v) / np.linalg.norm(w)
    assert report.layers[0].relative_error == pytest.approx(measured, rel=1e-4)
    x = _x(64)
    np.testing.assert_allclose(_run(rewritten, x), x @ u @ v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT16, ir.DataType.BFLOAT16])
def test_factors_keep_the_weight_dtype(dtype):
    model = ir.serde.deserialize_model(graphs.matmul(32, 48))
    weight = model.graph.initializers["W"]
    stored = ir.tensor(graphs.weight(32, 48).astype(dtype.numpy()), dtype=dtype, name="W")
    weight.const_value, weight.type = stored, ir.TensorType(dtype)
    rewritten = _rewrite(model, RankOptions(rank=16)).model
    u, v = rewritten.graph.initializers["W.svd_u"], rewritten.graph.initializers["W.svd_v"]
    assert u.const_value.dtype == dtype and v.const_value.dtype == dtype
    assert u.const_value.shape == (32, 16) and v.const_value.shape == (16, 48)


def test_a_rank_that_saves_nothing_stays_dense():
    result = _rewrite(graphs.matmul(16, 24), RankOptions(keep=0.9, align=16))
    (outcome,) = result.report.layers
    assert outcome.status == "dense" and "saves nothing" in outcome.reason
    assert [node.op_type for node in result.model.graph] == ["MatMul"]


def test_no_linear_layers_is_an_error():
    with pytest.raises(ModelError, match="no linear layer found"):
        _rewrite(graphs.no_linear_layers(), RankOptions())


def test_explicit_rank_above_min_k_n_is_an_error_in_the_apis_terms():
    with pytest.raises(OptionError, match="ranks.rank 17 is above min") as caught:
        _rewrite(graphs.matmul(16, 24), RankOptions(rank=17))
    assert caught.value.message(lambda option: f"<{option}>").startswith("<ranks.rank> 17 is above min")


def test_an_in_memory_model_is_left_unchanged():
    model = ir.serde.deserialize_model(graphs.matmul(16, 24))
    result = _rewrite(model, RankOptions(rank=4))
    assert [node.op_type for node in model.graph] == ["MatMul"]
    assert [node.op_type for node in result.model.graph] == [svd_ops.SVD_MATMUL]


def test_mlp_targets_leave_attention_alone(export, tmp_path):
    report = rewrite_file(export("llama", "dynamo"), tmp_path / "mlp.onnx", RankOptions(keep=0.5, align=32))
    factorized = {(layer.group, layer.role) for layer in report.factorized}
    assert factorized == {("mlp", "gate"), ("mlp", "up"), ("mlp", "down")}
    assert len(report.factorized) == 6
    proto = onnx.load(tmp_path / "mlp.onnx")
    assert len(_svd_nodes(proto)) == 6
    assert sum(node.op_type == "MatMul" for node in proto.graph.node) >= 9  # 8 attention projections + lm_head + scores


def test_tied_lm_head_keeps_the_embedding_weight(export, tmp_path):
    source = export("llama-tied", "dynamo")
    rewrite_file(source, tmp_path / "head.onnx", RankOptions(keep=0.5, align=32), EVERY_LAYER)
    original = onnx.load(source)
    rewritten = onnx.load(tmp_path / "head.onnx")
    gather = next(node for node in rewritten.graph.node if node.op_type == "Gather")
    embedding = next(t for t in rewritten.graph.initializer if t.name == gather.input[0])
    original_embedding = next(t for t in original.graph.initializer if t.name == gather.input[0])
    np.testing.assert_array_equal(numpy_helper.to_array(embedding), numpy_helper.to_array(original_embedding))
    assert sum(node.domain == svd_ops.DOMAIN for node in rewritten.graph.node) == 15


def test_external_data_in_external_data_out(export, tmp_path):
    source = export("llama", "dynamo", external_data=True)
    assert (source.parent / "model.onnx.data").exists()
    destination = tmp_path / "out" / "rewritten.onnx"
    rewrite_file(source, destination, RankOptions(keep=0.5, align=32))
    assert (destination.parent / "rewritten.onnx.data").stat().st_size > 1_000_000
    assert destination.stat().st_size < 1_000_000  # the graph alone
    assert sorted(p.name for p in destination.parent.iterdir()) == ["rewritten.onnx", "rewritten.onnx.data"]
    check_model_file(destination)


def test_failed_validation_leaves_nothing_on_disk(tmp_path):
    model = ir.serde.deserialize_model(graphs.matmul())

    def reject(path):
        raise OnnxNmmError("rejected")

    with pytest.raises(OnnxNmmError):
        save_model(model, tmp_path / "out.onnx", external_data=True, validate=reject)
    assert list(tmp_path.iterdir()) == []


def test_a_weight_older_exporters_also_list_as_an_input_is_replaced_inputs_and_all():
    rewritten, report = _rewrite_proto(graphs.weight_as_graph_input(), RankOptions(rank=4))
    assert report.layers[0].status == "factorized"
    assert [value.name for value in rewritten.graph.input] == ["X"]  # W is neither required nor kept
    assert "W" not in {tensor.name for tensor in rewritten.graph.initializer}
