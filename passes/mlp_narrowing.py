"""Narrow MLPs to the intermediate neurons they keep: every projection gets a narrower weight, stored as its
weight was, and the nodes between them compute the same on fewer columns.

    h  = f(X·W_g, X·W_u)        →    h_S = f(X·W_g[:, S], X·W_u[:, S])        S: the k neurons kept
    Y  = h·W_d (+ b_d)          →    Y   = h_S·W_d' (+ b_d)                   W_d' [k, H], refitted
    fc1 bias b₁                 →    b₁[S];  a reshape naming the width I     →    the same reshape naming k

The result is plain ONNX (MatMul, or the layer's own MatMulNBits, DequantizeLinear → MatMul or
MatMulInteger product): every runtime runs it at full speed. The pass is graph surgery only: the kept
neurons and the new weights come computed (onnx_nmm.decomposition.nystrom), quantized when they are to be stored so.
Each new product keeps the replaced node's name and metadata, so module paths and roles survive, and
records how wide the MLP was (NARROWED_KEY).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_nmm.passes import svd_ops
from onnx_nmm.passes.linear_layers import LinearLayer
from onnx_nmm.passes.mlp_rules.mlp import GRAPH_OUTPUT, Mlp, outside_reader
from onnx_nmm.passes.mlp_rules.pattern import RESHAPES
from onnx_nmm.passes.mlp_rules.rule_set import OUTPUT_PROJECTIONS, OWN_PROJECTIONS, by_output
from onnx_nmm.passes.quantized_weights import DEQUANTIZE, INTEGER, MICROSOFT, NBITS
from onnx_nmm.passes.rules import Mismatch, first_match
from onnx_nmm.passes.stored_weights import (
    NameAllocator,
    QuantizedFactor,
    bias_value,
    cast,
    dequantize,
    drop_unread_weight_inputs,
    initializer,
    integer_product,
    nbits_node,
    quantized_initializers,
)

# Node metadata of a narrowed product: "k of I", the neurons its MLP kept.
NARROWED_KEY = "onnx_nmm.narrowed"


def find_mlps(layers: list[LinearLayer]) -> tuple[list[Mlp[LinearLayer]], dict[str, str]]:
    """Every MLP among `layers` that narrowing can narrow (each site of one in several subgraphs), and for each
    output projection that heads none, why. Narrowed, an MLP computes what it did on fewer columns: nothing
    outside it but a Shape may read a value between its projections, every constant its activation reads must be
    a scalar, and a reshape between them must name the width as a constant."""
    projections = by_output(layers)
    mlps, unmatched = [], {}
    for down in layers:
        if down.role not in OUTPUT_PROJECTIONS:
            continue
        found = first_match(OWN_PROJECTIONS, down, projections)
        why = found.reason if isinstance(found, Mismatch) else _why_not_narrowed(found)
        if why:
            unmatched[down.name] = why
        else:
            mlps.append(found)
    return mlps, unmatched


def _why_not_narrowed(mlp: Mlp[LinearLayer]) -> str:
    """Why narrowing could not keep the MLP's computation as it is; "" when it can."""
    inside = {id(node) for node in mlp.region} | {id(node) for node in mlp.down.nodes}
    if mlp.down.quantizer is not None:
        inside.add(id(mlp.down.quantizer))
    values = [layer.output for layer in mlp.projections] + [value for node in mlp.region for value in node.outputs]
    reader = outside_reader(values, inside, mlp.down.node.graph, ignored=("Shape",))  # a Shape reads dimensions
    if reader == GRAPH_OUTPUT:
        return "a value between its projections is a graph output"
    if reader is not None:
        return f"{reader} outside the MLP reads a value between its projections"
    for node in mlp.region:
        if node.op_type == "Reshape":
            if width_constant(node, mlp.width, inside_values(mlp)) is None:
                return "a reshape between its projections computes its target shape"
            continue
        if node.op_type in RESHAPES:
            shape = node.outputs[0].shape
            if shape is None or not len(shape) or shape[-1] != mlp.width:
                return f"a {node.op_type} between its projections may move the width from the last axis"
            continue
        for value in node.inputs:
            constant = constant_array(value)
            if constant is not None and constant.size != 1:
                return (f"its activation reads a constant of shape {list(constant.shape)} (a {node.op_type}), which "
                        "narrowing would have to slice")
    return ""


def inside_values(mlp: Mlp) -> set[int]:
    """The ids of the values between the MLP's projections (the projections' outputs and the region's)."""
    return {id(layer.output) for layer in mlp.projections} | {id(value) for node in mlp.region
                                                               for value in node.outputs}


