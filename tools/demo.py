"""The main job on an embedded default: a real LLM (SmolLM2-135M-Instruct, from PyPI) exported with a KV cache,
its MLPs narrowed where it costs least, then what that cost and what it bought — the answers before and after,
the perplexity on text no step saw, and the decode speed on this machine — ending with those three figures.

    make demo            (sets everything up, then runs this)
    python tools/demo.py [--out DIR] [--keep 0.97]

Every step is the real `onnx-nmm` command, printed before it runs, so it can be copied. `--tiny` runs the same
steps on a random-weight Llama instead (seconds, no real model: a smoke test, whose logits move by design).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402

PROMPTS = ("What is the capital of France?", "Why is the sky blue?")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/demo", help="folder for the exported and rewritten models")
    parser.add_argument("--keep", default="0.97", help="the share of the MLP parameters to keep (default 0.97)")
    parser.add_argument("--tiny", action="store_true", help="a random-weight Llama instead: a smoke test")
    args = parser.parse_args()
    out = Path(args.out)
    return tiny(out) if args.tiny else real(out, args.keep)


def real(out: Path, keep: str) -> int:
    start = time.monotonic()
    steps = real_steps(out, keep, assets.smollm2_gguf(), assets.kjv_text("calibration"), assets.modern_text())
    for step in steps:
        if run(step, out / f"{step[0]}.json" if "--json" in step else None) != 0:
            return 1
        if step[0] == "diff":
            print(perplexity_line(json.loads((out / "diff.json").read_text())))
    reports = {name: json.loads((out / f"{name}.json").read_text()) for name in ("rewrite", "diff", "bench")}
    print(f"\nThe held-out text is modern news, which no step saw; the calibration was the Old Testament. Files are "
          f"in {out}/. docs/quality.md has the operating points, docs/speed.md their speed. The demo took "
          f"{(time.monotonic() - start) / 60:.1f} minutes.\n")
    print("\n".join(summary(reports["rewrite"], reports["diff"], reports["bench"])))
    return 0


def real_steps(out: Path, keep: str, gguf: Path, calibration: Path, held_out: Path) -> list[list]:
    """The `onnx-nmm` commands of the demo, the export only when its model is not there yet. Each measures less
    than a study would (a few short windows), to take minutes: the figures it ends with are what it measured."""
    model, rewritten = out / "smollm2.onnx", out / "smollm2.nmm.onnx"
    steps = [] if model.exists() else [["export", gguf, "-o", model]]
    return steps + [
        # the MLPs, narrowed where a held-out calibration window says it costs least
        ["rewrite", model, "-o", rewritten, "--calib", calibration, "--calib-samples", "16", "--calib-window", "128",
         "--sensitivity-windows", "1", "--tokenizer", gguf, "--keep", keep, "--budget", "sensitivity",
         "--align", "64", "--report", out / "rewrite.json", "--force"],
        *(["generate", path, "--tokenizer", gguf, "--prompt", prompt, "--max-new-tokens", "24"]
          for prompt in PROMPTS for path in (model, rewritten)),
        ["diff", model, rewritten, "--text", held_out, "--tokenizer", gguf, "--max-windows", "4", "--json"],
        ["bench", model, rewritten, "--prompt-lengths", "64", "--contexts", "128", "--steps", "8",
         "--time-budget", "45", "--report", out / "bench.json", "--force"],
    ]


def perplexity_line(diff: dict) -> str:
    """What `diff --text --json` measured, as one line."""
    before, after = diff["reference"], diff["candidate"]
    return (f"perplexity {before['perplexity']:.2f} → {after['perplexity']:.2f} "
            f"({after['perplexity'] / before['perplexity'] - 1:+.1%}) on {before['windows']} windows "
            f"({before['tokens_scored']:,} tokens scored); next-token top-1 agreement {diff['top1_agreement']:.1%}, "
            f"mean KL {diff['mean_kl']:.3f} nats")


def summary(rewrite: dict, diff: dict, bench: dict) -> list[str]:
    """The demo's last three lines, from the reports of its rewrite, diff and bench: what was removed, what it
    cost on held-out text, and what it bought in decode speed (or that the measurement could not tell)."""
    totals = rewrite["totals"]
    removed = totals["parameters_before"] - totals["parameters_after"]
    before, after = diff["reference"]["perplexity"], diff["candidate"]["perplexity"]
    rewritten = bench["models"][1]
    context, speedup = next(iter(rewritten["decode_speedup_interval"].items()))
    interval = (f"{bench['confidence']:.0%} interval {speedup['interval'][0]:.3f}–{speedup['interval'][1]:.3f}×"
                if speedup["interval"] else "no interval")
    return [
        f"parameters removed: {removed / 1e6:.1f} M of the MLPs' {totals['parameters_before'] / 1e6:.1f} M "
        f"({removed / totals['parameters_before']:.1%}); weights {totals['weight_bytes_before'] / 1e6:.1f} MB → "
        f"{totals['weight_bytes_after'] / 1e6:.1f} MB",
        f"perplexity on held-out text ({diff['reference']['tokens_scored']:,} tokens): {before:.2f} before, "
        f"{after:.2f} after ({after / before - 1:+.1%})",
        f"decode speed after {context} tokens: {speedup['median']:.2f}× ({interval}), {speedup['verdict']}; the "
        f"bytes a step reads allow {rewritten['ideal_decode_speedup'][context]:.2f}×",
    ]


def tiny(out: Path) -> int:
    model, rewritten = out / "llama-kv.onnx", out / "llama-kv.nmm.onnx"
    if not model.exists():
        print(f"$ export a random-weight Llama (hidden 512, intermediate 1536, 4 layers, a KV cache) to {model}",
              flush=True)
        from onnx_nmm import TinyShape, build_model, export_causal_lm

        shape = TinyShape(hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=2, vocab=4000)
        export_causal_lm(build_model("llama", shape), model, "dynamo", external_data=True, cache=True)
    steps = [
        ["inspect", model, "--keep", "0.5", "--align", "64"],
        ["rewrite", model, "-o", rewritten, "--keep", "0.5", "--align", "64", "--report", out / "report.json",
         "--force"],
        ["diff", model, rewritten, "--batch", "2", "--tokens", "64"],
        ["diff", model, rewritten, "--batch", "2", "--past-len", "63", "--tokens", "1"],
        ["bench", model, rewritten, "--prompt-lengths", "16", "--contexts", "64", "--steps", "4", "--time-budget", "5"],
    ]
    if not all(run(step) == 0 for step in steps):
        return 1
    print(f"\nRandom weights are not low-rank, so the logits move: `make demo` shows a real model. "
          f"Files are in {out}/.")
    return 0


def run(step: list, json_into: Path | None = None) -> int:
    """Run `onnx-nmm STEP`, printed first; with `json_into`, the JSON it prints goes to that file instead."""
    command = ["onnx-nmm", *map(str, step)]
    print(f"\n$ {shlex.join(command)}" + (f" > {json_into}" if json_into else ""), flush=True)
    argv = [sys.executable, "-m", "onnx_nmm", *map(str, step)]
    if json_into is None:
        return subprocess.run(argv).returncode
    with json_into.open("w") as stdout:
        return subprocess.run(argv, stdout=stdout).returncode


if __name__ == "__main__":
    sys.exit(main())
