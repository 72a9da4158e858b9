"""Fuse a factorized gated MLP into one `ai.onnx_nmm::SvdGatedMLP` (the paper's fused SVD MLP).

    g  = SvdMatMul(X, Ug, Vg)                  gate
    u  = SvdMatMul(X, Uu, Vu)                  up (reads the same X)
    a  = Mul(Mul(g, Sigmoid(g)), u)            SiLU(gate) · up, as the exporters write SiLU
    Y  = SvdMatMul(a, Ud, Vd)                  down
  →
    Y  = SvdGatedMLP(X, Ug, Vg, Uu, Vu, Ud, Vd)     activation = "silu", ranks = [rg, ru, rd]

The fused op carries the same computation as its function body, so onnxruntime still runs it; the
Neuron lowering calls the fused kernel, which keeps actᵀ on chip. Only bias-free projections whose
intermediate values have no other reader are fused; non-gated MLPs (GPT-2) stay as SvdMatMul nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_nmm.passes import svd_ops
from onnx_nmm.passes import roles


@dataclass
class _GatedMlp:
    gate: ir.Node
    up: ir.Node
    down: ir.Node
    nodes: list[ir.Node]  # everything the fused op replaces


class FuseGatedMlpPass(ir.passes.InPlacePass):
    """Replace each SiLU-gated triple of SvdMatMul nodes by one SvdGatedMLP. `fused` lists their names."""

    def __init__(self):
        super().__init__()
        self.fused: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.fused = []
        for down in [node for node in graph if _is_plain_svd_matmul(node)]:
            mlp = _match(down, graph)
            if mlp is not None:
                self.fused.append(_replace(model, mlp))
        return ir.passes.PassResult(model, modified=bool(self.fused))


def _is_plain_svd_matmul(node: ir.Node | None) -> bool:
    return (node is not None and node.domain == svd_ops.DOMAIN and node.op_type == svd_ops.SVD_MATMUL
            and node.overload == "" and len(node.inputs) == 3)


def _only_reader(value: ir.Value, graph: ir.Graph) -> ir.Node | None:
    """The single node reading `value`, if it has exactly one and is not a graph output."""
    uses = list(value.uses())
    if len(uses) != 1 or value in graph.outputs:
        return None
    return uses[0].node


def _match(down: ir.Node, graph: ir.Graph) -> _GatedMlp | None:
    product = down.inputs[0].producer()
    if product is None or product.op_type != "Mul" or product.domain != "" or _only_reader(product.outputs[0], graph) is not down:
        return None
    for silu_value, up_value in (product.inputs, product.inputs[::-1]):
        silu, up = silu_value.producer(), up_value.producer()
        gate = _silu_input(silu, graph)
        if gate is None or not _is_plain_svd_matmul(up) or _only_reader(up.outputs[0], graph) is not product:
            continue
        if _only_reader(silu.outputs[0], graph) is not product or gate.inputs[0] is not up.inputs[0]:
            continue
        sigmoid = next(use.node for use in gate.outputs[0].uses() if use.node.op_type == "Sigmoid")
        return _GatedMlp(gate=gate, up=up, down=down, nodes=[gate, sigmoid, silu, up, product, down])
    return None


def _silu_input(silu: ir.Node | None, graph: ir.Graph) -> ir.Node | None:
    """The gate SvdMatMul g of silu = Mul(g, Sigmoid(g)), if that is what `silu` computes."""
    if silu is None or silu.op_type != "Mul" or silu.domain != "":
        return None
    for g, s in (silu.inputs, silu.inputs[::-1]):
        sigmoid = s.producer()
        gate = g.producer()
        if (sigmoid is not None and sigmoid.op_type == "Sigmoid" and sigmoid.inputs[0] is g
                and _is_plain_svd_matmul(gate) and _only_reader(s, graph) is silu
                and {use.node for use in g.uses()} == {sigmoid, silu} and g not in graph.outputs):
            return gate
    return None


def _replace(model: ir.Model, mlp: _GatedMlp) -> str:
    svd_ops.register_svd_gated_mlp(model)
    ranks = [node.attributes["rank"].as_int() for node in (mlp.gate, mlp.up, mlp.down)]
    name = _mlp_name(mlp)
    metadata = dict(mlp.down.metadata_props)
    metadata[svd_ops.ORIGINAL_NODE_KEY] = ",".join(
        node.metadata_props.get(svd_ops.ORIGINAL_NODE_KEY, node.name or node.op_type) for node in mlp.nodes)
    fused = ir.Node(svd_ops.DOMAIN, svd_ops.SVD_GATED_MLP,
                    [mlp.gate.inputs[0], *mlp.gate.inputs[1:], *mlp.up.inputs[1:], *mlp.down.inputs[1:]],
                    [ir.AttrString("activation", "silu"), ir.AttrInt64s("ranks", ranks)],
                    num_outputs=1, name=name, metadata_props=metadata)
    ir.convenience.replace_nodes_and_values(model.graph, mlp.down, old_nodes=mlp.nodes, new_nodes=[fused],
                                            old_values=[mlp.down.outputs[0]], new_values=fused.outputs)
    return name


def _mlp_name(mlp: _GatedMlp) -> str:
    """The MLP's module path ("model.layers.0.mlp"), from the down projection's."""
    path = roles.module_path(mlp.down)
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    return parent or f"{mlp.down.name}.gated_mlp"
