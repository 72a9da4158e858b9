"""`onnx-nmm generate MODEL|DIR --prompt TEXT`: continue a prompt, streaming the tokens (onnx_nmm.generate); DIR
is a compiled folder, whose static-shape graphs then run."""

from __future__ import annotations

import sys

import onnx_nmm
from onnx_nmm.cli import _common


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text with a causal LM, token by token with its KV cache")
    parser.add_argument("model", help="an .onnx causal LM (with a KV cache, or without: then each step reads it "
                                      "all), or a folder `onnx-nmm compile --max-context` wrote")
    parser.add_argument("--prompt", required=True, help="the text to continue (a user turn, when the tokenizer has a "
                                                         "chat template)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a tokenizer folder or a .gguf file; needed unless the model's folder holds one (an "
                             "onnxruntime-genai folder does)")
    parser.add_argument("--max-new-tokens", type=int,
                        default=_common.default(onnx_nmm.GenerateOptions, "max_new_tokens"),
                        help="stop after this many new tokens (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (the default): greedy; above 0: sample from softmax(logits / T)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample only from the most likely tokens whose probabilities add up to P (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--no-chat", action="store_true",
                        help="feed the prompt as plain text, not through the tokenizer's chat template")
    parser.add_argument("--backend", choices=(*onnx_nmm.RUN_BACKENDS, "neuron"), default="ort",
                        help="ort (default), or the PyTorch lowering with the custom ops as torch math or on the "
                             "NKI kernels on the emulator; neuron: a compiled folder's traces, on a NeuronCore (a "
                             "folder compiled with --tp N: on N NeuronCores, with neuronx-distributed)")
    parser.add_argument("--target", choices=("trn1", "trn2"), default="trn2", help=_common.EMULATED_TARGET)
    parser.add_argument("--threads", type=int, help="CPU threads (default: onnxruntime's choice)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of streaming it")
    parser.set_defaults(handler=run)


def run(args) -> int:
    options = onnx_nmm.GenerateOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                       top_p=args.top_p,
                              seed=args.seed, chat=not args.no_chat, backend=args.backend, target=args.target,
                              threads=args.threads)
    stream = None if args.json else _print_piece
    result = onnx_nmm.generate(args.model, args.prompt, args.tokenizer, options, stream)
    if args.json:
        _common.print_json(result.to_dict())
        return 0
    print(flush=True)
    speed = result.decode_tokens_per_s
    _common.stderr.print(
        f"{_common.count(len(result.tokens), 'new token')} "
        f"({'end of sequence' if result.stopped_by == 'eos' else 'limit reached'})"
        f" after a prompt of {result.prompt_tokens}; first token {1000 * result.first_token_s:.0f} ms"
        + (f", then {speed:.1f} tokens/s" if speed else ""), style="dim", soft_wrap=True)
    return 0


def _print_piece(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
