"""Each kernel against a float64 NumPy reference, on shapes with partial tiles, one token, odd ranks.

Small explicit blocks make the same small shapes go through several token blocks, contraction blocks
(fp32 partial sums) and column blocks.
"""

import ml_dtypes
import numpy as np
import pytest

from onnx_nmm.kernels import (
    dense_gated_mlp,
    dense_matmul,
    dense_matmul_lhsT,
    dense_ungated_mlp,
    fused_svd_mlp,
    fused_svd_ungated_mlp,
    fused_xuv,
    lowrank_unfused,
    run,
    silu_mul,
    silu_mul_transposed,
)
from onnx_nmm.kernels.nki_kernels.tiles import k_blocks
from onnx_nmm.kernels.pricing.blocking import (
    DenseMlpPlan,
    DensePlan,
    MlpPlan,
    OutputBlockPlan,
    XuvPlan,
    column_groups,
    contraction_blocks,
    down_tiles_per_load,
    output_column_blocks,
)

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# Error relative to the output's largest magnitude: bf16 rounds the intermediates and the output
# (2^-9 each), fp32 only sums in a different order.
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-5}
SMALL_DENSE = DensePlan(m_stripe=128, m_block=128, n_block=512, k_tiles=1)
# w in pieces: the first contraction block's 512 columns wide, the others' 1024 (tiles.column_pieces); two row blocks
DENSE_PIECES = DensePlan(m_stripe=256, m_block=128, n_block=2048, k_tiles=1, w_piece=1024)
PSUM_BLOCKS = OutputBlockPlan(m_block=128, n_block=512, k_tiles=1)  # one bank per block, summed in PSUM
SBUF_BLOCKS = OutputBlockPlan(m_block=256, n_block=2048, k_tiles=1)  # up to 8 banks: summed in SBUF
# 8 banks summed in all of PSUM once x^T is made, the first column block narrowed (blocking.output_column_blocks)
ALL_PSUM_BLOCKS = OutputBlockPlan(m_block=512, n_block=1024, k_tiles=2, all_psum=True)
SMALL_XUV = XuvPlan(token_block=128, k_tiles=1, n_block=512)
SMALL_MLP = MlpPlan(token_block=128, k_tiles=1, i_tiles=2, down_tiles=1, n_block=512)
SMALL_DENSE_MLP = DenseMlpPlan(token_block=128, k_tiles=1, i_tiles=2)  # up to 128 tokens: every sum in PSUM
WIDE_DENSE_MLP = DenseMlpPlan(token_block=256, k_tiles=1, i_tiles=2)  # above 128: y summed in SBUF


def arrays(seed, dtype, *shapes):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) / np.sqrt(shape[0] if i else 1)).astype(DTYPES[dtype])
            for i, shape in enumerate(shapes)]


def f64(*values):
    return [np.asarray(v, dtype=np.float64) for v in values]


def silu(z):
    return z / (1 + np.exp(-z))


def check(result, reference, dtype):
    assert result.dtype == DTYPES[dtype] and result.shape == reference.shape
    assert not np.isnan(result.astype(np.float32)).any(), "the kernel left output elements unwritten"
    error = np.abs(result.astype(np.float64) - reference).max() / np.abs(reference).max()
    assert error <= TOLERANCE[dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", [None, PSUM_BLOCKS, SBUF_BLOCKS], ids=["planned", "summed-in-psum", "summed-in-sbuf"])
@pytest.mark.parametrize(("M", "K", "N"), [(1, 200, 300), (37, 300, 700), (130, 384, 1030), (300, 300, 2100)])
def test_dense_matmul(M, K, N, plan, dtype):
    x, w = arrays(0, dtype, (M, K), (K, N))
    X, W = f64(x, w)
    check(run(dense_matmul, x, w, target="trn1", plan=plan), X @ W, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "N"), [(400, 300, 2048), (700, 384, 1600)])
def test_dense_matmul_summing_in_all_of_psum(M, K, N, dtype):
    """Row blocks of 4 tiles, the last partial: a first column block of 768 in 6 banks (two row tiles share one
    for their last 256 columns), then blocks of 1,024 in all 8 banks, and a partial last one (the first shape's
    256 columns, again in shared banks); the second shape's last row block is 188 rows."""
    blocks = output_column_blocks(min(512, M), 1024, N, 1, all_psum=True)
    assert blocks[0] == (0, 768, 6, True) and blocks[1][::2] == (768, 8)
    x, w = arrays(0, dtype, (M, K), (K, N))
    X, W = f64(x, w)
    check(run(dense_matmul, x, w, target="trn1", plan=ALL_PSUM_BLOCKS), X @ W, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", [OutputBlockPlan(128, 1024, 8), OutputBlockPlan(256, 2048, 4)],
                         ids=["summed-in-psum", "summed-in-sbuf"])
