"""Fused low-rank product y = x · U · V (NeuronMM's TrainiumFusion XUV kernel).

For each block of tokens:
  stage 1  strip = (x_blk · U)ᵀ, with U as TensorE's stationary operand so the product comes out
           transposed (rank on partitions) without a transpose instruction; contraction blocks are
           combined in fp32; the strip stays in SBUF;
  stage 2  y_blk = stripᵀ · V, one block of output columns after another, every block reusing the cached
           strip: stage 1 is never recomputed and the intermediate never goes through HBM.
Block sizes (tokens per strip, contraction block, output column block) come from blocking.plan_xuv.
"""

from onnx_nmm.kernels.nki_kernels.nki_api import nki, nl
from onnx_nmm.kernels.nki_kernels.strip_stages import expand_strip, project_tokens
from onnx_nmm.kernels.pricing.blocking import plan_xuv


@nki.jit
def fused_xuv(x, u, v, plan=None):
    """y = x · U · V.

    Args:
        x: [M, K] activations, row-major (tokens x features).
        u: [K, r] first factor; v: [r, N] second factor (the ONNX SvdMatMul layout); any rank r.
        plan: a blocking.XuvPlan; None asks blocking.plan_xuv for this shape and target.
    Returns:
        y: [M, N] in x's dtype, in shared HBM.
    """
    M, K = x.shape
    K_u, rank = u.shape
    rank_v, N = v.shape
    assert K == K_u, f"x has {K} features but U has {K_u} rows"
    assert rank == rank_v, f"U has rank {rank} but V has {rank_v} rows"
    assert x.dtype == u.dtype == v.dtype, f"x, U, V dtypes differ: {x.dtype}, {u.dtype}, {v.dtype}"
    if plan is None:
        plan = plan_xuv(M, K, rank, N, x.dtype)
    y = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    for row0 in range(0, M, plan.token_block):
        token_block(x, u, v, y, row0, min(plan.token_block, M - row0), plan)
    return y


def token_block(x, u, v, y, row0, tokens, plan):
    # stage 1: (x_blk · U)ᵀ in SBUF, with V's first block loaded meanwhile
    (strip,), (first_v_block,) = project_tokens(x, (u,), row0, tokens, plan.k_tiles, prefetch=((v, plan.n_block),))
    expand_strip(strip, v, y, row0, tokens, plan.n_block, first_v_block)  # stage 2: every column block reuses it
