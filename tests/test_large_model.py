"""A model over 2 GB: external data in, external data out, checked by path, run by onnxruntime.

Slow (writes ~5 GB): runs in CI, skip locally with -m "not slow".
"""

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_nmm.cli import main
from onnx_nmm.model_io import PROTOBUF_LIMIT

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gigabytes")]  # one at a time with test_real_model.py

K, N, LAYERS = 2048, 40000, 8  # 8 × 328 MB of float32 weights


def _write_large_model(folder):
    """Y_i = X · W_i for 8 weights stored in one external-data file, written chunk by chunk."""
    folder.mkdir(parents=True)
    data = folder / "model.onnx.data"
    initializers, nodes, outputs = [], [], []
    rng = np.random.default_rng(0)
    with data.open("wb") as out:
        for i in range(LAYERS):
            offset = out.tell()
            for rows in np.array_split(np.arange(K), 8):
                (rng.standard_normal((len(rows), N), dtype=np.float32) / 45).tofile(out)
            tensor = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[K, N],
                                 data_location=TensorProto.EXTERNAL)
            for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(out.tell() - offset))):
                tensor.external_data.add(key=key, value=value)
            initializers.append(tensor)
            nodes.append(helper.make_node("MatMul", ["X", f"W{i}"], [f"Y{i}"],
                                          name=f"/model/layers.{i}/mlp/up_proj/MatMul"))
            outputs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["batch", N]))
    graph = helper.make_graph(nodes, "large", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", K])],
                              outputs, initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10),
              folder / "model.onnx")
    return folder / "model.onnx"


@pytest.fixture(scope="module")
def large_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("large")
    yield _write_large_model(folder / "in")
    shutil.rmtree(folder)


def _weights(model_path):
    return np.memmap(model_path.parent / "model.onnx.data", dtype=np.float32, mode="r", shape=(LAYERS, K, N))


def test_a_model_over_2_gb_is_rewritten_and_runs(large_model, tmp_path, capsys):
    source = large_model
    assert (source.parent / "model.onnx.data").stat().st_size > PROTOBUF_LIMIT
    output = tmp_path / "out" / "rewritten.onnx"
    code = main(["rewrite", str(source), "-o", str(output), "--include", r"layers\.0\.", "--rank", "64", "--svd",
                 "randomized", "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "rewritten.onnx.data").stat().st_size > PROTOBUF_LIMIT  # 7 dense weights remain
    assert output.stat().st_size < 1_000_000
    x = np.random.default_rng(1).standard_normal((2, K)).astype(np.float32)
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    results = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"X": x})))
    rewritten = onnx.load(str(output), load_external_data=False)
    assert [n.op_type for n in rewritten.graph.node].count("SvdMatMul") == 1
    weights = _weights(source)
    np.testing.assert_allclose(results["Y3"], x @ weights[3], rtol=1e-4, atol=1e-3)  # untouched layer: exact
    relative = np.linalg.norm(results["Y0"] - x @ weights[0]) / np.linalg.norm(x @ weights[0])
    assert 0.5 < relative < 1.0  # rank 64 of a random 2048×40000 matrix keeps little, but it is an approximation


def test_a_model_over_2_gb_lowers_to_pytorch(large_model):
    """In memory, as `compile` hands it over: shape inference and onnx2torch must not serialize it whole."""
    import torch

    from onnx_nmm.lowering import call_lowered, lower

    module = lower(onnx.load(str(large_model)))
    x = np.random.default_rng(2).standard_normal((2, K)).astype(np.float32)
    outputs = call_lowered(module, torch.from_numpy(x))
    np.testing.assert_allclose(outputs[5].numpy(), x @ _weights(large_model)[5], rtol=1e-4, atol=1e-3)
