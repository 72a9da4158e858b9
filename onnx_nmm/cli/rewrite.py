"""`onnx-nmm rewrite MODEL -o OUT`: narrow the MLPs to plain, narrower MatMuls (the default with --calib), or
factorize linear layers into ai.onnx_nmm::SvdMatMul ops (onnx_nmm.rewrite)."""

from __future__ import annotations

from pathlib import Path

import onnx_nmm
from onnx_nmm.cli import _common, _parsing, _scale
from onnx_nmm.cli._common import default
from onnx_nmm.model_io import check_new_output
from onnx_nmm.options import BUDGETS, CALIBRATION_MODES, FACTOR_DTYPES, METHODS, NEURON_SCORES, SVD_METHODS

EXTERNAL_DATA = {"auto": None, "yes": True, "no": False}


# What calibrates a rewrite given a tokenizer and no text: windows the model writes itself.
SELF_CALIBRATION = "generated:64"


def register(subparsers) -> None:
    C, R, F = onnx_nmm.CalibrationOptions, onnx_nmm.RankOptions, onnx_nmm.FactorizationOptions
    parser = subparsers.add_parser(
        "rewrite", help="compress linear layers: with --calib, by default narrow each MLP to the neurons that "
        "matter (plain, narrower MatMuls); otherwise factorize them into SvdMatMul custom ops (--method says which)")
    parser.add_argument("model", help="an .onnx model (external data is read from beside it)")
    parser.add_argument("-o", "--output", help="where to write the rewritten model (default: MODEL.nmm.onnx)")
    parser.add_argument("--force", action="store_true",
                        help=_common.force_help("-o file (even the input model itself), --report, --plot or "
                                                "--save-calib-stats file"))
    _common.add_rank_options(parser, calibrates=True)
    _common.add_selection_options(parser)
    parser.add_argument("--method", choices=METHODS,
                        help="svd: truncated SVD of W; whiten: SVD-LLM activation-aware SVD, minimising the error of "
                             "the layer's outputs on the calibration data; "
                             "fisher: also weighs each output direction by "
                             "how much the model's predictions depend on it (gradients through the model in PyTorch; "
                             "the best quality, and --budget global then spends parameters by predicted KL); "
                             "nystrom: narrow each targeted MLP to the intermediate neurons it keeps and refit its "
                             "down projection (dense, narrower MatMuls; other targets are whitened) "
                             "(default: nystrom with --calib, whiten with --calib and --rank or --energy, else svd)")
    parser.add_argument("--neuron-score", choices=NEURON_SCORES,
                        help="nystrom: which neurons an MLP keeps — energy: the activation energy each writes "
                             "through the down projection; leverage: ridge leverage of the activations' correlation "
                             "(MoDeGPT); greedy: backward elimination of the refit's error "
                             f"(default {default(F, 'neuron_score')})")
    parser.add_argument("--budget", choices=BUDGETS,
                        help="uniform: every matrix keeps --keep of its parameters; global: the same total, spent "
                             "per layer where it removes the most truncation loss; sensitivity: the same total, "
                             "removed where it raises the perplexity on calibration windows least (measured, as "
                             f"for --max-ppl-increase; needs --calib) (default {default(R, 'budget')})")
    calibration = parser.add_argument_group("calibration (activation-aware SVD)")
    calibration.add_argument("--calib", metavar="SOURCE", action="append",
                             help="a text file (with --tokenizer), an .npz with input_ids [samples, seq], "
                                  "statistics saved by --save-calib-stats, 'generated[:N]' (N windows sampled from "
                                  "the model itself, default 64: the recommended calibration, docs/quality.md), or "
                                  "'random' (tests only); repeat to mix sources (--calib a.txt --calib generated:64). "
                                  "One text that narrows MLPs is mixed with --calib-mix windows the model writes; "
                                  "with no --keep, --max-ppl-increase or --max-kl the MLPs are narrowed within +2 %% "
                                  "perplexity on held-out windows")
    calibration.add_argument("--calib-mix", type=int, metavar="N",
                             help="windows sampled from the model itself that a single --calib text is mixed with "
                                  f"when MLPs are narrowed (default {default(C, 'mix_generated')}; 0: the text "
                                  "alone)")
    calibration.add_argument("--calib-generator", metavar="MODEL.onnx",
                             help="sample generated windows from this export of the same model (e.g. one with a KV "
                                  "cache, which is much faster) instead of the model being rewritten")
    calibration.add_argument("--tokenizer", metavar="PATH",
                             help="a tokenizer folder or a .gguf file, for text; without --calib, the model is "
                                  f"calibrated on {SELF_CALIBRATION.split(':')[1]} windows it writes itself")
    calibration.add_argument("--calib-samples", type=int,
                             help=f"sequences to use (default {default(C, 'samples')})")
    window = calibration.add_argument("--calib-window", dest="seq_len", type=int, metavar="TOKENS",
                                      help=f"tokens per calibration window (default {default(C, 'seq_len')}: long "
                                           "enough for the activations of a real context; formerly --seq-len)")
    _parsing.add_former_name(calibration, "--seq-len", window)
    calibration.add_argument("--calib-spread", action="store_true",
                             help="take the --calib-samples windows evenly spaced over the whole text, not from its "
                                  "start (better when the text's opening is not like the rest)")
    _common.add_bos_option(calibration)
    calibration.add_argument("--calib-batch", type=int,
                             help=f"sequences per onnxruntime run (default {default(C, 'batch')})")
    calibration.add_argument("--calib-mode", choices=CALIBRATION_MODES,
                             help="independent: whiten every layer from the dense model's activations; sequential: fit "
                                  "each layer, in graph order, to the dense outputs "
                                  "from the inputs the already-compressed "
                                  "model feeds it (one onnxruntime pass per group of layers; slower, errors stop "
                                  "compounding). With --method nystrom, layer by layer only (--stream): once the "
                                  "widths are chosen, one more sweep over the calibration windows refits each narrowed "
                                  "MLP's down projection to the compressed model's inputs, written if its damage "
                                  "measured on the held-out windows is within the budget; whether it narrows better "
                                  f"has not been measured yet (default {default(C, 'mode')})")
    calibration.add_argument("--calib-stats", metavar="FILE.npz",
                             help="XᵀX statistics saved by --save-calib-stats, used instead of gathering them (with "
                                  "--calib TEXT still giving the tokens sequential calibration and budgets run on)")
    calibration.add_argument("--save-calib-stats", metavar="FILE.npz",
                             help="keep the gathered XᵀX statistics, to reuse with --calib FILE.npz")
    budget = parser.add_argument_group("quality budget (choose layers and ranks; needs --calib tokens)")
    budget.add_argument("--max-ppl-increase", type=float, metavar="P",
                        help="compress as many parameters as possible while the perplexity on calibration windows "
                             "held out of the statistics grows by at most this fraction (0.1 = +10 %%); it holds for "
                             "text like the calibration text; ranks stay multiples of --align")
    budget.add_argument("--max-kl", type=float, metavar="NATS",
                        help="the same, bounding the mean KL divergence to the dense model's next-token distributions")
    budget.add_argument("--sensitivity-windows", type=int,
                        help="calibration windows the budget is measured on, drawn from the --calib sources beside "
                             "and never among the windows the statistics come from (default "
                             f"{default(R, 'sensitivity_windows')})")
    budget.add_argument("--reference-layers", type=int, metavar="N",
                        help="layer by layer (--stream, or a model too large for memory): the layers whose MLPs' "
                             "damage is measured at the output, evenly spaced from the first to the last; the others' "
                             "is predicted from how much narrowing perturbs the residual stream, scaled by those "
                             "measurements, so the analysis costs about N·L layer runs instead of L² (0: every layer; "
                             f"default {default(R, 'reference_layers')}); how well the prediction ranks the layers "
                             "of real models has not been measured yet")
    budget.add_argument("--sensitivity-from", metavar="REPORT.json",
                        help="reuse the sensitivities another quality budget of this model measured (its --report, "
                             "same calibration and targets), to try another --keep or budget without measuring again")
    budget.add_argument("--ranks-from", metavar="REPORT.json",
                        help="the layers and ranks another rewrite of this model chose (its --report), e.g. to refit "
                             "a quality budget's choice with --calib-mode sequential without measuring it again")
    parser.add_argument("--no-answer-check", action="store_true",
                        help="skip comparing the rewritten model's greedy answers to a few check prompts with the "
                             "dense model's (done when --tokenizer is given; a warning says when they differ)")
    parser.add_argument("--fuse-mlp", action="store_true",
                        help="fuse each factorized MLP into one SvdGatedMLP or SvdMLP (what `compile` does "
                             "for Trainium; onnxruntime still runs it)")
    parser.add_argument("--svd", choices=SVD_METHODS,
                        help="exact (float64 Gram eigendecomposition) or randomized (faster for low ranks; "
                             f"its error is in the report) (default {default(F, 'svd')})")
    parser.add_argument("--factor-dtype", choices=FACTOR_DTYPES,
                        help="store U and V in this float dtype; by default as the weight was: a quantized weight's "
                             "factors quantized the same way (two MatMulNBits for an int4 layer), a float weight's "
                             "in its dtype")
    parser.add_argument("--power-iterations", type=int,
                        help=f"randomized SVD power iterations (default {default(F, 'power_iterations')})")
    parser.add_argument("--seed", type=int, help="seed of the randomized SVD and of fisher's sampled tokens "
                                                 f"(default {default(F, 'seed')})")
    parser.add_argument("--external-data", choices=tuple(EXTERNAL_DATA), default="auto",
                        help="write the weights to OUT.data: auto = when the input did, or when they pass protobuf's "
                             "2 GiB limit (export, writing a new model, moves them out at 1 GiB already)")
    parser.add_argument("--report", metavar="FILE.json", help="write the per-layer report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot rank and error of every targeted layer")
    parser.add_argument("--quiet", action="store_true", help=_common.quiet_help("table or summary"))
    _scale.add_scale_options(parser)
    parser.set_defaults(handler=run)


