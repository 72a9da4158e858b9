"""What the sub-commands share: consoles and progress bars, JSON files, flags shared by several commands,
and how an option's path in the API is spelt as a flag."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichBars
from rich.table import Table as RichTable

import onnx_nmm

# Tables and results go to stdout; progress and notes to stderr, so `--json` output stays clean.
# Piped output gets 200 columns instead of rich's 80: wide enough for a table of layer names, which fold (Table)
# rather than lose their end when even that is not enough.
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
stderr = Console(stderr=True, highlight=False)

# Option paths (errors.py) whose flag is not `--` + the last part with dashes.
FLAGS = {
    "calibration.source": "--calib",
    "calibration.samples": "--calib-samples",
    "calibration.seq_len": "--calib-window",
    "calibration.spread": "--calib-spread",
    "calibration.batch": "--calib-batch",
    "calibration.mode": "--calib-mode",
    "calibration.statistics": "--calib-stats",
    "calibration.save_statistics": "--save-calib-stats",
    "calibration.mix_generated": "--calib-mix",
    "output": "-o",
    "rewrite_streamed": "--stream",
    "overwrite_input": "--force",
    "overwrite": "--force",
    "training.learning_rate": "--lr",
    "training.adapter_rank": "--adapters",
}


def flag(option: str, overrides: dict[str, str] | None = None) -> str:
    """The flag that sets the API option `option` ("ranks.keep" → "--keep")."""
    overrides = overrides or {}
    if option in overrides:
        return overrides[option]
    if option in FLAGS:
        return FLAGS[option]
    return "--" + option.rsplit(".", 1)[-1].replace("_", "-")


def refuse_existing(args, *flags: str) -> None:
    """The files a command writes beside its output (--report, --plot, ...): one that exists is replaced only
    with --force, and that is said before the long work, not after."""
    for flag in flags:
        path = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if path is not None and Path(path).is_dir():
            raise onnx_nmm.OutputError(f"{flag} {path} is a folder: give a file name")
        if path is not None and Path(path).exists() and not args.force:
            raise onnx_nmm.OutputError(f"{flag} {path} exists: choose another path, or give --force to replace it")


def write_json(path: str | os.PathLike, data: dict) -> None:
    """Write `data` as JSON to `path` atomically (temporary file, then rename)."""
    from onnx_nmm.model_io import write_text_atomically

    write_text_atomically(path, json.dumps(data, indent=2))


def print_json(data: dict) -> None:
    print(json.dumps(data, indent=2))


def show_models(result, args, plot, *tables) -> None:
    """A result over several models (bench's, measured or modelled): its plot if --plot, then the JSON if
    --json, else each table, the models named by their shortest telling paths."""
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print_json(result.to_dict())
        return
    names = short_names([model.label for model in result.models])
    for table in tables:
        table(result, names)


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


def short_names(labels: list[str]) -> dict[str, str]:
    """Each model by the fewest trailing path parts that tell it from the others ("optimum-past/model.onnx")."""
    parts = [Path(label).parts for label in labels]
    for keep in range(1, max(map(len, parts)) + 1):
        names = [str(Path(*label[-keep:])) for label in parts]
        if len(set(names)) == len(names):
            return dict(zip(labels, names))
    return {label: label for label in labels}


def token_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated token counts, got {text!r}") from None


class Table(RichTable):
    """A rich table whose cells fold rather than end in an ellipsis when the width runs out: a log (piped
    output is 120 columns wide) keeps every layer name whole."""

    def add_column(self, *args, **kwargs) -> None:
        kwargs.setdefault("overflow", "fold")
        super().add_column(*args, **kwargs)


def millions(number: int | float) -> str:
    return f"{number / 1e6:.2f}M"


def megabytes(number: int | float) -> str:
    return f"{number / 1e6:,.1f} MB"


def count(number: int, noun: str) -> str:
    """"1 layer", "6 layers"."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def given(**values) -> dict:
    """The flags that were given: a flag left out leaves the API's default in place."""
    return {name: value for name, value in values.items() if value is not None}


def default(options_class, field: str):
    """An API option's default, for a flag's help text."""
    return options_class.__dataclass_fields__[field].default


class BarsProgress(onnx_nmm.Progress):
    """The API's progress, shown as rich progress bars on stderr (one per phase, gone when it ends)."""

    def __init__(self, bars: RichBars):
        self.bars = bars

    @contextlib.contextmanager
    def phase(self, description: str, total: int | None = None) -> Iterator[onnx_nmm.Phase]:
        task = self.bars.add_task(description, total=total)
        try:
            yield _Bar(self.bars, task, description)
        finally:
            self.bars.update(task, visible=False)


class _Bar(onnx_nmm.Phase):
    def __init__(self, bars: RichBars, task, description: str):
        self.bars, self.task, self.description = bars, task, description

    def set_total(self, total: int | None) -> None:
        self.bars.update(self.task, total=total)

    def advance(self, amount: int = 1, detail: str | None = None) -> None:
        self.bars.update(self.task, advance=amount, description=f"{self.description}: {detail}" if detail else None)


class LogProgress(onnx_nmm.Progress):
    """The API's progress as plain lines on stderr, for a log, CI or nohup: every `interval` seconds while a
    phase runs, how far it is (how long, about how long to go), and when such a phase ends. A phase shorter
    than the interval says nothing, and one that ends by an error or an interrupt says no "done"."""

    def __init__(self, interval: float):
        self.interval = interval

    @contextlib.contextmanager
    def phase(self, description: str, total: int | None = None) -> Iterator[onnx_nmm.Phase]:
        line = _LogLine(description, total)
        stop = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(line, stop), daemon=True)
        ticker.start()
        try:
            yield line
        finally:
            stop.set()
            ticker.join()
        if line.elapsed() >= self.interval:
            _log(line.text(f"done in {line.elapsed():.0f} s"))

    def _tick(self, line: _LogLine, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            _log(line.text(line.status()))


def _log(text: str) -> None:
    stderr.print(text, highlight=False, markup=False, soft_wrap=True)


class _LogLine(onnx_nmm.Phase):
    def __init__(self, description: str, total: int | None):
        self.description, self.total, self.done, self.detail = description, total, 0, ""
        self.start = time.monotonic()

    def set_total(self, total: int | None) -> None:
        self.total = total

    def advance(self, amount: int = 1, detail: str | None = None) -> None:
        self.done += amount
        self.detail = detail or self.detail

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def status(self) -> str:
        elapsed = self.elapsed()
        if not self.total:
            return f"{self.done} done, {elapsed:.0f} s" if self.done else f"{elapsed:.0f} s"
        left = f", about {elapsed * (self.total - self.done) / self.done:.0f} s to go" if self.done else ""
        return f"{self.done}/{self.total} ({self.done / self.total:.0%}), {elapsed:.0f} s{left}"

    def text(self, status: str) -> str:
        detail = f" [{self.detail}]" if self.detail else ""
        return f"onnx-nmm: {self.description}{detail}: {status}"


# Seconds between the progress lines of a log.
LOG_INTERVAL = 15.0


@contextlib.contextmanager
def progress(quiet: bool = False) -> Iterator[onnx_nmm.Progress]:
    """Progress bars on stderr while the block runs; when stderr is not a terminal (a log file, CI, nohup), a
    progress line every LOG_INTERVAL seconds instead; nothing when `quiet`."""
    if quiet:
        yield onnx_nmm.Progress()
    elif not stderr.is_terminal:
        yield LogProgress(LOG_INTERVAL)
    else:
        bars = RichBars(TextColumn("{task.description:<48.48}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=stderr, transient=True)
        with bars:
            yield BarsProgress(bars)


# -- flags shared by several commands, and the options they make --------------------------------------------
# --force, --quiet and --target mean one thing everywhere; each command's help names only what differs.
def force_help(replaced: str) -> str:
    """--force's help: what it lets the command replace ("-o file", "--plot file")."""
    return f"replace an existing {replaced}; without --force, one that exists is refused before any work"


def quiet_help(silenced: str = "") -> str:
    """--quiet's help: no progress bar, and what else it silences ("table and summary"); when nothing else, the
    results still print."""
    if silenced:
        return f"no progress bar and no {silenced}; warnings and errors still print"
    return "no progress bar; the results still print"


def target_help(use: str) -> str:
    """--target's help: which Trainium generation, and what the command does with it."""
    return f"the Trainium generation {use}"


EMULATED_TARGET = target_help("the emulator backend emulates (default trn2; read only with --backend emulator)")


def add_rank_options(parser, calibrates: bool = False) -> None:
    """--keep / --rank / --energy and --align, shared by inspect and rewrite (which `calibrates`: there no rule
    and calibration tokens mean a quality budget, not --keep's default)."""
    options = onnx_nmm.options
    default_rule = f"default {options.DEFAULT_KEEP}"
    if calibrates:
        budget = options.DEFAULT_PPL_INCREASE
        default_rule = (f"default {options.DEFAULT_KEEP} without --calib; with --calib tokens and no other rule, "
                        f"--max-ppl-increase {budget:g} instead: as much as fits within +{budget * 100:g} %% "
                        "perplexity on held-out windows")
    rule = parser.add_mutually_exclusive_group()
    rule.add_argument("--keep", type=float, metavar="F",
                      help="fraction of each matrix's parameters to keep, in (0, 1]; the rank is "
                           f"align·round(F·K·N/((K+N)·align)) ({default_rule})")
    rule.add_argument("--rank", type=_rank, metavar="R",
                      help="one explicit rank for every target, or 'full' for min(K, N)")
    rule.add_argument("--energy", type=float, metavar="E",
                      help="smallest aligned rank holding fraction E of the squared singular values")
    parser.add_argument("--align", type=int, default=onnx_nmm.options.DEFAULT_ALIGN,
                        help="ranks are multiples of this (default %(default)s, the TensorE tile; use 32 for small "
                             "models)")


def _rank(text: str) -> int | str:
    if text == onnx_nmm.options.FULL_RANK:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a positive integer or 'full', got {text!r}") from None


def add_selection_options(parser) -> None:
    parser.add_argument("--targets", choices=onnx_nmm.options.TARGETS, default=default(onnx_nmm.Selection, "targets"),
                        help="which layers to factorize (default %(default)s, as in the paper)")
    parser.add_argument("--include", metavar="REGEX", help="only layers whose node name or module path matches")
    parser.add_argument("--exclude", metavar="REGEX", help="leave out layers whose node name or module path matches")
    parser.add_argument("--lm-head", action="store_true", help="factorize the lm_head too")


def selection_from(args) -> onnx_nmm.Selection:
    return onnx_nmm.Selection(targets=args.targets, include=args.include, exclude=args.exclude, lm_head=args.lm_head)


def add_text_options(parser, required: bool) -> None:
    """--text/--tokenizer/--window/--stride/--max-windows, shared by eval and diff."""
    group = parser.add_argument_group("text")
    group.add_argument("--text", metavar="FILE", required=required, help="a UTF-8 text file to score")
    group.add_argument("--tokenizer", metavar="PATH", help="a tokenizer folder or a .gguf file; needed for a text "
                                                           "(an .npz of token ids needs none)")
    group.add_argument("--window", type=int,
                       help=f"tokens per window (default {onnx_nmm.options.DEFAULT_WINDOW})")
    group.add_argument("--stride", type=int, help="tokens between window starts (default: the window, disjoint)")
    group.add_argument("--max-windows", type=int, help="score only the first N windows (default: the whole text)")
    add_bos_option(group)


def add_bos_option(group) -> None:
    group.add_argument("--no-bos", action="store_true",
                       help="do not start each window with the BOS token the tokenizer puts before a text (by "
                            "default every window does, when the tokenizer adds one)")


def text_from(args) -> onnx_nmm.TextOptions:
    return onnx_nmm.TextOptions(args.text, args.tokenizer, args.window, args.stride, args.max_windows,
                                bos=not args.no_bos)


def windows_line(result) -> str:
    """How a perplexity result's windows were cut, as eval and diff print it."""
    bos = f", each starting with BOS (id {result.bos})" if result.bos is not None else ""
    return f"{result.tokens_scored} tokens in {result.windows} windows of {result.window} (stride {result.stride}{bos})"


def calibration_sources(sources: list[str] | None, generator: str | None,
                        flags: tuple[str, str] = ("--calib", "--calib-generator")):
    """--calib given once or repeated (a list, mixed), each "generated[:N]" sampled from --calib-generator
    when given. `flags` names the two options in errors (finetune calls them --text and --generator)."""
    source_flag, generator_flag = flags
    chosen = [onnx_nmm.GeneratedText.from_spec(source) or source for source in sources or []]
    if generator is not None and not any(isinstance(source, onnx_nmm.GeneratedText) for source in chosen):
        raise onnx_nmm.OptionError(f"{generator_flag} samples {source_flag} generated:N windows, and none is asked "
                                   f"for: add {source_flag} generated:N or drop {generator_flag}")
    if not chosen:
        return None
    if generator is not None:
        chosen = [dataclasses.replace(source, generator=generator) if isinstance(source, onnx_nmm.GeneratedText)
                  else source for source in chosen]
    return chosen[0] if len(chosen) == 1 else chosen
