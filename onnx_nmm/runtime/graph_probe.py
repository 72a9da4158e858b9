"""Read values from inside a model: expose them as outputs, prune what they do not need, and see a merged
decoder as the graph its first step runs.

Calibration (activation_stats) and sequential calibration (sequential) both run the original model cut
down to the inner values they observe; neither the logits nor any layer past those values is computed.
A merged decoder keeps its layers in the two branches of an If (first step, later steps); what observes
or lowers them sees the first step's branch in place of the If (`first_step`), the prefill every
calibration window, perplexity window and training window is.
"""

from __future__ import annotations

import onnx


def value_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value, with shape inference filling in what the exporter left out."""
    types = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:
        inferred = proto
    graph = inferred.graph
    for info in list(graph.value_info) + list(graph.input) + list(graph.output):
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            types[info.name] = info.type.tensor_type.elem_type
    return types


def expose(proto: onnx.ModelProto, values: list[str], types: dict[str, int]) -> onnx.ModelProto:
    """`proto` (changed in place) with `values` as its only outputs and every node they do not need pruned."""
    del proto.graph.output[:]
    for value in values:
        proto.graph.output.append(onnx.helper.make_tensor_value_info(value, types.get(value, onnx.TensorProto.FLOAT),
                                                                     None))
    prune(proto.graph)
    return proto


def prune(graph: onnx.GraphProto) -> None:
    """Drop every node the graph outputs do not depend on."""
    producers = {output: node for node in graph.node for output in node.output}
    needed, stack = set(), [output.name for output in graph.output]
    while stack:
        node = producers.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(value for value in node.input if value)
            for attribute in node.attribute:  # values captured by subgraphs (If/Loop bodies)
                for subgraph in [attribute.g, *attribute.graphs]:
                    stack.extend(value for inner in subgraph.node for value in inner.input if value)
    kept = [node for node in graph.node if id(node) in needed]
    del graph.node[:]
    graph.node.extend(kept)


def first_step(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` (changed in place) with every If on a boolean graph input — a merged decoder's use_cache_branch
    — replaced by its else branch, the one an empty cache takes. A graph without one is returned as it is."""
    return _taken_branch(proto, "else_branch")


def with_past_step(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` (changed in place) with a merged decoder's If replaced by its then branch, the step after the first
    (it reads the past), and the flag input, now read by nothing, gone. Any other graph is returned as it is."""
    taken = _taken_branch(proto, "then_branch")
    read = {name for node in taken.graph.node for name in node.input}
    flags = [value for value in taken.graph.input if value.type.tensor_type.elem_type == onnx.TensorProto.BOOL
             and value.name not in read]
    for value in flags:
        taken.graph.input.remove(value)
    return taken


def _taken_branch(proto: onnx.ModelProto, branch_name: str) -> onnx.ModelProto:
    graph = proto.graph
    flags = {value.name for value in graph.input if value.type.tensor_type.elem_type == onnx.TensorProto.BOOL}
    if not any(node.op_type == "If" and node.input[0] in flags for node in graph.node):
        return proto
    nodes = []
    for node in graph.node:
        if node.op_type != "If" or node.input[0] not in flags:
            nodes.append(node)
            continue
        branch = next(attribute.g for attribute in node.attribute if attribute.name == branch_name)
        nodes.extend(branch.node)
        graph.initializer.extend(branch.initializer)
        nodes.extend(onnx.helper.make_node("Identity", [inner.name], [outer])
                     for inner, outer in zip(branch.output, node.output) if inner.name != outer)
    del graph.node[:]
    graph.node.extend(nodes)
    return proto