def run(args) -> int:
    options = rewrite_options(args)
    source = Path(args.model)
    output = Path(args.output) if args.output else source.with_name(source.stem + ".nmm.onnx")
    if args.dry_run:
        return _scale.print_plan(args, options, source)
    onnx_nmm.check_output_path(source, output, args.force)  # before the long work, not after
    check_new_output(output, args.force)
    _common.refuse_existing(args, "--report", "--plot", "--save-calib-stats")
    new_folder = next((folder for folder in reversed(output.parents) if not folder.exists()), None)
    layer_by_layer = _scale.layer_by_layer(args, options, source)
    with _common.progress(args.quiet) as progress:
        if _scale.streams(args) or layer_by_layer:
            result = _scale.run_streamed(args, options, source, output, progress)
        else:
            result = onnx_nmm.rewrite(source, options, progress)
            with progress.phase("writing"):
                result.save(output, EXTERNAL_DATA[args.external_data], overwrite_input=args.force)
    report = result.report
    if args.report:
        _common.write_json(args.report, {"input": str(source), "output": str(output), **report.to_dict()})
    if args.plot:
        from onnx_nmm.plots.report import plot_report

        plot_report(report, args.plot, title=f"{source.name}: {report.rule}; {report.method}")
    if not args.quiet:
        _print_summary(report, output, new_folder)
    _say_what_calibrated(args)
    return 0


