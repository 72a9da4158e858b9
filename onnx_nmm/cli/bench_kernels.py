"""`onnx-nmm bench-kernels`: modelled Trainium time of the NKI kernels on LLM MLP shapes (no device needed)."""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

from rich.progress import Progress
from rich.table import Table

from onnx_nmm.cli import _common
from onnx_nmm import OptionError
from onnx_nmm.model_io import make_public, write_text_atomically
from onnx_nmm.kernels import benchmark


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench-kernels",
        help="model the Trainium time of dense, unfused, fused-XUV and fused-MLP kernels on LLM MLP shapes",
        description="Trace every kernel on the NKI emulator (no arithmetic) and model its time on Trainium "
        "with AWS's published engine numbers. Every number it prints is modelled, not measured.",
    )
    parser.add_argument("--target", choices=("trn1", "trn2", "both"), default="both", help="default: both")
    parser.add_argument("--out", type=Path, default=Path("out/bench-kernels"),
                        help="directory for bench-kernels.md, .json, .png and -roofline.png (default: out/bench-kernels)")
    parser.add_argument("--tokens", default=",".join(map(str, benchmark.TOKENS)),
                        help="comma-separated token counts, 1 to 8192 (default: %(default)s)")
    parser.add_argument("--models", default="all",
                        help="comma-separated model names, or 'all': " + ", ".join(m.model for m in benchmark.MODELS))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the kernels' input and weight dtype (default bfloat16, as on Trainium)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    targets = benchmark.TARGETS if args.target == "both" else (args.target,)
    tokens = _tokens(args.tokens)
    models = _models(args.models)
    command = _command(args)

    total = len(targets) * len(models) * len(tokens)
    with Progress(console=_common.stderr, transient=True) as progress:
        task = progress.add_task("tracing and modelling kernels", total=total)
        rows = benchmark.run_benchmark(models, tokens, targets, args.dtype, on_row=lambda row: progress.advance(task))

    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.out / "bench-kernels.md", benchmark.markdown(rows, command, args.dtype))
    _common.write_json(args.out / "bench-kernels.json", benchmark.to_json(rows, command, args.dtype))
    _write_plot(benchmark.plot, rows, args.out / "bench-kernels.png", args.dtype)
    _write_plot(benchmark.plot_roofline, rows, args.out / "bench-kernels-roofline.png", args.dtype)

    _print_table(rows, args.dtype)
    for line in benchmark.summary_lines(benchmark.summarize(rows)):
        _common.stdout.print(line)
    _common.stderr.print(f"wrote {args.out}/bench-kernels.md, .json, .png and -roofline.png")
    return 0


def _command(args) -> str:
    """The command line that reproduces this run, recorded with the results."""
    options = [("--target", args.target), ("--tokens", args.tokens), ("--models", args.models),
               ("--dtype", args.dtype), ("--out", str(args.out))]
    return "onnx-nmm bench-kernels " + " ".join(f"{name} {shlex.quote(value)}" for name, value in options)


def _tokens(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise OptionError(f"--tokens {text!r} is not a comma-separated list of integers; write e.g. --tokens 1,128") from None
    if not values or any(not 1 <= value <= 8192 for value in values):
        raise OptionError(f"--tokens {text!r}: every token count must be between 1 and 8192")
    return values


def _models(text: str) -> tuple[benchmark.MlpShape, ...]:
    if text == "all":
        return benchmark.MODELS
    known = {shape.model: shape for shape in benchmark.MODELS}
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise OptionError(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(known)} or 'all'")
    return tuple(known[name] for name in names)


def _write_plot(plot, rows, path: Path, dtype: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _common.stderr.print("no matplotlib: skipped the chart (pip install 'onnx-nmm[plot]')")
        return
    handle, staged = tempfile.mkstemp(dir=path.parent, prefix=".onnx-nmm-", suffix=".png")
    os.close(handle)
    plot(rows, staged, dtype)
    make_public(staged)
    Path(staged).replace(path)


def _print_table(rows, dtype: str) -> None:
    table = Table(title=f"MLP time on Trainium, {dtype} (modelled)")
    for column in ("target", "model", "tokens", "dense µs", "unfused µs", "fused XUV µs", "fused MLP µs",
                   "XUV vs unfused", "fused MLP vs dense", "params ratio"):
        table.add_column(column, justify="left" if column in ("target", "model") else "right")
    for row in rows:
        table.add_row(
            row.target, row.shape.model, str(row.tokens),
            *(f"{row.seconds(v) * 1e6:,.1f}" for v in benchmark.VARIANTS),
            f"{row.speedup('unfused', 'fused_xuv'):.2f}×", f"{row.speedup('dense', 'fused_mlp'):.2f}×",
            f"{row.shape.parameter_ratio:.2f}×",
        )
    _common.stdout.print(table)
