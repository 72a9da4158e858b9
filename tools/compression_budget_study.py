"""How much of SmolLM2's MLPs can go within +10 % perplexity on held-out text, and what each step adds.

    python tools/compression_budget_study.py [--budgets 0.05 0.2] [--keeps 0.9] [--finetune-minutes 15]

Every model is scored on the held-out New Testament; the best parameter reduction whose perplexity stays
within +10 % of the dense model's is reported for each method. Two ways to choose where to compress, both
measuring each MLP matrix's sensitivity on Old Testament calibration windows:

    rewrite --max-ppl-increase P           as many parameters as a selection budget P allows
    rewrite --keep K --budget sensitivity  a fixed reduction (1 − K), taken where it costs least

each as whitened (independent calibration) and sequential (error-aware factors refitted at the ranks the
whitened selection chose, `--ranks-from` its report). At each K both models are then fine-tuned for the
same time with both losses of `finetune`: distillation against the dense model, and next-token on the
calibration text. Next-token fine-tuning also adapts the model to the text's style, which the held-out part
shares, so the study fine-tunes a full-rank rewrite (the dense model's own MLPs) the same way and reports
it: the dense model given that recipe.
Every command is recorded in the page (a section of docs/quality.md). Models already in --work are kept,
so an interrupted study resumes; delete the folder to start afresh.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog, write_section  # noqa: E402

TOLERANCE = 0.10  # held-out perplexity increase allowed
BAR = 0.10  # fraction of the MLP parameters that must go within it, with everything on (issue 6)
LOSSES = {"distillation": "distill", "next-token": "next-token"}  # the study's name: finetune's --loss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.05, 0.2])
    parser.add_argument("--keeps", type=float, nargs="*", default=[0.9])
    parser.add_argument("--stats", default="out/quality/smollm2-stats.npz", help="XᵀX statistics (quality_sweep.py)")
    parser.add_argument("--calib-samples", type=int, default=8, help="windows of 512 tokens for sequential passes")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--finetune-minutes", type=float, default=15)
    parser.add_argument("--work", default="out/budget")
    parser.add_argument("--out", default="docs/quality.md")
    args = parser.parse_args()
    work = Path(args.work)
    model, tokenizer, calibration, evaluation = assets.smollm2_study(work)
    run = CommandLog()
    def perplexity(path) -> float:
        return run.perplexity(path, evaluation, tokenizer, args.eval_windows)["perplexity"]

    def finetune(rewritten: Path, loss: str) -> Path:
        tuned = work / f"{rewritten.stem}-{loss}-{args.finetune_minutes:g}min.onnx"
        run.produce([tuned], "finetune", rewritten, "-o", tuned, "--text", calibration, "--tokenizer", tokenizer,
                    "--loss", LOSSES[loss], *(["--teacher", model] if loss == "distillation" else []),
                    "--time-budget", int(args.finetune_minutes * 60), "--quiet", "--force")
        return tuned

    dense = perplexity(model)
    calib = ["--calib", calibration, "--tokenizer", tokenizer, "--calib-samples", args.calib_samples, "--seq-len", "512",
             "--align", "32"]
    choices = ([(f"--max-ppl-increase {budget}", f"{budget}", ["--max-ppl-increase", budget]) for budget in args.budgets]
               + [(f"--keep {keep} --budget sensitivity", f"keep-{keep}", ["--keep", keep, "--budget", "sensitivity"])
                  for keep in args.keeps])
    rows = []
    for chosen_by, tag, flags in choices:
        chosen = work / f"whitened-{tag}.json"  # the sequential rewrite refits the ranks this selection chose
        for method, extra in (("whitened", ["--calib-stats", args.stats, "--sensitivity-windows", "2", *flags]),
                              ("sequential", ["--calib-mode", "sequential", "--ranks-from", chosen])):
            out, report = work / f"{method}-{tag}.onnx", work / f"{method}-{tag}.json"
            run.produce([out, report], "rewrite", model, "-o", out, *calib, *extra, "--report", report,
                        "--quiet", "--force")
            rows.append((method, chosen_by, _kept(report), perplexity(out)))
            print(rows[-1], flush=True)
        if "--keep" in flags:
            kept = rows[-1][2]
            for method, loss in itertools.product(("sequential", "whitened"), LOSSES):
                tuned = finetune(work / f"{method}-{tag}.onnx", loss)
                rows.append((f"{method} + {loss} fine-tuning", chosen_by, kept, perplexity(tuned)))
                print(rows[-1], flush=True)
    control = None
    if args.keeps:
        full_rank = work / "full-rank.onnx"
        run.produce([full_rank], "rewrite", model, "-o", full_rank, "--calib", args.stats, "--rank", "full",
                    "--quiet", "--force")
        control = perplexity(finetune(full_rank, "next-token"))
    write_page(Path(args.out), dense, control, rows, run.lines, args)
    return 0


def _kept(report: Path) -> float:
    import json

    return json.loads(report.read_text())["totals"]["kept_fraction"]


def write_page(path: Path, dense: float, control: float | None, rows, commands, args) -> None:
    lines = [
        "## Choosing where to compress: the best reduction within +10 % perplexity",
        "",
        f"Dense perplexity on the held-out New Testament ({args.eval_windows} windows of 512 tokens): **{dense:.3f}**;",
        f"the bar is {dense * (1 + TOLERANCE):.3f} (+{TOLERANCE:.0%}). Each model's layers and ranks are chosen by",
        "measuring every MLP matrix's sensitivity on two Old Testament windows (ranks aligned to 32), either",
        "within a selection budget (`--max-ppl-increase P`: as many parameters as +P on those windows allows) or",
        "for a fixed reduction (`--keep K --budget sensitivity`). *Removed* is the fraction of the MLP parameters",
        f"(79.6M) the model no longer has. Fine-tuning: {args.finetune_minutes:g} minutes on the CPU from the sequential",
        "or the whitened model, only the factors trained, on Old Testament windows (2 × 256 tokens a step, lr",
        "1e-4): distillation against the dense model's logits, or next-token loss on the text.",
        "",
        "| method | chosen by | MLP parameters removed | held-out perplexity | increase | within +10 % |",
        "|---|---|---:|---:|---:|:---:|",
    ]
    best = {}
    for method, chosen_by, kept, ppl in rows:
        ok = ppl <= dense * (1 + TOLERANCE)
        lines.append(f"| {method} | `{chosen_by}` | {1 - kept:.2%} | {ppl:.3f} | {ppl / dense - 1:+.1%} | "
                     f"{'yes' if ok else 'no'} |")
        family = method.split(" + ")[0] + (" + fine-tuning" if "fine-tuning" in method else "")
        if ok and 1 - kept > best.get(family, -1.0):
            best[family] = 1 - kept
    for method in ("whitened", "sequential"):  # a model within the bar needs no fine-tuning to count
        if method in best:
            best[f"{method} + fine-tuning"] = max(best[method], best.get(f"{method} + fine-tuning", -1.0))
    lines += ["", "Best reduction of the MLP parameters within +10 % held-out perplexity:", ""]
    for method in ("whitened", "sequential", "sequential + fine-tuning", "whitened + fine-tuning"):
        lines.append(f"- {method}: **{best[method]:.2%}**" if method in best else f"- {method}: none of the models tried")
    met = max(best.get("sequential + fine-tuning", 0.0), best.get("whitened + fine-tuning", 0.0)) >= BAR
    lines += ["", f"The bar — with everything on, at least {BAR:.0%} of the MLP parameters removed within +10 % — is "
              f"**{'met' if met else 'not met'}**."]
    if control is not None:
        lines += ["", f"The dense model given the same {args.finetune_minutes:g} minutes of next-token fine-tuning (a "
                  f"full-rank rewrite, so the same factors train): **{control:.3f}** ({control / dense - 1:+.1%}). "
                  "Next-token fine-tuning also teaches the model the style of the text, which the held-out part "
                  "shares; measured against this adapted dense model instead, the next-token rows above are:",
                  ""]
        lines += [f"- {method} (`{chosen_by}`): {ppl / control - 1:+.1%}" for method, chosen_by, _, ppl in rows
                  if "next-token" in method]
    lines += ["", f"Measured on: {machine()}.", "", "### Commands", "",
              f"Generated by `{shlex.join(['python', 'tools/compression_budget_study.py', *sys.argv[1:]])}`:",
              "", "```", *commands, "```"]
    write_section(path, "budget-study", lines)


if __name__ == "__main__":
    sys.exit(main())
