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
        description="Measure the models side by side in one process, taking turns every round, so the ratios "
        "against the first model hold on a noisy machine. The first round warms up and is not counted. With "
        "--target, price them on one NeuronCore instead: linear layers by the kernels' cost model, the rest by "
        "a roofline (modelled, nothing is run).")
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
                        help="decode steps timed at each context, every round (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="timed rounds (default %(default)s)")
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default: onnxruntime's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids fed (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--quiet", action="store_true", help=_common.quiet_help())
    parser.add_argument("--plot", metavar="FILE.png", help="write decode tokens/s against context length")
    parser.add_argument("--force", action="store_true", help=_common.force_help("--plot file"))
    bench_trainium.add_options(parser)
    parser.set_defaults(handler=run, flags={"ranks.keep": "--factorized-keep"})


def run(args) -> int:
    if args.target:
        return bench_trainium.run(args)
    bench_trainium.refuse_modelled_options(args)
    _common.refuse_existing(args, "--plot")
    options = onnx_nmm.BenchOptions(prompt_lengths=args.prompt_lengths, contexts=args.contexts, steps=args.steps,
                                    rounds=args.rounds, threads=args.threads, seed=args.seed)
    with _common.progress(quiet=args.json or args.quiet) as progress:
        result = onnx_nmm.bench(args.models, options, progress)
    _common.show_models(result, args, plot_benchmark, _print_models, _print_prefill, _print_decode)
    if args.json:
        return 0
    _common.stdout.print(f"measured on {result.machine}; {options.threads or 'default'} threads, median of "
                         f"{_common.count(options.rounds, 'round')}" + (f"; wrote {args.plot}" if args.plot else ""),
                         soft_wrap=True)
    return 0


def _print_models(result: onnx_nmm.Benchmark, names: dict[str, str]) -> None:
    table = _common.Table(title="Models", title_justify="left")
    for column in ("model", "weights", "a decode step reads", "KV cache per token", "peak RSS"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model in result.models:
        table.add_row(names[model.label], _common.megabytes(model.weight_bytes),
                      _common.megabytes(model.step_weight_bytes),
                      f"{model.cache_bytes_per_token / 1e3:,.1f} kB" if model.cache_bytes_per_token else "no cache",
                      _common.megabytes(model.peak_rss_bytes) if model.peak_rss_bytes is not None else "?")
    _common.stdout.print(table)


def _print_prefill(result: onnx_nmm.Benchmark, names: dict[str, str]) -> None:
    table = _common.Table(title="Prefill: time to first token", title_justify="left")
    for column in ("model", "prompt", "first token", "tokens/s", "vs first"):
        table.add_column(column, justify="left" if column == "model" else "right")
    first = result.models[0]
    for model in result.models:
        for length in result.options.prompt_lengths:
            table.add_row(names[model.label], str(length), f"{1000 * model.time_to_first_token(length):.1f} ms",
                          f"{model.prefill_tokens_per_s(length):,.0f}",
                          f"{first.time_to_first_token(length) / model.time_to_first_token(length):.2f}×")
    _common.stdout.print(table)


def _print_decode(result: onnx_nmm.Benchmark, names: dict[str, str]) -> None:
    table = _common.Table(title="Decode: one token per step after a KV cache of `context` tokens", title_justify="left")
    for column in ("model", "context", "tokens/s", "median", "p90", "vs first", "ideal"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model in result.models:
        for context in result.options.contexts:
            table.add_row(names[model.label], str(context), f"{model.decode_tokens_per_s(context):.1f}",
                          f"{1000 * model.step_latency(context):.2f} ms",
                          f"{1000 * model.step_latency(context, 0.9):.2f} ms",
                          f"{result.decode_speedup(model, context):.2f}×",
                          f"{result.ideal_decode_speedup(model, context):.2f}×")
    _common.stdout.print(table)
    _common.stdout.print("ideal: the first model's bytes read per decode step (weights it multiplies by, KV cache) "
                         "over this model's", style="dim")
