"""The main job on an embedded default: export a small Llama with a KV cache, inspect it, rewrite it, diff it
on a prefill and on a decode step.

    make demo            (sets everything up, then runs this)
    python tools/demo.py [--out DIR]

Every step is the real `onnx-nmm` command, printed before it runs, so it can be copied.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/demo", help="folder for the exported and rewritten models")
    args = parser.parse_args()
    out = Path(args.out)
    model = out / "llama-kv.onnx"
    if not model.exists():
        print(f"$ export a random-weight Llama (hidden 512, intermediate 1536, 4 layers, a KV cache) to {model}",
              flush=True)
        from onnx_nmm import TinyShape, build_model, export_causal_lm

        shape = TinyShape(hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=2, vocab=4000)
        export_causal_lm(build_model("llama", shape), model, "dynamo", external_data=True, cache=True)
    rewritten = out / "llama-kv.nmm.onnx"
    steps = [
        ["inspect", model, "--keep", "0.5", "--align", "64"],
        ["rewrite", model, "-o", rewritten, "--keep", "0.5", "--align", "64", "--report", out / "report.json"],
        ["diff", model, rewritten, "--batch", "2", "--seq-len", "64"],
        ["diff", model, rewritten, "--batch", "2", "--past-len", "63", "--seq-len", "1"],
    ]
    for step in steps:
        command = ["onnx-nmm", *map(str, step)]
        print(f"\n$ {shlex.join(command)}", flush=True)
        result = subprocess.run([sys.executable, "-m", "onnx_nmm", *map(str, step)])
        if result.returncode != 0:
            return result.returncode
    print(f"\nThe random weights are not low-rank, so the logits move: a real model is in docs/quality.md. "
          f"Files are in {out}/.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
