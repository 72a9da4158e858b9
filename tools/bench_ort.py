"""onnxruntime CPU speed of rewritten models, on a Llama-3.2-1B-width model (MLP targets).

    python tools/bench_ort.py [--layers 4] [--repeats 7]

Variants, all run in one process, alternating every round, medians reported:
  dense             the original export
  keep K            the rewrite (SvdMatMul calls with model-local function bodies)
  keep K, inlined   the same factors written as two plain MatMuls (functions inlined by onnx.inliner)
Bars (issue 2): the function wrapping costs nothing (within 5 % of the inlined model); the speed-up
over dense at keep 0.8 and 0.5, for 1 and 512 tokens, is reported.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import llama_1b_width, machine  # noqa: E402


def rewritten(model: Path, keep: float) -> Path:
    path = model.with_name(f"keep{keep}.onnx")
    if not path.exists():
        subprocess.run([sys.executable, "-m", "onnx_nmm", "rewrite", str(model), "-o", str(path), "--keep", str(keep),
                        "--quiet"], check=True)
    return path


def inlined(path: Path) -> Path:
    """The model with every local function expanded into its body: plain MatMuls."""
    target = path.with_name(path.stem + ".inlined.onnx")
    if not target.exists():
        model = onnx.inliner.inline_local_functions(onnx.load(str(path)))
        onnx.save(model, str(target), save_as_external_data=True, location=target.name + ".data")
    return target


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 512])
    args = parser.parse_args()
    model = llama_1b_width(layers=args.layers)
    variants = {"dense": model}
    for keep in (0.8, 0.5):
        variants[f"keep {keep}"] = rewritten(model, keep)
        variants[f"keep {keep}, inlined"] = inlined(variants[f"keep {keep}"])
    sessions = {name: session(path) for name, path in variants.items()}
    rng = np.random.default_rng(0)
    print(f"machine: {machine()}; onnxruntime {ort.__version__}, CPUExecutionProvider, default threads")
    print(f"model: {model} ({args.layers} layers of Llama-3.2-1B width, MLP targets), batch 1, "
          f"median of {args.repeats} alternating rounds")
    ok = True
    for tokens in args.tokens:
        feeds = {"input_ids": rng.integers(0, 32000, (1, tokens), dtype=np.int64),
                 "attention_mask": np.ones((1, tokens), np.int64)}
        for runner in sessions.values():
            runner.run(None, feeds)  # warm-up
        times = {name: [] for name in sessions}
        for _ in range(args.repeats):
            for name, runner in sessions.items():
                start = time.perf_counter()
                runner.run(None, feeds)
                times[name].append(time.perf_counter() - start)
        median = {name: statistics.median(values) for name, values in times.items()}
        print(f"\n{tokens} token(s)")
        print(f"  {'variant':<20} {'median ms':>10} {'vs dense':>9} {'function vs inlined':>20}")
        for name, value in median.items():
            versus_inlined = ""
            if name.startswith("keep") and not name.endswith("inlined"):
                ratio = value / median[f"{name}, inlined"]
                versus_inlined = f"{ratio - 1:+.1%}"
                ok &= ratio <= 1.05
            print(f"  {name:<20} {value * 1e3:10.2f} {median['dense'] / value:8.2f}× {versus_inlined:>20}")
    print(f"\n{'PASS' if ok else 'FAIL'}  function wrapping within 5 % of the inlined model")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
