"""trainium/graph_session.py: onnxruntime on an in-memory graph whose weights protobuf could not hold (a static graph
of Qwen2.5-0.5B is 2.5 GB), the weights handed over as OrtValues, not serialized."""

import numpy as np
import onnx
import onnx_ir as ir
from exported_models import exported_model

from onnx_nmm.model_source import ModelSource
from onnx_nmm.runtime import ort_runner
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.trainium import graph_session


def test_a_graph_whose_weights_are_handed_over_computes_what_the_file_does(monkeypatch):
    path = exported_model("qwen2", "dynamo", cache=True)
    monkeypatch.setattr(graph_session, "WEIGHT_BYTES", 1024)  # all but the smallest weights, as a 2.5 GB graph's
    model = ir.load(path)
    proto, weights = graph_session.weightless_proto(model)
    assert weights and all(len(tensor.raw_data) == 0 for tensor in proto.graph.initializer if tensor.name in weights)
    assert proto.ByteSize() < sum(array.nbytes for array in weights.values())
    lm = CausalLm.of_source(ModelSource(path))
    feeds = lm.feeds(lm.random_tokens(1, 5, seed=0), None)
    expected = ort_runner.run(ModelSource(path).session(), feeds)
    actual = ort_runner.run(graph_session.session_of(proto, weights, "the test graph"), feeds)
    assert all(np.array_equal(expected[name], actual[name]) for name in expected)
    assert model.graph.initializers[next(iter(weights))].const_value is not None  # the model itself is unchanged


def test_graphs_read_from_one_proto_share_each_weight_as_one_array_and_write_the_same_proto():
    proto = onnx.load(exported_model("qwen2", "dynamo", cache=True))
    first, second = ir.from_proto(proto), ir.from_proto(proto)
    graph_session.weights_as_arrays([first, second])
    name = max(first.graph.initializers, key=lambda key: first.graph.initializers[key].const_value.nbytes)
    weight = first.graph.initializers[name].const_value
    assert not isinstance(weight, ir.TensorProtoTensor)
    assert weight is second.graph.initializers[name].const_value and weight.numpy() is weight.numpy()  # no copies
    assert ir.to_proto(first).SerializeToString() == proto.SerializeToString()
