"""`onnx-nmm bench MODEL ... --target trn1|trn2 [--tp N]`: the models priced on one NeuronCore, or split over N
of one instance (modelled, nothing run)."""

from __future__ import annotations

from pathlib import Path

import onnx_nmm
from onnx_nmm.cli import _common, _parsing
from onnx_nmm.kernels.pricing.hardware import instance
from onnx_nmm.options import DEFAULT_ALIGN
from onnx_nmm.plots.bench import plot_trainium


def add_options(parser) -> None:
    group = parser.add_argument_group("Trainium, modelled")
    group.add_argument("--target", choices=onnx_nmm.TrainiumOptions.targets,
                       help=_common.target_help("to price the models on, one NeuronCore of it (modelled: nothing "
                                                "runs); without --target, bench measures them on onnxruntime CPU"))
    keep = group.add_argument("--factorized-keep", dest="keep", type=float, action="append", metavar="K",
                              help="add, after each MODEL, the same model with its --targets layers factorized at "
                                   "keep K, priced from shapes alone, no weights read (what `rewrite --keep K` would "
                                   "run); may be repeated; formerly --keep")
    _parsing.add_former_name(group, "--keep", keep)
    group.add_argument("--targets", choices=onnx_nmm.options.TARGETS,
                       default=_common.default(onnx_nmm.Selection, "targets"),
                       help="the layers --factorized-keep factorizes (default %(default)s)")
    group.add_argument("--align", type=int, default=DEFAULT_ALIGN,
                       help="--factorized-keep's rank alignment (default %(default)s)")
    group.add_argument("--no-fuse-mlp", action="store_true",
                       help="price factorized gated MLPs as three fused_xuv launches, not one fused_svd_mlp "
                            "(what compile --no-fuse-mlp runs)")
    group.add_argument("--tp", type=int, default=onnx_nmm.TrainiumOptions().tp, metavar="N",
                       help="split the models over N NeuronCores of one trn1.32xlarge or trn2.48xlarge as NxD "
                            "Inference splits them (tensor parallelism), the NeuronLink collectives joining them "
                            "priced too; a factorized layer takes its cheapest split (default %(default)s)")
    group.add_argument("--generation", type=_common.token_counts, default=onnx_nmm.TrainiumOptions().generation,
                       metavar="PROMPT,NEW", help="the end-to-end generation priced: prompt tokens, new tokens "
                       "(default 32,32: NeuronMM's benchmark, a context of 32 and a sequence of 64)")


def refuse_modelled_options(args) -> None:
    """--factorized-keep, --no-fuse-mlp, --tp and config.json models only mean something when pricing (--target)."""
    if args.keep is not None or args.no_fuse_mlp or any(_is_config(model) for model in args.models):
        raise onnx_nmm.OptionError("--factorized-keep, --no-fuse-mlp and config.json models are priced, not "
                                   "measured: add --target trn1 or trn2")
    if args.tp != 1:
        raise onnx_nmm.OptionError("--tp splits the models for pricing, not for measuring: add --target trn1 or trn2")


def run(args) -> int:
    _common.refuse_existing(args, "--plot")  # said before the pricing, as without --target
    options = onnx_nmm.TrainiumOptions(args.target, args.prompt_lengths, args.contexts, tuple(args.generation),
                                       args.tp)
    with _common.progress(quiet=args.json or args.quiet) as progress:
        shapes: list = []
        for model in args.models:
            if onnx_nmm.is_compiled_folder(model):  # priced as compiled: its graphs, buckets and cache
                shapes.append(model)
                continue
            fuse = not args.no_fuse_mlp
            shape = (onnx_nmm.decoder_shape_of_config(model) if _is_config(model)
                     else onnx_nmm.decoder_shape(model, fuse))
            shapes.append(shape)
            shapes += [onnx_nmm.factorized(shape, keep, args.targets, args.align, fuse) for keep in args.keep or ()]
        result = onnx_nmm.estimate_trainium(shapes, options, progress)
    _common.show_models(result, args, plot_trainium, _print_models, _print_phases, _print_parts, _print_generation)
    if args.json:
        return 0
    cores = "one NeuronCore" if options.tp == 1 else (
        f"tp {options.tp}: each of {options.tp} NeuronCores of a {instance(options.target).name} priced, "
        "the collectives joining them by the NeuronLink model (docs/trainium.md)")
    _common.stdout.print(f"modelled on {options.target}: {cores}, bfloat16, batch 1; linear layers by the "
                         "kernels' cost model, the rest by a roofline (a lower bound); nothing was run"
                         + (f"; wrote {args.plot}" if args.plot else ""), soft_wrap=True)
    return 0


def _is_config(model: str) -> bool:
    path = Path(model)
    return path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists()
                                      and not any(path.glob("*.onnx")))


