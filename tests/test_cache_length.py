"""passes/cache_length.py on the pattern transformers exports: positions Range(0, S) + P and the key index
Range(0, P + S), both from P = Shape(past)[2]. After the pass the positions start at the write position and the
key index keeps the length the graph sees."""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnx_nmm.passes.cache_length import LengthSource, derive_from_lengths

SEEN, NEW = 7, 2  # the past as the graph sees it, the step's tokens


def _graph() -> tuple[ir.Model, ir.Value, ir.Value]:
    """(past [1, 1, SEEN, 4], tokens [1, NEW], position [1]) -> (positions, key_index, keys_shaped): what the
    graph computes from the past's length, as values and as a size."""
    past = ir.Value(name="past", shape=ir.Shape([1, 1, SEEN, 4]), type=ir.TensorType(ir.DataType.FLOAT))
    tokens = ir.Value(name="tokens", shape=ir.Shape([1, NEW]), type=ir.TensorType(ir.DataType.INT64))
    position = ir.Value(name="position", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    graph = ir.Graph([past, tokens, position], [], nodes=[], opset_imports={"": 20}, name="lengths")
    builder = ir.tape.Tape(graph)
    p = builder.op("Squeeze", [builder.op("Shape", [past], attributes={"start": 2, "end": 3})])
    s = builder.op("Squeeze", [builder.op("Shape", [tokens], attributes={"start": 1, "end": 2})])
    zero, one = (builder.op("Constant", [], attributes={"value": ir.tensor(np.array(k, np.int64))}) for k in (0, 1))
    positions = builder.op("Add", [builder.op("Range", [zero, s, one]), p])  # cache_position
    total = builder.op("Add", [p, s])
    key_index = builder.op("Range", [zero, total, one])  # the key axis: a size
    shape = builder.op("Concat", [builder.op("Unsqueeze", [total, zero]), builder.op("Constant", [], attributes={
        "value": ir.tensor(np.array([4], np.int64))})], attributes={"axis": 0})
    keys_shaped = builder.op("Expand", [builder.op("Constant", [], attributes={
        "value": ir.tensor(np.zeros((1, 4), np.float32))}), shape])
    for value, name in ((positions, "positions"), (key_index, "key_index"), (keys_shaped, "keys_shaped")):
        value.name = name
        graph.outputs.append(value)
    for node in builder.nodes:
        graph.append(node)
    return ir.Model(graph, ir_version=10), past, position


def _run(model: ir.Model, position: int) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"past": np.zeros((1, 1, SEEN, 4), np.float32), "tokens": np.zeros((1, NEW), np.int64),
             "position": np.array([position], np.int64)}
    return dict(zip([output.name for output in session.get_outputs()], session.run(None, feeds)))


def test_positions_follow_the_write_position_and_sizes_the_length_the_graph_sees():
    model, past, position = _graph()
    before = _run(model, 3)
    assert before["positions"].tolist() == [SEEN, SEEN + 1]  # where a static cache's length puts them

    assert derive_from_lengths(model.graph, [LengthSource(past, axis=2)], position) > 0
    for written in (0, 3, 5):
        after = _run(model, written)
        assert after["positions"].tolist() == [written, written + 1]
        assert after["key_index"].tolist() == list(range(SEEN + NEW))
        assert after["keys_shaped"].shape == (SEEN + NEW, 4)


def test_a_graph_that_reads_the_length_only_as_a_size_is_left_as_it_was():
    model, past, position = _graph()
    for name in ("positions",):
        model.graph.outputs.remove(next(value for value in model.graph.outputs if value.name == name))
    nodes = len(model.graph)
    assert derive_from_lengths(model.graph, [LengthSource(past, axis=2)], position) == 0
    assert len(model.graph) == nodes - 1  # only the positions' Add, now unread, is gone
