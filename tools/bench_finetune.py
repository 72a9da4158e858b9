"""Fine-tuning SmolLM2-135M's SVD factors on CPU within 15 minutes and 8 GB (issue 6).

    python tools/bench_finetune.py [--minutes 15] [--loss distill] [--seq-len 256] [--batch 2] [--threads N]

SmolLM2-135M-Instruct with its MLPs rewritten by whitened SVD (--keep 0.8 --align 32, calibrated on the Old
Testament) is fine-tuned on the Old Testament by one `onnx-nmm finetune` child process, whose whole run —
tokenizing, lowering, training, writing, and perplexity on the New Testament before and after — must fit in
--minutes; its training gets that time less --reserve seconds (--time-budget). Reports steps, tokens, wall
time, the child's peak RSS (os.wait4), the loss curve (PNG) and the perplexity before → after, next to the
dense model's (measured separately, outside the budget) and the share of the rewrite's perplexity gap that
fine-tuning won back. The perplexity is held out: the New Testament shares no verse with the Old.
Bars: the run fits the minutes, peak RSS ≤ 8 GiB, perplexity after < before.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog, run_measured  # noqa: E402

MEMORY_BAR_BYTES = 8 * 2**30


def rewritten_smollm2(work: Path, run: CommandLog, model: Path, tokenizer: Path, calibration: Path) -> Path:
    """The whitened keep-0.8 rewrite, made once (the quality study's statistics file when it exists)."""
    path = work / "smollm2-whitened-k0.8.onnx"
    if not path.exists():
        stats = Path("out/quality/smollm2-stats.npz")
        calib = ([stats] if stats.exists() else
                 [calibration, "--tokenizer", tokenizer, "--calib-samples", 64, "--seq-len", 512])
        run.run("rewrite", model, "-o", path, "--keep", 0.8, "--align", 32, "--calib", *calib, "--quiet")
    return path


def finetune(argv: list) -> dict:
    """Run `onnx-nmm finetune ARGV` in a fresh process; its wall time and its own peak RSS."""
    argv = [str(a) for a in argv]
    print("$", shlex.join(["onnx-nmm", "finetune", *argv]), flush=True)
    return run_measured([sys.executable, "-m", "onnx_nmm", "finetune", *argv])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=15.0, help="the whole finetune command's budget")
    parser.add_argument("--reserve", type=float, default=210.0,
                        help="seconds of the budget left for tokenizing, lowering, evaluating and writing")
    parser.add_argument("--loss", choices=("next-token", "distill"), default="distill",
                        help="distill (default): KL to the dense model, which measures recovery of what the rewrite "
                             "lost; next-token also adapts the model to the Bible's language")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, help="PyTorch threads of the child (default: PyTorch's)")
    parser.add_argument("--eval-windows", type=int, default=16, help="New Testament windows of 512 tokens")
    parser.add_argument("--work", default="out/bench/finetune")
    args = parser.parse_args()
    work = Path(args.work)
    model, tokenizer, calibration, evaluation = assets.smollm2_study(work)
    run = CommandLog()
    rewritten = rewritten_smollm2(work, run, model, tokenizer, calibration)
    dense = run.perplexity(model, evaluation, tokenizer, args.eval_windows)

    budget = args.minutes * 60
    report, plot = work / f"finetune-{args.loss}.json", work / f"finetune-{args.loss}.png"
    load_before = os.getloadavg()
    measured = finetune([
        rewritten, "--text", calibration, "--tokenizer", tokenizer, "--seq-len", args.seq_len, "--batch", args.batch,
        "--loss", args.loss, *(["--teacher", model] if args.loss == "distill" else []), "--lr", args.lr,
        "--steps", 100_000, "--time-budget", budget - args.reserve, "--eval-text", evaluation, "--eval-window", 512,
        "--eval-windows", args.eval_windows, *(["--threads", args.threads] if args.threads else []),
        "-o", work / f"smollm2-tuned-{args.loss}.onnx", "--force", "--report", report, "--plot", plot,
    ])
    load_after = os.getloadavg()
    result = json.loads(report.read_text())
    before, after = result["perplexity_before"]["perplexity"], result["perplexity_after"]["perplexity"]

    print(f"\nmachine: {machine()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"(other jobs share the cores)")
    print(f"model: {rewritten} (SmolLM2-135M, MLPs whitened SVD, keep 0.8, align 32); {args.loss} loss, batch "
          f"{args.batch}×{args.seq_len} tokens, lr {args.lr:g}, threads {args.threads or 'default'}")
    print(f"steps {result['steps']} ({result['stopped_by']} budget), tokens {result['tokens']:,}, "
          f"{result['trainable_parameters'] / 1e6:.1f}M factor parameters trained, "
          f"{result['seconds'] / result['steps']:.1f} s per step")
    print(f"wall {measured['wall_s']:.0f} s of {budget:.0f} s; phases: "
          + ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in result["seconds_by_phase"].items()))
    print(f"peak RSS {measured['peak_rss_bytes'] / 2**30:.2f} GiB")
    print(f"{args.loss} loss {result['loss_first_tenth']:.4f} → {result['loss_last_tenth']:.4f} "
          f"(mean of the first and last tenth of the steps); curve: {plot}")
    recovered = (before - after) / (before - dense["perplexity"]) if before != dense["perplexity"] else float("nan")
    print(f"perplexity on the New Testament ({result['perplexity_after']['tokens_scored']} tokens, onnxruntime): "
          f"{before:.3f} → {after:.3f}; dense {dense['perplexity']:.3f}; {recovered:.0%} of the gap won back")
    bars = {
        f"the run fits {args.minutes:g} minutes": measured["wall_s"] <= budget,
        "peak RSS ≤ 8 GiB": measured["peak_rss_bytes"] <= MEMORY_BAR_BYTES,
        "perplexity after < before": after < before,
    }
    for bar, ok in bars.items():
        print(f"{'PASS' if ok else 'FAIL'}  {bar}")
    return 0 if all(bars.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
