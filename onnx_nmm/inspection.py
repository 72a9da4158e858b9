"""What a model's linear layers are, what a rewrite would do to them, and, in a model onnx-nmm already rewrote,
what that rewrite did (`inspect`).

A rewrite leaves its marks in the model: each factorized layer is an ai.onnx_nmm op carrying its rank (or two
MatMulNBits whose node metadata names the factor and the rank), each narrowed layer's node records its MLP's
width before and after (passes/mlp_narrowing.NARROWED_KEY), and the model records the dense model it came from
and what it was calibrated on (teacher.py).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field

import onnx
import onnx_ir as ir

from onnx_nmm.errors import ModelError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RankOptions, Selection
from onnx_nmm.passes import (
    LinearLayer,
    find_linear_layers,
    find_unread_layers,
    roles,
    select_layers,
    svd_ops,
    unmatched_products,
)
from onnx_nmm.passes.mlp_narrowing import NARROWED_KEY
from onnx_nmm.passes.svd_factorization import FACTOR_KEY, RANK_KEY
from onnx_nmm.ranks.rank_plan import Dense, keep_choice
from onnx_nmm.teacher import CALIBRATION, DENSE_MODEL


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
    rewritten: str = ""  # what an onnx-nmm rewrite made of it: "narrowed: 32 of 512 neurons kept", "factor U …"


@dataclass
class FactorizedLayerInfo:
    """A layer an onnx-nmm rewrite factorized, as the rewritten model holds it: an SvdMatMul (or a quantized
    layer's two MatMulNBits), or a fused SvdGatedMLP/SvdMLP standing for a whole MLP."""

    name: str  # the node (for quantized factors, the node the pair replaced)
    module_path: str
    role: str
    op: str
    k: int  # the dense layer's K×N; for an MLP op, the hidden size × the MLP's width
    n: int
    ranks: list[int]  # one per projection
    parameters: int  # of the factors
    parameters_before: int  # of the dense weights they stand for


@dataclass
class Inspection:
    model: str
    rule: str
    selection: str
    layers: list[LayerInfo]
    unread: list[dict] = field(default_factory=list)  # quantized layers in forms onnx-nmm does not read
    not_layers: dict[str, int] = field(default_factory=dict)  # MatMul/Gemm nodes read as no layer, by the reason
    factorized: list[FactorizedLayerInfo] = field(default_factory=list)  # by an earlier onnx-nmm rewrite
    dense_model: str = ""  # the model an earlier rewrite started from, as it recorded it
    calibration: str = ""  # what that rewrite was calibrated on, in words
    rule_given: bool = True  # whether the rank rule was asked for (False: the default, keep 0.8)

    @property
    def rewritten(self) -> bool:
        """Whether an onnx-nmm rewrite made this model."""
        return bool(self.factorized or self.dense_model or any(layer.rewritten for layer in self.layers))

    def rewrite_totals(self) -> dict:
        """What the earlier rewrite did: layers narrowed and factorized, and their parameters against the dense
        model's."""
        narrowed = [layer for layer in self.layers if layer.rewritten.startswith("narrowed")]
        return {
            "narrowed_layers": len(narrowed),
            "widths": dict(Counter(layer.rewritten.removeprefix("narrowed: ").removesuffix(" neurons kept")
                                   for layer in narrowed)),
            "factorized_layers": sum(len(layer.ranks) for layer in self.factorized),
            "ranks": sorted({rank for layer in self.factorized for rank in layer.ranks}),
            "parameters": sum(layer.parameters for layer in narrowed) + sum(layer.parameters for layer in
                                                                            self.factorized),
            "parameters_before": sum(_dense_parameters(layer) for layer in narrowed)
                                 + sum(layer.parameters_before for layer in self.factorized),
        }

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
        rewrite = ({"dense_model": self.dense_model, "calibration": self.calibration,
                    "factorized": [asdict(layer) for layer in self.factorized], "totals": self.rewrite_totals()}
                   if self.rewritten else None)
        return {"model": self.model, "rule": self.rule, "selection": self.selection,
                "layers": [asdict(layer) for layer in self.layers], "unread": self.unread,
                "not_layers": self.not_layers, "totals": self.totals(), "rewrite": rewrite}


def inspect(model: str | os.PathLike | ir.Model | onnx.ModelProto, ranks: RankOptions | None = None,
            selection: Selection | None = None) -> Inspection:
    """Every linear layer of `model` (once, however many subgraphs compute it): role, shape, storage, whether
    `selection` targets it, and the rank `ranks` gives it; in a model an onnx-nmm rewrite made, what it narrowed
    and factorized (a layer it changed gets a rank only when `ranks` asks for one). Raises ModelError, naming
    the ops it saw, when there is no linear layer."""
    ranks, selection = ranks or RankOptions(), selection or Selection()
    source = ModelSource.of(model)
    layers = find_linear_layers(source.model)
    factorized = find_factorized_layers(source.model)
    unread = [{"node": layer.node.name, "op": layer.op, "module_path": layer.module_path, "group": layer.group}
              for layer in find_unread_layers(source.model)]
    not_layers = dict(Counter(reason for _, reason in unmatched_products(source.model)).most_common())
    if not layers and not unread and not factorized:
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
    metadata = source.model.metadata_props
    return Inspection(source.label, ranks.describe(), selection.describe(), list(infos.values()), unread,
                      not_layers, factorized, metadata.get(DENSE_MODEL, ""), metadata.get(CALIBRATION, ""),
                      rule_given=not ranks.by_default)


def _info(layer: LinearLayer, ranks: RankOptions, targeted: bool) -> LayerInfo:
    rewritten = _rewritten(layer)
    rank, note = _rank(layer, ranks) if targeted else (None, "not targeted")
    if rewritten and ranks.by_default:  # not offered the default rule again: say what was done instead
        rank, note = None, rewritten
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
        parameters_after=rank * (layer.k + layer.n) if rank is not None else layer.parameters, rewritten=rewritten)


