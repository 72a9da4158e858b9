"""Qwen2.5-Coder-0.5B-Instruct at keep 0.9 and 0.8: whitened, sequential, sequential + fine-tuning, and
Fisher-weighted SVD at the same ranks and with its global budget.

    python tools/qwen_study.py [--finetune-minutes 10]

A second real model for docs/quality.md (a section of its own): 24 layers, hidden 896, intermediate
4864, q/k/v with biases, untied lm_head. MLP targets, ranks aligned to 32; calibration on the Old
Testament, perplexity on two texts: the held-out New Testament and modern English news from another source
(the Lee corpus, tools/assets.modern_text). One fisher calibration pass gathers the statistics
of both methods. Every command is recorded in the page; models already in --work are kept, so an
interrupted study resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import DOMAINS, CommandLog, invocation, write_section  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.9, 0.8])
    parser.add_argument("--calib-samples", type=int, default=32, help="512-token windows for the statistics")
    parser.add_argument("--sequential-samples", type=int, default=8, help="512-token windows for sequential passes")
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--finetune-minutes", type=float, default=10)
    parser.add_argument("--finetune-lr", type=float, default=1e-5,
                        help="1e-4 (finetune's default, right for SmolLM2) makes the distillation loss diverge here")
    parser.add_argument("--work", default="out/qwen")
    parser.add_argument("--out", default="docs/quality.md")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, tokenizer = assets.qwen25_onnx(), assets.qwen25_gguf()
    calibration = assets.kjv_text("calibration")
    run = CommandLog()
    def perplexity(path) -> dict[str, float]:
        return run.two_domain_scores(path, tokenizer, args.eval_windows)

    dense = perplexity(model)
    stats = work / "stats.npz"
    tokens = ["--calib", calibration, "--tokenizer", tokenizer, "--seq-len", "512"]
    run.produce([stats], "rewrite", model, "-o", work / "calibrated.onnx", *tokens, "--calib-samples",
                args.calib_samples, "--method", "fisher", "--save-calib-stats", stats, "--quiet", "--force")
    rows = []
    for keep in args.keeps:
        common = ["--keep", keep, "--align", "32", "--quiet", "--force"]
        whitened, sequential = work / f"whitened-{keep}.onnx", work / f"sequential-{keep}.onnx"
        report = work / f"whitened-{keep}.json"
        run.produce([whitened, report], "rewrite", model, "-o", whitened, "--calib", stats, *common,
                    "--report", report)
        run.produce([sequential], "rewrite", model, "-o", sequential, *tokens, "--calib-samples",
                    args.sequential_samples, "--calib-mode", "sequential", *common)
        tuned = work / f"tuned-{keep}.onnx"
        run.produce([tuned], "finetune", sequential, "-o", tuned, "--text", calibration, "--tokenizer", tokenizer,
                    "--loss", "distill", "--teacher", model, "--time-budget", int(args.finetune_minutes * 60),
                    "--lr", args.finetune_lr, "--batch", "1", "--quiet", "--force")
        fisher, spent = work / f"fisher-{keep}.onnx", work / f"fisher-global-{keep}.onnx"
        for out, budget in ((fisher, "uniform"), (spent, "global")):
            run.produce([out, out.with_suffix(".json")], "rewrite", model, "-o", out, "--calib", stats,
                        "--method", "fisher", "--budget", budget, *common, "--report", out.with_suffix(".json"))
        row = {"keep": keep, "kept": _kept(report), "kept, global": _kept(spent.with_suffix(".json"))}
        for label, path in (("whitened", whitened), ("sequential", sequential), ("sequential + fine-tuning", tuned),
                            ("fisher", fisher), ("fisher, global budget", spent)):
            row[label] = perplexity(path)
        rows.append(row)
        print(row, flush=True)
        write_page(Path(args.out), dense, rows, run.lines, args)  # after every row: a long study shows progress
    return 0


def _kept(report: Path) -> float:
    return json.loads(report.read_text())["totals"]["kept_fraction"]


METHODS = ("whitened", "sequential", "sequential + fine-tuning", "fisher", "fisher, global budget")


def write_page(path: Path, dense: dict[str, float], rows: list[dict], commands: list[str], args) -> None:
    lines = [
        "## A second model: Qwen2.5-Coder-0.5B-Instruct",
        "",
        "Qwen2.5-Coder-0.5B-Instruct ([models.md](models.md): 24 layers, hidden 896, intermediate 4864, q/k/v with",
        "biases, untied lm_head; 630M parameters in fp32), MLPs rewritten, ranks aligned to 32. Statistics from",
        f"{args.calib_samples} Old Testament windows of 512 tokens; sequential calibration runs on "
        f"{args.sequential_samples}",
        f"of them; fine-tuning distils from the dense model for {args.finetune_minutes:g} minutes on the CPU",
        f"(lr {args.finetune_lr:g}). Perplexity on the first {args.eval_windows} windows of 512 tokens of two texts",
        "no step saw: **KJV NT**, the held-out New Testament, and **modern**, English news prose of 2001 from another",
        "source (the Lee corpus, 300 ABC news articles; tools/assets.py); each cell: perplexity, then its increase",
        "over dense on the same text. *fisher* is Fisher-weighted SVD at the whitened model's ranks; *fisher, global",
        "budget* spends the same parameters where the predicted KL is least (its share kept in brackets: alignment",
        "makes it a little lower).",
        "",
        f"**Dense: KJV NT {dense['kjv']:.3f}, modern {dense['modern']:.3f}.**",
        "",
        "| --keep | MLP parameters kept | "
        + " | ".join(f"{m}, {heading}" for m in METHODS for heading in DOMAINS.values()) + " |",
        "|---:|---:|" + "---:|" * (len(METHODS) * len(DOMAINS)),
    ]
    for row in rows:
        cells = [f"{row[m][d]:.3f} ({row[m][d] / dense[d] - 1:+.1%})" for m in METHODS for d in DOMAINS]
        cells[-1] += f" [{row['kept, global']:.1%}]"
        lines.append(f"| {row['keep']} | {row['kept']:.1%} | " + " | ".join(cells) + " |")
    lines += ["", f"Measured on: {machine()}.", "", "### Commands", "",
              f"Generated by `{invocation()}`:", "",
              "```", *commands, "```"]
    write_section(path, "qwen", lines)


if __name__ == "__main__":
    sys.exit(main())
