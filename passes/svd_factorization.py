"""Replace factorized linear layers by `ai.onnx_nmm::SvdMatMul` calls — or, for a weight stored quantized,
by the same quantized form twice.

    Y = X·W (+ b)                  →   Y = SvdMatMul(X, U, V (, b))      with  U·V ≈ W,  U [K, r], V [r, N]
    Y = MatMulNBits(X, W…)         →   Y = MatMulNBits(MatMulNBits(X, U…), V…) (+ b)
    Y = MatMul(X, Dequantize(W…))  →   Y = SvdMatMul(X, Dequantize(U…), Dequantize(V…) (, b))
    Y = MatMulInteger(DQL(X), W…)  →   H = MatMulInteger(DQL(X), U…);  Y = MatMulInteger(DQL(H), V…) (+ b)

The pass is pure graph surgery: the factors come computed (onnx_nmm.pipeline.factorize), quantized too when
they are to be stored so (onnx_nmm.decomposition.quantization). Float U and V become initializers in W's float dtype (or
the one asked for), behind a Cast when the layer computes in another. The new node keeps the replaced
node's name and metadata (so module paths survive) and records the names of the nodes it replaced.
Weights, Transposes and Identities nobody reads any more are removed; a weight that another node still
reads (a tied embedding) stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_nmm.passes import svd_ops
from onnx_nmm.passes.linear_layers import LinearLayer
from onnx_nmm.passes.quantized_weights import INTEGER, MICROSOFT, NBITS
from onnx_nmm.passes.stored_weights import (
    NameAllocator,
    QuantizedFactor,
    bias_value,
    cast,
    dequantize,
    drop_unread_weight_inputs,
    dynamic_quantization,
    initializer,
    integer_product,
    nbits_node,
    quantized_initializers,
)

# Node metadata of the two nodes a quantized layer becomes: which factor each computes, and the rank.
FACTOR_KEY, RANK_KEY = "onnx_nmm.svd_factor", "onnx_nmm.rank"


@dataclass
class FactorizedLayer:
    """A layer and the factors that replace its weight: float (stored in W's float dtype, or `storage`), or
    `quantized` in W's own format."""

    layer: LinearLayer
    u: np.ndarray  # [K, r]
    v: np.ndarray  # [r, N]
    align: int
    method: str
    storage: ir.DataType | None = None
    quantized: tuple[QuantizedFactor, QuantizedFactor] | None = None

    @property
    def rank(self) -> int:
        return self.u.shape[1]


@dataclass
class FactorsPlaced(ir.passes.PassResult):
    """`factor_names`: each layer's name → the names its U and V initializers were given."""

    factor_names: dict[str, tuple[str, str]] = field(default_factory=dict)


class SvdFactorizationPass(ir.passes.InPlacePass):
    """Swap each given layer for an SvdMatMul node with its factors as new initializers."""

    def __init__(self, factorized: list[FactorizedLayer]):
        super().__init__()
        self.factorized = factorized

    def call(self, model: ir.Model) -> FactorsPlaced:
        names = NameAllocator(model.graph)
        made: dict[tuple[int, int], tuple] = {}  # the factors' initializers, once per shared weight (_made_once)
        factor_names = {item.layer.name: _replace_layer(model, item, names, made) for item in self.factorized}
        if self.factorized:
            RemoveUnusedNodesPass()(model)
            drop_unread_weight_inputs(model.graph, [item.layer.weight.storage for item in self.factorized])
        return FactorsPlaced(model, modified=bool(self.factorized), factor_names=factor_names)


def _replace_layer(model: ir.Model, item: FactorizedLayer, names: NameAllocator,
                   made: dict[tuple[int, int], tuple]) -> tuple[str, str]:
    """Swap one layer for its SvdMatMul; the names of the U and V initializers. The factors are initializers
    of the main graph, which subgraph nodes read from the outer scope; a layer whose weight and factors another
    site already got reads the same ones."""
    layer = item.layer
    graph = model.graph
    base = layer.weight.name.removesuffix(".weight") if layer.weight.is_initializer else layer.name
    if item.quantized is not None and layer.weight.quantized.format == NBITS:
        return _replace_with_nbits(model, item, base, names, made)
    if item.quantized is not None and layer.weight.quantized.format == INTEGER:
        return _replace_with_integer(model, item, base, names, made)
    u, v = _made_once(made, item, lambda: _factor_initializers(graph, item, base, names))
    factor_names = (u.name, v.name)
    new_nodes: list[ir.Node] = []
    if item.quantized is not None:  # QDQ: the factors dequantized on the way, as the weight was
        u, v = (dequantize(value, factor, new_nodes) for value, factor in zip((u, v), item.quantized))
    else:
        compute = layer.weight.cast_to or layer.dtype
        if u.dtype != compute:
            u, v = (cast(value, compute, new_nodes) for value in (u, v))
    bias = bias_value(graph, layer, names, "svd_bias")
    overload = svd_ops.register_svd_matmul(model, with_bias=bias is not None)
    metadata = dict(layer.node.metadata_props)
    metadata[svd_ops.ORIGINAL_NODE_KEY] = ",".join(node.name or node.op_type for node in layer.nodes)
    call = svd_ops.svd_matmul_node(
        layer.x, u, v, bias, rank=item.rank, align=item.align, method=item.method,
        original_weight=layer.weight.name, overload=overload, name=layer.node.name or f"{base}.svd",
        metadata=metadata,
    )
    new_nodes.append(call)
    ir.convenience.replace_nodes_and_values(
        layer.node.graph, layer.node, old_nodes=layer.nodes, new_nodes=new_nodes,
        old_values=[layer.output], new_values=call.outputs,
    )
    return factor_names


def _made_once(made: dict, item: FactorizedLayer, make):
    """The initializers of `item`'s factors, made by `make` at the first site that needs them: every site of a
    shared weight (a merged decoder's branches) reads the same ones."""
    key = (id(item.layer.weight.storage), id(item.u))
    if key not in made:
        made[key] = make()
    return made[key]


def _factor_initializers(graph: ir.Graph, item: FactorizedLayer, base: str,
                         names: NameAllocator) -> tuple[ir.Value, ir.Value]:
    """U and V as initializers: float in the storage dtype, or a quantized factor's codes (its scales and zero
    points beside them, found by `dequantize` under the codes' name)."""
    if item.quantized is None:
        dtype = item.storage or item.layer.dtype
        return (initializer(graph, names.fresh(f"{base}.svd_u"), item.u, dtype),
                initializer(graph, names.fresh(f"{base}.svd_v"), item.v, dtype))
    u, v = _quantized_factor_initializers(graph, item, base, names)
    return u[0], v[0]


def _quantized_factor_initializers(graph: ir.Graph, item: FactorizedLayer, base: str, names: NameAllocator
                                   ) -> tuple[list[ir.Value], list[ir.Value]]:
    """[codes, scales(, zero points)] of U, then of V."""
    assert item.quantized is not None, "a quantized factorization"
    u, v = (quantized_initializers(graph, names.fresh(f"{base}.svd_{which}"), factor)
            for which, factor in zip("uv", item.quantized))
    return u, v


def _replace_with_nbits(model: ir.Model, item: FactorizedLayer, base: str, names: NameAllocator,
                        made: dict) -> tuple[str, str]:
    """MatMulNBits(X, W…) → MatMulNBits(MatMulNBits(X, U…), V…) (+ bias): the same kernels, two smaller codes."""
    layer, graph = item.layer, model.graph
    stored = _made_once(made, item, lambda: _quantized_factor_initializers(graph, item, base, names))
    metadata = dict(layer.node.metadata_props)
    metadata[svd_ops.ORIGINAL_NODE_KEY] = ",".join(node.name or node.op_type for node in layer.nodes)
    nodes, value = [], layer.x
    assert item.quantized is not None, "a quantized factorization"
    for which, factor, values in zip("uv", item.quantized, stored):
        nodes.append(nbits_node(value, values, factor, f"{layer.node.name or base}.svd_{which}",
                                {**metadata, FACTOR_KEY: which, RANK_KEY: str(item.rank)}))
        value = nodes[-1].outputs[0]
    bias = bias_value(graph, layer, names, "svd_bias")
    if bias is not None:
        nodes.append(ir.Node("", "Add", [value, bias], num_outputs=1, name=f"{layer.node.name or base}.bias"))
        value = nodes[-1].outputs[0]
    model.opset_imports.setdefault(MICROSOFT, 1)
    ir.convenience.replace_nodes_and_values(layer.node.graph, layer.node, old_nodes=layer.nodes, new_nodes=nodes,
                                            old_values=[layer.output], new_values=[value])
    return stored[0][0].name, stored[1][0].name


def _replace_with_integer(model: ir.Model, item: FactorizedLayer, base: str, names: NameAllocator,
                          made: dict) -> tuple[str, str]:
    """A dynamically quantized product twice: X's own quantization feeds U's, H is quantized on the way to V's."""
    layer, graph = item.layer, model.graph
    stored = _made_once(made, item, lambda: _quantized_factor_initializers(graph, item, base, names))
    name = layer.node.name or base
    nodes: list[ir.Node] = []
    quantized_x, value = layer.quantizer.outputs, None
    for which, values in zip("uv", stored):
        if which == "v":
            quantized_x = dynamic_quantization(value, f"{name}.svd_h_quantized", nodes)
        value = integer_product(quantized_x, values, layer.dtype, f"{name}.svd_{which}", nodes)
    assert value is not None, "U's product, then V's"
    bias = bias_value(graph, layer, names, "svd_bias")
    if bias is not None:
        nodes.append(ir.Node("", "Add", [value, bias], num_outputs=1, name=f"{name}.bias"))
        value = nodes[-1].outputs[0]
    ir.convenience.replace_nodes_and_values(layer.node.graph, layer.node, old_nodes=layer.nodes, new_nodes=nodes,
                                            old_values=[layer.output], new_values=[value])
    return stored[0][0].name, stored[1][0].name
