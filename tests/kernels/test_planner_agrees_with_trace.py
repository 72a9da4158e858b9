"""One cost model: the block planner's estimate of a plan is what the trace-based model finds for the kernel
run with that plan."""

import pytest

from onnx_nmm.kernels.pricing.blocking import ENGINES, TIE, estimate_plan
from onnx_nmm.kernels.pricing.plan_tracing import fitting_plans, planned, traced_cost

# (kernel, the planner's dimensions, dtype, target). M from 1 to 2048, most not a multiple of the token block;
# K, N, I and the ranks mostly not multiples of 128 or 512.
CASES = [
    ("fused_xuv", (1, 1000, 200, 700), "bfloat16", "trn2"),
    ("fused_xuv", (300, 1000, 200, 700), "float32", "trn1"),
    ("fused_xuv", (700, 576, 256, 1536), "bfloat16", "trn1"),
    ("fused_xuv", (2048, 576, 256, 1536), "bfloat16", "trn2"),
    ("fused_xuv", (129, 2048, 1280, 8192), "bfloat16", "trn1"),  # Llama-3.2-1B's gate projection
    ("fused_svd_mlp", (1, 640, 1000, 200, 256, 136), "bfloat16", "trn1"),
    ("fused_svd_mlp", (300, 640, 1000, 200, 256, 136), "float32", "trn2"),
    ("fused_svd_mlp", (700, 1000, 2100, 300, 300, 300), "bfloat16", "trn2"),
    ("fused_svd_mlp", (129, 2048, 8192, 1280, 1280, 1280), "bfloat16", "trn1"),  # Llama-3.2-1B's MLP
    ("fused_svd_ungated_mlp", (1, 640, 1000, 200, 136), "bfloat16", "trn2"),
    ("fused_svd_ungated_mlp", (300, 768, 3072, 384, 256), "float32", "trn1"),
    ("fused_svd_ungated_mlp", (700, 2560, 10240, 1280, 1280), "bfloat16", "trn2"),  # Phi-2's MLP
    ("dense_gated_mlp", (1, 640, 1000), "bfloat16", "trn1"),
    ("dense_gated_mlp", (300, 640, 1000), "float32", "trn2"),
    ("dense_gated_mlp", (129, 2048, 8192), "bfloat16", "trn1"),  # Llama-3.2-1B's MLP
    ("dense_gated_mlp", (700, 576, 1376), "bfloat16", "trn2"),  # SmolLM2's MLP narrowed to 1376 neurons
    ("dense_ungated_mlp", (1, 768, 3072), "bfloat16", "trn2"),
    ("dense_ungated_mlp", (300, 1000, 2100), "float32", "trn1"),
    ("dense_matmul", (1, 1000, 700), "float32", "trn2"),
    ("dense_matmul", (300, 1000, 700), "bfloat16", "trn1"),
    ("dense_matmul", (700, 300, 9000), "bfloat16", "trn2"),
    ("dense_matmul", (33, 2048, 700), "float32", "trn1"),
    ("dense_matmul", (1100, 2300, 2100), "bfloat16", "trn1"),  # blocks summed in PSUM and in SBUF
    ("dense_matmul_lhsT", (1, 1000, 700), "bfloat16", "trn1"),
    ("dense_matmul_lhsT", (300, 1000, 700), "float32", "trn1"),
    ("dense_matmul_lhsT", (2048, 1000, 1536), "bfloat16", "trn2"),
]

# cost_model plays the trace as an event-driven schedule (dependencies through reused SBUF addresses, each HBM
# tensor's transfers in program order an issue interval apart, each transfer's fixed latency); the planner can only
# approximate that overlap in closed form, so the totals agree loosely (28 % apart at worst over these cases)
# while everything additive is exact.
TOTAL_TOLERANCE = 0.30


