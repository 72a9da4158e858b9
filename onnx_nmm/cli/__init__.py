"""The `onnx-nmm` command: one sub-module per sub-command, each with `register(subparsers)`.

A sub-module's `register` adds its parser and sets `handler=run`; `run(args)` returns an exit code.
Any `UserError` becomes one line on stderr and the error's exit code; nothing else is caught.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from onnx_nmm import __version__
from onnx_nmm.errors import UserError

# Order is the order of `onnx-nmm --help`.
COMMAND_MODULES = [
    "inspect",
    "rewrite",
    "diff",
    "eval",
    "run",
    "compile",
    "finetune",
    "bench_kernels",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnx-nmm",
        description="Factorize the linear layers of an exported LLM into SVD custom ops, "
        "measure what it cost, and lower them to fused NKI kernels for AWS Trainium.",
    )
    parser.add_argument("--version", action="version", version=f"onnx-nmm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"onnx_nmm.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.formatwarning = lambda message, *_, **__: f"onnx-nmm {args.command}: warning: {message}\n"
    try:
        return args.handler(args)
    except UserError as error:
        print(f"onnx-nmm {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"onnx-nmm {args.command}: interrupted; no output was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
