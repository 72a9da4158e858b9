"""`onnx-nmm rewrite MODEL -o OUT`: factorize linear layers into ai.onnx_nmm::SvdMatMul ops."""

from __future__ import annotations

from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from onnx_nmm.cli import _common
from onnx_nmm.errors import UserError
from onnx_nmm.lowrank import SVD_METHODS
from onnx_nmm.model_io import (PROTOBUF_LIMIT, check_model_file, check_output_path, load_model, save_model,
                               uses_external_data, weight_bytes)
from onnx_nmm.rewrite import SvdOptions, rewrite_model


def register(subparsers) -> None:
    parser = subparsers.add_parser("rewrite", help="replace linear layers by SVD-factorized SvdMatMul custom ops")
    parser.add_argument("model", help="an .onnx model (external data is read from beside it)")
    parser.add_argument("-o", "--output", help="where to write the rewritten model (default: MODEL.nmm.onnx)")
    parser.add_argument("--force", action="store_true", help="allow the output to replace the input model")
    _common.add_rank_options(parser)
    _common.add_selection_options(parser)
    parser.add_argument("--svd", choices=SVD_METHODS, default="exact",
                        help="exact (float64 Gram eigendecomposition) or randomized (faster for low ranks; "
                             "its error is in the report)")
    parser.add_argument("--power-iterations", type=int, default=2, help="randomized SVD power iterations (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the randomized SVD")
    parser.add_argument("--external-data", choices=("auto", "yes", "no"), default="auto",
                        help="write weights to OUT.data: auto = if the input did or the model exceeds 2 GB")
    parser.add_argument("--report", metavar="FILE.json", help="write the per-layer report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    parser.set_defaults(handler=run)


def run(args) -> int:
    rule = _common.rank_rule_from(args)
    selection = _common.selection_from(args)
    if args.power_iterations < 0:
        raise UserError(f"--power-iterations must be ≥ 0, got {args.power_iterations}")
    svd = SvdOptions(method=args.svd, power_iterations=args.power_iterations, seed=args.seed)
    source = Path(args.model)
    output = Path(args.output) if args.output else source.with_name(source.stem + ".nmm.onnx")
    check_output_path(source, output, args.force)
    model = load_model(source)
    external = {"yes": True, "no": False}.get(args.external_data)
    if external is None:
        external = uses_external_data(model)

    with _progress(args.quiet) as progress:
        task = progress.add_task("factorizing", total=None)
        report = rewrite_model(
            model, rule, selection, svd,
            on_start=lambda total: progress.update(task, total=total),
            on_layer=lambda outcome: progress.update(task, advance=1, description=outcome.module_path or outcome.name),
        )
        progress.update(task, description="writing")
        if not external and weight_bytes(model) > PROTOBUF_LIMIT:
            external = True
        save_model(model, output, external_data=external, validate=check_model_file)

    if args.report:
        _common.write_json(args.report, {"input": str(source), "output": str(output), **report.to_dict()})
    if not args.quiet:
        _print_summary(report, output)
    return 0


def _progress(quiet: bool) -> Progress:
    return Progress(TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=_common.stderr, disable=quiet, transient=True)


def _print_summary(report, output: Path) -> None:
    prefix = _common.common_module_prefix([layer.module_path for layer in report.layers])
    table = Table(title=f"Rewrite ({report.rule}; {report.selection}; svd {report.svd})"
                  + (f", module paths under {prefix}" if prefix else ""), title_justify="left")
    for column, justify in (("layer", "left"), ("role", "left"), ("K×N", "right"), ("rank", "right"),
                            ("params before", "right"), ("after", "right"), ("rel. error", "right"), ("note", "left")):
        table.add_column(column, justify=justify)
    for layer in report.layers:
        if layer.status == "skipped":
            continue
        table.add_row(layer.module_path.removeprefix(prefix) or layer.name, layer.role, f"{layer.k}×{layer.n}",
                      str(layer.rank) if layer.rank else "dense", _common.millions(layer.parameters_before),
                      _common.millions(layer.parameters_after),
                      f"{layer.relative_error:.4f}" if layer.relative_error is not None else "—", layer.reason)
    _common.stdout.print(table)
    totals = report.totals()
    skipped = totals["layers_found"] - sum(1 for layer in report.layers if layer.status != "skipped")
    _common.stdout.print(
        f"{totals['layers_factorized']} layers factorized, {skipped} left alone (not targeted); targeted parameters "
        f"{_common.millions(totals['parameters_before'])} → {_common.millions(totals['parameters_after'])} "
        f"({totals['kept_fraction']:.1%} kept). Wrote {output}")
