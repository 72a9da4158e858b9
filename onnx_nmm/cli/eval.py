"""`onnx-nmm eval MODEL --text FILE --tokenizer T`: token-level perplexity (onnx_nmm.evaluate)."""

from __future__ import annotations

import onnx_nmm
from onnx_nmm.cli import _common


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="perplexity of a model on a text, in onnxruntime")
    parser.add_argument("model", help="an .onnx causal LM with logits as its first output")
    _common.add_text_options(parser, required=True)
    parser.add_argument("--backend", choices=onnx_nmm.RUN_BACKENDS, default="ort",
                        help="ort (default), or the PyTorch lowering with the custom ops as torch math or on the "
                             "NKI kernels on the emulator")
    parser.add_argument("--target", choices=("trn1", "trn2"), default="trn2", help=_common.EMULATED_TARGET)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--quiet", action="store_true", help=_common.quiet_help())
    parser.set_defaults(handler=run)


def run(args) -> int:
    with _common.progress(quiet=args.json or args.quiet) as progress:
        evaluation = onnx_nmm.evaluate(args.model, _common.text_from(args), args.backend, args.target, progress)
    if args.json:
        _common.print_json(evaluation.to_dict())
        return 0
    result = evaluation.result
    _common.stdout.print(
        f"perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.4f} nats) on {evaluation.text}: "
        f"{_common.windows_line(result)}; the text has {evaluation.text_tokens} tokens", soft_wrap=True)
    return 0
