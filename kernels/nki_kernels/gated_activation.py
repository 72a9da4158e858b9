"""act = silu(gate) * up, element-wise: the gated activation between the up and down projections when the
MLP is not fused (dense baseline, unfused and XUV variants of the benchmark).

    silu_mul             act [M, I]    for a down projection that takes x as it is (dense_matmul)
    silu_mul_transposed  actᵀ [I, M]   for one that takes it transposed (dense_matmul_lhsT)

Element-wise work does not care which element sits on which partition, so silu_mul views the arrays as
[128, M*I/128] when that divides: all 128 lanes of ScalarE and VectorE work even for one token (the perf
guide's "partition vectorization"). silu_mul_transposed keeps tokens on partitions and transposes on TensorE,
which an element-wise kernel leaves idle.
"""

from onnx_nmm.kernels.nki_kernels.nki_api import nisa, nki, nl
from onnx_nmm.kernels.nki_kernels.tiles import PMAX, cdiv, dtype_bytes, k_blocks, load_row_tiles, transpose_rows

DMA_BYTES_PER_PARTITION = 4096  # ">= 4 KiB per partition (target for full saturation)", nki-dma-bandwidth-guide.rst


def leaves_transposed(tokens):
    """Whether a dense MLP whose projections run one launch each hands its down projection actᵀ
    (silu_mul_transposed, then dense_matmul_lhsT) rather than act (silu_mul, then dense_matmul). Above one tile
    of tokens: there dense_matmul's transposes of x cost its TensorE 128/H of its work, while the activation's
    TensorE is idle; up to 128 tokens the down projection is bound by its weights' DMA and takes act as it is."""
    return tokens > PMAX


