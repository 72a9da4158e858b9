"""What a model's linear layers are, and what a rewrite would do to them (`inspect`)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field

import onnx
import onnx_ir as ir

from onnx_nmm.errors import ModelError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RankOptions, Selection
from onnx_nmm.passes import LinearLayer, find_linear_layers, find_unread_layers, select_layers, unmatched_products
from onnx_nmm.ranks.rank_plan import Dense, keep_choice


@dataclass
class LayerInfo:
    name: str
    module_path: str
    group: str
    role: str
    k: int
    n: int
    dtype: str
    weight: str
    storage: str  # "initializer", "external data" or "Constant"
    transposed: bool
    bias: bool
    shared_with: list[str]  # other nodes reading the weight (a tied embedding's Gather)
    parameters: int
    targeted: bool
    rank: int | None  # what the rank rule gives a targeted layer, when it needs no spectrum; None otherwise
    rank_note: str
    parameters_after: int
    sites: int = 1  # nodes computing it: a merged decoder's branches each hold one, reading the same weight


@dataclass
class Inspection:
    model: str
    rule: str
    selection: str
    layers: list[LayerInfo]
    unread: list[dict] = field(default_factory=list)  # quantized layers in forms onnx-nmm does not read
    not_layers: dict[str, int] = field(default_factory=dict)  # MatMul/Gemm nodes read as no layer, by the reason

    def totals(self) -> dict:
        targeted = [layer for layer in self.layers if layer.targeted]
        return {
            "layers": len(self.layers),
            "by_group": dict(Counter(layer.group for layer in self.layers)),
            "parameters": sum(layer.parameters for layer in self.layers),
            "targeted_layers": len(targeted),
            "targeted_parameters": sum(layer.parameters for layer in targeted),
            "targeted_parameters_after": sum(layer.parameters_after for layer in targeted),
        }

    def to_dict(self) -> dict:
        return {"model": self.model, "rule": self.rule, "selection": self.selection,
                "layers": [asdict(layer) for layer in self.layers], "unread": self.unread,
                "not_layers": self.not_layers, "totals": self.totals()}


def inspect(model: str | os.PathLike | ir.Model | onnx.ModelProto, ranks: RankOptions | None = None,
            selection: Selection | None = None) -> Inspection:
    """Every linear layer of `model` (once, however many subgraphs compute it): role, shape, storage, whether
    `selection` targets it, and the rank `ranks` gives it. Raises ModelError, naming the ops it saw, when
    there is no linear layer."""
    ranks, selection = ranks or RankOptions(), selection or Selection()
    source = ModelSource.of(model)
    layers = find_linear_layers(source.model)
    unread = [{"node": layer.node.name, "op": layer.op, "module_path": layer.module_path, "group": layer.group}
              for layer in find_unread_layers(source.model)]
    not_layers = dict(Counter(reason for _, reason in unmatched_products(source.model)).most_common())
    if not layers and not unread:
        ops = Counter(node.op_type for node in source.model.graph)
        seen = ", ".join(f"{count} {op}" for op, count in ops.most_common(8)) or "no nodes"
        why = "".join(f"; {count} where {reason}" for reason, count in list(not_layers.items())[:2])
        raise ModelError(f"no linear layer found in {source.label}: looked for MatMul/Gemm nodes whose second input "
                         f"is a constant weight, and saw {seen}{why}")
    targeted = {layer.name for layer in select_layers(layers, selection)[0]}
    infos: dict[str, LayerInfo] = {}
    for layer in layers:
        if layer.name in infos:
            infos[layer.name].sites += 1
        else:
            infos[layer.name] = _info(layer, ranks, layer.name in targeted)
    return Inspection(source.label, ranks.describe(), selection.describe(), list(infos.values()), unread,
                      not_layers)


def _info(layer: LinearLayer, ranks: RankOptions, targeted: bool) -> LayerInfo:
    rank, note = _rank(layer, ranks) if targeted else (None, "not targeted")
    storage = ("external data" if layer.weight.is_external
               else ("initializer" if layer.weight.is_initializer else "Constant"))
    quantized = layer.weight.quantized
    if quantized is not None:
        storage = f"{quantized.format} {quantized.bits}-bit" + (f" blocks of {quantized.block_size}"
                                                                 if quantized.block_size else "") + f", {storage}"
    return LayerInfo(
        name=layer.name, module_path=layer.module_path, group=layer.group, role=layer.role, k=layer.k, n=layer.n,
        dtype=layer.dtype.name.lower(), weight=layer.weight.name, storage=storage,
        transposed=layer.weight.transposed, bias=layer.bias is not None, shared_with=layer.shared_with,
        parameters=layer.parameters, targeted=targeted, rank=rank, rank_note=note,
        parameters_after=rank * (layer.k + layer.n) if rank is not None else layer.parameters)


def _rank(layer: LinearLayer, ranks: RankOptions) -> tuple[int | None, str]:
    """The rank the rule gives without the spectrum or calibration, or why it cannot tell."""
    if ranks.rule == "keep" and ranks.budget == "uniform" and ranks.keep is not None:
        choice = keep_choice(layer, ranks.keep, ranks.align)
        return (None, choice.reason) if isinstance(choice, Dense) else (choice, "")
    if ranks.rule == "rank":
        return (min(layer.k, layer.n) if not isinstance(ranks.rank, int) else ranks.rank), ""
    return None, "needs the spectrum" if ranks.rule == "energy" else "chosen when rewriting"
