"""`onnx-nmm rewrite MODEL -o OUT`: factorize linear layers into ai.onnx_nmm::SvdMatMul ops."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from onnx_nmm import calibration_data
from onnx_nmm.activation_stats import GramStatistics, collect_gram_matrices
from onnx_nmm.cli import _common
from onnx_nmm.errors import UserError
from onnx_nmm.lowrank import SVD_METHODS
from onnx_nmm.passes import FuseGatedMlpPass, find_linear_layers, select_layers
from onnx_nmm.model_io import (PROTOBUF_LIMIT, check_model_file, check_output_path, load_model, save_model,
                               uses_external_data, weight_bytes)
from onnx_nmm.rewrite import BUDGETS, METHODS, FactorizationOptions, rewrite_model, target_inputs
from onnx_nmm.sequential import GroupObserver


def register(subparsers) -> None:
    parser = subparsers.add_parser("rewrite", help="replace linear layers by SVD-factorized SvdMatMul custom ops")
    parser.add_argument("model", help="an .onnx model (external data is read from beside it)")
    parser.add_argument("-o", "--output", help="where to write the rewritten model (default: MODEL.nmm.onnx)")
    parser.add_argument("--force", action="store_true", help="allow the output to replace the input model")
    _common.add_rank_options(parser)
    _common.add_selection_options(parser)
    parser.add_argument("--method", choices=METHODS,
                        help="svd: truncated SVD of W; whiten: SVD-LLM activation-aware SVD, minimising the error of "
                             "the layer's outputs on the calibration data; fisher: also weighs each output direction by "
                             "how much the model's predictions depend on it (gradients through the model in PyTorch; "
                             "the best quality, and --budget global then spends parameters by predicted KL) "
                             "(default: whiten with --calib, else svd)")
    parser.add_argument("--budget", choices=BUDGETS, default="uniform",
                        help="uniform: every matrix keeps --keep of its parameters; global: the same total, spent "
                             "per layer where it removes the most truncation loss; sensitivity: the same total, "
                             "removed where it raises the perplexity on calibration windows least (measured, as "
                             "for --max-ppl-increase; needs --calib)")
    calibration = parser.add_argument_group("calibration (activation-aware SVD)")
    calibration.add_argument("--calib", metavar="SOURCE",
                             help="a text file (with --tokenizer), an .npz with input_ids [samples, seq], "
                                  "statistics saved by --save-calib-stats, or 'random' (tests only)")
    calibration.add_argument("--tokenizer", metavar="PATH", help="a tokenizer folder or a .gguf file, for text")
    calibration.add_argument("--calib-samples", type=int, default=128, help="sequences to use (default 128)")
    calibration.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    calibration.add_argument("--calib-spread", action="store_true",
                             help="take the --calib-samples windows evenly spaced over the whole text, not from its "
                                  "start (better when the text's opening is not like the rest)")
    calibration.add_argument("--calib-batch", type=int, default=1, help="sequences per onnxruntime run (default 1)")
    calibration.add_argument("--calib-mode", choices=("independent", "sequential"), default="independent",
                             help="independent: whiten every layer from the dense model's activations; sequential: fit "
                                  "each layer, in graph order, to the dense outputs from the inputs the already-compressed "
                                  "model feeds it (one onnxruntime pass per group of layers; slower, errors stop "
                                  "compounding)")
    calibration.add_argument("--calib-stats", metavar="FILE.npz",
                             help="XᵀX statistics saved by --save-calib-stats, used instead of gathering them (with "
                                  "--calib TEXT still giving the tokens sequential calibration and budgets run on)")
    calibration.add_argument("--save-calib-stats", metavar="FILE.npz",
                             help="keep the gathered XᵀX statistics, to reuse with --calib FILE.npz")
    budget = parser.add_argument_group("quality budget (choose layers and ranks; needs --calib tokens)")
    budget.add_argument("--max-ppl-increase", type=float, metavar="P",
                        help="compress as many parameters as possible while the perplexity on the calibration windows "
                             "grows by at most this fraction (0.1 = +10 %%); ranks stay multiples of --align")
    budget.add_argument("--max-kl", type=float, metavar="NATS",
                        help="the same, bounding the mean KL divergence to the dense model's next-token distributions")
    budget.add_argument("--sensitivity-windows", type=int, default=4,
                        help="calibration windows the budget is measured on (default 4), chosen as --calib's are: "
                             "from the start of the text, or spread over it with --calib-spread")
    budget.add_argument("--ranks-from", metavar="REPORT.json",
                        help="the layers and ranks another rewrite of this model chose (its --report), e.g. to refit "
                             "a quality budget's choice with --calib-mode sequential without measuring it again")
    parser.add_argument("--fuse-mlp", action="store_true",
                        help="fuse each SiLU-gated gate/up/down triple into one SvdGatedMLP (what `compile` does "
                             "for Trainium; onnxruntime still runs it)")
    parser.add_argument("--svd", choices=SVD_METHODS, default="exact",
                        help="exact (float64 Gram eigendecomposition) or randomized (faster for low ranks; "
                             "its error is in the report)")
    parser.add_argument("--power-iterations", type=int, default=2, help="randomized SVD power iterations (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the randomized SVD")
    parser.add_argument("--external-data", choices=("auto", "yes", "no"), default="auto",
                        help="write weights to OUT.data: auto = if the input did or the model exceeds 2 GB")
    parser.add_argument("--report", metavar="FILE.json", help="write the per-layer report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot rank and error of every targeted layer")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    parser.set_defaults(handler=run)


def run(args) -> int:
    rule = _common.rank_rule_from(args)
    selection = _common.selection_from(args)
    if args.power_iterations < 0:
        raise UserError(f"--power-iterations must be ≥ 0, got {args.power_iterations}")
    for flag, value in (("--calib-samples", args.calib_samples), ("--seq-len", args.seq_len),
                        ("--calib-batch", args.calib_batch)):
        if value < 1:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    if args.calib_spread and (not args.calib or args.calib == calibration_data.RANDOM or args.calib.endswith(".npz")):
        raise UserError("--calib-spread chooses windows of a text: give --calib a text file (with --tokenizer)")
    method = args.method or ("whiten" if args.calib else "svd")
    options = FactorizationOptions(method=method, svd=args.svd, power_iterations=args.power_iterations,
                                   seed=args.seed, budget=args.budget)
    source = Path(args.model)
    output = Path(args.output) if args.output else source.with_name(source.stem + ".nmm.onnx")
    check_output_path(source, output, args.force)
    model = load_model(source)
    external = {"yes": True, "no": False}.get(args.external_data)
    if external is None:
        external = uses_external_data(model)

    clock = time.perf_counter()
    seconds = {}
    sequential = args.calib_mode == "sequential"
    quality_budget = _quality_budget(args)
    if (sequential or quality_budget) and not args.calib:
        raise UserError("--calib-mode sequential and the quality budgets need calibration data: pass --calib")
    forced_ranks, forced_reason, chosen = None, "", None
    with _progress(args.quiet) as progress:
        observer = GroupObserver(source, _windows(args, model).batches(args.calib_batch)) if sequential else None
        needs_statistics = args.calib and (not sequential or args.budget == "global" or quality_budget
                                           or method == "fisher")
        statistics = _calibrate(args, method, source, model, selection, progress) if needs_statistics else None
        seconds["calibration"], clock = time.perf_counter() - clock, time.perf_counter()
        if args.ranks_from:
            forced_ranks = _ranks_from(args.ranks_from, model)
            forced_reason = f"kept dense in {args.ranks_from}"
        if quality_budget:
            chosen = _choose_ranks(args, source, model, selection, statistics, quality_budget, method == "fisher",
                                   progress)
            forced_ranks = chosen.ranks
            forced_reason = f"kept dense: the most sensitive layers within the {quality_budget.description}"
            seconds["rank selection"], clock = time.perf_counter() - clock, time.perf_counter()
        task = progress.add_task("factorizing" if not sequential else "observing and factorizing", total=None)
        report = rewrite_model(
            model, rule, selection, options, statistics, observer, forced_ranks, forced_reason,
            on_start=lambda total: progress.update(task, total=total),
            on_layer=lambda outcome: progress.update(task, advance=1, description=outcome.module_path or outcome.name),
        )
        if args.fuse_mlp:
            fusion = FuseGatedMlpPass()
            fusion(model)
            report.fused_mlps = fusion.fused
        seconds["factorization" if not sequential else "sequential calibration and factorization"], clock = (
            time.perf_counter() - clock, time.perf_counter())
        progress.update(task, description="writing")
        if not external and weight_bytes(model) > PROTOBUF_LIMIT:
            external = True
        save_model(model, output, external_data=external, validate=check_model_file)
        seconds["writing"] = time.perf_counter() - clock
    report.seconds = seconds
    if args.ranks_from:
        report.rule = f"ranks from {args.ranks_from}"
    if chosen is not None:
        report.rule = f"{quality_budget.description}, align={args.align}"
        report.quality_budget = {"metric": chosen.metric, "budget": chosen.budget, "keep": quality_budget.keep,
                                 "measured": chosen.damage,
                                 "moves_applied": chosen.moves_applied, "moves_considered": chosen.moves_considered,
                                 "evaluations": chosen.evaluations, "sensitivity": chosen.sensitivity}

    if args.report:
        _common.write_json(args.report, {"input": str(source), "output": str(output), **report.to_dict()})
    if args.plot:
        from onnx_nmm.report_plot import plot_report

        plot_report(report, args.plot, title=f"{source.name}: {report.rule}; {report.method}")
    if not args.quiet:
        _print_summary(report, output)
    return 0


def _calibrate(args, method: str, source: Path, model, selection, progress) -> GramStatistics:
    """XᵀX of every target's input (and, for fisher, the output-gradient Grams): loaded from a statistics
    file, or gathered — in onnxruntime, or for fisher by backpropagation in PyTorch."""
    for path in (args.calib_stats, args.calib):
        if path and path.endswith(".npz") and GramStatistics.is_statistics_file(path):
            return GramStatistics.load(path)
    if args.calib_stats:
        raise UserError(f"{args.calib_stats} is not a statistics file saved by --save-calib-stats")
    windows = _windows(args, model)
    task = progress.add_task(f"calibrating ({windows.description})", total=windows.token_count)

    def advance(rows: int) -> None:
        progress.update(task, advance=rows)

    if method == "fisher":
        from onnx_nmm.fisher import collect_fisher_statistics

        targets, _ = select_layers(find_linear_layers(model), selection)
        statistics = collect_fisher_statistics(source, model.graph, targets, windows.batches(args.calib_batch),
                                               windows.description, seed=args.seed, on_batch=advance)
    else:
        statistics = collect_gram_matrices(source, target_inputs(model, selection), windows.batches(args.calib_batch),
                                           windows.description, on_batch=advance)
    progress.update(task, visible=False)
    if args.save_calib_stats:
        statistics.save(args.save_calib_stats)
    return statistics


@dataclass(frozen=True)
class QualityBudget:
    """How the sensitivity pass chooses ranks: `metric` ("ppl" or "kl") within `budget` of damage in its
    unit, or at the least damage keeping the fraction `keep` of the target parameters."""

    metric: str
    budget: float | None
    keep: float | None
    description: str


def _quality_budget(args) -> QualityBudget | None:
    """What --max-ppl-increase, --max-kl or --keep F --budget sensitivity ask for, or None."""
    asked = [flag for flag, value in (("--max-ppl-increase", args.max_ppl_increase), ("--max-kl", args.max_kl),
                                      ("--budget sensitivity", args.budget == "sensitivity" or None)) if value is not None]
    if len(asked) > 1:
        raise UserError(f"give one of --max-ppl-increase, --max-kl and --budget sensitivity, not {' and '.join(asked)}")
    if args.ranks_from and (asked or args.budget == "global"):
        raise UserError(f"--ranks-from gives every rank already: drop {asked[0] if asked else '--budget global'}")
    if args.max_ppl_increase is not None:
        if args.max_ppl_increase <= 0:
            raise UserError(f"--max-ppl-increase must be positive (0.1 = +10 %), got {args.max_ppl_increase}")
        return QualityBudget("ppl", math.log1p(args.max_ppl_increase), None,
                             f"perplexity budget +{args.max_ppl_increase:.1%}")
    if args.max_kl is not None:
        if args.max_kl <= 0:
            raise UserError(f"--max-kl must be positive, got {args.max_kl}")
        return QualityBudget("kl", args.max_kl, None, f"KL budget {args.max_kl} nats")
    if args.budget == "sensitivity":
        if args.keep is None:
            raise UserError("--budget sensitivity removes the parameters --keep would remove: use it with --keep")
        return QualityBudget("ppl", None, args.keep, f"sensitivity budget keeping {args.keep:.1%} of the parameters")
    return None


def _ranks_from(path: str, model) -> dict[str, int | None]:
    """Layer name → rank (None: dense) from a rewrite report of the same model."""
    try:
        layers = json.loads(Path(path).read_text())["layers"]
        targeted = [layer for layer in layers if layer["status"] != "skipped"]
        ranks = {layer["name"]: layer["rank"] if layer["status"] == "factorized" else None for layer in targeted}
        shapes = {layer["name"]: (layer["k"], layer["n"]) for layer in targeted}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"--ranks-from {path} is not a report written by `rewrite --report` ({error})") from None
    ours = {layer.name: (layer.k, layer.n) for layer in find_linear_layers(model)}
    foreign = sorted(name for name, shape in shapes.items() if ours.get(name) != shape)
    if foreign:
        raise UserError(f"--ranks-from {path} names {len(foreign)} layers this model does not have with that shape "
                        f"({foreign[0]}, ...): it reports a rewrite of another model")
    return ranks


def _choose_ranks(args, source, model, selection, statistics, quality_budget, use_fisher: bool, progress):
    from onnx_nmm.sensitivity import choose_ranks

    if args.sensitivity_windows < 1:
        raise UserError("--sensitivity-windows must be a positive integer")
    tokens = _windows(args, model, samples=args.sensitivity_windows).tokens  # chosen like the calibration's
    targets, _ = select_layers(find_linear_layers(model), selection)
    task = progress.add_task("measuring sensitivity" if not use_fisher else "measuring the predicted choice",
                             total=len(targets) if not use_fisher else None)
    chosen = choose_ranks(source, selection, statistics, tokens, args.align, quality_budget.metric,
                          quality_budget.budget, quality_budget.keep, use_fisher,
                          on_step=lambda name: progress.update(task, advance=1, description=f"sensitivity: {name}"))
    progress.update(task, visible=False)
    return chosen


def _windows(args, model, samples: int | None = None) -> calibration_data.TokenWindows:
    """The calibration token windows of --calib (text, input .npz, or random): --calib-samples of them, or
    `samples`."""
    if args.calib.endswith(".npz") and GramStatistics.is_statistics_file(args.calib):
        raise UserError(f"{args.calib} holds statistics, but sequential calibration runs the model on tokens: "
                        "give --calib a text or an .npz of input_ids")
    vocab = _vocabulary(model) if args.calib == calibration_data.RANDOM else None
    return calibration_data.calibration_windows(args.calib, args.tokenizer, samples or args.calib_samples, args.seq_len,
                                                vocab, args.calib_spread)


def _vocabulary(model) -> int:
    """Rows of the embedding table: a Gather on a graph input reading a 2-D initializer."""
    inputs = set(model.graph.inputs)
    for node in model.graph:
        if node.op_type == "Gather" and len(node.inputs) == 2 and node.inputs[1] in inputs:
            table = node.inputs[0]
            if table is not None and table.const_value is not None and len(table.const_value.shape) == 2:
                return table.const_value.shape[0]
    raise UserError("cannot tell the vocabulary size for random calibration; give --calib TEXT or .npz")


def _progress(quiet: bool) -> Progress:
    return Progress(TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=_common.stderr, disable=quiet, transient=True)


def _print_summary(report, output: Path) -> None:
    prefix = _common.common_module_prefix([layer.module_path for layer in report.layers])
    table = Table(title=f"Rewrite ({report.rule}; {report.selection}; {report.method})"
                  + (f", module paths under {prefix}" if prefix else ""), title_justify="left")
    fisher = any(layer.predicted_kl is not None for layer in report.layers)
    for column, justify in (("layer", "left"), ("role", "left"), ("K×N", "right"), ("rank", "right"),
                            ("params before", "right"), ("after", "right"), ("‖W−UV‖/‖W‖", "right"),
                            ("‖Sᵀ(W−UV)T‖/‖SᵀWT‖" if fisher else "‖X(W−UV)‖/‖XW‖", "right"),
                            *([("predicted KL", "right")] if fisher else []), ("note", "left")):
        table.add_column(column, justify=justify)
    for layer in report.layers:
        if layer.status == "skipped":
            continue
        table.add_row(layer.module_path.removeprefix(prefix) or layer.name, layer.role, f"{layer.k}×{layer.n}",
                      str(layer.rank) if layer.rank else "dense", _common.millions(layer.parameters_before),
                      _common.millions(layer.parameters_after),
                      f"{layer.relative_error:.4f}" if layer.relative_error is not None else "—",
                      f"{layer.whitened_loss:.4f}" if layer.whitened_loss is not None else "—",
                      *([f"{layer.predicted_kl:.2e}" if layer.predicted_kl is not None else "—"] if fisher else []),
                      ", ".join(filter(None, [layer.reason, layer.conditioning if layer.conditioning != "cholesky" else ""])))
    _common.stdout.print(table)
    conditioned = [layer for layer in report.factorized if layer.conditioning not in ("", "cholesky")]
    if conditioned:
        _common.stdout.print(f"XᵀX was singular or ill-conditioned for {len(conditioned)} layer(s) "
                             f"({', '.join(layer.module_path or layer.name for layer in conditioned[:5])}"
                             f"{', …' if len(conditioned) > 5 else ''}): see the note column; more calibration "
                             "tokens than the layer's input width avoid it")
    totals = report.totals()
    skipped = totals["layers_found"] - sum(1 for layer in report.layers if layer.status != "skipped")
    _common.stdout.print(
        f"{totals['layers_factorized']} layers factorized, {skipped} left alone (not targeted); targeted parameters "
        f"{_common.millions(totals['parameters_before'])} → {_common.millions(totals['parameters_after'])} "
        f"({totals['kept_fraction']:.1%} kept)"
        + (f"; {len(report.fused_mlps)} gated MLPs fused into SvdGatedMLP" if report.fused_mlps else "")
        + f". Wrote {output}")
