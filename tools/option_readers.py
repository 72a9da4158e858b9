"""Which library modules read an option during a rewrite, in the order they first do, and how often the reading
comes back to a module it had left: the walks docs/architecture.md quotes, printed instead of typed. The options
module, which parses them, is not counted.

    python tools/option_readers.py

A tiny random-weight Llama is rewritten with the options under watch; every read of a watched field
(`calibration.source` and the sources it was read as, `factorization.method` and the method it resolves to,
`ranks.keep`) is recorded with the
module whose code read it. A module that reads a value passed on as another name is not seen: this counts the
modules that look at the option itself.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import onnx_nmm
from onnx_nmm import CalibrationOptions, FactorizationOptions, RankOptions, RewriteOptions

WATCHED = {"calibration": ("source", "sources"), "factorization": ("method", "strategy"), "ranks": ("keep",),
           "rewrite": ("strategy",)}


def recording(options, fields: tuple[str, ...], label: str, reads: list[tuple[str, str]]):
    """`options` as an instance of a subclass that appends (label.field, reading module) to `reads` on every read
    of one of `fields` from a library module."""
    base = type(options)

    class Recording(base):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name):
            if name in fields:
                module = sys._getframe(1).f_globals.get("__name__", "")
                if module.startswith("onnx_nmm") and not module.startswith(("onnx_nmm.cli", "onnx_nmm.options")):
                    reads.append((f"{label}.{name}", module))
            return super().__getattribute__(name)

    Recording.__name__ = Recording.__qualname__ = base.__name__
    watched = object.__new__(Recording)
    for field in dataclasses.fields(options):
        object.__setattr__(watched, field.name, getattr(options, field.name))
    return watched


def watched_options(options: RewriteOptions, reads: list[tuple[str, str]]) -> RewriteOptions:
    """`options` with every WATCHED field recorded."""
    parts = {name: recording(getattr(options, name), fields, name, reads)
             for name, fields in WATCHED.items() if name != "rewrite" and getattr(options, name) is not None}
    rewritten = recording(options, WATCHED["rewrite"], "options", reads)
    for name, part in parts.items():
        object.__setattr__(rewritten, name, part)
    return rewritten


def walk(reads: list[tuple[str, str]]) -> tuple[list[str], int]:
    """The modules that made `reads`, in first-read order, and how many times the reading came back to a module
    after another had read."""
    sequence = [module for _, module in reads]
    order = list(dict.fromkeys(sequence))
    runs = [module for i, module in enumerate(sequence) if i == 0 or sequence[i - 1] != module]
    return order, len(runs) - len(order)


CASES = {
    "--calib": (lambda: RewriteOptions(calibration=CalibrationOptions("random", samples=12, seq_len=32)),
                ("calibration.source", "calibration.sources")),
    "--method fisher": (lambda: RewriteOptions(
        ranks=RankOptions(keep=0.8), factorization=FactorizationOptions("fisher"),
        calibration=CalibrationOptions("random", samples=4, seq_len=32)),
        ("factorization.method", "factorization.strategy", "options.strategy")),
    "--keep 0.8": (lambda: RewriteOptions(ranks=RankOptions(keep=0.8)), ("ranks.keep",)),
}


def readers(model: Path) -> list[str]:
    """One line per case of CASES: the modules that read its option, as docs/architecture.md quotes them."""
    lines = []
    for title, (options, prefixes) in CASES.items():
        reads: list[tuple[str, str]] = []
        onnx_nmm.rewrite(model, watched_options(options(), reads))
        order, returns = walk([read for read in reads if read[0].startswith(prefixes)])
        modules = " → ".join(f"`{module.removeprefix('onnx_nmm.')}`" for module in order)
        lines.append(f"`{title}` is read by {len(order)} module{'s' * (len(order) != 1)} ({modules}), "
                     f"{returns} return{'s' * (returns != 1)} to a module it had left")
    return lines


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        model = onnx_nmm.export_causal_lm(onnx_nmm.build_model("llama"), Path(folder) / "llama.onnx", "dynamo")
        print("\n".join(readers(model)))


if __name__ == "__main__":
    main()
