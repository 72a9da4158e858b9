"""A streamed rewrite of a Llama-3-8B-shaped model (hidden 4096, intermediate 14336, 8 kv heads; random bf16
weights written to disk layer by layer), serial and on a local Ray cluster, and the modelled time of a
Llama-3-70B rewrite on 1, 4 and 16 machines from the measured per-matrix time.

    python tools/bench_scale.py [--layers 20] [--include 'layers\\.(0|1)\\.'] [--threads 1]

Each rewrite runs `onnx-nmm rewrite --stream` (then with `--ray`) as a child process, at keep 0.8 on the MLPs the
--include regex selects, every factorization with --threads BLAS threads (the same in both runs, so the factors
are byte-identical). Reported: wall time, seconds per 4096×14336 matrix (median, from the report), the child's
peak RSS (the driver's: Ray workers are other processes), and whether the two outputs hash the same.
The outputs are deleted once hashed (each holds the model's dense weights: as large as the input).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import onnx_nmm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from commands import run_measured  # noqa: E402
from scale_model import LLAMA_3_8B, write_llama_shaped  # noqa: E402

# Llama-3-70B: 80 layers, hidden 8192, intermediate 28672, 8 kv heads of 128.
LLAMA_3_70B = {"layers": 80, "hidden": 8192, "intermediate": 28672, "kv": 1024}
MACHINES = (1, 4, 16)


def rewrite(model: Path, output: Path, include: str, threads: int, ray: bool) -> dict:
    """Run the CLI in a fresh process; wall time, its peak RSS, the report and the outputs' hashes."""
    report = output.with_suffix(".json")
    command = [sys.executable, "-m", "onnx_nmm", "rewrite", str(model), "-o", str(output), "--keep", "0.8",
               "--include", include, "--stream", "--threads", str(threads), "--report", str(report), "--quiet",
               *(["--ray"] if ray else [])]
    measured = run_measured(command)
    hashes = {path.name: _sha256(path) for path in (output, onnx_nmm.external_data_path(output))}
    result = {**measured, "hashes": hashes, "report": json.loads(report.read_text())}
    shutil.rmtree(output.parent)
    return result


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def per_matrix(result: dict) -> list[float]:
    return [layer["seconds"] for layer in result["report"]["layers"] if layer["status"] == "factorized"]


def modelled_70b(seconds_per_8b_matrix: float, cores: int) -> dict[str, dict[int, float]]:
    """Hours to factorize Llama-3-70B's MLP (240 matrices of 8192×28672) and every linear layer (560), with one
    single-threaded task per core of `cores`-core machines, from the measured single-thread 4096×14336 time
    scaled by K·N·min(K,N)."""
    def cost(k, n):
        return seconds_per_8b_matrix * (k * n * min(k, n)) / (4096 * 14336 * 4096)

    h, i, kv, layers = (LLAMA_3_70B[key] for key in ("hidden", "intermediate", "kv", "layers"))
    mlp = [cost(h, i)] * (3 * layers)
    every = mlp + [cost(h, h)] * (2 * layers) + [cost(h, kv)] * (2 * layers)
    return {name: {machines: _greedy(tasks, machines * cores) / 3600 for machines in MACHINES}
            for name, tasks in (("mlp", mlp), ("all", every))}


def _greedy(tasks: list[float], workers: int) -> float:
    loads = [0.0] * workers
    for task in sorted(tasks, reverse=True):
        loads[loads.index(min(loads))] += task
    return max(loads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--include", default=r"layers\.(0|1)\.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--folder", type=Path, default=Path("out/bench/llama3-8b-shape"))
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("out/bench/scale.json"))
    args = parser.parse_args()
    model = args.folder / f"{args.layers}l" / "model.onnx"
    if not model.exists():
        print(f"writing a {args.layers}-layer Llama-3-8B-shaped model to {model} ...", flush=True)
        start = time.perf_counter()
        write_llama_shaped(model.parent, **LLAMA_3_8B, layers=args.layers)
        print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    weights = onnx_nmm.external_data_path(model).stat().st_size
    results = {"serial": rewrite(model, args.folder / "serial" / "model.nmm.onnx", args.include, args.threads, False)}
    if not args.no_ray:
        results["ray"] = rewrite(model, args.folder / "ray" / "model.nmm.onnx", args.include, args.threads, True)
    serial_seconds = per_matrix(results["serial"])
    summary = {
        "machine": onnx_nmm.describe_machine(), "layers": args.layers, "weight_bytes": weights,
        "weight_bytes_fp32": weights * 2, "include": args.include, "threads": args.threads,
        "runs": {name: {"wall_s": r["wall_s"], "peak_rss_bytes": r["peak_rss_bytes"], "seconds": per_matrix(r),
                        "hashes": r["hashes"]} for name, r in results.items()},
        "median_s_per_matrix": statistics.median(serial_seconds),
        "identical": len({json.dumps(r["hashes"], sort_keys=True) for r in results.values()}) == 1,
    }
    summary["modelled_70b_hours"] = modelled_70b(summary["median_s_per_matrix"], os.cpu_count() or 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    print(f"\nmachine: {summary['machine']}")
    print(f"model: {model}, {args.layers} layers, {weights / 2**30:.2f} GiB of bf16 external data "
          f"({2 * weights / 2**30:.1f} GiB at fp32); targets: MLP matrices matching {args.include}, keep 0.8")
    print(f"{'run':<7} {'wall s':>7} {'matrices':>8} {'s/matrix median':>16} {'min':>6} {'max':>6} "
          f"{'peak RSS GiB':>13}")
    for name, run in summary["runs"].items():
        s = run["seconds"]
        print(f"{name:<7} {run['wall_s']:7.0f} {len(s):8d} {statistics.median(s):16.1f} {min(s):6.1f} {max(s):6.1f} "
              f"{run['peak_rss_bytes'] / 2**30:13.2f}")
    if not args.no_ray:
        print(f"serial and Ray outputs byte-identical (model and external data): {summary['identical']}")
    print(f"\nLlama-3-70B, modelled from {summary['median_s_per_matrix']:.1f} s per 4096×14336 matrix at "
          f"{args.threads} thread(s), × K·N·min(K,N); one task per core, {os.cpu_count()} cores per machine:")
    for name, hours in summary["modelled_70b_hours"].items():
        print(f"  {'MLP (240 matrices)' if name == 'mlp' else 'all 560 linear layers':<22} "
              + "  ".join(f"{machines} machine(s): {h:6.1f} h" for machines, h in hours.items()))
    ok = summary["identical"] and results["serial"]["peak_rss_bytes"] <= 3 * 2**30
    print(f"{'PASS' if ok else 'FAIL'}  peak RSS ≤ 3 GiB and serial = Ray")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
