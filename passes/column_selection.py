"""Which columns of a projection's output a value downstream holds, found by evaluation.

Phi-3 computes gate and up with one projection and splits its output in two; exporters spell the split
as a Split node, as two Slices with constant bounds, or as Slices whose bounds are computed from the
output's Shape. Rather than one pattern per spelling, the nodes between the projection's output and the
halves are run (onnx's reference evaluator) on a probe whose every element is its own flat index: each
half then shows exactly which columns of which row it took.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import onnx_ir as ir

from onnx_nmm.passes.activation_match import in_dependency_order
from onnx_nmm.passes.mlp_rules.pattern import SELECTIONS

MAX_NODES = 40
PROBE_ROWS = 2


def selection_region(source: ir.Value, targets: list[ir.Value]) -> list[ir.Node] | None:
    """The nodes computing `targets` from `source` (and constants, and `source`'s shape), each after those it
    reads; None if a target depends on anything else, or if a value reaches a target other than by selection."""
    region: list[ir.Node] = []
    pending = list(targets)
    while pending:
        value = pending.pop()
        if value is source or value.const_value is not None:
            continue
        if value.is_graph_input():
            return None
        node = value.producer()
        if node is None or node.domain != "" or len(region) > MAX_NODES:
            return None
        if node not in region:
            region.append(node)
            pending.extend(input for input in node.inputs if input is not None)
    region = in_dependency_order(region)
    return region if _carries_only_by_selection(region, source) else None


def selected_columns(source: ir.Value, targets: list[ir.Value], region: list[ir.Node], width: int,
                     opset: int) -> list[np.ndarray] | None:
    """For each target, the columns of `source` (of `width` columns, the last axis) it holds in order, the
    same for every row; None if a target holds anything else (rows mixed, a column transformed)."""
    rank = len(source.shape) if source.shape is not None else 3
    probe = np.arange(PROBE_ROWS * width, dtype=np.float32).reshape((1,) * (rank - 2) + (PROBE_ROWS, width))
    try:
        results = onnx.reference.ReferenceEvaluator(_probe_model(source, targets, region, opset)).run(
            None, {_name(source): probe})
    except Exception:  # noqa: BLE001 - a region the evaluator cannot run is simply not a selection
        return None
    columns = []
    for result in map(np.asarray, results):
        if result.size % PROBE_ROWS:
            return None
        rows = result.reshape(PROBE_ROWS, -1)
        # Row r of a target holds elements r·width + c: the columns c of row r of the projection, untouched.
        if not (np.all(rows[1] - rows[0] == width) and np.all((rows[0] >= 0) & (rows[0] < width))
                and np.all(rows[0] == np.round(rows[0]))):
            return None
        columns.append(rows[0].astype(np.int64))
    return columns


def _carries_only_by_selection(region: list[ir.Node], source: ir.Value) -> bool:
    """Whether every node of `region` (in dependency order) that reads `source`'s values (not just its Shape)
    is a selection reading them as its data input."""
    carried = {id(source)}
    for node in region:
        reads = [i for i, value in enumerate(node.inputs) if value is not None and id(value) in carried]
        if node.op_type == "Shape" or not reads:
            continue
        if node.op_type not in SELECTIONS or reads != [0]:
            return False
        carried.update(id(value) for value in node.outputs)
    return True


def _probe_model(source: ir.Value, targets: list[ir.Value], region: list[ir.Node], opset: int) -> onnx.ModelProto:
    inside = {id(value) for node in region for value in node.outputs}
    constants = {_name(value): _constant(value) for node in region for value in node.inputs
                 if value is not None and value is not source and id(value) not in inside}
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(node) for node in region], "selection",
        [onnx.helper.make_tensor_value_info(_name(source), onnx.TensorProto.FLOAT, None)],
        [onnx.helper.make_tensor_value_info(_name(value), onnx.TensorProto.FLOAT, None) for value in targets],
        initializer=[_named(ir.serde.serialize_tensor(tensor), name) for name, tensor in constants.items()])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])


def _name(value: ir.Value) -> str:
    assert value.name is not None, "the values of a loaded graph have names"
    return value.name


def _constant(value: ir.Value) -> ir.TensorProtocol:
    """What a value the region reads from outside holds: selection_region let in constants alone."""
    assert value.const_value is not None, "a selection region reads constants besides its source"
    return value.const_value


def _named(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    tensor.name = name
    return tensor
