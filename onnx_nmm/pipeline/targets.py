"""What a rewrite targets in a model: every linear layer, the ones the selection chooses (and why the others are
left alone), and with a method that narrows MLPs the MLPs it narrows (and why the others are not)."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from onnx_nmm.errors import ModelError
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes import LinearLayer, find_linear_layers, find_unread_layers, select_layers
from onnx_nmm.passes.mlp_narrowing import find_mlps
from onnx_nmm.passes.mlp_rules.mlp import Mlp


@dataclass(frozen=True)
class Targets:
    """`layers`: every linear layer, each site; `chosen`: the targets, each by its first site (a target a merged
    decoder's branches both hold is one target); `skipped`: why each other layer is left alone; `mlps`: the
    MLPs narrowed as modules, each site; `not_narrowed`: an MLP's module path → why it is not one."""

    layers: list[LinearLayer]
    chosen: list[LinearLayer]
    skipped: dict[str, str]
    mlps: list[Mlp] = field(default_factory=list)
    not_narrowed: dict[str, str] = field(default_factory=dict)

    def sites(self) -> list[LinearLayer]:
        """Every node of the targets, in graph order: a target in several subgraphs has a site in each."""
        names = {layer.name for layer in self.chosen}
        return [layer for layer in self.layers if layer.name in names]


def find_targets(model: ir.Model, options: RewriteOptions) -> Targets:
    """The targets of `model` as `options` select them, with the MLPs its method narrows; refused when there is
    nothing to target."""
    targets = find_layers(model, options)
    if not options.strategy.narrows_mlps:
        return targets
    mlps, unmatched = find_mlps(targets.layers)
    by_name = {layer.name: layer for layer in targets.layers}
    not_narrowed = {by_name[down].module_path.rsplit(".", 1)[0]: why for down, why in unmatched.items()}
    chosen = {layer.name for layer in targets.chosen}
    targeted = [mlp for mlp in mlps if all(layer.name in chosen for layer in mlp.layers)]
    return Targets(targets.layers, targets.chosen, targets.skipped, targeted, not_narrowed)


def find_layers(model: ir.Model, options: RewriteOptions) -> Targets:
    """The linear layers of `model` the selection targets (no MLPs looked for); refused when there is nothing to
    target."""
    layers = find_linear_layers(model)
    _refuse_unread_targets(model, layers, options)
    if not layers:
        raise ModelError("no linear layer found: looked for MatMul/Gemm nodes whose second input is a constant weight "
                         "(an initializer or a Constant, possibly behind Identity/Transpose/Cast), and MatMulNBits, "
                         "DequantizeLinear → MatMul and MatMulInteger")
    chosen, skipped = select_layers(layers, options.selection)
    if not chosen:
        raise ModelError(f"none of the {len(layers)} linear layers matches {options.selection.describe()}; "
                         "inspect lists their names and roles")
    first_sites: dict[str, LinearLayer] = {}
    for layer in chosen:
        first_sites.setdefault(layer.name, layer)
    return Targets(layers, list(first_sites.values()), skipped)


def _refuse_unread_targets(model: ir.Model, layers: list[LinearLayer], options: RewriteOptions) -> None:
    """Quantized layers in a form onnx-nmm does not read, where the rewrite would target them: name the op."""
    unread = [layer for layer in find_unread_layers(model)
              if not layers or options.selection.targets in ("all", layer.group) or layer.group == "other"]
    if unread:
        ops = sorted({layer.op for layer in unread})
        raise ModelError(f"{len(unread)} of the targeted linear layers are quantized as {', '.join(ops)} (e.g. "
                         f"{unread[0].module_path or unread[0].node.name}), a form onnx-nmm does not read; rewrite the "
                         "float model and quantize the result, or quantize with MatMulNBits, QDQ or dynamic int8")
