"""The analytical block-size model: its plans fit SBUF, cache the strip, and read weights once when they can."""

from collections import Counter

import pytest

from onnx_nmm.kernels import dense_matmul, fused_svd_mlp, fused_xuv
from onnx_nmm.kernels.bench.runner import estimate, trace
from onnx_nmm.kernels.nki_kernels.tiles import k_blocks, ramped_k_blocks, row_pieces
from onnx_nmm.kernels.pricing.blocking import (
    SBUF_RESERVE_BYTES,
    column_groups,
    contraction_blocks,
    plan_dense,
    plan_mlp,
    plan_xuv,
)
from onnx_nmm.kernels.pricing.hardware import neuron_core

# Llama-3.2-3B's MLP: the largest rank of the benchmark grid.
H, I, R = 3072, 8192, 1792


def mlp_shapes(M):
    return (M, H), (H, R), (R, I), (H, R), (R, I), (I, R), (R, H)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize(("M", "dtype"), [(1, "bfloat16"), (512, "bfloat16"), (128, "float32")])
def test_planned_kernels_fit_sbuf_with_the_compilers_reserve(M, dtype, target):
    budget = neuron_core(target).sbuf_partition_bytes - SBUF_RESERVE_BYTES
    launches = [
        trace(dense_matmul, (M, I), (I, H), dtype=dtype, target=target),
        trace(fused_xuv, (M, I), (I, R), (R, H), dtype=dtype, target=target),
        trace(fused_svd_mlp, *mlp_shapes(M), dtype=dtype, target=target),
    ]
    for (launch,) in launches:
        assert launch.sbuf_peak_bytes <= budget, launch.kernel
        assert launch.psum_peak_bytes <= neuron_core(target).psum_partition_bytes


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_at_one_token_every_weight_is_read_once(target):
    xuv = estimate(fused_xuv, (1, H), (H, R), (R, I), target=target)
    assert xuv.hbm_read_bytes == 2 * (H + H * R + R * I)
    assert xuv.hbm_write_bytes == 2 * I
    mlp = estimate(fused_svd_mlp, *mlp_shapes(1), target=target)
    assert mlp.hbm_read_bytes == 2 * (H + 3 * R * (H + I))


