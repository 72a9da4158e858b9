"""The `onnx-nmm` command: one sub-module per sub-command, each a thin shell over the Python API.

A sub-module's `register` adds its parser and sets `handler=run` (and `flags`, the command's own spelling
of API options where it differs from cli._common.FLAGS); `run(args)` parses the flags into the API's
options, calls the API, prints, and returns an exit code. Any OnnxNmmError becomes one line on stderr,
its options spelt as flags, and the exit code of its kind; nothing else is caught.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from onnx_nmm import GenerationMismatch, LoweringMismatch, NeuronSdkMissing, OnnxNmmError, TrainingDiverged, __version__
from onnx_nmm.cli import _common, _parsing

# Order is the order of `onnx-nmm --help`.
COMMAND_MODULES = [
    "export",
    "inspect",
    "rewrite",
    "diff",
    "eval",
    "run",
    "generate",
    "bench",
    "compile",
    "finetune",
    "bench_kernels",
]

# 2 for bad input (argparse's own code for bad usage); these kinds have their own.
EXIT_CODES = {LoweringMismatch: 1, GenerationMismatch: 1, TrainingDiverged: 1, NeuronSdkMissing: 3}
EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = _parsing.Parser(
        prog="onnx-nmm",
        description="Compress the linear layers of an exported LLM: narrow its MLPs to the neurons that matter "
        "(plain, narrower MatMuls; the default with calibration text) or factorize them into SvdMatMul custom ops; "
        "measure what it cost, and lower the result to fused NKI kernels for AWS Trainium.",
    )
    parser.add_argument("--version", action="version", version=f"onnx-nmm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"onnx_nmm.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _parsing.format_warning("onnx-nmm")  # a renamed flag's note, while parsing
    args = build_parser().parse_args(argv)
    warnings.formatwarning = _parsing.format_warning(f"onnx-nmm {args.command}")
    try:
        return args.handler(args)
    except OnnxNmmError as error:
        overrides = getattr(args, "flags", {})
        message = error.message(lambda option: _common.flag(option, overrides))
        print(f"onnx-nmm {args.command}: error: {message}", file=sys.stderr)
        return next((code for kind, code in EXIT_CODES.items() if isinstance(error, kind)), EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        print(f"onnx-nmm {args.command}: interrupted; no output was written", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `onnx-nmm eval ... --json | head`: the reader left, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
