"""The main job on an embedded default: a real LLM (SmolLM2-135M-Instruct, from PyPI) exported with a KV cache,
its MLPs narrowed where it costs least, then what that cost and what it bought — the answers before and after,
the perplexity on text no step saw, and the decode speed on this machine.

    make demo            (sets everything up, then runs this)
    python tools/demo.py [--out DIR] [--keep 0.97]

Every step is the real `onnx-nmm` command, printed before it runs, so it can be copied. `--tiny` runs the same
steps on a random-weight Llama instead (seconds, no real model: a smoke test, whose logits move by design).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
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
    steps = real_steps(out, keep, assets.smollm2_gguf(), assets.kjv_text("calibration"), assets.modern_text())
    if not all(run(step) == 0 for step in steps):
        return 1
    print(f"\nThe held-out text is modern news, which neither step saw; the calibration was the Old Testament. "
          f"Files are in {out}/. docs/quality.md has the operating points, docs/speed.md their speed.")
    return 0


def real_steps(out: Path, keep: str, gguf: Path, calibration: Path, held_out: Path) -> list[list]:
    """The `onnx-nmm` commands of the demo, the export only when its model is not there yet."""
    model, rewritten = out / "smollm2.onnx", out / "smollm2.nmm.onnx"
    steps = [] if model.exists() else [["export", gguf, "-o", model]]
    return steps + [
        # the MLPs, narrowed where held-out calibration windows say it costs least
        ["rewrite", model, "-o", rewritten, "--calib", calibration, "--calib-samples", "16", "--tokenizer", gguf,
         "--keep", keep, "--budget", "sensitivity", "--align", "64", "--force"],
        *(["generate", path, "--tokenizer", gguf, "--prompt", prompt, "--max-new-tokens", "24"]
          for prompt in PROMPTS for path in (model, rewritten)),
        ["diff", model, rewritten, "--text", held_out, "--tokenizer", gguf, "--max-windows", "4"],
        ["bench", model, rewritten, "--prompt-lengths", "64", "--contexts", "128", "--rounds", "3"],
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
        ["diff", model, rewritten, "--batch", "2", "--seq-len", "64"],
        ["diff", model, rewritten, "--batch", "2", "--past-len", "63", "--seq-len", "1"],
    ]
    if not all(run(step) == 0 for step in steps):
        return 1
    print(f"\nRandom weights are not low-rank, so the logits move: `make demo` shows a real model. "
          f"Files are in {out}/.")
    return 0


def run(step: list) -> int:
    command = ["onnx-nmm", *map(str, step)]
    print(f"\n$ {shlex.join(command)}", flush=True)
    return subprocess.run([sys.executable, "-m", "onnx_nmm", *map(str, step)]).returncode


if __name__ == "__main__":
    sys.exit(main())
