"""`onnx-nmm diff A B`: run both models on the same inputs and compare the outputs (onnx_nmm.diff,
onnx_nmm.diff_on_text)."""

from __future__ import annotations

import onnx_nmm
from onnx_nmm.cli import _common, _parsing


def register(subparsers) -> None:
    D = onnx_nmm.DiffOptions
    parser = subparsers.add_parser("diff", help="compare two models' outputs in onnxruntime (A is the reference)")
    parser.add_argument("reference", help="the reference model, e.g. the original export")
    parser.add_argument("candidate", help="the model to judge, e.g. the rewritten one")
    parser.add_argument("--batch", type=int,
                        help=f"batch size of the random inputs (default {_common.default(D, 'batch')})")
    tokens = parser.add_argument("--tokens", dest="seq_len", type=int, metavar="N",
                                 help="tokens per sequence of the random inputs (default "
                                      f"{_common.default(D, 'seq_len')}: enough positions to compare, quick on any "
                                      "model; formerly --seq-len)")
    _parsing.add_former_name(parser, "--seq-len", tokens)
    parser.add_argument("--past-len", type=int,
                        help="compare a decode step of --tokens tokens after a KV cache each model fills with its "
                             "own prefill of this many tokens (default 0: a prefill over an empty cache)")
    parser.add_argument("--seed", type=int, help=f"seed of the random token ids (default {_common.default(D, 'seed')})")
    parser.add_argument("--inputs", metavar="FILE.npz", help="use these inputs (keys = input names) instead")
    parser.add_argument("--atol", type=float, help="exit 1 if any element differs by more than atol + rtol·|A|")
    parser.add_argument("--rtol", type=float, help="see --atol")
    parser.add_argument("--backend", choices=onnx_nmm.RUN_BACKENDS,
                        help="how the candidate runs: onnxruntime (default), "
                             "or its PyTorch lowering with the custom ops "
                             "as torch math or on the NKI kernels on the emulator; "
                             "the reference always runs in onnxruntime")
    parser.add_argument("--target", choices=("trn1", "trn2"), help=_common.EMULATED_TARGET)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quiet", action="store_true", help=_common.quiet_help())
    _common.add_text_options(parser, required=False)
    parser.set_defaults(handler=run, flags={"seq_len": "--tokens"})


def run(args) -> int:
    options = onnx_nmm.DiffOptions(**_common.given(batch=args.batch, seq_len=args.seq_len, past_len=args.past_len,
                                                   seed=args.seed,
                                                   inputs=args.inputs, atol=args.atol, rtol=args.rtol,
                                                   backend=args.backend, target=args.target))
    if args.text:
        return _diff_on_text(args, options)
    result = onnx_nmm.diff(args.reference, args.candidate, options)
    if args.json:
        _common.print_json(result.to_dict())
    else:
        _print_table(args, result)
    return 0 if result.passed else 1


def _diff_on_text(args, options: onnx_nmm.DiffOptions) -> int:
    """Both perplexities, top-1 agreement and KL over the windows of a real text."""
    with _common.progress(quiet=args.json or args.quiet) as progress:
        result = onnx_nmm.diff_on_text(args.reference, args.candidate, _common.text_from(args), options.backend,
                                       options.target, progress)
    if args.json:
        _common.print_json(result.to_dict())
        return 0
    a, b = result.comparison.reference, result.comparison.candidate
    reference, candidate = _labels(args, options)
    _common.stdout.print(
        f"on {result.text}: {_common.windows_line(a)}\n"
        f"  perplexity  {reference}: {a.perplexity:.4f}   {candidate}: {b.perplexity:.4f} "
        f"({b.perplexity / a.perplexity - 1:+.1%})\n"
        f"  next-token top-1 agreement {result.comparison.top1_agreement:.2%}, mean KL "
        f"{result.comparison.mean_kl:.4f} nats", soft_wrap=True)
    return 0


def _labels(args, options: onnx_nmm.DiffOptions) -> tuple[str, str]:
    """How the two sides are named: by file, and by backend when both are one file."""
    if args.reference != args.candidate:
        return args.reference, args.candidate
    return f"{args.reference} (ort)", f"{args.candidate} ({options.backend})"


def _input_shapes(inputs: dict[str, list[int]]) -> str:
    """Each input's shape; a KV cache whose entries share one shape as their count times it."""
    cache = {name: shape for name, shape in inputs.items() if "past" in name.lower()}
    shown = [f"{name} {shape}" for name, shape in inputs.items() if name not in cache or len(cache) == 1]
    shapes = {tuple(shape) for shape in cache.values()}
    if len(cache) > 1 and len(shapes) == 1:
        shown.append(f"KV cache {len(cache)} × {list(shapes.pop())}")
    elif len(cache) > 1:
        shown.extend(f"{name} {shape}" for name, shape in cache.items())
    return ", ".join(shown)


def _print_table(args, result: onnx_nmm.Diff) -> None:
    shapes = _input_shapes(result.inputs)
    how = "onnxruntime CPU" if result.backend == "ort" else f"{result.backend} backend vs onnxruntime CPU"
    reference, candidate = _labels(args, onnx_nmm.DiffOptions(backend=result.backend))
    table = _common.Table(title=f"{candidate} vs {reference} ({how}; {shapes})", title_justify="left")
    for column in ("output", "max |Δ|", "max |Δ| / max |A|", "cosine", "top-1 agree", "mean KL (nats)", "outside tol"):
        table.add_column(column, justify="left" if column == "output" else "right")
    tolerance = result.atol is not None or result.rtol is not None
    for c in result.outputs:
        table.add_row(c.name, f"{c.max_abs:.3e}", f"{c.max_rel:.3e}", f"{c.cosine:.6f}",
                      f"{c.top1_agreement:.2%}" if c.top1_agreement is not None else "—",
                      f"{c.mean_kl:.3e}" if c.mean_kl is not None else "—",
                      str(c.mismatched) if tolerance else "—")
    _common.stdout.print(table)
    if tolerance:
        verdict = "pass" if result.passed else "FAIL"
        _common.stdout.print(f"{verdict}: atol={result.atol or 0}, rtol={result.rtol or 0}")
    if result.misleading_on_random_tokens:
        _common.stdout.print("note: these are random token ids, unlike anything a calibrated rewrite was fitted to; "
                             "judge it on real text with --text and --tokenizer")