def plans_to_check(kernel, shape, dtype, target):
    """The planner's choice and three candidates it did not choose: the smallest blocks (remainders in every
    dimension), a middle one and the largest."""
    chosen = planned(kernel, shape, dtype, target)
    others = [plan for plan in fitting_plans(kernel, shape, dtype, target) if plan != chosen]
    picks = [others[0], others[len(others) // 2], others[-1]] if others else []
    return [chosen] + [plan for i, plan in enumerate(picks) if plan not in picks[:i]]


@pytest.mark.parametrize(("kernel", "shape", "dtype", "target"), CASES)
def test_the_planners_estimate_of_a_plan_is_the_traced_cost_of_the_kernel_run_with_it(kernel, shape, dtype, target):
    for plan in plans_to_check(kernel, shape, dtype, target):
        planner = estimate_plan(kernel, shape, plan, dtype, target)
        trace = traced_cost(kernel, shape, plan, dtype, target)
        for engine in ENGINES:
            assert planner.busy_s[engine] == pytest.approx(trace.busy_s[engine], rel=1e-9, abs=1e-15), (plan, engine)
        assert planner.hbm_read_bytes == trace.hbm_read_bytes, plan
        assert planner.hbm_write_bytes == trace.hbm_write_bytes, plan
        assert planner.sbuf_bytes >= trace.sbuf_peak_bytes, plan
        assert planner.total_s == pytest.approx(trace.total_s, rel=TOTAL_TOLERANCE), plan


@pytest.mark.parametrize(("kernel", "shape", "option"), [("dense_matmul", (600, 1100, 3100), "all_psum"),
                                                          ("dense_matmul_lhsT", (520, 3000, 2300), "w_piece")])
def test_the_planner_prices_blocks_summed_in_all_of_psum_and_w_in_pieces_as_the_trace_does(kernel, shape, option):
    """The candidates the choices at 512 tokens come from: dense_matmul's blocks summed in all of PSUM after a
    narrowed first block, dense_matmul_lhsT's w in pieces; partial tiles and blocks in every dimension."""
    candidates = [plan for plan in fitting_plans(kernel, shape, "bfloat16", "trn1") if getattr(plan, option)]
    assert len(candidates) >= 4
    for plan in candidates[:2] + candidates[-2:]:
        planner = estimate_plan(kernel, shape, plan, "bfloat16", "trn1")
        trace = traced_cost(kernel, shape, plan, "bfloat16", "trn1")
        for engine in ENGINES:
            assert planner.busy_s[engine] == pytest.approx(trace.busy_s[engine], rel=1e-9, abs=1e-15), (plan, engine)
        assert (planner.hbm_read_bytes, planner.hbm_write_bytes) == (trace.hbm_read_bytes, trace.hbm_write_bytes)
        assert planner.sbuf_bytes >= trace.sbuf_peak_bytes, plan
        assert planner.total_s == pytest.approx(trace.total_s, rel=TOTAL_TOLERANCE), plan


@pytest.mark.parametrize(("kernel", "shape", "dtype", "target"), CASES)
def test_the_planner_picks_the_fewest_hbm_bytes_among_the_candidates_it_estimates_fastest(kernel, shape, dtype, target):
    chosen = estimate_plan(kernel, shape, planned(kernel, shape, dtype, target), dtype, target)
    estimates = [estimate_plan(kernel, shape, plan, dtype, target)
                 for plan in fitting_plans(kernel, shape, dtype, target)]
    fastest = min(e.total_s for e in estimates)
    assert chosen.total_s <= fastest * (1 + TIE)
    assert chosen.hbm_bytes == min(e.hbm_bytes for e in estimates if e.total_s <= fastest * (1 + TIE))


@pytest.mark.parametrize(("kernel", "shape", "dtype", "target"),
                         [("fused_xuv", (300, 1000, 200, 700), "float32", "trn2"),
                          ("dense_matmul", (300, 1000, 700), "bfloat16", "trn1")])
def test_the_planners_choice_is_close_to_the_best_candidate_traced_cost(kernel, shape, dtype, target):
    """A loose check of the choice; tools/planner_check.py measures it on larger shapes."""
    times = [traced_cost(kernel, shape, plan, dtype, target).total_s
             for plan in fitting_plans(kernel, shape, dtype, target)]
    chosen = traced_cost(kernel, shape, planned(kernel, shape, dtype, target), dtype, target).total_s
    assert chosen <= 1.10 * min(times)
