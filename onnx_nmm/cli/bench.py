"""`onnx-nmm bench MODEL [MODEL ...]`: prefill and decode speed on onnxruntime CPU, side by side (onnx_nmm.bench),
or with `--target trn1|trn2` the same modelled on one NeuronCore (onnx_nmm.estimate_trainium, bench_trainium.py)."""

from __future__ import annotations

import onnx_nmm
from onnx_nmm.cli import _common, bench_trainium
from onnx_nmm.plots.bench import plot_benchmark


def register(subparsers) -> None:
    defaults = onnx_nmm.BenchOptions()
    parser = subparsers.add_parser(
        "bench", help="time to first token, prefill and decode tokens/s of causal LMs on onnxruntime CPU "
        "(measured) or on Trainium (--target, modelled)",
        description="Measure the models side by side in one process. Every round loads each model afresh "
        "(two loads of one model can differ in speed for as long as they live), warms it up untimed, then times "
        "every model in a drawn order and again in reverse; a speed-up is the median of the rounds' with its 95 % "
        "interval, and rounds go on until every interval is within ±--precision or --time-budget is spent. A "
        "speed-up whose interval holds 1.0 is within noise. Each model's peak RSS is measured in a process of its "
        "own. With --target, price them on one NeuronCore instead: linear layers by the kernels' cost model, the "
        "rest by a roofline (modelled, nothing is run).")
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help=".onnx causal LMs (with --target also a Hugging Face config.json); ratios are against "
                             "the first")
    parser.add_argument("--prompt-lengths", type=_common.token_counts, default=defaults.prompt_lengths, metavar="N,N",
                        help="prompt lengths for the time to first token (default "
                             f"{','.join(map(str, defaults.prompt_lengths))})")
    parser.add_argument("--contexts", type=_common.token_counts, default=defaults.contexts, metavar="N,N",
                        help="tokens in the KV cache before the timed decode steps (default "
                             f"{','.join(map(str, defaults.contexts))})")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="decode steps timed at each context, every pass (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="at least this many rounds, each every model loaded afresh and timed in a drawn "
                             "order, then in reverse (default %(default)s: the fewest a 95 %% interval needs)")
    parser.add_argument("--time-budget", type=float, default=defaults.time_budget_s, metavar="SECONDS",
                        help="after --rounds, more rounds until every speed-up's interval is within ±--precision "
                             "or this many seconds of timing have passed (default %(default)s)")
    parser.add_argument("--precision", type=float, default=defaults.precision, metavar="F",
                        help="the interval width that ends the rounds early, a fraction of the speed-up "
                             "(default %(default)s: ±2 %%)")
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default: onnxruntime's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids fed (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--report", metavar="FILE.json",
                        help="also write the measurements as JSON (what --json prints) to this file")
    parser.add_argument("--quiet", action="store_true", help=_common.quiet_help())
    parser.add_argument("--plot", metavar="FILE.png", help="write decode tokens/s against context length")
    parser.add_argument("--force", action="store_true", help=_common.force_help("--plot file"))
    bench_trainium.add_options(parser)
    parser.set_defaults(handler=run, flags={"ranks.keep": "--factorized-keep"})


def run(args) -> int:
    if args.target:
        if args.report:
            raise onnx_nmm.OptionError("--report writes what was measured: with --target, use --json")
        return bench_trainium.run(args)
    bench_trainium.refuse_modelled_options(args)
    _common.refuse_existing(args, "--plot", "--report")
    options = onnx_nmm.BenchOptions(prompt_lengths=args.prompt_lengths, contexts=args.contexts, steps=args.steps,
                                    rounds=args.rounds, time_budget_s=args.time_budget, precision=args.precision,
                                    threads=args.threads, seed=args.seed)
    with _common.progress(quiet=args.json or args.quiet) as progress:
        result = onnx_nmm.bench(args.models, options, progress)
    if args.report:
        _common.write_json(args.report, result.to_dict())
    _common.show_models(result, args, plot_benchmark, _print_models, _print_prefill, _print_decode)
    if args.json:
        return 0
    wrote = [path for path in (args.plot, args.report) if path]
    _common.stdout.print(f"measured on {result.machine}; {options.threads or 'default'} threads; "
                         f"{_how_long(result)}" + (f"; wrote {', '.join(wrote)}" if wrote else ""), soft_wrap=True)
    return 0


