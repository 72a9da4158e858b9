"""`rewrite`'s flags for models larger than memory (onnx_nmm.scale, docs/scale.md): --stream, --ray, --threads,
--restart and --dry-run, and what they print."""

from __future__ import annotations

from pathlib import Path

import onnx_nmm
from onnx_nmm.cli import _common

LOCAL_RAY = "local"
WORKERS = (1, 4, 16)  # the plan's modelled wall time on this many workers


def add_scale_options(parser) -> None:
    scale = parser.add_argument_group("large models (streamed, resumable, on Ray; docs/scale.md)")
    scale.add_argument("--stream", action="store_true",
                       help="factorize one matrix at a time and write the output tensor by tensor, never holding the "
                            "model in memory; finished matrices are kept in OUT.partial/, and the same command "
                            "resumes there if killed")
    scale.add_argument("--ray", nargs="?", const=LOCAL_RAY, metavar="ADDRESS",
                       help="(implies --stream) one Ray task per matrix on the cluster at ADDRESS (e.g. "
                            "ray://head:10001 or auto); without ADDRESS, RAY_ADDRESS's cluster or one started on "
                            "this machine. Needs pip install 'onnx-nmm[ray]'")
    scale.add_argument("--threads", type=int, default=0,
                       help="BLAS threads per factorization (default 0: every core); the same count gives the same "
                            "factor bytes here and on Ray")
    scale.add_argument("--restart", action="store_true", help="with --stream: discard OUT.partial/ and start afresh")
    scale.add_argument("--dry-run", action="store_true",
                       help="print the targets, ranks, sizes and a time estimate from one sample factorization, "
                            "and write nothing")


def streams(args) -> bool:
    return bool(args.stream or args.ray)


def layer_by_layer(args, options, source: Path) -> bool:
    """Whether a rewrite that narrows MLPs in memory would not fit this machine: then it runs layer by layer, and
    says so in one line."""
    reason = None if streams(args) else onnx_nmm.too_large_for_memory(source, options)
    if reason is not None:
        _common.stderr.print(reason, soft_wrap=True)
    return reason is not None


def run_streamed(args, options, source: Path, output: Path, progress):
    stream = onnx_nmm.StreamOptions(ray=args.ray, threads=args.threads, resume=not args.restart)
    return onnx_nmm.rewrite_streamed(source, output, options, stream, progress)


def print_plan(args, options, source: Path) -> int:
    if options.strategy.narrows_mlps:
        return _print_layerwise_plan(options, source)
    with _common.stderr.status("factorizing one sample matrix to time it..."):
        plan = onnx_nmm.plan_rewrite(source, options, args.threads)
    prefix = _common.common_module_prefix([layer.module_path for layer in plan.layers])
    table = _common.Table(title=f"Plan for {source.name}" + (f", module paths under {prefix}" if prefix else ""),
                  title_justify="left")
    for column in ("layer", "role", "K×N", "dtype", "rank", "params before", "after", "bytes before", "after",
                   "est. s"):
        table.add_column(column, justify="left" if column in ("layer", "role", "dtype") else "right")
    for layer in plan.layers:
        table.add_row(layer.module_path.removeprefix(prefix) or layer.name, layer.role, f"{layer.k}×{layer.n}",
                      layer.dtype, str(layer.rank) if layer.rank else "dense",
                      _common.millions(layer.parameters_before), _common.millions(layer.parameters_after),
                      _common.megabytes(layer.bytes_before), _common.megabytes(layer.bytes_after),
                      f"{layer.seconds:.1f}")
    _common.stdout.print(table)
    def total(field):
        return sum(getattr(layer, field) for layer in plan.layers)

    _common.stdout.print(
        f"{_common.count(len(plan.layers), 'target')}: parameters {_common.millions(total('parameters_before'))} → "
        f"{_common.millions(total('parameters_after'))}, bytes {_common.megabytes(total('bytes_before'))} → "
        f"{_common.megabytes(total('bytes_after'))}")
    if plan.sample:
        on = ", ".join(f"{workers} workers {plan.seconds_on(workers):,.0f} s" for workers in WORKERS[1:])
        _common.stdout.print(
            f"time: sample {plan.sample} factorized in {plan.sample_seconds:.1f} s (measured, "
            f"{_common.count(plan.threads, 'BLAS thread')}); every target modelled as that × K·N·min(K,N) ratio: "
            f"{plan.seconds:,.0f} s in one process, "
            f"{on} (modelled; writing the output and loading not included). Nothing was written.")
    return 0


def _sweeps(count: int) -> str:
    return "the narrowing sweep" if count == 1 else f"at most {count} narrowing sweeps (the budget's search)"


def _print_layerwise_plan(options, source: Path) -> int:
    """What narrowing the MLPs layer by layer will take on this machine: measured on one layer, modelled for all."""
    with _common.stderr.status("timing one layer, its narrowing and the head on one window..."):
        plan = onnx_nmm.plan_layerwise(source, options)
    gb = 2**30
    _common.stdout.print(
        f"{source.name}, layer by layer: {plan.layers} layers, {plan.windows} calibration windows and {plan.held_out} "
        f"held-out ones of {plan.seq_len} tokens. Measured on layer {plan.sample_layer} and one window: the layer "
        f"{plan.layer_seconds:.2f} s, its session {plan.session_seconds:.2f} s, its narrowing's maths "
        f"{plan.maths_seconds:.2f} s, the head "
        f"{plan.head_seconds:.2f} s. Modelled: the analysis sweep {plan.analysis_seconds / 60:,.1f} min, "
        f"{_sweeps(plan.narrowing_sweeps)} {plan.narrowing_seconds / 60:,.1f} min, {plan.seconds / 60:,.1f} min in "
        f"all (sampling generated "
        f"windows and writing not included); peak memory {plan.peak_bytes / gb:.1f} GB. Nothing was written.",
        soft_wrap=True)
    return 0