def _rewritten(layer: LinearLayer) -> str:
    """What an onnx-nmm rewrite made of the layer, from its node's metadata; "" for a layer it did not touch."""
    metadata = layer.node.metadata_props
    if NARROWED_KEY in metadata:
        return f"narrowed: {metadata[NARROWED_KEY]} neurons kept"
    if FACTOR_KEY in metadata:
        return f"factor {metadata[FACTOR_KEY].upper()} of a rank-{metadata.get(RANK_KEY, '?')} factorization"
    return ""


def _dense_parameters(layer: LayerInfo) -> int:
    """A narrowed layer's parameters at its MLP's width before narrowing ("32 of 512": the narrowed side ×16)."""
    kept, _, width = layer.rewritten.removeprefix("narrowed: ").removesuffix(" neurons kept").partition(" of ")
    return layer.parameters * int(width) // int(kept)


def find_factorized_layers(model: ir.Model) -> list[FactorizedLayerInfo]:
    """The layers an onnx-nmm rewrite factorized, once each however many subgraphs hold them: its custom ops,
    and the quantized layers it wrote as two MatMulNBits (U's node and V's, named by node metadata)."""
    found: dict[str, FactorizedLayerInfo] = {}
    halves: dict[str, dict[str, ir.Node]] = {}  # a quantized layer's replaced node → its U and V nodes
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == svd_ops.DOMAIN and node.op_type in (svd_ops.SVD_MATMUL, *svd_ops.MLP_OPS):
            found.setdefault(node.name or str(id(node)), _factorized_op(node))
        elif FACTOR_KEY in node.metadata_props:
            original = node.metadata_props.get(svd_ops.ORIGINAL_NODE_KEY, node.name or "")
            halves.setdefault(original, {})[node.metadata_props[FACTOR_KEY]] = node
    for original, pair in halves.items():
        if set(pair) == {"u", "v"}:
            found.setdefault(original, _quantized_pair(original, pair["u"], pair["v"]))
    return list(found.values())


def _factorized_op(node: ir.Node) -> FactorizedLayerInfo:
    """An SvdMatMul, SvdGatedMLP or SvdMLP: its ranks from its attributes, its dense shape and parameters from
    its factors' shapes (0 where the model does not give them)."""
    shapes = [shape for shape in map(_matrix_shape, node.inputs[1:]) if shape is not None]  # U, V (, bias) …
    pairs = list(zip(shapes[::2], shapes[1::2]))  # (U [K, r], V [r, N]) of each projection
    path = roles.module_path(node)
    if node.op_type == svd_ops.SVD_MATMUL:
        ranks = [node.attributes["rank"].as_int()]
        group, role = roles.classify(path) or (roles.OTHER, roles.OTHER)
    else:  # a whole MLP, named after its down projection's module: the MLP's is its parent
        ranks = list(node.attributes["ranks"].as_ints())
        group, role = roles.MLP, ("gate+up+down" if node.op_type == svd_ops.SVD_GATED_MLP else "fc1+fc2")
        path = path.rpartition(".")[0] or path
    k, n = (pairs[0][0][0], pairs[0][1][1]) if pairs else (0, 0)
    return FactorizedLayerInfo(
        name=node.name or "", module_path=path, role=f"{group}/{role}", op=node.op_type, k=k, n=n, ranks=ranks,
        parameters=sum(u[0] * u[1] + v[0] * v[1] for u, v in pairs),
        parameters_before=sum(u[0] * v[1] for u, v in pairs))


def _matrix_shape(value: ir.Value | None) -> tuple[int, int] | None:
    """A factor's [rows, columns], read through the Cast or DequantizeLinear a rewrite may put before it; None
    for a bias or a shape the model does not say."""
    while value is not None:
        if value.shape is not None:
            if len(value.shape) != 2:
                return None
            rows, columns = value.shape
            if isinstance(rows, int) and isinstance(columns, int):
                return rows, columns
        producer = value.producer()
        if producer is None or producer.op_type not in ("Cast", "DequantizeLinear"):
            return None
        value = producer.inputs[0]
    return None


def _quantized_pair(original: str, u: ir.Node, v: ir.Node) -> FactorizedLayerInfo:
    """A quantized layer written as MatMulNBits(MatMulNBits(X, U), V): K×N and the rank from their attributes."""
    k, rank, n = u.attributes["K"].as_int(), u.attributes["N"].as_int(), v.attributes["N"].as_int()
    path = roles.module_path(u)
    group, role = roles.classify(path) or (roles.OTHER, roles.OTHER)
    return FactorizedLayerInfo(name=original, module_path=path, role=f"{group}/{role}", op=f"{u.op_type} ×2", k=k, n=n,
                           ranks=[rank], parameters=rank * (k + n), parameters_before=k * n)


def _rank(layer: LinearLayer, ranks: RankOptions) -> tuple[int | None, str]:
    """The rank the rule gives without the spectrum or calibration, or why it cannot tell."""
    if ranks.rule == "keep" and ranks.budget == "uniform" and ranks.keep is not None:
        choice = keep_choice(layer, ranks.keep, ranks.align)
        return (None, choice.reason) if isinstance(choice, Dense) else (choice, "")
    if ranks.rule == "rank":
        return (min(layer.k, layer.n) if not isinstance(ranks.rank, int) else ranks.rank), ""
    return None, "needs the spectrum" if ranks.rule == "energy" else "chosen when rewriting"
