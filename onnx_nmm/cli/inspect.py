"""`onnx-nmm inspect MODEL`: every linear layer, its role, shape, storage and the rank --keep gives; in a model
onnx-nmm rewrote, what the rewrite narrowed and factorized instead (onnx_nmm.inspect)."""

from __future__ import annotations

import sys
from collections import Counter

import onnx_nmm
from onnx_nmm.cli import _common


def register(subparsers) -> None:
    parser = subparsers.add_parser("inspect", help="list the linear layers of a model and what a rewrite would do")
    parser.add_argument("model", help="an .onnx model (external data is read from beside it)")
    _common.add_rank_options(parser)
    _common.add_selection_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def run(args) -> int:
    ranks = onnx_nmm.RankOptions(**_common.given(keep=args.keep, rank=args.rank, energy=args.energy, align=args.align))
    inspection = onnx_nmm.inspect(args.model, ranks, _common.selection_from(args))
    if args.json:
        _common.print_json(inspection.to_dict())
    else:
        _print_table(inspection)
    return 0


def _print_table(inspection: onnx_nmm.Inspection) -> None:
    prefix = _common.common_module_prefix([layer.module_path for layer in inspection.layers])
    title = f"Linear layers of {inspection.model}" + (f" (module paths under {prefix})" if prefix else "")
    table = _common.Table(title=title, title_justify="left")
    for column, justify in (("#", "right"), ("node", "left"), ("module path", "left"), ("role", "left"),
                            ("K×N", "right"), ("dtype", "left"), ("weight", "left"), ("params", "right"),
                            ("rank", "right"), *([("targeted", "left")] if not sys.stdout.isatty() else [])):
        table.add_column(column, justify=justify)
    for index, layer in enumerate(inspection.layers):
        storage = layer.storage.replace("external data", "external").replace("initializer", "init")
        storage += "ᵀ" if layer.transposed else ""
        storage += " +bias" if layer.bias else ""
        if layer.shared_with:
            storage += f" shared: {', '.join(layer.shared_with)}"
        if layer.sites > 1:
            storage += f" ×{layer.sites} subgraphs"
        rank = str(layer.rank) if layer.rank is not None else "—"
        if layer.rank is None and layer.rewritten:
            rank = layer.rewritten
        elif layer.rank_note:
            rank += f" ({layer.rank_note})"
        table.add_row(str(index), layer.name, layer.module_path.removeprefix(prefix), f"{layer.group}/{layer.role}",
                      f"{layer.k}×{layer.n}", layer.dtype, storage, _common.millions(layer.parameters), rank,
                      *(["yes" if layer.targeted else "no"] if not sys.stdout.isatty() else []),
                      style=None if layer.targeted else "dim")
    _common.stdout.print(table)
    if inspection.factorized:
        _print_factorized(inspection, prefix)
    if inspection.unread:
        ops = Counter(layer["op"] for layer in inspection.unread)
        _common.stdout.print(f"{_common.count(len(inspection.unread), 'linear layer')} quantized in a form onnx-nmm "
                             f"does not read: {', '.join(f'{count} {op}' for op, count in ops.items())}")
    if inspection.not_layers:
        said = "; ".join(f"{count} {reason}" for reason, count in inspection.not_layers.items())
        _common.stdout.print(f"MatMul/Gemm nodes read as no linear layer: {said}", style="dim", soft_wrap=True)
    totals = inspection.totals()
    groups = ", ".join(f"{count} {group}" for group, count in totals["by_group"].items())
    before, after = totals["targeted_parameters"], totals["targeted_parameters_after"]
    untargeted = "dimmed rows are not targeted" if sys.stdout.isatty() else "see the targeted column"
    said = (f"{_common.count(totals['layers'], 'linear layer')} ({groups}), {_common.millions(totals['parameters'])} "
            "parameters.")
    if inspection.rewritten:
        said += " " + _rewrite_said(inspection)
    if not inspection.rewritten or inspection.rule_given:  # a rewritten model is not offered the default again
        said += (f" Targets ({inspection.selection}; {untargeted}): {totals['targeted_layers']} layers, "
                 f"{_common.millions(before)} → {_common.millions(after)} parameters at {inspection.rule}"
                 + (f" ({after / before:.1%} kept)" if before else ""))
    _common.stdout.print(said)


def _print_factorized(inspection: onnx_nmm.Inspection, prefix: str) -> None:
    """The layers an earlier rewrite factorized: they are custom ops now, not linear layers."""
    table = _common.Table(title="Factorized by onnx-nmm (K×N and parameters of the dense layers they replace)",
                          title_justify="left")
    for column, justify in (("node", "left"), ("module path", "left"), ("role", "left"), ("op", "left"),
                            ("K×N", "right"), ("rank", "right"), ("params", "right"), ("dense params", "right")):
        table.add_column(column, justify=justify)
    for layer in inspection.factorized:
        table.add_row(layer.name, layer.module_path.removeprefix(prefix), layer.role, layer.op, f"{layer.k}×{layer.n}",
                      "/".join(map(str, layer.ranks)), _common.millions(layer.parameters),
                      _common.millions(layer.parameters_before))
    _common.stdout.print(table)


def _rewrite_said(inspection: onnx_nmm.Inspection) -> str:
    """What the rewrite that made the model did, in a sentence or two."""
    rewrite = inspection.rewrite_totals()
    done = []
    if rewrite["narrowed_layers"]:
        widths = ", ".join(f"{width} neurons kept in {_common.count(count, 'layer')}"
                           for width, count in rewrite["widths"].items())
        done.append(f"{rewrite['narrowed_layers']} narrowed ({widths})")
    if rewrite["factorized_layers"]:
        done.append(f"{rewrite['factorized_layers']} factorized (ranks {', '.join(map(str, rewrite['ranks']))})")
    source = f" from {inspection.dense_model}" if inspection.dense_model else ""
    calibrated = f", calibrated on {inspection.calibration}" if inspection.calibration else ""
    said = f"Rewritten by onnx-nmm{source}{calibrated}: " + ("; ".join(done) or "no layer changed")
    if rewrite["parameters_before"]:
        said += (f", {_common.millions(rewrite['parameters'])} parameters where the dense model had "
                 f"{_common.millions(rewrite['parameters_before'])}")
    if not inspection.rule_given:
        said += ". Give --keep, --rank or --energy for what another rewrite of this model would do"
    return said + "."
