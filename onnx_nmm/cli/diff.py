"""`onnx-nmm diff A B`: run both models in onnxruntime on the same inputs and compare the outputs."""

from __future__ import annotations

from rich.table import Table

from rich.progress import Progress

from onnx_nmm import metrics, ort_runner
from onnx_nmm.backend_runner import RUN_BACKENDS, ModelRunner
from onnx_nmm.cli import _common
from onnx_nmm.errors import UserError
from onnx_nmm.model_io import load_model
from onnx_nmm.perplexity import compare_on_text, window_count


def register(subparsers) -> None:
    parser = subparsers.add_parser("diff", help="compare two models' outputs in onnxruntime (A is the reference)")
    parser.add_argument("reference", help="the reference model, e.g. the original export")
    parser.add_argument("candidate", help="the model to judge, e.g. the rewritten one")
    parser.add_argument("--batch", type=int, default=1, help="batch size of the random inputs (default 1)")
    parser.add_argument("--seq-len", type=int, default=32, help="sequence length of the random inputs (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--inputs", metavar="FILE.npz", help="use these inputs (keys = input names) instead")
    parser.add_argument("--atol", type=float, help="exit 1 if any element differs by more than atol + rtol·|A|")
    parser.add_argument("--rtol", type=float, help="see --atol")
    parser.add_argument("--backend", choices=RUN_BACKENDS, default="ort",
                        help="how the candidate runs: onnxruntime (default), or its PyTorch lowering with the custom ops "
                             "as torch math or on the NKI kernels on the emulator; the reference always runs in onnxruntime")
    parser.add_argument("--target", choices=("trn1", "trn2"), default="trn2", help="emulated target (emulator backend)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _common.add_text_options(parser, required=False)
    parser.set_defaults(handler=run)


def run(args) -> int:
    if args.batch < 1 or args.seq_len < 1:
        raise UserError("--batch and --seq-len must be positive")
    for path in (args.reference, args.candidate):
        load_model(path)  # same one-line errors as every command for missing files or data
    reference = ModelRunner(args.reference)
    candidate = ModelRunner(args.candidate, args.backend, args.target)
    if args.text:
        return _diff_on_text(args, reference, candidate)
    if args.inputs:
        inputs = ort_runner.load_inputs(args.inputs, reference.session)
    else:
        inputs = ort_runner.random_inputs(reference.session, args.reference, args.batch, args.seq_len, args.seed)
    expected = reference(inputs)
    actual = candidate(inputs)
    missing = [name for name in expected if name not in actual]
    if missing:
        raise UserError(f"the candidate has no output(s) {', '.join(missing)}; the two models do not match")
    comparisons = [metrics.compare(name, expected[name], actual[name], args.atol, args.rtol) for name in expected]
    failed = any(comparison.mismatched for comparison in comparisons)
    if args.json:
        _common.print_json({"reference": args.reference, "candidate": args.candidate, "backend": args.backend,
                            "inputs": {name: list(array.shape) for name, array in inputs.items()},
                            "atol": args.atol, "rtol": args.rtol, "passed": not failed,
                            "outputs": [comparison.to_dict() for comparison in comparisons]})
    else:
        _print_table(args, inputs, comparisons)
    return 1 if failed else 0


def _diff_on_text(args, reference, candidate) -> int:
    """Both perplexities, top-1 agreement and KL over the windows of a real text."""
    tokens, windows = _common.text_windows_from(args)
    with Progress(console=_common.stderr, transient=True, disable=args.json) as progress:
        task = progress.add_task("scoring windows", total=window_count(len(tokens), windows))
        result = compare_on_text(reference.logits, candidate.logits, tokens, windows,
                                 on_window=lambda: progress.update(task, advance=1))
    if args.json:
        _common.print_json({"reference": args.reference, "candidate": args.candidate, "backend": args.backend,
                            "text": args.text, **result.to_dict()})
        return 0
    a, b = result.reference, result.candidate
    _common.stdout.print(
        f"on {args.text}: {a.tokens_scored} tokens in {a.windows} windows of {a.window} (stride {a.stride})\n"
        f"  perplexity  {args.reference}: {a.perplexity:.4f}   {args.candidate}: {b.perplexity:.4f} "
        f"({b.perplexity / a.perplexity - 1:+.1%})\n"
        f"  next-token top-1 agreement {result.top1_agreement:.2%}, mean KL {result.mean_kl:.4f} nats")
    return 0


def _print_table(args, inputs, comparisons) -> None:
    shapes = ", ".join(f"{name} {list(array.shape)}" for name, array in inputs.items())
    how = "onnxruntime CPU" if args.backend == "ort" else f"{args.backend} backend vs onnxruntime CPU"
    table = Table(title=f"{args.candidate} vs {args.reference} ({how}; {shapes})", title_justify="left")
    for column in ("output", "max |Δ|", "max |Δ| / max |A|", "cosine", "top-1 agree", "mean KL (nats)", "outside tol"):
        table.add_column(column, justify="left" if column == "output" else "right")
    tolerance = args.atol is not None or args.rtol is not None
    for c in comparisons:
        table.add_row(c.name, f"{c.max_abs:.3e}", f"{c.max_rel:.3e}", f"{c.cosine:.6f}",
                      f"{c.top1_agreement:.2%}" if c.top1_agreement is not None else "—",
                      f"{c.mean_kl:.3e}" if c.mean_kl is not None else "—",
                      str(c.mismatched) if tolerance else "—")
    _common.stdout.print(table)
    if tolerance:
        verdict = "FAIL" if any(c.mismatched for c in comparisons) else "pass"
        _common.stdout.print(f"{verdict}: atol={args.atol or 0}, rtol={args.rtol or 0}")