def width_constant(reshape: ir.Node, width: int, inside: set[int]) -> tuple[ir.Node, int, np.ndarray] | None:
    """Where a reshape's target shape names the width: (the node reading that constant, its input index, the
    constant) — the Reshape itself, or the Concat that builds the shape from a constant last part (which other
    reshapes may read too). A last part of -1, or one computed from the Shape of a value between the
    projections (`inside`: their ids), follows the narrowing by itself: its constant is given as [-1]. None
    when the shape is computed otherwise, or names another width."""
    reader, index = reshape, 1
    target = reshape.inputs[1]
    if constant_array(target) is None:
        concat = target.producer() if target is not None else None
        if concat is None or concat.op_type != "Concat" or not concat.inputs:
            return None
        reader, index = concat, len(concat.inputs) - 1
        if _measured_inside(concat.inputs[-1], inside):
            return reader, index, np.array([-1])
    array = constant_array(reader.inputs[index])
    if array is None or array.ndim != 1 or array.size < 1 or array[-1] not in (width, -1):
        return None
    return reader, index, array


def _measured_inside(value: ir.Value | None, inside: set[int], hops: int = 6) -> bool:
    """Whether `value` is computed from the Shape of a value between the projections (through Slice, Gather,
    Squeeze, Unsqueeze and the like)."""
    node = value.producer() if value is not None else None
    if node is None or hops == 0:
        return False
    if node.op_type == "Shape":
        return id(node.inputs[0]) in inside
    return any(_measured_inside(argument, inside, hops - 1) for argument in node.inputs[:1])


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The array a value holds when it is fixed at build time (an initializer or a Constant node's output)."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is None or producer.op_type != "Constant":
        return None
    attributes = producer.attributes
    if "value" in attributes:
        return attributes["value"].as_tensor().numpy()
    for name, dtype in (("value_ints", np.int64), ("value_int", np.int64), ("value_floats", np.float32),
                        ("value_float", np.float32)):
        if name in attributes:
            return np.asarray(attributes[name].value, dtype)
    return None


@dataclass
class NarrowedWeight:
    """A layer's narrower weight W' [K', N']: float (stored in the layer's dtype), or `quantized` in the layer's
    own format; and the bias it gets instead of its own (an fc1 bias sliced to the kept neurons)."""

    layer: LinearLayer
    matrix: np.ndarray
    quantized: QuantizedFactor | None = None
    bias: np.ndarray | None = None


@dataclass
class NarrowedMlp:
    """An MLP and what narrowing it gives: the kept neurons (ascending) and a weight for each of mlp.layers."""

    mlp: Mlp
    kept: np.ndarray
    weights: list[NarrowedWeight]

    @property
    def width(self) -> int:
        return len(self.kept)


@dataclass
class WeightsNarrowed(ir.passes.PassResult):
    """`weight_names`: each narrowed layer → the name of its new weight initializer (a float weight's: what
    fine-tuning trains)."""

    weight_names: dict[str, str] = field(default_factory=dict)


class NarrowMlpPass(ir.passes.InPlacePass):
    """Swap each given MLP's projections for narrower ones."""

    def __init__(self, narrowed: list[NarrowedMlp]):
        super().__init__()
        self.narrowed = narrowed

    def call(self, model: ir.Model) -> WeightsNarrowed:
        names = NameAllocator(model.graph)
        made: dict[int, list[ir.Value]] = {}  # new weights' initializers by array, once for every site
        weight_names = {}
        for item in self.narrowed:
            label = f"{item.width} of {item.mlp.width}"
            _narrow_between(model.graph, item, names)  # first: it reads the projections' outputs as they are
            for weight in item.weights:
                weight_names[weight.layer.name] = _replace_weight(model, weight, label, names, made)
        if self.narrowed:
            RemoveUnusedNodesPass()(model)
            drop_unread_weight_inputs(model.graph, [w.layer.weight.storage for i in self.narrowed for w in i.weights])
        return WeightsNarrowed(model, modified=bool(self.narrowed), weight_names=weight_names)


def _replace_weight(model: ir.Model, weight: NarrowedWeight, label: str, names: NameAllocator,
                    made: dict[int, list[ir.Value]]) -> str:
    """Swap one layer for the product with its narrower weight, in the layer's form; the new weight's name."""
    layer, graph = weight.layer, model.graph
    base = layer.weight.name.removesuffix(".weight") if layer.weight.is_initializer else layer.name
    name = layer.node.name or f"{base}.narrowed"
    if id(weight.matrix) not in made:
        wanted = names.fresh(f"{base}.narrowed")
        made[id(weight.matrix)] = ([initializer(graph, wanted, weight.matrix, layer.dtype)] if weight.quantized is None
                                   else quantized_initializers(graph, wanted, weight.quantized))
    stored = made[id(weight.matrix)]
    metadata = {**layer.node.metadata_props, NARROWED_KEY: label,
                svd_ops.ORIGINAL_NODE_KEY: ",".join(node.name or node.op_type for node in layer.nodes)}
    form = layer.weight.quantized.format if weight.quantized is not None else None
    nodes: list[ir.Node] = []
    if form == NBITS:
        nodes.append(nbits_node(layer.x, stored, weight.quantized, name, metadata))
        model.opset_imports.setdefault(MICROSOFT, 1)
        value = nodes[-1].outputs[0]
    elif form == INTEGER:
        value = integer_product(layer.quantizer.outputs, stored, layer.dtype, name, nodes)
        nodes[0].metadata_props.update(metadata)
    else:
        matrix = stored[0]
        if form == DEQUANTIZE:
            matrix = dequantize(matrix, weight.quantized, nodes)
        elif matrix.dtype != (layer.weight.cast_to or layer.dtype):
            matrix = cast(matrix, layer.weight.cast_to or layer.dtype, nodes)
        nodes.append(ir.Node("", "MatMul", [layer.x, matrix], num_outputs=1, name=name, metadata_props=metadata))
        value = nodes[-1].outputs[0]
    bias = (bias_value(graph, layer, names, "narrowed_bias") if weight.bias is None else
            initializer(graph, names.fresh(f"{base}.narrowed_bias"), weight.bias, layer.bias.dtype))
    if bias is not None:
        nodes.append(ir.Node("", "Add", [value, bias], num_outputs=1, name=f"{name}.bias"))
        value = nodes[-1].outputs[0]
    shape = layer.output.shape
    ir.convenience.replace_nodes_and_values(layer.node.graph, layer.node, old_nodes=layer.nodes, new_nodes=nodes,
                                            old_values=[layer.output], new_values=[value])
    value.shape = _with_width(shape, weight.matrix.shape[1])
    assert stored[0].name is not None, "initializers have names"
    return stored[0].name


def _narrow_between(graph: ir.Graph, item: NarrowedMlp, names: NameAllocator) -> None:
    """The values between the projections declared at the new width, and reshapes naming the width told it."""
    width, kept = item.mlp.width, item.width
    for node in item.mlp.region:
        for value in node.outputs:
            if value.shape is not None and len(value.shape) and value.shape[-1] == width:
                value.shape = _with_width(value.shape, kept)
    for reshape in item.mlp.reshapes:
        if reshape.op_type != "Reshape":
            continue  # find_mlps saw that it keeps the width last
        found = width_constant(reshape, width, inside_values(item.mlp))
        assert found is not None, "find_mlps found the width named in the reshape"
        reader, index, shape = found
        if shape[-1] != width:
            continue  # -1: the reshape infers the width
        narrowed = shape.copy()
        narrowed[-1] = kept
        constant = initializer(graph, names.fresh(f"{reshape.name or 'reshape'}.narrowed_shape"), narrowed,
                               ir.DataType.from_numpy(shape.dtype))
        if reader is not reshape:  # the Concat building the shape: a copy of it for this reshape
            inputs = [*reader.inputs[:index], constant, *reader.inputs[index + 1:]]
            copy = ir.Node(reader.domain, reader.op_type, inputs, reader.attributes.values(), num_outputs=1,
                           name=_fresh_node_name(graph, f"{reader.name or 'concat'}.narrowed"))
            reshape.graph.insert_before(reshape, copy)
            reader, index, constant = reshape, 1, copy.outputs[0]
        reader.replace_input_with(index, constant)


def _fresh_node_name(graph: ir.Graph, wanted: str) -> str:
    taken = {node.name for node in graph}
    name, suffix = wanted, 1
    while name in taken:
        name, suffix = f"{wanted}.{suffix}", suffix + 1
    return name


def _with_width(shape: ir.Shape | None, width: int) -> ir.Shape | None:
    """`shape` with its last dimension `width` (None stays None: the shape is not known)."""
    if shape is None or not len(shape):
        return shape
    return ir.Shape([*shape.dims[:-1], width])
