"""Calibrated rewrite of SmolLM2-135M: time and memory, split by phase.

    python tools/bench_calibration.py [--samples 256] [--seq-len 512]

Runs `onnx-nmm rewrite --calib` (whitened SVD of the MLPs, keep 0.8, align 32) in a child process on
the Old Testament part of the KJV, and reports the wall time, the child's peak RSS and the split
between calibration (onnxruntime + XᵀX), factorization and writing, from the rewrite report.
Bar (issue 4): 256 sequences × 512 tokens in under 5 minutes, peak RSS under 4 GB.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import run_measured  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    model, tokenizer, text = assets.smollm2_onnx(), assets.smollm2_gguf(), assets.kjv_text("calibration")
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        command = [sys.executable, "-m", "onnx_nmm", "rewrite", str(model), "-o", str(Path(folder) / "out.onnx"),
                   "--keep", "0.8", "--align", "32", "--calib", str(text), "--tokenizer", str(tokenizer),
                   "--calib-samples", str(args.samples), "--seq-len", str(args.seq_len), "--report", str(report),
                   "--quiet"]
        measured = run_measured(command)
        data = json.loads(report.read_text())
    wall, rss = measured["wall_s"], measured["peak_rss_bytes"]
    seconds = data["seconds"]
    print(f"machine: {machine()}")
    print(f"SmolLM2-135M-Instruct, MLP targets, whitened SVD, keep 0.8, align 32; calibration: {data['calibration']}")
    print(f"wall {wall:.1f} s (calibration {seconds['calibration']:.1f} s, "
          f"factorization {seconds['factorization']:.1f} s, "
          f"writing {seconds['writing']:.1f} s, start-up and the rest {wall - sum(seconds.values()):.1f} s); "
          f"peak RSS {rss / 2**30:.2f} GiB")
    bars = {"under 5 minutes": wall < 300, "peak RSS under 4 GB": rss < 4e9}
    for bar, ok in bars.items():
        print(f"{'PASS' if ok else 'FAIL'}  {bar}")
    return 0 if all(bars.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
