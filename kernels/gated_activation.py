"""act = silu(gate) * up, element-wise: the gated activation between the up and down projections when the
MLP is not fused (dense baseline, unfused and XUV variants of the benchmark).

Element-wise work does not care which element sits on which partition, so the arrays are viewed as
[128, M*I/128] when that divides: all 128 lanes of ScalarE and VectorE work even for one token (the perf
guide's "partition vectorization").
"""

from onnx_nmm.kernels.nki_api import nisa, nki, nl
from onnx_nmm.kernels.tiles import PMAX, dtype_bytes

DMA_BYTES_PER_PARTITION = 4096  # ">= 4 KiB per partition (target for full saturation)", nki-dma-bandwidth-guide.rst


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
