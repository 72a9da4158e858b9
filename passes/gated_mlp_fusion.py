"""Fuse a factorized gated MLP into one `ai.onnx_nmm::SvdGatedMLP` (the paper's fused SVD MLP).

    g  = SvdMatMul(X, Ug, Vg)                  gate
    u  = SvdMatMul(X, Uu, Vu)                  up (reads the same X)
    a  = Mul(act(g), u)                        act(gate) · up, act SiLU or GELU (erf or tanh) however
                                               the exporter spelled it (activation_match)
    Y  = SvdMatMul(a, Ud, Vd)                  down
  →
    Y  = SvdGatedMLP(X, Ug, Vg, Uu, Vu, Ud, Vd)     activation = "silu" | "gelu" | "gelu_tanh",
                                                    ranks = [rg, ru, rd]

The fused op carries the same computation as its function body, so onnxruntime still runs it; the
Neuron lowering calls the fused kernel, which keeps actᵀ on chip. Only bias-free projections whose
intermediate values have no other reader are fused; non-gated MLPs (GPT-2) and a gate and up computed by
one projection (Phi-3's gate_up) stay as SvdMatMul nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_nmm.passes import activation_match, roles, svd_ops


@dataclass
class _GatedMlp:
    gate: ir.Node
    up: ir.Node
    down: ir.Node
    activation: str
    nodes: list[ir.Node]  # everything the fused op replaces


class FuseGatedMlpPass(ir.passes.InPlacePass):
    """Replace each gated triple of SvdMatMul nodes by one SvdGatedMLP. `fused` lists their names;
    `unfused` says, for every MLP output projection left alone, why."""

    def __init__(self):
        super().__init__()
        self.fused: list[str] = []
        self.unfused: dict[str, str] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused, self.unfused = [], {}
        downs = [node for node in ir.traversal.RecursiveGraphIterator(model.graph) if _is_mlp_output_projection(node)]
        for down in downs:  # subgraphs too: each branch of a merged decoder holds its own MLPs
            graph = down.graph
            mlp = _match(down, graph) if _is_plain_svd_matmul(down) else None
            if mlp is not None:
                name = _replace(model, mlp)
                if name not in self.fused:  # the same MLP in another branch
                    self.fused.append(name)
            else:
                self.unfused[roles.module_path(down) or down.name] = _why_not_fused(down, graph)
        return ir.passes.PassResult(model, modified=bool(self.fused))


def _is_plain_svd_matmul(node: ir.Node | None) -> bool:
    return (node is not None and node.domain == svd_ops.DOMAIN and node.op_type == svd_ops.SVD_MATMUL
            and node.overload == "" and len(node.inputs) == 3)


def _is_mlp_output_projection(node: ir.Node) -> bool:
    """A down (or fc2) projection by its module path, factorized or not."""
    if node.op_type not in ("MatMul", "Gemm", svd_ops.SVD_MATMUL):
        return False
    named = roles.classify(roles.module_path(node))
    return named is not None and named[0] == roles.MLP and named[1] in ("down", "fc2")


def _why_not_fused(down: ir.Node, graph: ir.Graph) -> str:
    """Why an MLP's output projection was not fused, in the terms of what the graph shows."""
    product = _through_shape_ops(down.inputs[0].producer())
    if product is None or product.op_type != "Mul":
        found = product.op_type if product is not None else "a graph input"
        return f"not gated: {found} feeds the down projection (fusion needs act(gate) · up)"
    upstream = _projections_upstream(product)
    if len(upstream) == 1:
        if any(use.node.op_type in ("Split", "Slice") for use in upstream[0].outputs[0].uses()):
            return "gate and up come from one projection split in two (a fused gate_up, as Phi-3 exports)"
        return "not gated: one projection feeds the down projection, through an activation"
    for activated, up_value in (product.inputs, product.inputs[::-1]):
        gate = _gate_of(activated, up_value.producer())
        if gate is None:
            continue
        region = activation_match.activation_region(gate.outputs[0], activated)
        if region is None or activation_match.identify(region, gate.outputs[0], activated) is None:
            return (f"gated by {activated.producer().op_type}, an activation onnx-nmm does not fuse (it fuses SiLU "
                    "and GELU, erf or tanh)")
        if not all(_is_plain_svd_matmul(node) for node in (gate, up_value.producer(), down)):
            return "its gate, up or down projection is not factorized (or has a bias)"
        return "an intermediate value has another reader"
    return "the down projection's input is not act(gate) · up"