def _how_long(result: onnx_nmm.Benchmark) -> str:
    """How many rounds ran, and why they stopped."""
    options = result.options
    rounds = f"{_common.count(result.rounds, 'round')} in {result.timing_s:.0f} s"
    if len(result.models) == 1:
        return rounds
    if result.precise:
        return f"{rounds}, every interval within ±{options.precision:.0%}"
    return f"{rounds}, stopped by the {options.time_budget_s:g} s time budget before every interval was within " \
           f"±{options.precision:.0%}"


def _print_models(result: onnx_nmm.Benchmark, names: dict[str, str]) -> None:
    table = _common.Table(title="Models", title_justify="left")
    for column in ("model", "weights", "a decode step reads", "KV cache per token", "peak RSS, alone"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model in result.models:
        table.add_row(names[model.label], _common.megabytes(model.weight_bytes),
                      _common.megabytes(model.step_weight_bytes),
                      f"{model.cache_bytes_per_token / 1e3:,.1f} kB" if model.cache_bytes_per_token else "no cache",
                      _common.megabytes(model.peak_rss_bytes) if model.peak_rss_bytes is not None else "?")
    _common.stdout.print(table)
    _common.stdout.print("peak RSS, alone: a process of its own that loads only that model, as `generate` does, "
                         "and decodes after its longest context (Python, onnx-nmm and onnxruntime included)",
                         style="dim")


def _print_prefill(result: onnx_nmm.Benchmark, names: dict[str, str]) -> None:
    table = _common.Table(title="Prefill: time to first token", title_justify="left")
    for column in ("model", "prompt", "first token", "tokens/s", "vs first", "interval", "verdict"):
        table.add_column(column, justify="left" if column in ("model", "verdict") else "right")
    for index, model in enumerate(result.models):
        for length in result.options.prompt_lengths:
            table.add_row(names[model.label], str(length), f"{1000 * model.time_to_first_token(length):.1f} ms",
                          f"{model.prefill_tokens_per_s(length):,.0f}",
                          *_speedup_cells(result.prefill_speedup(model, length), None, index == 0))
    _common.stdout.print(table)


def _print_decode(result: onnx_nmm.Benchmark, names: dict[str, str]) -> None:
    table = _common.Table(title="Decode: one token per step after a KV cache of `context` tokens", title_justify="left")
    for column in ("model", "context", "tokens/s", "median", "p90", "vs first", "interval", "ideal", "verdict"):
        table.add_column(column, justify="left" if column in ("model", "verdict") else "right")
    for index, model in enumerate(result.models):
        for context in result.options.contexts:
            ideal = result.ideal_decode_speedup(model, context)
            speedup, interval, verdict = _speedup_cells(result.decode_speedup(model, context), ideal, index == 0)
            table.add_row(names[model.label], str(context), f"{model.decode_tokens_per_s(context):.1f}",
                          f"{1000 * model.step_latency(context):.2f} ms",
                          f"{1000 * model.step_latency(context, 0.9):.2f} ms", speedup, interval, f"{ideal:.2f}×",
                          verdict)
    _common.stdout.print(table)
    _common.stdout.print(f"vs first: the median over rounds of the first model's time over this model's; interval: "
                         f"{result.options.confidence:.0%} confidence (sign test, no assumption about the noise); "
                         "ideal: the first model's bytes read per decode step (weights it multiplies by, KV cache) "
                         "over this model's", style="dim")


def _speedup_cells(speedup, ideal: float | None, reference: bool) -> tuple[str, str, str]:
    """A Speedup's median, interval and verdict as table cells; the first model's row is the reference."""
    if reference:
        return "1.00×", "", "the reference"
    # three decimals: at two, an interval that just excludes 1.0 would read "1.00–1.10×" beside "faster"
    interval = f"{speedup.interval[0]:.3f}–{speedup.interval[1]:.3f}×" if speedup.interval else ""
    return f"{speedup.median:.2f}×", interval, speedup.verdict(ideal)
