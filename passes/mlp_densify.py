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
                    and all(value.const_value is not None for value in _factors(node))):
                _replace(model, node, allocate, products)
                self.densified.append(node.name)
        if self.densified:
            RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(self.densified))


def _replace(model: ir.Model, node: ir.Node, allocate: NameAllocator, products: dict) -> None:
    graph, inputs = model.graph, list(node.inputs)
    if node.op_type == svd_ops.SVD_GATED_MLP:
        x, *factors = inputs
        weights = [_product(graph, u, v, allocate, products) for u, v in zip(factors[::2], factors[1::2])]
        dense_inputs = [x, *weights]
    else:
        x, u1, v1, b1, u2, v2, *b2 = inputs
        second = _product(graph, u2, v2, allocate, products)
        bias = b2[0] if b2 and b2[0] is not None else initializer(
            graph, allocate.fresh(f"{node.name}.b2"), np.zeros(second.shape[1], np.float32), second.dtype)
        dense_inputs = [x, _product(graph, u1, v1, allocate, products), b1, second, bias]
    activation = node.attributes["activation"].as_string()
    op_type = DENSE_OF[node.op_type]
    dense = ir.Node(svd_ops.DOMAIN, op_type, dense_inputs, [ir.AttrString("activation", activation)],
                    overload=svd_ops.register_mlp_op(model, op_type, activation), num_outputs=1, name=node.name,
                    metadata_props=dict(node.metadata_props))
    ir.convenience.replace_nodes_and_values(graph, node, old_nodes=[node], new_nodes=[dense],
                                            old_values=node.outputs, new_values=dense.outputs)


def _factors(node: ir.Node) -> list[ir.Value]:
    inputs = list(node.inputs)
    return inputs[1:7] if node.op_type == svd_ops.SVD_GATED_MLP else [inputs[1], inputs[2], inputs[4], inputs[5]]


def _product(graph: ir.Graph, u: ir.Value, v: ir.Value, allocate: NameAllocator, products: dict) -> ir.Value:
    """U·V as a new initializer in U's dtype, computed in float32."""
    key = (u.name, v.name)
    if key not in products:
        product = u.const_value.numpy().astype(np.float32) @ v.const_value.numpy().astype(np.float32)
        products[key] = initializer(graph, allocate.fresh(f"{u.name}.dense"), product, u.dtype)
    return products[key]
