"""`onnx-nmm export CHECKPOINT -o MODEL.onnx`: a Hugging Face folder or a GGUF file as an ONNX causal LM
(onnx_nmm.export_checkpoint)."""

from __future__ import annotations

import onnx_nmm
from onnx_nmm.cli import _common

EXTERNAL_DATA = {"auto": None, "yes": True, "no": False}


def register(subparsers) -> None:
    parser = subparsers.add_parser("export", help="export a Hugging Face folder or a GGUF file to ONNX, a causal "
                                                  "LM with a KV cache")
    parser.add_argument("checkpoint", help="a Hugging Face model folder (config.json and weights) or a .gguf file")
    parser.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    parser.add_argument("--exporter", choices=("dynamo", "dynamo-noopt", "torchscript"), default="dynamo",
                        help="torch.onnx's dynamo exporter (default; dynamo-noopt skips its optimizer) or the "
                             "TorchScript one (opset 17)")
    parser.add_argument("--external-data", choices=tuple(EXTERNAL_DATA), default="auto",
                        help="write the weights to OUTPUT.data: auto = when they pass 1 GiB (half protobuf's 2 GiB "
                             "limit, so that a rewrite that grows a model still fits)")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="no KV cache: input_ids and attention_mask in, logits out")
    parser.add_argument("--force", action="store_true", help=_common.force_help("-o file"))
    parser.add_argument("--quiet", action="store_true", help=_common.quiet_help())
    parser.set_defaults(handler=run)


def run(args) -> int:
    with _common.progress(args.quiet) as progress, progress.phase(f"exporting {args.checkpoint}"):
        written = onnx_nmm.export_checkpoint(args.checkpoint, args.output, args.exporter,
                                             EXTERNAL_DATA[args.external_data], overwrite=args.force,
                                             cache=args.cache)
    if args.cache:
        _common.stdout.print(f"wrote {written}: inputs input_ids, attention_mask (past + new tokens), position_ids "
                             "and the KV cache past_key_values.N.key/value; outputs logits and present.N.key/value")
    else:
        _common.stdout.print(f"wrote {written}: inputs input_ids and attention_mask [batch, sequence], output logits")
    return 0
