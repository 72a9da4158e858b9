"""`onnx-nmm bench-kernels`: modelled Trainium time of the NKI kernels on LLM MLP shapes (no device needed);
with --device, the same launches run, checked and timed on a Trainium device beside their modelled time; with
--fit, the cost model's main parameters re-estimated from such a run."""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from pathlib import Path

from rich.progress import Progress

from onnx_nmm import NeuronSdkMissing, OptionError
from onnx_nmm.cli import _common, _parsing
from onnx_nmm.kernels import USING_EMULATOR
from onnx_nmm.kernels.bench import benchmark, device, device_fit
from onnx_nmm.kernels.pricing.hardware import TRAINIUM_TARGETS
from onnx_nmm.model_io import make_public, write_text_atomically

DEFAULT_OUT = Path("out/bench-kernels")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench-kernels",
        help="model the Trainium time of dense (separate and fused), unfused, fused-XUV and fused-MLP kernels on "
             "LLM MLP shapes",
        description="Trace every kernel on the NKI emulator (no arithmetic) and model its time on Trainium "
        "with AWS's published engine numbers. Every number it prints is modelled, not measured.",
    )
    parser.add_argument("--target", choices=("trn1", "trn2", "both"), default="both",
                        help=_common.target_help("to model, or both (default both)"))
    output = parser.add_argument("-o", "--output", dest="out", type=Path, metavar="DIR",
                                 help="directory for bench-kernels.md, .json, .png and -roofline.png, or -device.json "
                                      f"with --device (default: {DEFAULT_OUT}); with --fit, for fit.json (default: "
                                      "beside FILE); formerly --out")
    _parsing.add_former_name(parser, "--out", output)
    parser.add_argument("--tokens", default=",".join(map(str, benchmark.TOKENS)),
                        help="comma-separated token counts, 1 to 8192 (default: %(default)s)")
    parser.add_argument("--models", default="all",
                        help="comma-separated model names, or 'all': " + ", ".join(m.model for m in benchmark.MODELS))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the kernels' input and weight dtype (default bfloat16, as on Trainium)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--device", nargs="?", const="neuron", choices=("neuron", "emulator"),
                      help="run every distinct kernel launch of the grid on this machine's Trainium device (one "
                           "--target) with random inputs, check each result against NumPy and time it: writes "
                           "bench-kernels-device.json, measured beside modelled. Needs AWS's Neuron SDK, run with "
                           "ONNX_NMM_NKI=emulator (the launches are modelled here and run in a child process). "
                           "'--device emulator' is a stand-in for tests: the emulator computes and its "
                           "'measured' times are modelled")
    mode.add_argument("--fit", type=Path, metavar="FILE",
                      help="re-estimate the cost model's TensorE, DMA, ScalarE and VectorE parameters from a "
                           "bench-kernels-device.json; writes fit.json")
    parser.add_argument("--samples", type=int, default=20, metavar="N",
                        help="timed executions per launch with --device (default: %(default)s)")
    parser.add_argument("--nrtpy-python", metavar="PATH",
                        help="with --device: time with nrtpy's NrtpyModel.benchmark in this Python (nrtpy cannot "
                             "share an environment with nki); default: neuron-explorer capture")
    parser.set_defaults(handler=run)


def run(args) -> int:
    if args.fit:
        return _fit(args)
    if args.device:
        return _on_device(args)
    args.out = args.out or DEFAULT_OUT
    targets = TRAINIUM_TARGETS if args.target == "both" else (args.target,)
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


def _on_device(args) -> int:
    """--device: run, check and time every launch of the grid on the device; modelled beside measured."""
    if args.device == "neuron" and (missing := device.missing_neuron()):
        raise NeuronSdkMissing(f"bench-kernels --device needs AWS's Neuron SDK and a Trainium device: pip install "
                               f"neuronx-cc nki --extra-index-url {device.NEURON_INDEX} ({missing})")
    if args.target == "both":
        raise OptionError("--device runs on this machine's device: give --target trn1 or trn2, its generation")
    _require_emulator_kernels()
    tokens, models = _tokens(args.tokens), _models(args.models)
    args.out = args.out or DEFAULT_OUT
    if args.device == "emulator":
        chosen = device.EmulatedDevice(args.target)
    else:
        chosen = device.NeuronDevice(args.target, args.samples, args.nrtpy_python)
    launches = device.grid_launches(models, tokens, args.target, args.dtype)
    with Progress(console=_common.stderr, transient=True) as progress:
        task = progress.add_task(f"running launches on {chosen.description}", total=len(launches))
        report = device.bench_on_device(chosen, launches, on_launch=lambda result: progress.advance(task))

    args.out.mkdir(parents=True, exist_ok=True)
    _common.write_json(args.out / "bench-kernels-device.json", {"command": _command(args), **report})
    _print_device_table(report)
    _common.stderr.print(f"wrote {args.out}/bench-kernels-device.json")
    failed = sum(not result["ok"] for result in report["launches"])
    if failed:
        _common.stderr.print(f"{failed} of {len(launches)} launches gave a wrong result (ok: false in the JSON)")
    return 1 if failed else 0