def _projections_upstream(node: ir.Node, hops: int = 8) -> list[ir.Node]:
    """The linear projections within `hops` nodes upstream of `node`, through anything else."""
    found, frontier, seen = [], [node], {id(node)}
    for _ in range(hops):
        producers = [value.producer() for current in frontier for value in current.inputs if value is not None]
        frontier = []
        for producer in producers:
            if producer is None or id(producer) in seen:
                continue
            seen.add(id(producer))
            (found if producer.op_type in _PROJECTIONS else frontier).append(producer)
    return found


def _through_shape_ops(node: ir.Node | None) -> ir.Node | None:
    """The first producer upstream of `node` that does more than reshape or cast its input."""
    while node is not None and node.op_type in ("Reshape", "Flatten", "Identity", "Cast", "Squeeze", "Unsqueeze"):
        node = node.inputs[0].producer()
    return node


_PROJECTIONS = ("MatMul", "Gemm", svd_ops.SVD_MATMUL)


def _gate_of(activated: ir.Value, up: ir.Node | None) -> ir.Node | None:
    """The projection upstream of `activated` (through element-wise nodes) that reads up's input."""
    if up is None or up.op_type not in _PROJECTIONS or activated.producer() is None:
        return None
    return next((node for node in _projections_upstream(activated.producer(), hops=12)
                 if node.inputs[0] is up.inputs[0] and node is not up), None)


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
    for activated, up_value in (product.inputs, product.inputs[::-1]):
        up = up_value.producer()
        if not _is_plain_svd_matmul(up) or _only_reader(up.outputs[0], graph) is not product:
            continue
        gate = _gate_of(activated, up)
        if not _is_plain_svd_matmul(gate) or _only_reader(activated, graph) is not product:
            continue
        g = gate.outputs[0]
        region = activation_match.activation_region(g, activated)
        if region is None or not activation_match.read_only_inside(region, g, activated, graph):
            continue
        activation = activation_match.identify(region, g, activated)
        if activation is not None:
            return _GatedMlp(gate=gate, up=up, down=down, activation=activation,
                             nodes=[gate, *region, up, product, down])
    return None


def _replace(model: ir.Model, mlp: _GatedMlp) -> str:
    overload = svd_ops.register_svd_gated_mlp(model, mlp.activation)
    ranks = [node.attributes["rank"].as_int() for node in (mlp.gate, mlp.up, mlp.down)]
    name = _mlp_name(mlp)
    metadata = dict(mlp.down.metadata_props)
    metadata[svd_ops.ORIGINAL_NODE_KEY] = ",".join(
        node.metadata_props.get(svd_ops.ORIGINAL_NODE_KEY, node.name or node.op_type) for node in mlp.nodes)
    fused = ir.Node(svd_ops.DOMAIN, svd_ops.SVD_GATED_MLP,
                    [mlp.gate.inputs[0], *mlp.gate.inputs[1:], *mlp.up.inputs[1:], *mlp.down.inputs[1:]],
                    [ir.AttrString("activation", mlp.activation), ir.AttrInt64s("ranks", ranks)],
                    overload=overload, num_outputs=1, name=name, metadata_props=metadata)
    ir.convenience.replace_nodes_and_values(mlp.down.graph, mlp.down, old_nodes=mlp.nodes, new_nodes=[fused],
                                            old_values=[mlp.down.outputs[0]], new_values=fused.outputs)
    return name


def _mlp_name(mlp: _GatedMlp) -> str:
    """The MLP's module path ("model.layers.0.mlp"), from the down projection's."""
    path = roles.module_path(mlp.down)
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    return parent or f"{mlp.down.name}.gated_mlp"
