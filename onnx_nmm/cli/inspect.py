"""`onnx-nmm inspect MODEL`: every linear layer, its role, shape, storage and the rank --keep gives."""

from __future__ import annotations

from collections import Counter

from rich.table import Table

from onnx_nmm.cli import _common
from onnx_nmm.model_io import load_model
from onnx_nmm.passes import find_linear_layers, select_layers


def register(subparsers) -> None:
    parser = subparsers.add_parser("inspect", help="list the linear layers of a model and what a rewrite would do")
    parser.add_argument("model", help="an .onnx model (external data is read from beside it)")
    _common.add_rank_options(parser)
    _common.add_selection_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def run(args) -> int:
    rule = _common.rank_rule_from(args)
    selection = _common.selection_from(args)
    model = load_model(args.model)
    layers = find_linear_layers(model)
    targeted, _ = select_layers(layers, selection)
    targeted_ids = {id(layer) for layer in targeted}
    rows = [_row(layer, rule, id(layer) in targeted_ids) for layer in layers]
    totals = _totals(rows)
    if args.json:
        _common.print_json({"model": str(args.model), "rule": rule.describe(), "selection": selection.describe(),
                            "layers": rows, "totals": totals})
        return 0
    _print_table(args.model, rows, totals, rule, selection)
    return 0


def _row(layer, rule, targeted: bool) -> dict:
    rank, reason = rule.rank_before_svd(layer.k, layer.n)
    storage = "external data" if layer.weight.is_external else ("initializer" if layer.weight.is_initializer else "Constant")
    return {
        "name": layer.name, "module_path": layer.module_path, "group": layer.group, "role": layer.role,
        "k": layer.k, "n": layer.n, "dtype": layer.dtype.name.lower(), "weight": layer.weight.name,
        "storage": storage, "transposed": layer.weight.transposed, "bias": layer.bias is not None,
        "shared_with": layer.shared_with, "parameters": layer.parameters, "targeted": targeted,
        "rank": rank, "rank_note": reason or ("needs the spectrum" if rank is None else ""),
        "parameters_after": rank * (layer.k + layer.n) if rank is not None and targeted else layer.parameters,
    }


def _totals(rows: list[dict]) -> dict:
    targeted = [row for row in rows if row["targeted"]]
    return {
        "layers": len(rows),
        "by_group": dict(Counter(row["group"] for row in rows)),
        "parameters": sum(row["parameters"] for row in rows),
        "targeted_layers": len(targeted),
        "targeted_parameters": sum(row["parameters"] for row in targeted),
        "targeted_parameters_after": sum(row["parameters_after"] for row in targeted),
    }


def _print_table(model, rows, totals, rule, selection) -> None:
    prefix = _common.common_module_prefix([row["module_path"] for row in rows])
    table = Table(title=f"Linear layers of {model}" + (f" (module paths under {prefix})" if prefix else ""),
                  title_justify="left")
    for column, justify in (("#", "right"), ("node", "left"), ("module path", "left"), ("role", "left"), ("K×N", "right"),
                            ("dtype", "left"), ("weight", "left"), ("params", "right"), ("rank", "right")):
        table.add_column(column, justify=justify)
    for index, row in enumerate(rows):
        storage = {"external data": "external", "initializer": "init", "Constant": "Constant"}[row["storage"]]
        storage += "ᵀ" if row["transposed"] else ""
        storage += " +bias" if row["bias"] else ""
        if row["shared_with"]:
            storage += f" shared: {', '.join(row['shared_with'])}"
        rank = str(row["rank"]) if row["rank"] is not None else "—"
        if row["rank_note"]:
            rank += f" ({row['rank_note']})"
        table.add_row(str(index), row["name"], row["module_path"].removeprefix(prefix),
                      f"{row['group']}/{row['role']}", f"{row['k']}×{row['n']}", row["dtype"], storage,
                      _common.millions(row["parameters"]), rank, style=None if row["targeted"] else "dim")
    _common.stdout.print(table)
    groups = ", ".join(f"{count} {group}" for group, count in totals["by_group"].items())
    before, after = totals["targeted_parameters"], totals["targeted_parameters_after"]
    _common.stdout.print(
        f"{totals['layers']} linear layers ({groups}), {_common.millions(totals['parameters'])} parameters. "
        f"Targets ({selection.describe()}; dimmed rows are not targeted): {totals['targeted_layers']} layers, "
        f"{_common.millions(before)} → {_common.millions(after)} parameters at {rule.describe()}"
        + (f" ({after / before:.1%} kept)" if before else ""))
