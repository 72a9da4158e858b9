"""The block planner's plans, run: each kernel by the name the planner gives it, its arguments from the
planner's dimensions, and the trace-based modelled cost of the kernel run with a given plan. What
tests/kernels/test_planner_agrees_with_trace.py and tools/planner_check.py compare the planner against."""

from __future__ import annotations

from onnx_nmm.kernels.bench.runner import estimate
from onnx_nmm.kernels.nki_kernels.dense_matmul import dense_matmul, dense_matmul_lhsT
from onnx_nmm.kernels.nki_kernels.dense_mlp import dense_gated_mlp, dense_ungated_mlp
from onnx_nmm.kernels.nki_kernels.fused_mlp import fused_svd_mlp, fused_svd_ungated_mlp
from onnx_nmm.kernels.nki_kernels.fused_xuv import fused_xuv
from onnx_nmm.kernels.pricing.blocking import (
    SBUF_RESERVE_BYTES,
    candidate_plans,
    estimate_plan,
    plan_dense,
    plan_dense_mlp,
    plan_mlp,
    plan_ungated_mlp,
    plan_xuv,
)
from onnx_nmm.kernels.pricing.cost_model import KernelCost
from onnx_nmm.kernels.pricing.hardware import neuron_core

KERNEL_FUNCTIONS = {"dense_matmul": dense_matmul, "dense_matmul_lhsT": dense_matmul_lhsT, "fused_xuv": fused_xuv,
                    "fused_svd_mlp": fused_svd_mlp, "fused_svd_ungated_mlp": fused_svd_ungated_mlp,
                    "dense_gated_mlp": dense_gated_mlp, "dense_ungated_mlp": dense_ungated_mlp}


def planned(kernel, shape, dtype, target):
    """The plan the planner chooses for `kernel` on `shape` (the dimensions plan_* takes)."""
    if kernel == "fused_xuv":
        return plan_xuv(*shape, dtype, target=target)
    if kernel == "fused_svd_mlp":
        return plan_mlp(*shape, dtype, target=target)
    if kernel == "fused_svd_ungated_mlp":
        return plan_ungated_mlp(*shape, dtype, target=target)
    if kernel in ("dense_gated_mlp", "dense_ungated_mlp"):
        return plan_dense_mlp(*shape, kernel == "dense_gated_mlp", dtype, target=target)
    return plan_dense(*shape, dtype, transposed_input=kernel == "dense_matmul_lhsT", target=target)


def fitting_plans(kernel, shape, dtype, target):
    """Every candidate plan whose estimated SBUF use fits the target."""
    budget = neuron_core(target).sbuf_partition_bytes - SBUF_RESERVE_BYTES
    return [plan for plan in candidate_plans(kernel, shape)
            if estimate_plan(kernel, shape, plan, dtype, target).sbuf_bytes <= budget]


def argument_shapes(kernel, shape):
    """The kernel's argument shapes for the planner's dimensions."""
    if kernel == "fused_xuv":
        M, K, rank, N = shape
        return (M, K), (K, rank), (rank, N)
    if kernel == "fused_svd_mlp":
        M, H, intermediate, rank_gate, rank_up, rank_down = shape
        return ((M, H), (H, rank_gate), (rank_gate, intermediate), (H, rank_up), (rank_up, intermediate),
                (intermediate, rank_down), (rank_down, H))
    if kernel == "fused_svd_ungated_mlp":
        M, H, intermediate, rank_1, rank_2 = shape
        return (M, H), (H, rank_1), (rank_1, intermediate), (intermediate,), (intermediate, rank_2), (rank_2, H)
    if kernel == "dense_gated_mlp":
        M, H, intermediate = shape
        return (M, H), (H, intermediate), (H, intermediate), (intermediate, H)
    if kernel == "dense_ungated_mlp":
        M, H, intermediate = shape
        return (M, H), (H, intermediate), (intermediate,), (intermediate, H)
    M, K, N = shape
    return ((K, M) if kernel == "dense_matmul_lhsT" else (M, K)), (K, N)


def traced_cost(kernel, shape, plan, dtype, target) -> KernelCost:
    """The modelled cost of the kernel traced with `plan` (trace-only emulation)."""
    return estimate(KERNEL_FUNCTIONS[kernel], *argument_shapes(kernel, shape), dtype=dtype, target=target, plan=plan)
