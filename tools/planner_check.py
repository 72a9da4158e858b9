"""How good the block planner's choices are, judged by the trace-based cost model.

    python tools/planner_check.py [--jobs 2]

For a few shapes of each kernel (benchmark MLP shapes and shapes with remainders, bf16 and fp32, trn1 and
trn2) it traces (trace-only emulation) every candidate blocking the planner considers that fits SBUF, and
prints for each shape:
- how much longer the planner's choice takes, traced, than the best candidate traced;
- where the choice ranks among the candidates by traced time;
- how far the planner's overlapped-time estimate is from the traced time (the choice, and the worst
  candidate); its per-engine busy times and HBM bytes are equal by construction (see
  tests/kernels/test_planner_agrees_with_trace.py).
Every time is modelled. A full run traces about 1,400 launches: about four minutes on two cores.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor

from onnx_nmm.kernels.pricing.blocking import estimate_plan
from onnx_nmm.kernels.pricing.plan_tracing import fitting_plans, planned, traced_cost

# (kernel, plan_* dimensions, dtype, target)
CASES = [
    ("fused_xuv", (1, 2048, 1280, 8192), "bfloat16", "trn2"),  # Llama-3.2-1B gate, one token
    ("fused_xuv", (512, 2048, 1280, 8192), "bfloat16", "trn1"),
    ("fused_xuv", (2048, 8192, 1280, 2048), "bfloat16", "trn2"),  # Llama-3.2-1B down, a long prompt
    ("fused_xuv", (2048, 576, 256, 1536), "bfloat16", "trn2"),
    ("fused_xuv", (1000, 768, 384, 3000), "bfloat16", "trn1"),  # remainders everywhere
    ("fused_xuv", (300, 1000, 200, 700), "float32", "trn2"),
    ("fused_svd_mlp", (1, 2048, 6144, 1280, 1280, 1280), "bfloat16", "trn2"),  # Qwen3-1.7B MLP, one token
    ("fused_svd_mlp", (128, 2048, 6144, 1280, 1280, 1280), "bfloat16", "trn1"),
    ("fused_svd_mlp", (300, 640, 1000, 200, 256, 136), "float32", "trn2"),
    ("dense_matmul", (128, 2048, 8192), "bfloat16", "trn2"),
    ("dense_matmul", (2048, 8192, 2048), "bfloat16", "trn1"),
    ("dense_matmul", (512, 3072, 8192), "bfloat16", "trn2"),
    ("dense_matmul", (700, 300, 9000), "float32", "trn2"),
    ("dense_matmul_lhsT", (1024, 4096, 4096), "bfloat16", "trn1"),
    ("dense_gated_mlp", (128, 2048, 8192), "bfloat16", "trn2"),  # Llama-3.2-1B's MLP, every sum in PSUM
    ("dense_gated_mlp", (512, 2048, 6144), "bfloat16", "trn1"),  # Qwen3-1.7B's MLP
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="processes tracing candidates (default: 2)")
    args = parser.parse_args()
    print("| kernel | shape | dtype | target | candidates | choice vs best, traced | choice's rank "
          "| estimate vs traced: choice, worst candidate |")
    print("|---|---|---|---|---:|---|---:|---|")
    regrets, errors = [], []
    with ProcessPoolExecutor(args.jobs) as pool:
        for kernel, shape, dtype, target in CASES:
            regret, error = report(pool, kernel, shape, dtype, target)
            regrets.append(regret)
            errors.append(error)
    print(f"\nchoice vs best traced: mean +{sum(regrets) / len(regrets) * 100:.2f} %, "
          f"worst +{max(regrets) * 100:.1f} %; estimate vs traced, worst over every candidate: "
          f"{max(errors, key=abs) * 100:+.1f} % (all modelled)")
    return 0


def report(pool, kernel, shape, dtype, target) -> tuple[float, float]:
    """Print one row; returns (how much slower the choice is than the best candidate, the worst estimate
    error), both as fractions."""
    plans = fitting_plans(kernel, shape, dtype, target)
    traced = dict(zip(map(repr, plans), pool.map(traced_seconds, [(kernel, shape, p, dtype, target) for p in plans])))
    errors = {repr(p): estimate_plan(kernel, shape, p, dtype, target).total_s / traced[repr(p)] - 1 for p in plans}
    chosen = repr(planned(kernel, shape, dtype, target))
    best, mine = min(traced.values()), traced[chosen]
    rank = 1 + sum(seconds < mine for seconds in traced.values())
    worst = max(errors.values(), key=abs)
    print(f"| {kernel} | {shape} | {dtype} | {target} | {len(plans)} | +{(mine / best - 1) * 100:.1f} % "
          f"({mine * 1e6:,.1f} vs {best * 1e6:,.1f} µs) | {rank} | {errors[chosen] * 100:+.1f} %, "
          f"{worst * 100:+.1f} % |", flush=True)
    return mine / best - 1, worst


def traced_seconds(job) -> float:
    kernel, shape, plan, dtype, target = job
    return traced_cost(kernel, shape, plan, dtype, target).total_s


if __name__ == "__main__":
    sys.exit(main())
