"""Dense matmul y = x · w with the blocking of AWS's fully optimized NKI matmul tutorial (the baseline).

The tutorial (nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py,
`nki_matmul_fully_optimized_`) holds a stripe of output rows for one block of columns in SBUF while it
streams the contraction in blocks: each block of w is loaded once and reused by every row block of the
stripe, each row block of x is reused by every column tile, and TensorE accumulates one block of the
contraction in PSUM before the Vector engine adds it onto the stripe. Two changes here:

- the stripe's partial sums are float32 (the tutorial keeps them in the output dtype, so a bf16 kernel
  rounds after every contraction block), and the last block writes the output dtype directly;
- block sizes come from blocking.plan_dense for the shape and target instead of fixed constants, and the
  stripe height is bounded so that float32 partial sums fit SBUF for any M.

`dense_matmul(x, w)` takes x in natural [M, K] layout like every other kernel here and makes x^T tiles
in-kernel with TensorE transposes (tiles.transpose_tokens). `dense_matmul_lhsT(lhsT, w)` is the
tutorial's own calling convention (x delivered transposed) and is what the calibration anchor runs.
"""

from onnx_nmm.kernels.blocking import plan_dense
from onnx_nmm.kernels.nki_api import nki, nl
from onnx_nmm.kernels.tiles import (
    PMAX,
    TILE_M,
    cdiv,
    k_blocks,
    load_interleaved_rows,
    multiply_rows_into,
    transpose_tokens,
)


@nki.jit
def dense_matmul(x, w, plan=None):
    """y = x · w.

    Args:
        x: [M, K] activations, row-major (tokens x features, as an ONNX graph holds them).
        w: [K, N] weight, same dtype as x (bfloat16 or float32).
        plan: a blocking.DensePlan; None asks blocking.plan_dense for this shape and target.
    Returns:
        y: [M, N] in x's dtype, in shared HBM.
    """
    M, K = x.shape
    K_w, N = w.shape
    assert K == K_w, f"x has {K} features but w has {K_w} rows"
    assert x.dtype == w.dtype, f"x is {x.dtype} but w is {w.dtype}"
    if plan is None:
        plan = plan_dense(M, K, N, x.dtype, transposed_input=False)
    y = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    blocked_matmul(x, w, y, plan, x_is_transposed=False)
    return y


@nki.jit
def dense_matmul_lhsT(lhsT, w, plan=None):
    """y = lhsT^T · w, the tutorial's form.

    Args:
        lhsT: [K, M], the left operand delivered transposed (contraction first).
        w: [K, N] weight, same dtype.
        plan: a blocking.DensePlan; None asks blocking.plan_dense.
    Returns:
        y: [M, N] in lhsT's dtype, in shared HBM.
    """
    K, M = lhsT.shape
    K_w, N = w.shape
    assert K == K_w, f"lhsT has {K} rows but w has {K_w}"
    assert lhsT.dtype == w.dtype, f"lhsT is {lhsT.dtype} but w is {w.dtype}"
    if plan is None:
        plan = plan_dense(M, K, N, lhsT.dtype, transposed_input=True)
    y = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    blocked_matmul(lhsT, w, y, plan, x_is_transposed=True)
    return y


def blocked_matmul(x, w, y, plan, x_is_transposed):
    """y = x · w, one output stripe of rows and block of columns at a time."""
    M, N = y.shape
    # Partial sums are kept per 128-row tile of the stripe, so row blocks must start on tile boundaries.
    assert plan.m_block % TILE_M == 0 or plan.m_block >= M, f"m_block {plan.m_block}: a multiple of {TILE_M}"
    assert plan.m_stripe % plan.m_block == 0 or plan.m_stripe >= M, "m_stripe must be a multiple of m_block"
    for row0 in range(0, M, plan.m_stripe):
        for col0 in range(0, N, plan.n_block):
            output_block(x, w, y, row0, min(plan.m_stripe, M - row0), col0, min(plan.n_block, N - col0),
                         plan, x_is_transposed)


def output_block(x, w, y, row0, rows, col0, cols, plan, x_is_transposed):
    """y[row0:row0+rows, col0:col0+cols], streaming the contraction in blocks of plan.k_tiles tiles."""
    K = w.shape[0]
    blocks = k_blocks(K, plan.k_tiles)
    # fp32 partial sums of the stripe, one [128, cols] tile per 128 output rows; a single block needs none.
    partials = None
    if len(blocks) > 1:
        partials = [nl.ndarray((PMAX, cols), dtype=nl.float32, buffer=nl.sbuf) for _ in range(cdiv(rows, TILE_M))]

    for b, (k0, P, t) in enumerate(blocks):
        first, last = b == 0, b == len(blocks) - 1
        # The w block is loaded once and reused by every row block of the stripe.
        w_block = nl.ndarray((PMAX, t, cols), dtype=w.dtype, buffer=nl.sbuf)
        load_interleaved_rows(w_block, w, k0, P, t, col0, col0 + cols)

        for m0 in range(0, rows, plan.m_block):
            m_rows = min(plan.m_block, rows - m0)
            lhsT = lhsT_block(x, x_is_transposed, row0 + m0, m_rows, k0, P, t)
            multiply_rows_into(y, row0 + m0, col0, lhsT, w_block, partials, m0 // TILE_M, m_rows, cols, P, t,
                               first, last)


def lhsT_block(x, x_is_transposed, row0, rows, k0, P, t):
    """The [P, t, rows] block of x^T for contraction rows k0.. and output rows row0..row0+rows."""
    block = nl.ndarray((PMAX, t, rows), dtype=x.dtype, buffer=nl.sbuf)
    if x_is_transposed:
        load_interleaved_rows(block, x, k0, P, t, row0, row0 + rows)
    else:
        for tok0 in range(0, rows, PMAX):
            transpose_tokens(block, x, row0 + tok0, min(PMAX, rows - tok0), k0, P, t, tok0)
    return block