def rewrite_options(args) -> onnx_nmm.RewriteOptions:
    """The API's options from the flags; a flag not given leaves the API's default."""
    given = _common.given
    ranks = onnx_nmm.RankOptions(**given(
        keep=args.keep, rank=args.rank, energy=args.energy, max_ppl_increase=args.max_ppl_increase,
        max_kl=args.max_kl, ranks_from=args.ranks_from, budget=args.budget, align=args.align,
        sensitivity_windows=args.sensitivity_windows, sensitivity_from=args.sensitivity_from,
        reference_layers=args.reference_layers))
    calibration = None
    if args.calib is not None or args.calib_stats is not None or _self_calibrated(args):
        calib = args.calib if args.calib is not None or args.calib_stats is not None else [SELF_CALIBRATION]
        calibration = onnx_nmm.CalibrationOptions(**given(
            source=_common.calibration_sources(calib, args.calib_generator), tokenizer=args.tokenizer,
            samples=args.calib_samples, seq_len=args.seq_len,
            spread=args.calib_spread or None, bos=False if args.no_bos else None, batch=args.calib_batch,
            mode=args.calib_mode,
            statistics=args.calib_stats, save_statistics=args.save_calib_stats, mix_generated=args.calib_mix))
    factorization = onnx_nmm.FactorizationOptions(**given(
        method=args.method, svd=args.svd, power_iterations=args.power_iterations, seed=args.seed,
        factor_dtype=args.factor_dtype, neuron_score=args.neuron_score))
    return onnx_nmm.RewriteOptions(ranks, _common.selection_from(args), factorization, calibration, args.fuse_mlp,
                                   check_answers=not args.no_answer_check)


def _self_calibrated(args) -> bool:
    """No --calib, a --tokenizer and nothing that asks for weight-only SVD: the model's own windows calibrate it."""
    return (args.calib is None and args.calib_stats is None and args.tokenizer is not None
            and args.method in (None, "nystrom"))


