"""Rewrite throughput and memory on a Llama-3.2-1B-width model (MLP targets, --keep 0.8).

    python tools/bench_rewrite.py [--layers 4]

Runs `onnx-nmm rewrite` as a child process once per SVD method and reports wall time, seconds per
2048×8192 matrix (from the rewrite report), the child's peak RSS next to the model's weight bytes,
and how much larger the randomized SVD's error is than the exact one's, layer by layer.
Bars (issue 2): ≤ 3 s per 2048×8192 matrix with the randomized SVD; peak RSS below the weight
bytes plus 1 GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import onnx_nmm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import llama_1b_width, machine  # noqa: E402
from commands import run_measured  # noqa: E402


def rewrite(model: Path, method: str, folder: Path) -> dict:
    """Run the CLI in a fresh process; return wall time, peak RSS and the report."""
    output, report = folder / f"{method}.onnx", folder / f"{method}.json"
    command = [sys.executable, "-m", "onnx_nmm", "rewrite", str(model), "-o", str(output), "--keep", "0.8",
               "--svd", method, "--report", str(report), "--quiet"]
    return {**run_measured(command), "report": json.loads(report.read_text())}


def weight_bytes(model: Path) -> int:
    """Bytes of the model's own external-data file (the folder also holds other benchmarks' outputs)."""
    return onnx_nmm.external_data_path(model).stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model = llama_1b_width(layers=args.layers)
    weights = weight_bytes(model)
    results = {}
    with tempfile.TemporaryDirectory(dir=model.parent) as folder:
        for method in ("exact", "randomized"):
            results[method] = rewrite(model, method, Path(folder))
    print(f"\nmachine: {machine()}")
    print(f"model: {model} ({args.layers} layers, weights {weights / 2**30:.2f} GiB in external data), "
          f"targets mlp, keep 0.8 → rank 1280 for every 2048×8192 matrix")
    print(f"{'svd':<11} {'wall s':>7} {'s/matrix (median)':>18} {'peak RSS GiB':>13} {'weights+1GB GiB':>16}")
    for method, result in results.items():
        layers = [layer for layer in result["report"]["layers"] if layer["status"] == "factorized"]
        per_matrix = statistics.median(layer["seconds"] for layer in layers)
        result["median_s_per_matrix"] = per_matrix
        print(f"{method:<11} {result['wall_s']:7.1f} {per_matrix:18.2f} {result['peak_rss_bytes'] / 2**30:13.2f} "
              f"{(weights + 2**30) / 2**30:16.2f}")
    exact = {layer["name"]: layer["relative_error"] for layer in results["exact"]["report"]["layers"]
             if layer["status"] == "factorized"}
    extra = [layer["relative_error"] / exact[layer["name"]] - 1 for layer in results["randomized"]["report"]["layers"]
             if layer["status"] == "factorized"]
    print(f"randomized SVD error above exact: median {statistics.median(extra):+.2%}, max {max(extra):+.2%} "
          f"(relative Frobenius error of W, over {len(extra)} matrices)")
    randomized = results["randomized"]
    bars = {
        "randomized ≤ 3 s per matrix": randomized["median_s_per_matrix"] <= 3.0,
        "peak RSS < weights + 1 GB": all(r["peak_rss_bytes"] < weights + 2**30 for r in results.values()),
    }
    for bar, ok in bars.items():
        print(f"{'PASS' if ok else 'FAIL'}  {bar}")
    return 0 if all(bars.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