@nki.jit
def silu_mul(gate, up):
    """act = silu(gate) * up.

    Args:
        gate, up: [M, I] in the same dtype (tokens on rows).
    Returns:
        act: [M, I] in that dtype, in shared HBM.
    """
    M, intermediate = gate.shape
    assert up.shape == gate.shape and up.dtype == gate.dtype, "gate and up must have the same shape and dtype"
    act = nl.ndarray((M, intermediate), dtype=gate.dtype, buffer=nl.shared_hbm)
    size = M * intermediate
    rows, columns = (PMAX, size // PMAX) if size % PMAX == 0 else (M, intermediate)
    gate_view, up_view, act_view = (gate.reshape((rows, columns)), up.reshape((rows, columns)),
                                    act.reshape((rows, columns)))
    block = DMA_BYTES_PER_PARTITION // dtype_bytes(gate.dtype)
    for row0 in range(0, rows, PMAX):
        P = min(PMAX, rows - row0)
        for col0 in range(0, columns, block):
            F = min(block, columns - col0)
            gate_tile = nl.ndarray((PMAX, block), dtype=gate.dtype, buffer=nl.sbuf)
            up_tile = nl.ndarray((PMAX, block), dtype=up.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=gate_tile[0:P, 0:F], src=gate_view[row0 : row0 + P, col0 : col0 + F])
            nisa.dma_copy(dst=up_tile[0:P, 0:F], src=up_view[row0 : row0 + P, col0 : col0 + F])
            silu = nl.ndarray((PMAX, block), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=silu[0:P, 0:F], op=nl.silu, data=gate_tile[0:P, 0:F])
            result = nl.ndarray((PMAX, block), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=result[0:P, 0:F], data1=silu[0:P, 0:F], data2=up_tile[0:P, 0:F], op=nl.multiply)
            nisa.dma_copy(dst=act_view[row0 : row0 + P, col0 : col0 + F], src=result[0:P, 0:F])
    return act


# silu_mul_transposed's chunks: runs of 2 KiB (bfloat16) both ways, gate and up loaded and actᵀ stored, and a
# chunk's tiles small enough (~70 KiB per partition) that the next chunk's loads fit beside them
TOKEN_CHUNK = 1024
COLUMN_CHUNK = 1024


@nki.jit
def silu_mul_transposed(gate, up):
    """actᵀ = (silu(gate) * up)ᵀ, for a down projection that takes its input transposed (dense_matmul_lhsT): the
    transposes its TensorE would spend on x^T (128/N of its work) are done here, where TensorE is idle.

    Per chunk of TOKEN_CHUNK tokens and COLUMN_CHUNK columns:
      1. gate and up, 128 tokens to a tile, one DMA each (tiles.load_row_tiles);
      2. per token tile, silu(gate) on ScalarE, times up on VectorE: act in the inputs' dtype; the next tile's
         silu is issued before this tile's copy below, so that ScalarE does not wait on VectorE;
      3. per block of the columns (tiles.k_blocks, row-interleaved as tiles.py describes), TensorE transposes
         the token tile's act 128 columns at a time, several to a PSUM bank, and ScalarE copies each bank out
         into actᵀ [128, t, tokens], partition p and tile j holding column c0 + p*t + j (tiles.transpose_rows);
      4. each block of actᵀ stored in one DMA: each partition writes t rows of actᵀ, runs of the chunk's tokens.

    Args:
        gate, up: [M, I] in the same dtype (tokens on rows).
    Returns:
        actᵀ: [I, M] in that dtype, in shared HBM.
    """
    M, intermediate = gate.shape
    assert up.shape == gate.shape and up.dtype == gate.dtype, "gate and up must have the same shape and dtype"
    actT = nl.ndarray((intermediate, M), dtype=gate.dtype, buffer=nl.shared_hbm)
    for m0 in range(0, M, TOKEN_CHUNK):
        tokens = min(TOKEN_CHUNK, M - m0)
        token_tiles = cdiv(tokens, PMAX)
        for i0 in range(0, intermediate, COLUMN_CHUNK):
            columns = min(COLUMN_CHUNK, intermediate - i0)
            gate_rows = nl.ndarray((PMAX, token_tiles, columns), dtype=gate.dtype, buffer=nl.sbuf)
            up_rows = nl.ndarray((PMAX, token_tiles, columns), dtype=up.dtype, buffer=nl.sbuf)
            load_row_tiles(gate_rows, gate, m0, tokens, i0, i0 + columns)
            load_row_tiles(up_rows, up, m0, tokens, i0, i0 + columns)
            act = nl.ndarray((PMAX, token_tiles, columns), dtype=gate.dtype, buffer=nl.sbuf)
            blocks = k_blocks(columns, COLUMN_CHUNK // PMAX)
            transposed = [nl.ndarray((PMAX, t, tokens), dtype=gate.dtype, buffer=nl.sbuf) for _, _, t in blocks]
            _gated_tile(act, gate_rows, up_rows, 0, tokens, columns)
            for c in range(token_tiles):
                if c + 1 < token_tiles:
                    _gated_tile(act, gate_rows, up_rows, c + 1, tokens, columns)
                for (c0, P, t), block in zip(blocks, transposed):
                    transpose_rows(block, act[:, c, :], min(PMAX, tokens - c * PMAX), c0, P, t, c * PMAX)
            for (c0, P, t), block in zip(blocks, transposed):
                rows = actT[i0 + c0 : i0 + c0 + P * t, m0 : m0 + tokens].reshape((P, t, tokens))
                nisa.dma_copy(dst=rows, src=block[0:P, 0:t, 0:tokens])
    return actT


def _gated_tile(act, gate_rows, up_rows, c, tokens, columns):
    """act[:, c] = silu(gate) * up for token tile c: ScalarE's silu in fp32, VectorE's product in act's dtype."""
    R = min(PMAX, tokens - c * PMAX)
    silu = nl.ndarray((PMAX, columns), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=silu[0:R, 0:columns], op=nl.silu, data=gate_rows[0:R, c, 0:columns])
    nisa.tensor_tensor(dst=act[0:R, c, 0:columns], data1=silu[0:R, 0:columns], data2=up_rows[0:R, c, 0:columns],
                       op=nl.multiply)
