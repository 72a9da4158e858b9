"""Run `onnx-nmm` commands from the study scripts and keep each one, so the pages they write can list
the exact commands behind their numbers."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOMAINS = {"kjv": "KJV NT", "modern": "modern"}  # the two texts every quality table is scored on → its column


def invocation() -> str:
    """How the running study script was called, as a user types it: `python tools/NAME.py ARGS`."""
    return shlex.join(["python", f"tools/{Path(sys.argv[0]).name}", *sys.argv[1:]])


class CommandLog:
    def __init__(self):
        self.lines: list[str] = []

    def run(self, *argv, shown: list | None = None) -> str:
        """Run `onnx-nmm ARGV` (this Python's package), echo and record it (as `shown`, if given); return its
        stdout."""
        argv = [str(a) for a in argv]
        self._record([str(a) for a in shown] if shown else argv, "$")
        result = subprocess.run([sys.executable, "-m", "onnx_nmm", *argv], capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"command failed (exit {result.returncode}): {shlex.join(argv)}\n{result.stderr.strip()}")
        return result.stdout

    def produce(self, outputs, *argv, shown: list | None = None) -> None:
        """`run`, unless every file in `outputs` is already there from an earlier run of the study (the
        command is still recorded): a long study interrupted part-way resumes where it stopped. `shown`: the
        command as a run from scratch types it, when this run takes a shortcut (files an earlier run left)."""
        from pathlib import Path

        if all(Path(output).exists() for output in outputs):
            self.kept(*(shown or argv))
            return
        self.run(*argv, shown=shown)

    def kept(self, *argv) -> None:
        """Record `onnx-nmm ARGV` without running it: its result is what an earlier run of the study left."""
        self._record([str(a) for a in argv], "# kept from an earlier run:")

    def _record(self, argv: list[str], label: str) -> None:
        line = shlex.join(["onnx-nmm", *map(as_typed, argv)])
        if line not in self.lines:  # a step two tables share is listed once
            self.lines.append(line)
        print(label, line, flush=True)

    def json(self, *argv) -> dict:
        """`run`, for a command given --json."""
        return json.loads(self.run(*argv))

    def perplexity(self, model, text, tokenizer, windows: int, window: int = 512) -> dict:
        """`onnx-nmm eval --json` of `model` on the first `windows` windows of `window` tokens of `text`.

        The result is kept beside the model (MODEL.eval-HASH.json, HASH of the command) and reused while the
        model is not newer, so a resumed study does not score its models again."""
        import hashlib
        from pathlib import Path

        argv = [str(a) for a in ("eval", model, "--text", text, "--tokenizer", tokenizer, "--window", window,
                                 "--max-windows", windows, "--json")]
        model = Path(model)
        kept = model.with_name(f"{model.stem}.eval-{hashlib.sha1(shlex.join(argv).encode()).hexdigest()[:12]}.json")
        if kept.exists() and kept.stat().st_mtime >= model.stat().st_mtime:
            self.kept(*argv)
            return json.loads(kept.read_text())
        result = self.json(*argv)
        kept.write_text(json.dumps(result))
        return result

    def two_domain_scores(self, model, tokenizer, windows: int) -> dict[str, float]:
        """`model`'s perplexity on each text of DOMAINS (`perplexity`, so kept beside the model): "kjv", the
        held-out King James New Testament (the calibration corpus's other half), and "modern", English news
        from another source (the Lee corpus, assets.modern_text)."""
        import assets

        texts = {"kjv": assets.kjv_text("evaluation"), "modern": assets.modern_text()}
        return {domain: self.perplexity(model, texts[domain], tokenizer, windows)["perplexity"] for domain in DOMAINS}


def run_measured(command: list) -> dict:
    """Run `command` in a fresh process; its wall time and its own peak RSS (os.wait4 reports the usage of
    that child alone). A failed command stops the benchmark."""
    command = [str(a) for a in command]
    start = time.perf_counter()
    child = subprocess.Popen(command)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"command failed (exit {os.waitstatus_to_exitcode(status)}): {shlex.join(command)}")
    return {"wall_s": wall, "peak_rss_bytes": usage.ru_maxrss * 1024}


def measured_rewrite(log: CommandLog, rewrite: list, report_file: Path, measured_file: Path) -> tuple[dict, dict]:
    """`onnx-nmm REWRITE` recorded as typed and run with its report in a process of its own (run_measured): its
    wall time and peak RSS, and the report. Both are kept in their files: a second run of the study reuses them."""
    log.kept(*rewrite)
    if not measured_file.exists():
        measured = run_measured([sys.executable, "-m", "onnx_nmm", *rewrite, "--report", report_file, "--force"])
        measured_file.write_text(json.dumps(measured))
    return json.loads(measured_file.read_text()), json.loads(Path(report_file).read_text())


def held_out_by_source(spread: dict) -> str:
    """Each calibration source's perplexity increase on its held-out windows, from a rewrite report's
    quality_budget.spread (a report written before the spread had them: its mean over every window)."""
    by_source = spread.get("by_source", {"all held-out windows": spread["mean"]})
    return ", ".join(f"{source} {mean:+.1%}" for source, mean in by_source.items())


def as_typed(argument: str) -> str:
    """An argument as a user types it from the repository's root: a path inside the repository relative to
    it, a file of an installed package as it lies in the project's own .venv (`make setup`)."""
    path = Path(argument)
    if not path.is_absolute():
        return argument
    if path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    if "site-packages" in path.parts:
        at = path.parts.index("site-packages")
        return str(Path(".venv", "lib", path.parts[at - 1], *path.parts[at:]))
    return argument


def write_section(path, name: str, lines: list[str]) -> None:
    """Replace (or append) the part of a Markdown page between `<!-- name -->` and `<!-- /name -->`, so
    several study scripts can each own a section of one page."""
    from pathlib import Path

    path = Path(path)
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    text = path.read_text() if path.exists() else ""
    block = "\n".join([begin, *lines, end])
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
