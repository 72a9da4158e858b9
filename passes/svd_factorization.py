"""Replace factorized linear layers by `ai.onnx_nmm::SvdMatMul` calls.

    Y = X·W (+ b)   →   Y = SvdMatMul(X, U, V (, b))      with  U·V ≈ W,  U [K, r], V [r, N]

The pass is pure graph surgery: the factors come computed (onnx_nmm.pipeline.factorize). U and V become
initializers in W's storage dtype; if W was read through a Cast, U and V get the same Cast. The new
node keeps the replaced node's name and metadata (so module paths survive) and records the names of
the nodes it replaced. Weights, Transposes and Identities nobody reads any more are removed; a weight
that another node still reads (a tied embedding) stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_nmm.passes import svd_ops
from onnx_nmm.passes.linear_layers import LinearLayer


@dataclass
class FactorizedLayer:
    """A layer and the factors that replace its weight (any float dtype; stored in W's dtype)."""

    layer: LinearLayer
    u: np.ndarray  # [K, r]
    v: np.ndarray  # [r, N]
    align: int
    method: str

    @property
    def rank(self) -> int:
        return self.u.shape[1]


class SvdFactorizationPass(ir.passes.InPlacePass):
    """Swap each given layer for an SvdMatMul node with its factors as new initializers.

    `factor_names` maps each layer's name to the names its U and V initializers were given.
    """

    def __init__(self, factorized: list[FactorizedLayer]):
        super().__init__()
        self.factorized = factorized
        self.factor_names: dict[str, tuple[str, str]] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        names = _NameAllocator(model.graph)
        made: dict[tuple[int, int], tuple[ir.Value, ir.Value]] = {}  # one pair of initializers per shared factors
        for item in self.factorized:
            self.factor_names[item.layer.name] = _replace_layer(model, item, names, made)
        if self.factorized:
            RemoveUnusedNodesPass()(model)
            _drop_unread_weight_inputs(model.graph, [item.layer.weight.storage for item in self.factorized])
        return ir.passes.PassResult(model, modified=bool(self.factorized))


def _replace_layer(model: ir.Model, item: FactorizedLayer, names: "_NameAllocator",
                   made: dict[tuple[int, int], tuple[ir.Value, ir.Value]]) -> tuple[str, str]:
    """Swap one layer for its SvdMatMul; the names of the U and V initializers. The factors are initializers
    of the main graph, which subgraph nodes read from the outer scope; a layer whose weight and factors another
    site already got reads the same ones."""
    layer = item.layer
    graph = model.graph
    base = layer.weight.name.removesuffix(".weight") if layer.weight.is_initializer else layer.name
    key = (id(layer.weight.storage), id(item.u))
    if key not in made:
        made[key] = (_initializer(graph, names.fresh(f"{base}.svd_u"), item.u, layer.dtype),
                     _initializer(graph, names.fresh(f"{base}.svd_v"), item.v, layer.dtype))
    u, v = made[key]
    factor_names = (u.name, v.name)
    new_nodes: list[ir.Node] = []
    if layer.weight.cast_to is not None:
        u, v = (_cast(value, layer.weight.cast_to, new_nodes) for value in (u, v))
    bias = _bias_value(graph, layer, names)
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


def _drop_unread_weight_inputs(graph: ir.Graph, weights: list[ir.Value]) -> None:
    """A replaced weight that an older exporter also listed as a graph input would stay a required input
    once its initializer goes: drop both when nothing reads it any more."""
    for weight in weights:
        if weight in graph.inputs and not list(weight.uses()):
            graph.inputs.remove(weight)
            graph.initializers.pop(weight.name, None)


def _initializer(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    stored = np.ascontiguousarray(array.astype(dtype.numpy()))
    value = ir.Value(name=name, shape=ir.Shape(stored.shape), type=ir.TensorType(dtype),
                     const_value=ir.tensor(stored, dtype=dtype, name=name))
    graph.register_initializer(value)
    return value


def _cast(value: ir.Value, to: ir.DataType, nodes: list[ir.Node]) -> ir.Value:
    node = ir.Node("", "Cast", [value], [ir.AttrInt64("to", to.value)], num_outputs=1, name=f"{value.name}.cast")
    node.outputs[0].name = f"{value.name}.cast"
    nodes.append(node)
    return node.outputs[0]


def _bias_value(graph: ir.Graph, layer: LinearLayer, names: "_NameAllocator") -> ir.Value | None:
    """The bias input: the original constant, or a new one when Gemm's beta had to be applied."""
    if layer.bias is None or layer.beta == 1.0:
        return layer.bias
    bias = layer.bias_vector()
    return _initializer(graph, names.fresh(f"{layer.name}.svd_bias"), bias, ir.convenience.get_const_tensor(layer.bias).dtype)


class _NameAllocator:
    """Initializer names that do not clash with anything in the graph."""

    def __init__(self, graph: ir.Graph):
        self.taken = set(graph.initializers) | {v.name for v in graph.inputs} | {
            out.name for node in graph for out in node.outputs}

    def fresh(self, wanted: str) -> str:
        name, suffix = wanted, 1
        while name in self.taken:
            name, suffix = f"{wanted}.{suffix}", suffix + 1
        self.taken.add(name)
        return name
