"""What the emulator computes and tracks: fresh memory, bf16 rounding, PSUM accumulation, views."""

import ml_dtypes
import numpy as np
import pytest

from onnx_nmm.kernels.emulator import NkiValidationError, Placeholder, emulation, jit
from onnx_nmm.kernels.emulator import isa as nisa
from onnx_nmm.kernels.emulator import language as nl
from onnx_nmm.kernels.nki_kernels import nki_api

BF16 = ml_dtypes.bfloat16


def store(tile, dtype=None):
    """Copy an SBUF tile to a fresh shared-HBM output."""
    out = nl.ndarray(tile.shape, dtype=dtype or tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def matmul_kernel(accumulates):
    """Two matmuls of ones (contraction 4) into one PSUM tile, with the given accumulate flags."""

    @jit
    def kernel():
        ones = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(ones, 1.0)
        acc = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.psum)
        for accumulate in accumulates:
            nisa.nc_matmul(acc, stationary=ones, moving=ones, accumulate=accumulate)
        result = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=result, op=nl.copy, data=acc)
        return store(result)

    return kernel


def test_kernels_get_nki_from_the_emulator_here():
    assert nki_api.USING_EMULATOR
    assert nki_api.nl.ndarray is nl.ndarray and nki_api.nisa.nc_matmul is nisa.nc_matmul


def test_fresh_memory_holds_nan():
    kernel = jit(lambda: store(nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)))
    assert np.isnan(kernel()).all()


def test_casts_to_bf16_round_to_nearest_even():
    halfway = np.array([[1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)]], dtype=np.float32)  # exactly between two bf16

    @jit
    def kernel(x):
        tile = nl.ndarray((1, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        rounded = nl.ndarray((1, 3), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.activation(dst=rounded, op=nl.copy, data=tile)
        return store(rounded)

    result = kernel(halfway)
    assert result.dtype == BF16
    np.testing.assert_array_equal(result.astype(np.float32), [[1.0, 1 + 2**-6, -1.0]])


@pytest.mark.parametrize(
    ("accumulates", "expected"),
    [((None, None), 8), ((False, True), 8), ((None, False), 4), ((False,), 4)],
)
def test_nc_matmul_accumulates_in_psum(accumulates, expected):
    assert (matmul_kernel(accumulates)() == expected).all()


def test_default_accumulation_is_decided_per_psum_location():
    """accumulate=None adds where an earlier nc_matmul wrote and overwrites elsewhere."""

    @jit
    def kernel():
        ones = nl.ndarray((2, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(ones, 1.0)
        acc = nl.ndarray((2, 8), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc[:, 0:4], stationary=ones[:, 0:2], moving=ones[:, 0:4])
        nisa.nc_matmul(acc, stationary=ones[:, 0:2], moving=ones)
        result = nl.ndarray((2, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=result, src=acc)
        return store(result)

    np.testing.assert_array_equal(kernel(), [[4, 4, 4, 4, 2, 2, 2, 2]] * 2)


def test_psum_written_by_another_engine_cannot_be_accumulated_onto():
    @jit
    def kernel():
        ones = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(ones, 1.0)
        acc = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(acc, 0.0)
        nisa.nc_matmul(acc, stationary=ones, moving=ones, accumulate=True)

    with pytest.raises(NkiValidationError, match=r"^\[psum-accumulate\]"):
        kernel()


def test_views_slice_step_reshape_and_permute_like_numpy():
    x = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)

    @jit
    def kernel(x):
        tile = nl.ndarray((6, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        picked = nl.ndarray((6, 2, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=picked, src=tile[:, 1:8:2].reshape((6, 2, 2)).permute((0, 2, 1)))
        transposed = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=transposed, src=x.permute((1, 0))[2:6, :])
        return store(picked), store(transposed)

    picked, transposed = kernel(x)
    np.testing.assert_array_equal(picked, x[:, 1:8:2].reshape(6, 2, 2).transpose(0, 2, 1))
    np.testing.assert_array_equal(transposed, x.T[2:6])


def test_an_on_chip_integer_index_keeps_the_partition_dimension():
    seen = {}

    @jit
    def kernel():
        tile = nl.ndarray((128, 4, 8), dtype=nl.float32, buffer=nl.sbuf)
        seen["row"], seen["column"] = tile[3].shape, tile[:, 2].shape

    kernel()
    assert seen == {"row": (1, 4, 8), "column": (128, 8)}


def test_trace_only_mode_traces_the_same_instructions_without_data():
    @jit
    def kernel(a):
        tile = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=a)
        return store(tile)

    with emulation("trn2") as computed:
        kernel(np.ones((128, 64), dtype=np.float32))
    with emulation("trn2", trace_only=True) as traced:
        result = kernel(Placeholder((128, 64), "float32"))
    assert result == Placeholder((128, 64), "float32")

    def without_storage_ids(instructions):  # HBM accesses name their storage by a running id
        return [(i.op, i.engine, i.size, i.run_bytes, [a[2:] for a in i.reads + i.writes]) for i in instructions]

    assert without_storage_ids(traced.traces[0].instructions) == without_storage_ids(computed.traces[0].instructions)


def test_the_target_comes_from_the_platform_variable(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    version = {}
    jit(lambda: version.setdefault("nc", nisa.get_nc_version()))()
    assert version["nc"] is nisa.nc_version.gen2


def test_the_trace_records_what_the_cost_model_needs():
    @jit
    def kernel(a):
        tile = nl.ndarray((128, 2048), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile[:, 0:1024], src=a)
        acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, stationary=tile[:, 0:128], moving=tile[:, 0:512])

    with emulation("trn2", trace_only=True) as session:
        kernel(Placeholder((128, 1024), "bfloat16"))
    load, matmul = session.traces[0].instructions
    assert ((load.engine, load.size, load.partitions, load.run_bytes, load.hbm_read)
            == ("dma", 262144, 128, 2048, 262144))
    assert (matmul.engine, matmul.size, matmul.flops, matmul.fp32) == ("pe", 512, 2 * 128 * 128 * 512, False)
    assert matmul.reads[0][0] == "sbuf" and matmul.writes[0][0] == "psum"