def _print_models(result: onnx_nmm.TrainiumEstimate, names: dict[str, str]) -> None:
    table = _common.Table(title="Models", title_justify="left")
    for column in ("model", "layers", "linear weights (bf16)", "dense", "factorized", "fused MLP", "dense MLP"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model in result.models:
        counts = model.shape.counts()
        table.add_row(names[model.label], str(model.shape.layers), _common.megabytes(model.weight_bytes),
                      *(str(counts[kind]) for kind in ("dense", "factorized", "fused MLP", "dense MLP")))
    _common.stdout.print(table)
    for model in result.models:
        for note in model.shape.notes:
            _common.stdout.print(f"{names[model.label]}: {note}", style="dim")


def _print_phases(result: onnx_nmm.TrainiumEstimate, names: dict[str, str]) -> None:
    split = result.options.tp > 1
    cores = f", tp {result.options.tp}" if split else ""
    table = _common.Table(title=f"Prefill and decode on {result.options.target}{cores} (modelled)",
                          title_justify="left")
    columns = ("model", "phase", "time", "tokens/s", "vs first", "ideal", "kernel-priced share")
    for column in columns + (("low-rank splits save",) if split else ()):
        table.add_column(column, justify="left" if column in ("model", "phase") else "right")
    for model in result.models:
        for length, phase in model.prefill.items():
            table.add_row(names[model.label], f"prefill of {length}", f"{phase.seconds * 1e3:.2f} ms",
                          f"{length / phase.seconds:,.0f}", f"{result.prefill_speedup(model, length):.2f}×", "",
                          f"{phase.kernel_share:.0%}",
                          *_saving(phase.low_rank_saving_s, phase.rank_all_reduce_saving_s, split))
        for context, phase in model.decode.items():
            table.add_row(names[model.label], f"decode at {context}", f"{phase.seconds * 1e3:.3f} ms",
                          f"{1 / phase.seconds:,.1f}", f"{result.decode_speedup(model, context):.2f}×",
                          f"{result.ideal_decode_speedup(model, context):.2f}×", f"{phase.kernel_share:.0%}",
                          *_saving(phase.low_rank_saving_s, phase.rank_all_reduce_saving_s, split))
    _common.stdout.print(table)
    _common.stdout.print("ideal: the first model's bytes read per decode step (linear weights, KV cache) over this "
                         "model's" + ("; low-rank splits save: the factorized layers split at their rank against "
                                      "split as NxD splits the dense layers, and of that, the row-parallel layers' "
                                      "all-reduce of X·U (r wide) against that of their output (N wide)" if split
                                      else ""), style="dim")


def _saving(seconds: float, all_reduce: float, split: bool) -> tuple[str, ...]:
    """The low-rank splits' saving, and the rank-r all-reduces' part of it, as a table cell when the model is split
    ("—" when they save nothing)."""
    if not split:
        return ()
    return (f"{seconds * 1e6:,.1f} µs (all-reduce {all_reduce * 1e6:,.1f} µs)" if seconds else "—",)


def _print_parts(result: onnx_nmm.TrainiumEstimate, names: dict[str, str]) -> None:
    context = result.options.contexts[len(result.options.contexts) // 2]
    on = "" if result.options.tp == 1 else f" on each of {result.options.tp} NeuronCores"
    table = _common.Table(title=f"Where a decode step at context {context} goes{on} (µs, modelled)",
                          title_justify="left")
    table.add_column("part")
    table.add_column("priced by")
    for model in result.models:
        table.add_column(names[model.label], justify="right")
    for name in result.decode_parts(context):
        priced = next(m.decode[context].parts[name].how for m in result.models if name in m.decode[context].parts)
        table.add_row(name, priced, *(f"{m.decode[context].parts[name].seconds * 1e6:,.1f}"
                                      if name in m.decode[context].parts else "—" for m in result.models))
    _common.stdout.print(table)
    for model in result.models:
        taken = model.decode[context].splits
        if taken:
            _common.stdout.print(f"{names[model.label]}, split: " + "; ".join(
                f"{how} (×{count})" for how, count in taken.items()), style="dim", soft_wrap=True)


def _print_generation(result: onnx_nmm.TrainiumEstimate, names: dict[str, str]) -> None:
    prompt, new = result.options.generation
    table = _common.Table(title=f"End to end: a prompt of {prompt}, {new} new tokens (modelled)", title_justify="left")
    for column in ("model", "time", "prefill vs first", "decode vs first", "end to end vs first"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model in result.models:
        speedups = result.generation_speedups(model)
        table.add_row(names[model.label], f"{model.generation_s * 1e3:.1f} ms",
                      *(f"{speedups[phase]:.2f}×" for phase in ("prefill", "decode", "end to end")))
    _common.stdout.print(table)
    _common.stdout.print("NeuronMM end to end on trn1, measured by its authors: "
                         + "; ".join(f"{value:.2f}× ({source})" for source, value in result.paper_figures.items()),
                         style="dim", soft_wrap=True)
