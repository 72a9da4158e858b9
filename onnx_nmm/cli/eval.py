"""`onnx-nmm eval MODEL --text FILE --tokenizer T`: token-level perplexity in onnxruntime."""

from __future__ import annotations

from rich.progress import Progress

from onnx_nmm.backend_runner import RUN_BACKENDS, ModelRunner
from onnx_nmm.cli import _common
from onnx_nmm.model_io import load_model
from onnx_nmm.perplexity import perplexity, window_count


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="perplexity of a model on a text, in onnxruntime")
    parser.add_argument("model", help="an .onnx causal LM with logits as its first output")
    _common.add_text_options(parser, required=True)
    parser.add_argument("--backend", choices=RUN_BACKENDS, default="ort",
                        help="ort (default), or the PyTorch lowering with the custom ops as torch math or on the "
                             "NKI kernels on the emulator")
    parser.add_argument("--target", choices=("trn1", "trn2"), default="trn2", help="emulated target (emulator backend)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run)


def run(args) -> int:
    load_model(args.model)
    tokens, windows = _common.text_windows_from(args)
    model = ModelRunner(args.model, args.backend, args.target)
    with Progress(console=_common.stderr, transient=True, disable=args.json) as progress:
        task = progress.add_task("scoring windows", total=window_count(len(tokens), windows))
        result = perplexity(model.logits, tokens, windows, on_window=lambda: progress.update(task, advance=1))
    if args.json:
        _common.print_json({"model": args.model, "backend": args.backend, "text": args.text,
                            "text_tokens": int(len(tokens)), **result.to_dict()})
    else:
        _common.stdout.print(
            f"perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.4f} nats) on {args.text}: "
            f"{result.tokens_scored} tokens scored in {result.windows} windows of {result.window} "
            f"(stride {result.stride}; the text has {len(tokens)} tokens)")
    return 0
