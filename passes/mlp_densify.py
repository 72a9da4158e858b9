"""Run a factorized MLP on its dense path: each factor pair multiplied back into one weight.

    SvdGatedMLP(X, Ug, Vg, Uu, Vu, Ud, Vd)   →   GatedMLP(X, Ug·Vg, Uu·Vu, Ud·Vd)
    SvdMLP(X, U1, V1, b1, U2, V2 (, b2))     →   MLP(X, U1·V1, b1, U2·V2, b2)      zeros for a missing b2

It computes the same function (up to rounding) with more parameters: what `compile` does where the dense MLP
kernel is modelled faster than both the fused low-rank kernel and its factors launched one by one (a prefill
of many tokens at a high rank), so that no compiled shape is slower than the dense model because of a rank.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_nmm.passes import svd_ops
from onnx_nmm.passes.stored_weights import NameAllocator, initializer

DENSE_OF = {svd_ops.SVD_GATED_MLP: svd_ops.GATED_MLP, svd_ops.SVD_MLP: svd_ops.MLP}


class DensifyMlpPass(ir.passes.InPlacePass):
    """Replace each SvdGatedMLP or SvdMLP node named in `names` by the dense MLP op with the factors' products as
    its weights. `densified` lists the nodes replaced; a node whose factors are not initializers (cast or
    dequantized on the way) stays as it is."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names
        self.densified: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.densified = []
        allocate = NameAllocator(model.graph)
        products: dict[tuple[str, str], ir.Value] = {}  # (U, V) initializer names → their product, made once
        for node in list(model.graph):
            if (node.domain == svd_ops.DOMAIN and node.op_type in DENSE_OF and node.name in self.names
                    and all(value is not None and value.const_value is not None for value in _factors(node))):
                _replace(model, node, allocate, products)
                self.densified.append(node.name)
        if self.densified:
            RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(self.densified))


def _replace(model: ir.Model, node: ir.Node, allocate: NameAllocator, products: dict) -> None:
    graph, named = model.graph, _named_inputs(node)
    weights = [_product(graph, named[f"U{key}"], named[f"V{key}"], allocate, products) for key in _factor_keys(node)]
    if node.op_type == svd_ops.SVD_GATED_MLP:
        dense_inputs = [named["X"], *weights]
    else:
        columns = weights[1].const_value.shape[1] if weights[1].const_value is not None else None
        assert isinstance(columns, int), "W2 is an initializer _product made"
        bias = named.get("b2") or initializer(graph, allocate.fresh(f"{node.name}.b2"),
                                              np.zeros(columns, np.float32), weights[1].dtype)
        dense_inputs = [named["X"], weights[0], named["b1"], weights[1], bias]
    activation = node.attributes["activation"].as_string()
    op_type = DENSE_OF[node.op_type]
    dense = ir.Node(svd_ops.DOMAIN, op_type, dense_inputs, [ir.AttrString("activation", activation)],
                    overload=svd_ops.register_mlp_op(model, op_type, activation), num_outputs=1, name=node.name,
                    metadata_props=dict(node.metadata_props))
    ir.convenience.replace_nodes_and_values(graph, node, old_nodes=[node], new_nodes=[dense],
                                            old_values=node.outputs, new_values=dense.outputs)


def _named_inputs(node: ir.Node) -> dict[str, ir.Value]:
    """The node's inputs by their names in svd_ops.MLP_OP_INPUTS (an absent optional input left out)."""
    return {name: value for name, value in zip(svd_ops.MLP_OP_INPUTS[node.op_type], node.inputs) if value is not None}


def _factor_keys(node: ir.Node) -> list[str]:
    """What follows U and V in each factor pair's names: g, u, d or 1, 2."""
    return [name[1:] for name in svd_ops.MLP_OP_INPUTS[node.op_type] if name.startswith("U")]


def _factors(node: ir.Node) -> list[ir.Value | None]:
    named = _named_inputs(node)
    return [named.get(f"{side}{key}") for key in _factor_keys(node) for side in "UV"]


def _product(graph: ir.Graph, u: ir.Value, v: ir.Value, allocate: NameAllocator, products: dict) -> ir.Value:
    """U·V as a new initializer in U's dtype, computed in float32."""
    key = (u.name, v.name)
    if key not in products:
        assert u.const_value is not None and v.const_value is not None, "an SvdMatMul's factors are initializers"
        product = u.const_value.numpy().astype(np.float32) @ v.const_value.numpy().astype(np.float32)
        products[key] = initializer(graph, allocate.fresh(f"{u.name}.dense"), product, u.dtype)
    return products[key]
