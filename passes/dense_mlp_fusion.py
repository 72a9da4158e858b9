"""Fuse each dense MLP into one `ai.onnx_nmm` op: what Trainium computes in one kernel (kernels/dense_mlp),
the intermediate activation kept on chip. A narrowed MLP (--method nystrom) is such an MLP, of smaller width.

    g = X·Wg;  u = X·Wu;  Y = (act(g) * u)·Wd           →   Y = GatedMLP(X, Wg, Wu, Wd)
    Y = act(X·W1 + b1)·W2 (+ b2)                        →   Y = MLP(X, W1, b1, W2, b2)      zeros for a missing bias

The MLPs are those the MLP rules find that narrowing could narrow (mlp_narrowing.find_mlps); act is SiLU or
GELU (erf or tanh) however the exporter spelled it (activation_match). The fused op's function body computes
the same in plain ONNX, so onnxruntime still runs it. Not fused, with the reason: an MLP stored quantized (the
kernels take float weights), a gated MLP with biases, an activation the kernels do not have.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_nmm.passes import svd_ops
from onnx_nmm.passes.linear_layers import LinearLayer, find_linear_layers
from onnx_nmm.passes.mlp_fusion import FuseMlpPass, FusionChoice, MlpFusion
from onnx_nmm.passes.mlp_narrowing import find_mlps
from onnx_nmm.passes.mlp_rules.mlp import Mlp
from onnx_nmm.passes.mlp_rules.rule_set import GATED_MLP, UNGATED_MLP
from onnx_nmm.passes.mlp_rules.shared import Activation, keeps_rows
from onnx_nmm.passes.rules import Mismatch
from onnx_nmm.passes.stored_weights import NameAllocator, initializer


class FuseDenseMlpPass(ir.passes.InPlacePass):
    """Replace each dense MLP by one GatedMLP or MLP op (those `choose` accepts)."""

    def __init__(self, choose: FusionChoice | None = None):
        super().__init__()
        self.choose = choose

    def call(self, model: ir.Model) -> MlpFusion:
        fused: list[str] = []
        unfused: dict[str, str] = {}
        names = NameAllocator(model.graph)
        weights: dict[str, ir.Value] = {}  # weight values by layer name: every site of an MLP reads the same
        for mlp in find_mlps(find_linear_layers(model))[0]:
            reason = _why_not(mlp)
            activation = (GATED_MLP.activation(mlp) if mlp.gated else UNGATED_MLP.activation(mlp)) if not reason \
                else None
            if isinstance(activation, Mismatch):
                reason = "its activation is not SiLU or GELU (erf or tanh)"
            elif not reason and self.choose is not None:
                reason = self.choose(mlp.name, svd_ops.GATED_MLP if mlp.gated else svd_ops.MLP, _input_shapes(mlp))
            if reason or not isinstance(activation, Activation):
                unfused[mlp.name] = reason
                continue
            _replace(model, mlp, activation, names, weights)
            if mlp.name not in fused:  # the same MLP in another branch of a merged decoder
                fused.append(mlp.name)
        if fused:
            RemoveUnusedNodesPass()(model)
        return MlpFusion(model, modified=bool(fused), fused=fused, unfused=unfused)


def _input_shapes(mlp: Mlp) -> list[tuple[int, ...]]:
    """The fused op's inputs after X: Wg, Wu, Wd; or W1, b1, W2, b2."""
    h, i = mlp.down.n, mlp.width
    return [(h, i), (h, i), (i, h)] if mlp.gated else [(h, i), (i,), (i, h), (h,)]


def _why_not(mlp: Mlp) -> str:
    if any(layer.weight.quantized is not None for layer in mlp.layers):
        return "its weights are stored quantized"
    if mlp.gated and any(layer.bias is not None for layer in mlp.layers):
        return "a gated MLP with biases"
    if not keeps_rows(mlp):
        return "reshapes between its projections, and no shapes in the graph to show they keep the rows"
    return ""


def _replace(model: ir.Model, mlp: Mlp, activation: Activation, names: NameAllocator, weights: dict) -> None:
    op_type = svd_ops.GATED_MLP if mlp.gated else svd_ops.MLP
    overload = svd_ops.register_mlp_op(model, op_type, activation.name)
    graph, x = model.graph, mlp.projections[0].x
    if mlp.gated:  # gate, up as the activation reads them
        inputs = [x, *(_weight(graph, layer, names, weights) for layer in [*activation.inputs, mlp.down])]
    else:
        first, second = mlp.layers
        inputs = [x, _weight(graph, first, names, weights), _bias(graph, first, names, weights),
                  _weight(graph, second, names, weights), _bias(graph, second, names, weights)]
    down = mlp.down
    metadata = {**down.node.metadata_props, svd_ops.ORIGINAL_NODE_KEY: ",".join(
        node.name or node.op_type for layer in mlp.layers for node in layer.nodes)}
    fused = ir.Node(svd_ops.DOMAIN, op_type, inputs, [ir.AttrString("activation", activation.name)], overload=overload,
                    num_outputs=1, name=mlp.name, metadata_props=metadata)
    ir.convenience.replace_nodes_and_values(down.node.graph, down.node, old_nodes=down.nodes, new_nodes=[fused],
                                            old_values=[down.output], new_values=fused.outputs)


def _weight(graph: ir.Graph, layer: LinearLayer, names: NameAllocator, made: dict) -> ir.Value:
    """W [K, N] as the op reads it: the stored initializer itself when it is that, else a new one."""
    if layer.name not in made:
        stored = layer.weight.storage
        as_is = (stored.is_initializer() and not layer.weight.path and layer.alpha == 1.0
                 and stored.const_value is not None and tuple(stored.const_value.shape) == (layer.k, layer.n))
        made[layer.name] = stored if as_is else initializer(
            graph, names.fresh(f"{layer.name}.weight"), layer.weight_matrix(), layer.dtype)
    return made[layer.name]


def _bias(graph: ir.Graph, layer: LinearLayer, names: NameAllocator, made: dict) -> ir.Value:
    """The layer's bias [N] (beta applied), or zeros when it has none."""
    key = f"{layer.name} bias"
    if key not in made:
        bias = layer.bias_vector()
        made[key] = initializer(graph, names.fresh(f"{layer.name}.bias"),
                                np.zeros(layer.n, np.float32) if bias is None else bias, layer.dtype)
    return made[key]


def fuse_every_mlp(model: ir.Model, choose: FusionChoice | None = None) -> tuple[list[str], dict[str, str]]:
    """Each factorized MLP into one SvdGatedMLP or SvdMLP (mlp_fusion), then each dense one into a GatedMLP or
    MLP, where `choose` (if given) accepts it: the names of the fused MLPs, and for the others why not (by module
    path)."""
    factorized, dense = FuseMlpPass(choose)(model), FuseDenseMlpPass(choose)(model)
    assert isinstance(factorized, MlpFusion) and isinstance(dense, MlpFusion)
    unfused = {path: reason for path, reason in factorized.unfused.items() if path.rsplit(".", 1)[0] not in dense.fused}
    return factorized.fused + dense.fused, unfused | dense.unfused
