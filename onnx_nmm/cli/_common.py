"""What the sub-commands share: consoles, atomic JSON files, number formatting."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console

# Tables and results go to stdout; progress and notes to stderr, so `--json` output stays clean.
# Piped output gets a wide page instead of rich's 80 columns: the tables are meant to be read whole.
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
stderr = Console(stderr=True, highlight=False)


def write_json(path: str | os.PathLike, data: dict) -> None:
    """Write `data` as JSON to `path` atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".onnx-nmm-", suffix=".json", delete=False) as handle:
        json.dump(data, handle, indent=2)
        staged = Path(handle.name)
    staged.replace(path)


def print_json(data: dict) -> None:
    print(json.dumps(data, indent=2))


def common_module_prefix(paths: list[str]) -> str:
    """The dotted prefix all module paths share ("inner.model."), to print them shorter."""
    split = [path.split(".") for path in paths if path]
    if not split:
        return ""
    common = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    common = common[: min(len(parts) for parts in split) - 1]
    return ".".join(common) + "." if common else ""


def millions(count: int | float) -> str:
    return f"{count / 1e6:.2f}M"


def add_rank_options(parser) -> None:
    """--keep / --rank / --energy and --align, shared by inspect and rewrite."""
    rule = parser.add_mutually_exclusive_group()
    rule.add_argument("--keep", type=float, metavar="F",
                      help="fraction of each matrix's parameters to keep, in (0, 1]; the rank is "
                           "align·round(F·K·N/((K+N)·align)) (default 0.8)")
    rule.add_argument("--rank", metavar="R", help="one explicit rank for every target, or 'full' for min(K, N)")
    rule.add_argument("--energy", type=float, metavar="E",
                      help="smallest aligned rank holding fraction E of the squared singular values")
    parser.add_argument("--align", type=int, default=128,
                        help="ranks are multiples of this (default 128, the TensorE tile; use 32 for small models)")


def rank_rule_from(args):
    from onnx_nmm.errors import UserError
    from onnx_nmm.rewrite import FULL_RANK, RankRule

    rank = args.rank
    if rank is not None and rank != FULL_RANK:
        try:
            rank = int(rank)
        except ValueError:
            raise UserError(f"--rank takes a positive integer or 'full', got {rank!r}") from None
    keep = args.keep if args.keep is not None or rank is not None or args.energy is not None else 0.8
    return RankRule(keep=keep, rank=rank, energy=args.energy, align=args.align)


def add_selection_options(parser) -> None:
    from onnx_nmm.passes import TARGETS

    parser.add_argument("--targets", choices=TARGETS, default="mlp",
                        help="which layers to factorize (default mlp, as in the paper)")
    parser.add_argument("--include", metavar="REGEX", help="only layers whose node name or module path matches")
    parser.add_argument("--exclude", metavar="REGEX", help="leave out layers whose node name or module path matches")
    parser.add_argument("--lm-head", action="store_true", help="factorize the lm_head too")


def selection_from(args):
    import re

    from onnx_nmm.errors import UserError
    from onnx_nmm.passes import Selection

    for flag, pattern in (("--include", args.include), ("--exclude", args.exclude)):
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as error:
                raise UserError(f"{flag} {pattern!r} is not a valid regular expression: {error}") from None
    return Selection(targets=args.targets, include=args.include, exclude=args.exclude, lm_head=args.lm_head)


def add_text_options(parser, required: bool) -> None:
    """--text/--tokenizer/--window/--stride/--max-windows, shared by eval and diff."""
    group = parser.add_argument_group("text")
    group.add_argument("--text", metavar="FILE", required=required, help="a UTF-8 text file to score")
    group.add_argument("--tokenizer", metavar="PATH", help="a tokenizer folder or a .gguf file")
    group.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    group.add_argument("--stride", type=int, help="tokens between window starts (default: the window, disjoint)")
    group.add_argument("--max-windows", type=int, help="score only the first N windows (default: the whole text)")


def text_windows_from(args):
    """(token ids of --text, Windows) from the parsed text options."""
    from onnx_nmm.calibration_data import load_tokenizer, text_tokens
    from onnx_nmm.errors import UserError
    from onnx_nmm.perplexity import Windows

    if args.tokenizer is None:
        raise UserError("--text needs --tokenizer (a tokenizer folder or a .gguf file)")
    if args.max_windows is not None and args.max_windows < 1:
        raise UserError("--max-windows must be a positive integer")
    windows = Windows(window=args.window, stride=args.stride or args.window, max_windows=args.max_windows)
    return text_tokens(args.text, load_tokenizer(args.tokenizer)), windows