def test_the_strip_is_cached_so_u_and_v_are_read_once_per_token_block():
    M = 512
    plan = plan_xuv(M, H, R, I, "bfloat16", target="trn2")
    blocks = -(-M // plan.token_block)
    cost = estimate(fused_xuv, (M, H), (H, R), (R, I), target="trn2", plan=plan)
    assert cost.hbm_read_bytes == 2 * (M * H + blocks * (H * R + R * I))
    assert cost.hbm_write_bytes == 2 * M * I


@pytest.mark.parametrize("M", [1, 100, 300])
def test_weights_move_in_one_transfer_per_block_and_small_token_blocks_store_their_rows_in_two(M):
    """Each tensor's transfers start an issue interval apart, so the kernels move few, large ones: one per U
    contraction block, one per V column block (whole 128-row tiles together), and a block of at most 128
    tokens stores its output rows with two transfers (the first half of the columns early)."""
    plan = plan_xuv(M, H, R, I, "bfloat16", target="trn2")
    (launch,) = trace(fused_xuv, (M, H), (H, R), (R, I), target="trn2", plan=plan)
    transfers = Counter(next(key for space, key, _, _ in ins.reads + ins.writes if space == "hbm")
                        for ins in launch.instructions if ins.engine == "dma")
    x, u, v, y = sorted(transfers)  # HBM tensors in the order they were made: the inputs, then the output
    token_blocks = -(-M // plan.token_block)
    contraction_blocks = -(-H // (128 * plan.k_tiles))
    column_blocks = -(-I // plan.n_block)
    assert transfers[u] == token_blocks * contraction_blocks
    assert transfers[v] == token_blocks * column_blocks  # R is a multiple of 128: no partial tile
    token_block_sizes = [min(plan.token_block, M - row0) for row0 in range(0, M, plan.token_block)]
    halves = 1 + any(n0 < I // 2 <= n0 + plan.n_block < I for n0 in range(0, I, plan.n_block))
    assert transfers[y] == sum(halves if tokens <= 128 else column_blocks * -(-tokens // 128)
                               for tokens in token_block_sizes)


def test_plans_respect_the_shape_and_the_hardware_tiles():
    dense = plan_dense(700, 300, 9000, "bfloat16", target="trn1")
    assert dense.n_block % 512 == 0 or dense.n_block == 9000
    assert dense.m_block % 128 == 0 or dense.m_block == 700
    tutorial = plan_dense(700, 300, 9000, "bfloat16", transposed_input=True, target="trn1")
    assert tutorial.m_block <= tutorial.m_stripe <= 700
    xuv = plan_xuv(1, 4096, 1000, 4096, "float32", target="trn2")
    assert xuv.token_block == 1 and 1 <= xuv.k_tiles <= 16
    mlp = plan_mlp(8192, H, I, R, R, R, "bfloat16", target="trn1")
    assert mlp.token_block % 128 == 0 and mlp.down_tiles <= mlp.i_tiles


def test_the_model_adapts_the_blocking_to_the_target():
    """The same shape gets a different blocking where SBUF and engine speeds differ."""
    assert (plan_mlp(512, H, I, R, R, R, "bfloat16", target="trn1")
            != plan_mlp(512, H, I, R, R, R, "bfloat16", target="trn2"))


def test_a_rank_too_large_for_sbuf_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="no blocking of shape .* fits SBUF"):
        plan_xuv(1, 128, 100_000, 512, "float32", target="trn1")


def test_8192_tokens_trace_within_sbuf():
    """The longest prompt the kernels take (trace-only; Qwen3-1.7B's MLP, trn1's smaller SBUF)."""
    budget = neuron_core("trn1").sbuf_partition_bytes - SBUF_RESERVE_BYTES
    M, hidden, inter, rank = 8192, 2048, 6144, 1280
    (xuv,) = trace(fused_xuv, (M, hidden), (hidden, rank), (rank, inter), target="trn1")
    (mlp,) = trace(fused_svd_mlp, (M, hidden), (hidden, rank), (rank, inter), (hidden, rank), (rank, inter),
                   (inter, rank), (rank, hidden), target="trn1")
    assert max(xuv.sbuf_peak_bytes, mlp.sbuf_peak_bytes) <= budget


@pytest.mark.parametrize(("rows", "n_block", "N", "groups"), [
    (32, 8192, 8192, 4),  # 4 x 32 partitions: 2,048 columns per bank, the block in 4 banks
    (1, 6144, 6144, 64),  # pieces of 96 columns (128 groups would leave 48, under a matmul's 64 cycles)
    (64, 2048, 2048, 2),
    (65, 2048, 2048, 1),  # two groups would need 130 partitions
    (32, 4096, 8190, 2),  # the columns divide into 2 pieces, not 4
    (32, 16384, 16384, 1),  # 4 groups of 4,096 columns would need 8 banks: summed in SBUF, plain blocks
])
def test_few_tokens_multiply_pieces_of_the_columns_side_by_side(rows, n_block, N, groups):
    assert column_groups(rows, n_block, N) == groups


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_a_few_tokens_take_the_weight_in_whole_rows_and_store_through_all_partitions(target):
    """At 32 tokens a gate projection's whole output fits PSUM in column groups: w comes in runs of whole rows
    (16 KiB and more) and y leaves through 128 partitions, where plain blocks of 6 banks load 6 KiB runs."""
    M, K, N = 32, 2048, 8192
    plan = plan_dense(M, K, N, "bfloat16", target=target)
    assert column_groups(M, plan.n_block, N) == 4
    (launch,) = trace(dense_matmul, (M, K), (K, N), target=target)
    loads = [ins for ins in launch.instructions if ins.engine == "dma" and ins.hbm_read and ins.size > M * K * 2]
    stores = [ins for ins in launch.instructions if ins.engine == "dma" and ins.hbm_write]
    assert min(ins.run_bytes for ins in loads) >= 8 * 1024
    assert all(ins.partitions == 128 for ins in stores)


@pytest.mark.parametrize(("rows", "tiles", "sizes"), [
    (2048, 16, [2, 4, 10]),  # 2, 4, then the 10 tiles left (fewer than 16)
    (4096, 8, [2, 4, 8, 8, 8, 2]),
    (2048, 2, [2] * 8),  # nothing to ramp
    (1000, 4, [2, 4, 1, 1]),  # then the full tiles left, then the 104-row partial tile
])
def test_a_ramped_contraction_starts_small_and_doubles(rows, tiles, sizes):
    blocks = ramped_k_blocks(rows, tiles)
    assert [t for _, _, t in blocks] == sizes
    assert [k0 for k0, _, _ in blocks] == [sum(P * t for _, P, t in blocks[:b]) for b in range(len(blocks))]
    assert sum(P * t for _, P, t in blocks) == rows


@pytest.mark.parametrize(("rows", "cols", "tiles", "pieces"), [
    (32, 8192, 2, 4),  # 4 x 32 partitions, 2,048 columns each; blocks of 2 tiles never straddle a piece
    (64, 8192, 2, 2),
    (32, 6144, 4, 1),  # a ramp of 2 then 4 tiles puts a block across the piece boundary at 1,536
    (16, 8192, 2, 1),  # pieces must start at partitions 0, 32, 64, 96
    (128, 8192, 2, 1),
])
def test_32_or_64_rows_load_in_pieces_over_all_partitions(rows, cols, tiles, pieces):
    assert row_pieces(rows, cols, ramped_k_blocks(cols, tiles)) == pieces


def test_only_a_large_first_w_block_is_ramped():
    """A ramp adds transfers, each an issue interval after the last: it pays only where the first w block takes
    longer than that (a 2 MiB block of a gate projection at 512 tokens, not a decode step's small k/v weights)."""
    assert contraction_blocks(2048, 16, 512, 2, first_row_block=True) == ramped_k_blocks(2048, 16)
    assert contraction_blocks(2048, 16, 512, 2, first_row_block=False) == k_blocks(2048, 16)
    assert contraction_blocks(576, 4, 192, 2, first_row_block=True) == k_blocks(576, 4)