def _fit(args) -> int:
    """--fit FILE: the cost-model factors that best explain a device report's times."""
    try:
        report = json.loads(args.fit.read_text())
    except (OSError, ValueError) as error:
        raise OptionError(f"--fit {args.fit}: cannot read it as JSON ({error})") from None
    _require_emulator_kernels()
    try:
        fit = device_fit.fit_report(report)
    except (KeyError, TypeError, ValueError) as error:
        raise OptionError(f"--fit {args.fit}: not a usable bench-kernels-device.json ({error})") from None
    out = args.out or args.fit.parent
    out.mkdir(parents=True, exist_ok=True)
    result = fit.to_json()
    _common.write_json(out / "fit.json", result)
    _print_fit(result)
    _common.stderr.print(f"wrote {out}/fit.json")
    return 0


def _require_emulator_kernels() -> None:
    if not USING_EMULATOR:
        raise OptionError("set ONNX_NMM_NKI=emulator: bench-kernels models the kernels on the NKI emulator "
                          "(with --device each launch still runs on the device, in a child process)")


def _command(args) -> str:
    """The command line that reproduces this run, recorded with the results."""
    options = [("--target", args.target), ("--tokens", args.tokens), ("--models", args.models),
               ("--dtype", args.dtype), ("-o", str(args.out))]
    if args.device:
        options += [("--device", args.device), ("--samples", str(args.samples))]
        options += [("--nrtpy-python", args.nrtpy_python)] if args.nrtpy_python else []
    return "onnx-nmm bench-kernels " + " ".join(f"{name} {shlex.quote(value)}" for name, value in options)


def _tokens(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise OptionError(f"--tokens {text!r} is not a comma-separated list of integers; "
                          "write e.g. --tokens 1,128") from None
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
    table = _common.Table(title=f"MLP time on Trainium, {dtype} (modelled)")
    for column in ("target", "model", "tokens", "dense µs", "dense MLP µs", "unfused µs", "fused XUV µs",
                   "fused MLP µs", "XUV vs unfused", "fused MLP vs best dense", "params ratio"):
        table.add_column(column, justify="left" if column in ("target", "model") else "right")
    for row in rows:
        table.add_row(
            row.target, row.shape.model, str(row.tokens),
            *(f"{row.seconds(v) * 1e6:,.1f}" for v in benchmark.VARIANTS),
            f"{row.speedup('unfused', 'fused_xuv'):.2f}×", f"{row.speedup(row.best_dense, 'fused_mlp'):.2f}×",
            f"{row.shape.parameter_ratio:.2f}×",
        )
    _common.stdout.print(table)


def _print_device_table(report: dict) -> None:
    table = _common.Table(title=f"Kernel launches on {report['device']}: measured (p50) vs modelled")
    for column in ("target", "kernel", "input shapes", "modelled µs", "measured µs", "p99 µs", "ratio",
                   "max error", "ok"):
        table.add_column(column, justify="left" if column in ("target", "kernel", "input shapes") else "right")
    for result in report["launches"]:
        measured = result["measured_us"]
        table.add_row(
            result["target"], result["kernel"], _shapes(result["shapes"]),
            f"{result['modelled_us']:,.2f}", f"{measured['p50']:,.2f}", f"{measured['p99']:,.2f}",
            f"{measured['p50'] / result['modelled_us']:.2f}×", f"{result['max_error']:.2e}",
            "yes" if result["ok"] else "[red]NO[/red]",
        )
    _common.stdout.print(table)


def _print_fit(result: dict) -> None:
    table = _common.Table(title="Cost-model parameters fitted to the measured times")
    for column in ("parameter", "documented", "fitted", "factor"):
        table.add_column(column, justify="left" if column == "parameter" else "right")
    for name, values in result["parameters"].items():
        table.add_row(name, ", ".join(f"{t} {v:.4g}" for t, v in values["documented"].items()),
                      ", ".join(f"{t} {v:.4g}" for t, v in values["fitted"].items()), f"{values['factor']:.3f}×")
    _common.stdout.print(table)
    launches = _common.Table(title="Per launch: measured / modelled")
    for column in ("target", "kernel", "input shapes", "before", "after"):
        launches.add_column(column, justify="left" if column in ("target", "kernel", "input shapes") else "right")
    for launch in result["launches"]:
        ratio = launch["measured_over_modelled"]
        launches.add_row(launch["target"], launch["kernel"], _shapes(launch["shapes"]),
                         f"{ratio['before']:.3f}", f"{ratio['after']:.3f}")
    _common.stdout.print(launches)
    residual = result["median_abs_log_residual"]
    _common.stdout.print(f"median |log(measured/modelled)|: {residual['before']:.3f} with the documented parameters, "
                         f"{residual['after']:.3f} fitted, over {len(result['launches'])} launches.")
    _common.stdout.print("The fit is only as good as the grid it saw: a parameter its launches barely exercise "
                         "stays near 1.")


def _shapes(shapes) -> str:
    """A launch's input shapes as '64×256 256×128'."""
    return " ".join("×".join(map(str, shape)) for shape in shapes)
