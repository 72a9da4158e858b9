"""On-chip memory by liveness: a tile holds SBUF from its allocation to its last use, not while Python
holds a reference to it, and a kernel whose live tiles exceed SBUF is refused with the tiles named."""

import ml_dtypes
import numpy as np
import pytest

from onnx_nmm.kernels.emulator import NkiValidationError, emulation, jit
from onnx_nmm.kernels.emulator import isa as nisa
from onnx_nmm.kernels.emulator import language as nl
from onnx_nmm.kernels.pricing.cost_model import model_trace
from onnx_nmm.kernels.pricing.hardware import KIB, TRN1

TILE = (128, 4096)  # bf16: 8 KiB per partition
TILE_BYTES = 8 * KIB


@jit
def block_sums(a):
    """out[b] = sum over k of a[b, k]: each block's tiles are loaded into a list rebuilt in every iteration
    (the hoisted-load pattern of AWS's matmul tutorial), then summed."""
    blocks, tiles_per_block = a.shape[0], a.shape[1]
    out = nl.ndarray((blocks, *TILE), dtype=nl.float32, buffer=nl.shared_hbm)
    for b in range(blocks):
        tiles = []
        for k in range(tiles_per_block):
            tile = nl.ndarray(TILE, dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=a[b, k])
            tiles.append(tile)
        total = nl.ndarray(TILE, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=total, src=tiles[0])
        for tile in tiles[1:]:
            nisa.tensor_tensor(dst=total, data1=total, data2=tile, op=nl.add)
        nisa.dma_copy(dst=out[b], src=total)
    return out


def blocks_of(tiles_per_block, blocks=3):
    rng = np.random.default_rng(0)
    return rng.standard_normal((blocks, tiles_per_block, *TILE)).astype(ml_dtypes.bfloat16)


def test_a_list_rebuilt_in_a_loop_is_charged_once():
    """15 tiles of 8 KiB per block: 120 KiB live, 240 KiB if the old list were held while the new one
    loads; trn1 has 192 KiB, so this kernel fits only because memory is counted by liveness."""
    a = blocks_of(15)
    assert 2 * 15 * TILE_BYTES > TRN1.sbuf_partition_bytes >= 15 * TILE_BYTES + 16 * KIB
    with emulation("trn1") as session:
        out = block_sums(a)
    np.testing.assert_allclose(out, a.astype(np.float32).sum(axis=1), rtol=1e-5, atol=1e-4)
    assert session.traces[0].sbuf_peak_bytes == 15 * TILE_BYTES + 16 * KIB  # one list and the fp32 total


def test_tiles_live_at_once_beyond_sbuf_are_refused_naming_them():
    """23 tiles of 8 KiB all live before the first sum: 184 KiB plus the 16 KiB total is over trn1's 192."""
    with emulation("trn1"), pytest.raises(NkiValidationError) as refused:
        block_sums(blocks_of(23, blocks=1))
    message = str(refused.value)
    assert refused.value.rule == "sbuf-capacity"
    assert "204800 B per partition are live" in message
    assert "23 x (128, 4096) bfloat16 from test_emulator_memory.py:" in message
    assert "1 x (128, 4096) float32 from test_emulator_memory.py:" in message


def test_the_same_kernel_fits_the_larger_sbuf_of_trn2():
    with emulation("trn2") as session:
        block_sums(blocks_of(23, blocks=1))
    assert session.traces[0].sbuf_peak_bytes == 23 * TILE_BYTES + 16 * KIB


def test_a_tile_is_free_after_its_last_use_even_while_python_holds_it():
    @jit
    def kernel():
        kept = []
        for _ in range(4):
            tile = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(tile, 0.0)
            kept.append(tile)

    with emulation("trn1") as session:
        kernel()
    assert session.traces[0].sbuf_peak_bytes == 4 * KIB


def test_freed_bytes_are_reused_only_after_their_last_reader():
    """The cost model orders a load into reused bytes after the last instruction that read them."""
    with emulation("trn1") as session:
        block_sums(blocks_of(15))
    trace = session.traces[0]
    schedule = []
    model_trace(trace, schedule=schedule)
    last_use = {}
    for i, ins in enumerate(trace.instructions):
        for space, _, low, high in ins.reads + ins.writes:
            if space == "sbuf":
                for address in range(low, high, 4096):
                    if ins.op == "dma_copy" and ins.writes[0][0] == "sbuf" and address in last_use:
                        reader = last_use[address]
                        assert schedule[i][1] >= schedule[reader][2], (i, reader)
                    last_use[address] = i
