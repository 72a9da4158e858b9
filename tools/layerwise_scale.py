"""The layer-wise narrowing on a Llama-3-8B-shaped causal LM (hidden 4096, intermediate 14336, 8 kv heads, vocab
128256; random bf16 weights written to disk layer by layer, a stand-in attention: values made up, for memory and
time only): its --dry-run price against a measured run of a few layers, and the whole model priced from them.

    python tools/layerwise_scale.py [--layers 4] [--windows 8] [--held-out 2] [--window 512]

The rewrite runs as `onnx-nmm rewrite --stream` in a fresh process (its own peak RSS), calibrated on random token
ids (the time and memory are those of any text).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import onnx_nmm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from commands import run_measured  # noqa: E402
from scale_model import LLAMA_3_8B, write_llama_shaped  # noqa: E402

VOCAB = 128256
WHOLE = {"Llama-3-8B": 32}
GB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--windows", type=int, default=8, help="calibration windows")
    parser.add_argument("--held-out", type=int, default=2, help="windows the budget is measured on")
    parser.add_argument("--window", type=int, default=512, help="tokens per window")
    parser.add_argument("--work", default="out/layerwise-scale")
    args = parser.parse_args()
    work = Path(args.work)
    model = work / "model" / "model.onnx"
    if not model.exists():
        write_llama_shaped(model.parent, **LLAMA_3_8B, layers=args.layers, vocab=VOCAB)
    flags = ["--calib", "random", "--calib-samples", args.windows, "--calib-window", args.window, "--calib-mix", 0,
             "--sensitivity-windows", args.held_out]
    options = onnx_nmm.RewriteOptions(calibration=onnx_nmm.CalibrationOptions(
        "random", samples=args.windows, seq_len=args.window, mix_generated=0),
        ranks=onnx_nmm.RankOptions(sensitivity_windows=args.held_out))
    plan = onnx_nmm.plan_layerwise(model, options)
    output, report_file = work / "out" / "model.onnx", work / "report.json"
    report_file.unlink(missing_ok=True)  # the previous run's
    measured = run_measured([sys.executable, "-m", "onnx_nmm", "rewrite", model, "-o", output, "--stream", "--quiet",
                             "--report", report_file, *flags])
    shutil.rmtree(output.parent)
    report = json.loads(report_file.read_text())
    phases = report["seconds"]
    sweeps = sum(1 for prefix, _ in report["quality_budget"].get("evaluations", []) if prefix > 0) or 1
    per_sweep = plan.narrowing_seconds / plan.narrowing_sweeps
    priced = plan.analysis_seconds + sweeps * per_sweep  # the dry run's model at the sweeps this run took
    swept = phases["analysis sweep"] + phases["narrowing sweeps"]
    lines = [f"A Llama-3-8B-shaped causal LM cut to {args.layers} layers (bf16, vocab {VOCAB}), {args.windows} "
             f"calibration windows and {args.held_out} held-out ones of {args.window} tokens, on "
             f"{onnx_nmm.describe_machine()}:",
             "",
             "| | measured | `--dry-run` (modelled) |",
             "|---|---:|---:|",
             f"| analysis sweep | {phases['analysis sweep'] / 60:.1f} min | {plan.analysis_seconds / 60:.1f} min |",
             f"| narrowing sweeps: {sweeps} taken, at most {plan.narrowing_sweeps} | "
             f"{phases['narrowing sweeps'] / 60:.1f} min | {sweeps * per_sweep / 60:.1f} min "
             f"(at most {plan.narrowing_seconds / 60:.1f}) |",
             f"| the sweeps, {args.layers} layers | {swept / 60:.1f} min | {priced / 60:.1f} min "
             f"({priced / swept - 1:+.0%}; at most {plan.seconds / 60:.1f}) |",
             f"| wall time, the process (with reading, calibration windows, writing) | {measured['wall_s'] / 60:.1f} "
             "min | |",
             f"| peak RSS | {measured['peak_rss_bytes'] / GB:.2f} GiB | {plan.peak_bytes / GB:.2f} GiB |",
             f"| peak RSS at the end of each phase | {_marks(report['peak_rss_bytes'])} | |",
             f"| one layer on one window | | {plan.layer_seconds:.2f} s |",
             f"| one layer's onnxruntime session, its weights read | | {plan.session_seconds:.2f} s |",
             f"| one MLP's narrowing maths (I = {LLAMA_3_8B['intermediate']}) | | {plan.maths_seconds:.1f} s |",
             f"| one MLP's refit at one width | | {plan.refit_seconds:.1f} s |",
             f"| the head and its damage on one window | | {plan.head_seconds:.1f} s |",
             "",
             *[f"The whole {name} ({layers} layers), modelled from the same measurements: "
               f"{plan.seconds_for(layers) / 3600:.1f} h with these windows (at most {plan.narrowing_sweeps} "
               "narrowing sweeps)." for name, layers in WHOLE.items()]]
    print("\n".join(lines))


def _marks(peaks: dict[str, int]) -> str:
    """The process's high-water mark at each phase's end: the phase where it rises set the peak."""
    return ", ".join(f"{phase} {peak / GB:.2f} GiB" for phase, peak in peaks.items())


if __name__ == "__main__":
    main()