def _say_what_calibrated(args) -> None:
    """One line when no --calib was given: what the rewrite learned from instead, or that it learned from nothing."""
    if args.quiet or args.calib is not None or args.calib_stats is not None:
        return
    if _self_calibrated(args):
        _common.stderr.print(f"no --calib: calibrated on {SELF_CALIBRATION.split(':')[1]} windows the model wrote "
                             "itself; give --calib TEXT for text like what it will read", soft_wrap=True)
    elif args.method in (None, "svd"):
        _common.stderr.print("no --calib: weight-only SVD, which often leaves a model that no longer answers; give "
                             "--calib TEXT --tokenizer T, or --tokenizer T alone to calibrate on text the model writes",
                             soft_wrap=True)


def _print_summary(report: onnx_nmm.RewriteReport, output: Path, new_folder: Path | None) -> None:
    prefix = _common.common_module_prefix([layer.module_path for layer in report.layers])
    table = _common.Table(title=f"Rewrite ({report.rule}; {report.selection}; {report.method})"
                  + (f", module paths under {prefix}" if prefix else ""), title_justify="left")
    fisher = any(layer.predicted_kl is not None for layer in report.layers)
    for column, justify in (("layer", "left"), ("role", "left"), ("K×N", "right"), ("rank", "right"),
                            ("params before", "right"), ("after", "right"), ("‖W−UV‖/‖W‖", "right"),
                            ("‖Sᵀ(W−UV)T‖/‖SᵀWT‖" if fisher else "‖X(W−UV)‖/‖XW‖", "right"),
                            *([("predicted KL", "right")] if fisher else []), ("note", "left")):
        table.add_column(column, justify=justify)
    for group in report.groups():  # layers treated alike share a row
        layer, alike = group.first, len(group.layers)
        table.add_row(group.label(prefix) + (f" ({alike} layers)" if alike > 1 else ""), layer.role,
                      f"{layer.k}×{layer.n}", _choice(layer), _common.millions(group.parameters_before),
                      _common.millions(group.parameters_after),
                      f"{layer.relative_error:.4f}" if layer.relative_error is not None else "—",
                      f"{layer.whitened_loss:.4f}" if layer.whitened_loss is not None else "—",
                      *([f"{layer.predicted_kl:.2e}" if layer.predicted_kl is not None else "—"] if fisher else []),
                      ", ".join(filter(None, [layer.reason,
                                              layer.conditioning if layer.conditioning != "cholesky" else ""])))
    _common.stdout.print(table)
    conditioned = [layer for layer in report.factorized if layer.conditioning not in ("", "cholesky")]
    if conditioned:
        _common.stdout.print(f"XᵀX was singular or ill-conditioned for {_common.count(len(conditioned), 'layer')} "
                             f"({', '.join(layer.module_path or layer.name for layer in conditioned[:5])}"
                             f"{', …' if len(conditioned) > 5 else ''}): it was damped, and the note column says why")
    totals, counts = report.totals(), report.outcome_counts()
    _common.stdout.print(
        f"{_common.count(counts['factorized'], 'layer')} factorized, "
        + (f"{counts['narrowed']} narrowed, " if counts["narrowed"] else "")
        + (f"{counts['dense']} targeted but kept dense (the note says why), " if counts["dense"] else "")
        + f"{counts['skipped']} left alone (not targeted); "
        f"targeted parameters {_common.millions(totals['parameters_before'])} → "
        f"{_common.millions(totals['parameters_after'])} ({totals['kept_fraction']:.1%} kept), the model's weights "
        f"{_common.megabytes(totals['weight_bytes_before'])} → {_common.megabytes(totals['weight_bytes_after'])}"
        + (f"; {len(report.fused_mlps)} MLPs fused into one op each" if report.fused_mlps else "")
        + f". Wrote {output}" + (f" (the folder {new_folder} was created for it)" if new_folder else ""))
    if report.budget_summary:
        _common.stdout.print(report.budget_summary)
    if report.answers:
        answers = report.answers
        _common.stdout.print(f"Check prompts: the dense model's answers are {answers['mean_drop']:.2f} nats per token "
                             f"less likely in the rewritten model (a warning above {answers['max_answer_drop']:g}); "
                             f"{sum(answers['same_start'])} of {len(answers['prompts'])} greedy answers begin with the "
                             f"same {answers['compared_tokens']} tokens.")


def _choice(layer) -> str:
    """The rank column: a rank, "dense", or a narrowed MLP's kept width."""
    if layer.width is not None:
        return f"width {layer.width}"
    return str(layer.rank) if layer.rank else "dense"
