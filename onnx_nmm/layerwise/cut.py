"""Cut a decoder's graph at the residual stream between its layers: a prologue with the first layer, one
segment per later layer, and the head, each a model of its own that onnxruntime runs.

    boundary Bᵢ   the residual Add after layer i's MLP: the nearest Add below the output projection whose
                  other operand does not come from the MLP (a post-norm between them is passed through), or
                  the sum an onnxruntime Skip*LayerNormalization keeps
    segment 0     every node B₀ depends on: the embedding, the masks and rotary tables, layer 0
    segment i     the nodes that depend on Bᵢ₋₁ and that Bᵢ (or a later segment) needs: layer i
    head          what the logits need of B_{N-1}: the final norm, the lm_head

A node that depends on no boundary (a mask, a rotary table, a shape computed from the token ids) is copied
into every later segment that reads it, which then takes the graph inputs it needs; a value one segment
makes and a later one reads (Bᵢ₋₁ always, sometimes a shape) is carried between them. Nodes that only make
the cache (`present.*`) are left out: a segment computes what the next one needs and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from onnx_nmm.errors import ModelError

FREE = -1  # depends on no boundary
# onnxruntime's contrib ops that add the residual and normalize at once (output 3: the sum)
FUSED_RESIDUAL_NORMS = ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")


@dataclass
class Segment:
    """One piece of the cut graph: a model reading `inputs` (carried values and graph inputs) and writing
    `outputs` (its boundary first, then what later segments read)."""

    index: int  # 0 … layers − 1 for the decoder layers, `layers` for the head
    model: onnx.ModelProto
    carried_inputs: list[str]  # made by an earlier segment
    graph_inputs: list[str]  # inputs of the whole model (token ids, mask, positions, an empty cache)
    outputs: list[str]

    @property
    def boundary(self) -> str:
        return self.outputs[0]


@dataclass
class DecoderCut:
    boundaries: list[str]
    segments: list[Segment]  # one per layer, then the head

    @property
    def layers(self) -> int:
        return len(self.boundaries)

    @property
    def head(self) -> Segment:
        return self.segments[-1]


def residual_boundary(down_output: str, proto: onnx.ModelProto) -> str:
    """Bᵢ of the layer whose MLP's output projection writes `down_output`."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in proto.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    constants = _constant_names(proto.graph)
    below, frontier = {down_output}, [down_output]
    while frontier:
        value = frontier.pop(0)
        for node in consumers.get(value, []):
            if node.op_type in FUSED_RESIDUAL_NORMS:  # onnxruntime's Add and norm in one: its sum, when it is kept
                return node.output[3] if len(node.output) > 3 and node.output[3] else node.output[0]
            if node.op_type == "Add":
                other = [name for name in node.input if name not in below]
                if other and not all(name in constants for name in other):
                    return node.output[0]
            if len(below) > 64:
                break
            for output in node.output:
                if output not in below:
                    below.add(output)
                    frontier.append(output)
    raise ModelError(f"no residual Add follows the MLP output '{down_output}': the layer-wise rewrite needs "
                     "a decoder whose layers add their MLP to the residual stream; rewrite in memory")


def cut_decoder(proto: onnx.ModelProto, boundaries: list[str], logits: str) -> DecoderCut:
    """`proto` (a single-step graph, external weights not loaded) cut at `boundaries`, in layer order."""
    graph = proto.graph
    nodes = list(graph.node)
    producer = {output: index for index, node in enumerate(nodes) for output in node.output if output}
    for name in [*boundaries, logits]:
        if name not in producer:
            raise ModelError(f"no node of the graph computes '{name}'")
    segment_of = _segments_of(nodes, producer, {name: layer for layer, name in enumerate(boundaries)})
    for layer, name in enumerate(boundaries):
        if segment_of[producer[name]] != (layer if layer else FREE):
            raise ModelError(f"layer {layer}'s output does not follow from layer {layer - 1}'s alone: its layers are "
                             "not one residual stream (attention and MLP in parallel?); rewrite in memory")
    useful = _ancestors(nodes, producer, [*boundaries, logits], stop=lambda index: False)
    last_reader: dict[str, int] = {}
    for index in useful:
        for name in _reads(nodes[index]):
            last_reader[name] = max(last_reader.get(name, FREE), segment_of[index])
    types = _value_types(proto)
    segments = []
    for index in range(len(boundaries) + 1):
        outputs = [boundaries[index] if index < len(boundaries) else logits]
        made_here = {i for i, segment in enumerate(segment_of) if segment == index}
        made_here |= {producer[outputs[0]]}  # layer 0's last node is free, and may make more than the boundary
        outputs += sorted(name for name, reader in last_reader.items()
                          if reader > index and producer.get(name) in made_here and name not in outputs)
        before = {producer[name] for name in boundaries[:index]}  # carried, never made again
        kept = _ancestors(nodes, producer, outputs,
                          stop=lambda i, index=index, before=before: segment_of[i] not in (index, FREE) or i in before)
        segments.append(_segment(proto, index, [nodes[i] for i in sorted(kept)], outputs, types))
    return DecoderCut(list(boundaries), segments)


