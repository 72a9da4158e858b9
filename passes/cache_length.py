"""What a graph computes from its cache's length, computed from where the step writes instead.

An export without position inputs (transformers' with a DynamicCache) derives the step's positions, and its
causal and padding masks, from the length of its past inputs:

    P = Shape(past)[2] ─ Range(0, S) + P ─ positions ─ rotary tables; the causal mask's query index
                       └ P + S ─ Range(0, P + S) (the key index), Reshape, Expand: the key axis's size

A static cache always has the same length (passes/static_cache.py shows a decode step max - 1 past positions,
so that with its token it attends over all max), so P computed from it puts every decode step at the cache's last
position. The model the graph came from saw P = the write position. Both are needed: the graph's static shapes
need P as it sees it, the model's values P as the model saw it. So every value computed from a length is made
twice where it must be:

    as a size   P as the graph sees it: what an input that sets an output's shape reads (Reshape's shape,
                Expand's, ConstantOfShape's, Tile's repeats, Range's and Slice's bounds)
    as a value  P as the model saw it: what everything else reads

Range and Slice keep the length their bounds give as sizes and start where the values put them:

    Range(start, limit)  →  Range(start', start' + (limit - start))      start' the start as a value

A node whose outputs are never read as sizes reads the values in place; one whose outputs are also read as
sizes gets a copy that reads the values. Shape and Size read only a shape, which both share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

# The inputs of each op that set the shape of its output rather than its values.
SIZE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "ConstantOfShape": (0,), "Tile": (1,), "Pad": (1,), "OneHot": (1,),
    "Resize": (3,), "TopK": (1,), "Split": (1,), "Range": (0, 1, 2), "Slice": (1, 2, 3, 4),
}
_SHAPE_READERS = ("Shape", "Size")
SHAPE_ALIASES = ("Identity", "Cast", "Concat")  # pass a tensor's shape on unchanged (one input each)


@dataclass(frozen=True)
class LengthSource:
    """A value (a graph input) whose axis `axis` the graph sees at a fixed length, where the model it came from
    saw the write position plus `beyond` (the past: 0; the attention mask, which covers the new tokens too: their
    count)."""

    value: ir.Value
    axis: int
    beyond: int = 0


def derive_from_lengths(graph: ir.Graph, sources: list[LengthSource], position: ir.Value) -> int:
    """Every value `graph` computes from a source's length, computed from the write position `position` (an int64
    tensor of shape [1]) instead; the graph is changed in place. How many nodes now read the lengths as the model
    saw them."""
    values = _source_shapes(graph, sources, position)
    if not values:
        return 0
    graph.sort()
    region = _downstream(graph, set(values))
    sizes = _read_as_sizes(graph, region)
    changed = []
    for node in list(graph):
        if node.op_type in _SHAPE_READERS or not any(value in values for value in node.inputs):
            continue
        made = _as_value(graph, node, values, copy=any(output in sizes for output in node.outputs))
        if made is None:
            continue
        changed.append(made)
        if made is not node:  # a copy: what reads the outputs as values reads the copy's
            values.update(zip(node.outputs, made.outputs))
    for index, output in enumerate(graph.outputs):
        if output in values:
            graph.outputs[index] = values[output]
    graph.sort()
    _remove_unread(graph, region | {output for node in changed for output in node.outputs})
    return sum(1 for node in changed if node.graph is graph)


def _source_shapes(graph: ir.Graph, sources: list[LengthSource], position: ir.Value) -> dict[ir.Value, ir.Value]:
    """Each Shape of a source (or of an alias of one) whose range includes the axis → that shape with the
    source's length as the model saw it on the axis."""
    values: dict[ir.Value, ir.Value] = {}
    lengths = {0: position}
    for source in sources:
        for reader in _shape_readers(source.value):
            rank = len(source.value.shape) if source.value.shape is not None else None
            start, end = _shape_range(reader, rank)
            if not start <= source.axis < end:
                continue
            shaped = reader.inputs[0]
            pieces = [*([append_node(graph, "Shape", [shaped], f"{reader.name}.before", start=start, end=source.axis)]
                        if source.axis > start else []),
                      _length(graph, position, source.beyond, lengths),
                      *([append_node(graph, "Shape", [shaped], f"{reader.name}.after", start=source.axis + 1, end=end)]
                        if end > source.axis + 1 else [])]
            values[reader.outputs[0]] = (pieces[0] if len(pieces) == 1 else
                                         append_node(graph, "Concat", pieces, f"{reader.name}.as_value", axis=0))
    return values


def _shape_readers(value: ir.Value) -> list[ir.Node]:
    """The Shape nodes that read `value`, directly or through aliases that keep its shape."""
    readers, pending = [], [value]
    while pending:
        for use in pending.pop().uses():
            if use.node.op_type == "Shape":
                readers.append(use.node)
            elif use.node.op_type in SHAPE_ALIASES and len(use.node.inputs) == 1:
                pending.extend(use.node.outputs)
    return readers


