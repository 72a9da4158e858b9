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

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_nmm.passes import svd_ops
from onnx_nmm.passes.linear_layers import LinearLayer
from onnx_nmm.passes.mlp_modules import Mlp, inside_values, width_constant
from onnx_nmm.passes.quantized_weights import DEQUANTIZE, INTEGER, MICROSOFT, NBITS
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


class NarrowMlpPass(ir.passes.InPlacePass):
    """Swap each given MLP's projections for narrower ones. `weight_names` maps each narrowed layer to the name
    of its new weight initializer (a float weight's: what fine-tuning trains)."""

    def __init__(self, narrowed: list[NarrowedMlp]):
        super().__init__()
        self.narrowed = narrowed
        self.weight_names: dict[str, str] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        names = NameAllocator(model.graph)
        made: dict[int, list[ir.Value]] = {}  # new weights' initializers by array, once for every site
        for item in self.narrowed:
            label = f"{item.width} of {item.mlp.width}"
            _narrow_between(model.graph, item, names)  # first: it reads the projections' outputs as they are
            for weight in item.weights:
                self.weight_names[weight.layer.name] = _replace_weight(model, weight, label, names, made)
        if self.narrowed:
            RemoveUnusedNodesPass()(model)
            drop_unread_weight_inputs(model.graph, [w.layer.weight.storage for i in self.narrowed for w in i.weights])
        return ir.passes.PassResult(model, modified=bool(self.narrowed))


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
    return stored[0].name


def _narrow_between(graph: ir.Graph, item: NarrowedMlp, names: NameAllocator) -> None:
    """The values between the projections declared at the new width, and reshapes naming the width told it."""
    width, kept = item.mlp.width, item.width
    for node in item.mlp.region:
        for value in node.outputs:
            if value.shape is not None and len(value.shape) and value.shape[-1] == width:
                value.shape = _with_width(value.shape, kept)
    for reshape in item.mlp.reshapes:
        reader, index, shape = width_constant(reshape, width, inside_values(item.mlp))
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