def _segments_of(nodes: list[onnx.NodeProto], producer: dict[str, int], boundary_layer: dict[str, int]) -> list[int]:
    """For each node, 1 + the last boundary it depends on (the segment it belongs to), or FREE."""
    after_boundary = {producer[name]: layer + 1 for name, layer in boundary_layer.items()}
    segment_of: list[int] = []
    for node in nodes:  # exporters write nodes in topological order; onnx.checker insists on it
        segment = FREE
        for name in _reads(node):
            if producer.get(name) in after_boundary:  # any output of the node that makes a boundary
                segment = max(segment, after_boundary[producer[name]])
            elif name in producer and producer[name] < len(segment_of):
                segment = max(segment, segment_of[producer[name]])
        segment_of.append(segment)
    return segment_of


def _ancestors(nodes: list[onnx.NodeProto], producer: dict[str, int], outputs: list[str], stop) -> set[int]:
    """Indices of the nodes `outputs` depend on, not going past (nor taking) a node `stop` says is outside."""
    found: set[int] = set()
    stack = [producer[name] for name in outputs if name in producer]
    while stack:
        index = stack.pop()
        if index in found or stop(index):
            continue
        found.add(index)
        stack.extend(producer[name] for name in _reads(nodes[index]) if name in producer)
    return found


def _reads(node: onnx.NodeProto) -> list[str]:
    """The values a node reads, those its subgraphs capture from outside included."""
    names = [name for name in node.input if name]
    for attribute in node.attribute:
        for subgraph in [attribute.g, *attribute.graphs] if attribute.type in (onnx.AttributeProto.GRAPH,
                                                                                onnx.AttributeProto.GRAPHS) else []:
            inner = {output for inner_node in subgraph.node for output in inner_node.output}
            inner |= {value.name for value in subgraph.input} | {tensor.name for tensor in subgraph.initializer}
            names += [name for inner_node in subgraph.node for name in _reads(inner_node) if name not in inner]
    return names


def _value_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """The type of every value shape inference can tell (element type and, where known, shape)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:
        inferred = proto
    graph = inferred.graph
    return {info.name: info.type for info in [*graph.input, *graph.value_info, *graph.output]}


def _segment(proto: onnx.ModelProto, index: int, nodes: list[onnx.NodeProto], outputs: list[str],
             types: dict[str, onnx.TypeProto]) -> Segment:
    graph = proto.graph
    made = {output for node in nodes for output in node.output}
    read = list(dict.fromkeys(name for node in nodes for name in _reads(node)))
    initializers = [tensor for tensor in graph.initializer if tensor.name in set(read)]
    constant = {tensor.name for tensor in initializers}
    graph_inputs = {value.name for value in graph.input}
    inputs = [name for name in read if name not in made and name not in constant]
    missing = [name for name in inputs if name not in graph_inputs and name not in types]
    if missing:
        raise ModelError(f"segment {index} reads '{missing[0]}', whose type the graph does not say")

    def info(name: str) -> onnx.ValueInfoProto:
        value = onnx.ValueInfoProto(name=name)
        if name in types:
            value.type.CopyFrom(types[name])
        return value

    model = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, f"{graph.name}_segment_{index}", [info(name) for name in inputs],
                               [info(name) for name in outputs], initializers),
        opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    model.functions.extend(proto.functions)
    return Segment(index, model, [name for name in inputs if name not in graph_inputs],
                   [name for name in inputs if name in graph_inputs], outputs)


def _constant_names(graph: onnx.GraphProto) -> set[str]:
    return {tensor.name for tensor in graph.initializer} | {
        output for node in graph.node if node.op_type == "Constant" for output in node.output}