def _shape_range(node: ir.Node, rank: int | None) -> tuple[int, int]:
    """The [start, end) of the dims a Shape node gives (its attributes, negative ones from the end)."""
    start = node.attributes["start"].as_int() if "start" in node.attributes else 0
    end = node.attributes["end"].as_int() if "end" in node.attributes else None
    if rank is None:
        if start < 0 or (end is not None and end < 0):
            raise ValueError(f"'{node.name}' reads the cache's shape from its end, and the cache's rank is unknown")
        return start, end if end is not None else 1 << 30
    start = start + rank if start < 0 else start
    end = rank if end is None else (end + rank if end < 0 else min(end, rank))
    return start, end


def _downstream(graph: ir.Graph, starts: set[ir.Value]) -> set[ir.Value]:
    """Every value computed from `starts` (in a sorted graph), shape readers aside."""
    reached = set(starts)
    for node in graph:
        if node.op_type not in _SHAPE_READERS and any(value in reached for value in node.inputs):
            reached.update(node.outputs)
    return reached


def _read_as_sizes(graph: ir.Graph, region: set[ir.Value]) -> set[ir.Value]:
    """The values of `region` some size input reads, and those they are computed from."""
    sizes = {value for node in graph for index, value in enumerate(node.inputs)
             if index in SIZE_INPUTS.get(node.op_type, ()) and value is not None and value in region}
    pending = list(sizes)
    while pending:
        producer = pending.pop().producer()
        if producer is None or producer.op_type in _SHAPE_READERS:
            continue
        for value in producer.inputs:
            if value in region and value not in sizes:
                sizes.add(value)
                pending.append(value)
    return sizes


def _as_value(graph: ir.Graph, node: ir.Node, values: dict[ir.Value, ir.Value], copy: bool) -> ir.Node | None:
    """The node computing its outputs as values: itself (changed) or, with `copy`, a new node beside it; None
    where it reads the lengths only as sizes."""
    if node.op_type in ("Range", "Slice"):
        return _bounded_as_value(graph, node, values)
    size_inputs = SIZE_INPUTS.get(node.op_type, ())
    reads = {index: values[value] for index, value in enumerate(node.inputs)
             if value in values and index not in size_inputs}
    if not reads:
        return None
    if not copy:
        for index, value in reads.items():
            node.replace_input_with(index, value)
        return node
    subgraphs = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
    if any(attribute.type in subgraphs for attribute in node.attributes.values()):
        raise ValueError(f"'{node.name}' ({node.op_type}) computes both a size and a value from the cache's length "
                         "inside a subgraph, which the static cache cannot split")
    inputs = [reads.get(index, value) for index, value in enumerate(node.inputs)]
    twin = ir.Node(node.domain, node.op_type, inputs, list(node.attributes.values()), num_outputs=len(node.outputs),
                   version=node.version, name=f"{node.name}.as_value")
    graph.append(twin)
    for output, made in zip(node.outputs, twin.outputs):
        made.type, made.shape, made.name = output.type, output.shape, f"{output.name}.as_value"
    return twin


def _bounded_as_value(graph: ir.Graph, node: ir.Node, values: dict[ir.Value, ir.Value]) -> ir.Node | None:
    """A Range (start, limit, delta) or Slice (data, starts, ends, ...) whose start or data is a value: a new one,
    as long as its bounds make it, starting where the start's value puts it."""
    start_index = 0 if node.op_type == "Range" else 1
    data = node.inputs[0] if node.op_type == "Slice" else None
    start = node.inputs[start_index]
    if start not in values and data not in values:
        return None
    inputs = list(node.inputs)
    if data is not None and data in values:
        inputs[0] = values[data]
    if start in values:
        length = append_node(graph, "Sub", [node.inputs[start_index + 1], start], f"{node.name}.length")
        inputs[start_index] = values[start]
        inputs[start_index + 1] = append_node(graph, "Add", [values[start], length], f"{node.name}.end_as_value")
    twin = ir.Node("", node.op_type, inputs, list(node.attributes.values()), num_outputs=1,
                   name=f"{node.name}.as_value")
    graph.append(twin)
    made, output = twin.outputs[0], node.outputs[0]
    made.type, made.shape, made.name = output.type, output.shape, f"{output.name}.as_value"
    return twin


def _remove_unread(graph: ir.Graph, region: set[ir.Value]) -> None:
    """The nodes of `region` nothing reads any more (the sizes' copies of what now reads the values)."""
    outputs = set(graph.outputs)
    for node in reversed(list(graph)):
        if node.outputs and all(output in region and not output.uses() and output not in outputs
                                for output in node.outputs):
            graph.remove(node, safe=True)


def append_node(graph: ir.Graph, op_type: str, inputs: list, name: str, **attributes: int) -> ir.Value:
    """A node of the default domain appended to `graph`, its one output named `name`."""
    node = ir.Node("", op_type, inputs, [ir.AttrInt64(key, value) for key, value in attributes.items()],
                   num_outputs=1, name=name)
    node.outputs[0].name = name
    graph.append(node)
    return node.outputs[0]


def int64_constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """`array` (int64) as an initializer of `graph`."""
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.INT64),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _length(graph: ir.Graph, position: ir.Value, beyond: int, made: dict[int, ir.Value]) -> ir.Value:
    """position + beyond, made once per `beyond` (in `made`)."""
    if beyond not in made:
        name = f"{position.name}.plus_{beyond}"
        step = int64_constant(graph, f"{name}.step", np.array([beyond], np.int64))
        made[beyond] = append_node(graph, "Add", [position, step], name)
    return made[beyond]
