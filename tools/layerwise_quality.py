"""The README's first-screen rewrite, as written, on a model too large to rewrite in memory here: Qwen2.5-Coder-
0.5B-Instruct with a KV cache (2.5 GB of float32 weights; the in-memory rewrite was killed at 24.3 GB).

    python tools/layerwise_quality.py [--eval-windows 40] [--work out/layerwise-quality]

`rewrite` takes the layer-wise path by itself (and says so). The tool prints what `--dry-run` priced, the
rewrite's wall time and own peak RSS, its measured budget, the MLP parameters it removed, whether the check
prompts' answers were kept, the perplexity before and after on modern English news that no step saw, and the
speed-ups: `bench` decode at a context of 128 on onnxruntime (this machine's CPU) and `bench --target trn1`
(a prompt of 32 and 32 new tokens; modelled). The output is kept in --work: run again, the rewrite is not
repeated.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog, as_typed, held_out_by_source, invocation, measured_rewrite  # noqa: E402

GB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-windows", type=int, default=40, help="512-token windows of the modern news")
    parser.add_argument("--work", default="out/layerwise-quality")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, gguf, calibration = assets.qwen25_kv_onnx(), assets.qwen25_gguf(), assets.kjv_text("calibration")
    log = CommandLog()
    small, report_file, measured_file = work / "small.onnx", work / "small.report.json", work / "small.measured.json"
    rewrite = ["rewrite", model, "-o", small, "--calib", calibration, "--tokenizer", gguf]
    priced = log.run(*rewrite, "--dry-run").strip()
    measured, report = measured_rewrite(log, rewrite, report_file, measured_file)
    modern = assets.modern_text()
    before = log.perplexity(model, modern, gguf, args.eval_windows)["perplexity"]
    after = log.perplexity(small, modern, gguf, args.eval_windows)["perplexity"]
    measured_speed = _bench(log, work / "bench-ort.json", model, small, "--contexts", 128, "--prompt-lengths", 128,
                            "--threads", 2)["models"][1]
    modelled_speed = _bench(log, work / "bench-trn1.json", model, small, "--target", "trn1")["models"][1]
    budget = report["quality_budget"]
    mlp_before = sum(row["parameters_before"] for row in report["layers"])
    mlp_after = sum(row["parameters_after"] for row in report["layers"])
    answers = report["answers"]
    starts, warned = answers["same_start"], answers["mean_drop"] > answers["max_answer_drop"] or \
        2 * answers["same_start"].count(False) > len(answers["prompts"])
    lines = [f"`{invocation()}` on {machine()}:", "",
             "| | |", "|---|---:|",
             f"| wall time | {measured['wall_s'] / 60:.0f} min |",
             f"| peak RSS | {measured['peak_rss_bytes'] / GB:.2f} GiB |",
             f"| `--dry-run` (modelled, sampling and writing not included) | {_priced(priced)} |",
             f"| budget (perplexity on the held-out windows of each calibration source) | "
             f"+{math.expm1(budget['budget']):.1%} |",
             f"| measured there, after {len(budget['evaluations']) - 1} narrowing sweeps | "
             f"{held_out_by_source(budget['spread'])} |",
             f"| MLP parameters removed | {1 - mlp_after / mlp_before:.1%} ({(mlp_before - mlp_after) / 1e6:.1f}M) |",
             f"| check prompts: answers that start as the dense model's; likelihood drop of its answers | "
             f"{sum(starts)} of {len(starts)}; {answers['mean_drop']:.2f} nats/token "
             f"({'the check warned' if warned else 'kept'}) |",
             f"| perplexity on modern news, {args.eval_windows} windows of 512 | {before:.2f} → {after:.2f} "
             f"({after / before - 1:+.1%}) |",
             f"| decode speed-up, onnxruntime CPU, context 128 (measured; median, 95 % interval) | "
             f"{_speedup(measured_speed['decode_speedup_interval']['128'])} |",
             f"| bytes a decode step reads, dense / rewritten | {measured_speed['ideal_decode_speedup']['128']:.3f}× |",
             f"| end to end on trn1, prompt 32 + 32 new tokens (modelled) | "
             f"{modelled_speed['speedup']['generation']['end to end']:.2f}× |",
             "", "Commands:", "", "```", *log.lines, "```"]
    print("\n".join(lines))
    print("\ndry run said:", priced, file=sys.stderr)
    print("report:", as_typed(str(report_file)), file=sys.stderr)


def _speedup(measured: dict) -> str:
    """A measured speed-up as bench gives it: the median, its 95 % interval over the rounds, the verdict."""
    low, high = measured["interval"]
    return f"{measured['median']:.2f}× ({low:.2f}–{high:.2f}, {measured['rounds']} rounds: {measured['verdict']})"


def _bench(log: CommandLog, kept: Path, model: Path, small: Path, *flags) -> dict:
    """`onnx-nmm bench MODEL SMALL FLAGS --json`, kept in `kept` (reused on a second run)."""
    if kept.exists():
        log.kept("bench", model, small, *flags, "--json")
        return json.loads(kept.read_text())
    result = log.json("bench", model, small, *flags, "--json")
    kept.write_text(json.dumps(result))
    return result


def _priced(line: str) -> str:
    """The time in all and the peak memory, from the dry run's sentence ("..., 39.6 min in all (...); peak memory
    2.7 GB. ...")."""
    time, peak = re.search(r"([\d.,]+ min) in all", line), re.search(r"peak memory ([\d.]+ GB)", line)
    return f"{time.group(1)}, peak {peak.group(1)}" if time and peak else line


if __name__ == "__main__":
    main()