def test_dense_matmul_ramps_the_first_row_blocks_contraction(plan, dtype):
    """The first row block, whose first w block would be over 1 MiB, takes the contraction in blocks of 2 and 4
    tiles, then the rest (blocking.contraction_blocks), the others in the planned blocks; the x^T tiles and the
    fp32 sums follow each row block's own blocks."""
    element_bytes = 2 if dtype == "bfloat16" else 4
    ramped = contraction_blocks(1000, plan.k_tiles, min(plan.n_block, 1500), element_bytes, first_row_block=True)
    assert len(ramped) > len(k_blocks(1000, plan.k_tiles))
    x, w = arrays(0, dtype, (300, 1000), (1000, 1500))
    X, W = f64(x, w)
    check(run(dense_matmul, x, w, target="trn1", plan=plan), X @ W, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "N", "plan"), [
    (1, 200, 8192, OutputBlockPlan(m_block=1, n_block=8192, k_tiles=1)),  # 64 groups of 128 columns
    (5, 384, 1000, OutputBlockPlan(m_block=5, n_block=512, k_tiles=2)),  # 8 groups; a last block of 488 columns
    (32, 300, 3000, OutputBlockPlan(m_block=32, n_block=1024, k_tiles=2)),  # 4 groups, a partial contraction tile
    (64, 256, 1536, OutputBlockPlan(m_block=64, n_block=1536, k_tiles=1)),  # 2 groups, two banks each
    (32, 1024, 2048, OutputBlockPlan(m_block=32, n_block=2048, k_tiles=2)),  # x's rows in 4 pieces of 256 columns
    (64, 512, 1024, OutputBlockPlan(m_block=64, n_block=1024, k_tiles=2)),  # x's rows in 2 pieces
])
def test_dense_matmul_with_column_groups(M, K, N, plan, dtype):
    """Few tokens multiply pieces of the columns side by side (blocking.column_groups); the zeros of x^T's
    windows add nothing, so fp32 matches as closely as the plain blocks do."""
    assert column_groups(M, plan.n_block, N) > 1
    x, w = arrays(0, dtype, (M, K), (K, N))
    X, W = f64(x, w)
    check(run(dense_matmul, x, w, target="trn2", plan=plan), X @ W, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", [None, SMALL_DENSE, DENSE_PIECES], ids=["planned", "small-blocks", "w-in-pieces"])
@pytest.mark.parametrize(("M", "K", "N"), [(1, 200, 300), (37, 300, 700), (130, 384, 1030)])
def test_the_tutorials_dense_matmul_lhsT(M, K, N, plan, dtype):
    x, w = arrays(0, dtype, (M, K), (K, N))
    X, W = f64(x, w)
    check(run(dense_matmul_lhsT, np.ascontiguousarray(x.T), w, target="trn2", plan=plan), X @ W, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", [None, SMALL_XUV], ids=["planned", "small-blocks"])
@pytest.mark.parametrize(
    ("M", "K", "r", "N"), [(1, 200, 64, 300), (37, 300, 200, 700), (130, 256, 130, 600), (300, 384, 256, 512)]
)
def test_fused_xuv(M, K, r, N, plan, dtype):
    x, u, v = arrays(1, dtype, (M, K), (K, r), (r, N))
    X, U, V = f64(x, u, v)
    check(run(fused_xuv, x, u, v, target="trn2", plan=plan), X @ U @ V, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "r", "N"), [(1, 200, 64, 300), (130, 256, 130, 600)])
def test_lowrank_unfused(M, K, r, N, dtype):
    x, u, v = arrays(2, dtype, (M, K), (K, r), (r, N))
    X, U, V = f64(x, u, v)
    check(run(lowrank_unfused, x, u, v, target="trn1"), X @ U @ V, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", [None, SMALL_MLP], ids=["planned", "small-blocks"])
@pytest.mark.parametrize(
    ("M", "H", "I", "ranks"),
    [(1, 200, 300, (64, 96, 80)), (37, 256, 700, (200, 130, 128)), (130, 300, 520, (130, 128, 200))],
)
def test_fused_svd_mlp(M, H, I, ranks, plan, dtype):
    rg, ru, rd = ranks
    x, ug, vg, uu, vu, ud, vd = arrays(3, dtype, (M, H), (H, rg), (rg, I), (H, ru), (ru, I), (I, rd), (rd, H))
    X, UG, VG, UU, VU, UD, VD = f64(x, ug, vg, uu, vu, ud, vd)
    reference = (silu(X @ UG @ VG) * (X @ UU @ VU)) @ UD @ VD
    target = "trn1" if M % 2 else "trn2"
    check(run(fused_svd_mlp, x, ug, vg, uu, vu, ud, vd, target=target, plan=plan), reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", [None, SMALL_DENSE_MLP, WIDE_DENSE_MLP],
                         ids=["planned", "small-blocks", "wide-blocks"])
@pytest.mark.parametrize(("M", "H", "I", "activation"), [(1, 200, 300, "silu"), (37, 256, 700, "gelu"),
                                                         (130, 300, 520, "gelu_tanh"), (300, 200, 1100, "silu")])
def test_dense_gated_mlp(M, H, I, activation, plan, dtype):
    x, wg, wu, wd = arrays(8, dtype, (M, H), (H, I), (H, I), (I, H))
    X, WG, WU, WD = f64(x, wg, wu, wd)
    reference = (activated(X @ WG, activation) * (X @ WU)) @ WD
    target = "trn1" if M % 2 else "trn2"
    check(run(dense_gated_mlp, x, wg, wu, wd, target=target, plan=plan, activation=activation), reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_gated_mlp_loads_wd_rows_a_few_tiles_of_i_at_a_time(dtype):
    """Up to 128 tokens, Wd's rows of a block of 10 I tiles come in loads of blocking.down_tiles_per_load tiles
    (3, 3, 3 and 1 in bfloat16, 2 by 2 in float32, whose rows are longer), and a last partial I tile in its own
    block."""
    M, H, I = 37, 2000, 1300
    plan = DenseMlpPlan(token_block=128, k_tiles=2, i_tiles=10)
    assert down_tiles_per_load(10, H, 2) == 3 and down_tiles_per_load(10, H, 4) == 2
    x, wg, wu, wd = arrays(10, dtype, (M, H), (H, I), (H, I), (I, H))
    X, WG, WU, WD = f64(x, wg, wu, wd)
    reference = (activated(X @ WG, "silu") * (X @ WU)) @ WD
    check(run(dense_gated_mlp, x, wg, wu, wd, target="trn1", plan=plan), reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", [None, SMALL_DENSE_MLP, WIDE_DENSE_MLP],
                         ids=["planned", "small-blocks", "wide-blocks"])
@pytest.mark.parametrize(("M", "H", "I"), [(1, 200, 300), (130, 300, 520)])
def test_dense_ungated_mlp(M, H, I, plan, dtype):
    x, w1, b1, w2 = arrays(9, dtype, (M, H), (H, I), (I,), (I, H))
    X, W1, B1, W2 = f64(x, w1, b1, w2)
    reference = activated(X @ W1 + B1, "gelu_tanh") @ W2
    check(run(dense_ungated_mlp, x, w1, b1, w2, target="trn2", plan=plan), reference, dtype)


def activated(z, activation):
    from math import erf, pi, sqrt

    if activation == "silu":
        return silu(z)
    if activation == "gelu":
        return 0.5 * z * (1 + np.vectorize(erf)(z / sqrt(2)))
    return 0.5 * z * (1 + np.tanh(sqrt(2 / pi) * (z + 0.044715 * z**3)))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_fused_svd_mlp_with_gelu_gating(activation):
    x, ug, vg, uu, vu, ud, vd = arrays(5, "float32", (130, 256), (256, 40), (40, 300), (256, 40), (40, 300),
                                       (300, 64), (64, 256))
    X, UG, VG, UU, VU, UD, VD = f64(x, ug, vg, uu, vu, ud, vd)
    reference = (activated(X @ UG @ VG, activation) * (X @ UU @ VU)) @ UD @ VD
    check(run(fused_svd_mlp, x, ug, vg, uu, vu, ud, vd, plan=SMALL_MLP, activation=activation), reference, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", [None, SMALL_MLP], ids=["planned", "small-blocks"])
@pytest.mark.parametrize(("M", "H", "I", "ranks", "activation"), [
    (1, 200, 300, (64, 80), "gelu_tanh"), (37, 256, 700, (200, 128), "gelu"), (130, 300, 520, (130, 200), "silu")])
def test_fused_svd_ungated_mlp(M, H, I, ranks, activation, plan, dtype):
    r1, r2 = ranks
    x, u1, v1, b1, u2, v2 = arrays(6, dtype, (M, H), (H, r1), (r1, I), (I,), (I, r2), (r2, H))
    X, U1, V1, B1, U2, V2 = f64(x, u1, v1, b1, u2, v2)
    reference = activated(X @ U1 @ V1 + B1, activation) @ U2 @ V2
    target = "trn1" if M % 2 else "trn2"
    result = run(fused_svd_ungated_mlp, x, u1, v1, b1, u2, v2, target=target, plan=plan, activation=activation)
    check(result, reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "I"), [(1, 5000), (130, 700)])
def test_silu_mul(M, I, dtype):
    gate, up = arrays(4, dtype, (M, I), (M, I))
    G, U = f64(gate, up)
    check(run(silu_mul, gate, up), silu(G) * U, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "I"), [(1, 5000), (1100, 300)])  # two token chunks; columns with a partial tile
def test_silu_mul_transposed(M, I, dtype):
    gate, up = arrays(4, dtype, (M, I), (M, I))
    G, U = f64(gate, up)
    check(run(silu_mul_transposed, gate, up), (silu(G) * U).T, dtype)


def test_inputs_of_different_dtypes_are_refused():
    x = np.ones((4, 128), dtype=np.float32)
    with pytest.raises(AssertionError, match="x is float32 but w is bfloat16"):
        run(dense_matmul, x, np.ones((128, 8), dtype=ml_dtypes.bfloat16))
