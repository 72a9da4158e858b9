"""The README's first-screen rewrite of SmolLM2-135M two ways, at the same default budget: in memory, and one
decoder layer at a time (`--stream`). For each: the MLP parameters removed, the budget as measured on its
held-out windows (each calibration source's mean), perplexity on modern news that no step saw, the answer
check, wall time and the rewrite's own peak RSS.

    python tools/layerwise_side_by_side.py [--eval-windows 40] [--work out/layerwise-side-by-side] [--ways ...]

The rewrites and evaluations are kept in --work: run again, they are not repeated (two runs with one --ways
each rewrite in parallel; a third with none prints the table).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog, held_out_by_source, invocation, measured_rewrite  # noqa: E402

GB = 2**30
WAYS = {"memory": [], "layerwise": ["--stream"]}  # the rewrite's name in --work: its flags
LABELS = {"memory": "in memory", "layerwise": "layer by layer"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-windows", type=int, default=40, help="512-token windows of the modern news")
    parser.add_argument("--work", default="out/layerwise-side-by-side")
    parser.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS), help="the rewrites to run")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, gguf, calibration = assets.smollm2_kv_onnx(), assets.smollm2_gguf(), assets.kjv_text("calibration")
    modern = assets.modern_text()
    log = CommandLog()
    dense = log.perplexity(model, modern, gguf, args.eval_windows)["perplexity"]
    rows = []
    for name in args.ways:
        flags = WAYS[name]
        small, report_file, measured_file = (work / f"{name}.onnx", work / f"{name}.report.json",
                                             work / f"{name}.measured.json")
        rewrite = ["rewrite", model, "-o", small, "--calib", calibration, "--tokenizer", gguf, *flags]
        measured, report = measured_rewrite(log, rewrite, report_file, measured_file)
        after = log.perplexity(small, modern, gguf, args.eval_windows)["perplexity"]
        rows.append(_row(LABELS[name], report, measured, dense, after))
    lines = [f"`{invocation()}` on {machine()}:", "",
             "| | MLP parameters removed | budget | measured on held-out windows (per source) | modern news, "
             f"{args.eval_windows} windows | answers | wall time | peak RSS |",
             "|---|---:|---:|---|---:|---|---:|---:|", *rows, "", "Commands:", "", "```", *log.lines, "```"]
    print("\n".join(lines))


def _row(way: str, report: dict, measured: dict, dense: float, after: float) -> str:
    budget = report["quality_budget"]
    before_mlp = sum(row["parameters_before"] for row in report["layers"])
    after_mlp = sum(row["parameters_after"] for row in report["layers"])
    answers = report["answers"]
    warned = answers["mean_drop"] > answers["max_answer_drop"] or \
        2 * answers["same_start"].count(False) > len(answers["prompts"])
    return (f"| {way} | {1 - after_mlp / before_mlp:.1%} | +{math.expm1(budget['budget']):.1%} | "
            f"{held_out_by_source(budget['spread'])} | {dense:.2f} → {after:.2f} ({after / dense - 1:+.1%}) | "
            f"{sum(answers['same_start'])} of {len(answers['same_start'])} start alike"
            f"{', the check warned' if warned else ''} | {measured['wall_s'] / 60:.0f} min | "
            f"{measured['peak_rss_bytes'] / GB:.2f} GiB |")


if __name__ == "__main__":
    main()
