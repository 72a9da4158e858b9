"""Every hardware rule the emulator enforces: a small kernel that breaks it, and the error it gets."""

import ml_dtypes
import numpy as np
import pytest

from onnx_nmm.kernels.emulator import RULES, NkiValidationError, emulation, jit
from onnx_nmm.kernels.emulator import isa as nisa
from onnx_nmm.kernels.emulator import language as nl


def sbuf(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)


def psum(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.psum)


def partition_max():
    sbuf((256, 4))


def partition_start():
    tile = sbuf((128, 8))
    nisa.tensor_copy(dst=tile[64:128], src=tile[32:96])


def partition_stride():
    sbuf((128, 8))[0:128:2, :]


def view():
    sbuf((128, 8)).permute((1, 0))


def index():
    sbuf((128, 8))[:, 4:9]


def engine_memory():
    data = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.tensor_tensor(dst=sbuf((128, 8)), data1=data, data2=sbuf((128, 8)), op=nl.add)


def elementwise_shape():
    nisa.tensor_tensor(dst=sbuf((128, 8)), data1=sbuf((128, 8)), data2=sbuf((128, 16)), op=nl.add)


def matmul_operands_sbuf():
    nisa.nc_matmul(psum((128, 512)), stationary=sbuf((128, 128)), moving=psum((128, 512)))


def matmul_dst_psum():
    nisa.nc_matmul(sbuf((128, 512)), stationary=sbuf((128, 128)), moving=sbuf((128, 512)))


def matmul_contraction():
    nisa.nc_matmul(psum((128, 512)), stationary=sbuf((128, 128)), moving=sbuf((64, 512)))


def matmul_stationary_fmax():
    nisa.nc_matmul(psum((128, 512)), stationary=sbuf((128, 256)), moving=sbuf((128, 512)))


def matmul_moving_fmax():
    nisa.nc_matmul(psum((128, 1024)), stationary=sbuf((128, 128)), moving=sbuf((128, 1024)))


def matmul_dst_shape():
    nisa.nc_matmul(psum((64, 512)), stationary=sbuf((128, 128)), moving=sbuf((128, 512)))


def matmul_dtype():
    nisa.nc_matmul(psum((128, 512)), stationary=sbuf((128, 128), nl.bfloat16), moving=sbuf((128, 512)))


def psum_bank():
    acc = psum((128, 1024))  # two banks; columns 256..767 straddle their boundary
    nisa.nc_matmul(acc[:, 256:768], stationary=sbuf((128, 128)), moving=sbuf((128, 512)))


def psum_accumulate():
    nisa.nc_matmul(psum((128, 512)), stationary=sbuf((128, 128)), moving=sbuf((128, 512)), accumulate=True)


def psum_capacity():
    banks = [psum((128, 512)) for _ in range(9)]  # 9 banks of 2 KiB; PSUM has 8
    assert banks


def sbuf_capacity():
    tiles = [sbuf((128, 25 * 1024)) for _ in range(2)]  # 200 KiB per partition: over trn1's 192 KiB
    assert tiles


def dma_no_psum():
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=psum((128, 512)))


def dma_element_count():
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=sbuf((128, 256)))


def transpose_size():
    nisa.nc_transpose(dst=sbuf((64, 64)), data=sbuf((64, 64)), engine=nisa.engine.vector)  # VectorE: 32x32


def transpose_buffers():
    nisa.nc_transpose(dst=sbuf((128, 128)), data=sbuf((128, 128)), engine=nisa.engine.tensor)


def transpose_dtype():
    nisa.nc_transpose(dst=psum((128, 128)), data=sbuf((128, 128), nl.bfloat16), engine=nisa.engine.tensor)


def tensor_tensor_psum():
    nisa.tensor_tensor(dst=sbuf((128, 8)), data1=psum((128, 8)), data2=psum((128, 8)), op=nl.add)


def scalar_copy_gen2():
    nisa.tensor_copy(dst=sbuf((128, 8)), src=sbuf((128, 8)), engine=nisa.engine.scalar)


def activation_bias():
    nisa.activation(dst=sbuf((128, 8)), op=nl.copy, data=sbuf((128, 8)), bias=1.0)


def memset_value():
    nisa.memset(sbuf((128, 8), nl.int32), 1.5)


def kernel_output():
    return sbuf((128, 8))


BREAKERS = {
    "partition-max": partition_max,
    "partition-start": partition_start,
    "partition-stride": partition_stride,
    "view": view,
    "index": index,
    "engine-memory": engine_memory,
    "elementwise-shape": elementwise_shape,
    "matmul-operands-sbuf": matmul_operands_sbuf,
    "matmul-dst-psum": matmul_dst_psum,
    "matmul-contraction": matmul_contraction,
    "matmul-stationary-fmax": matmul_stationary_fmax,
    "matmul-moving-fmax": matmul_moving_fmax,
    "matmul-dst-shape": matmul_dst_shape,
    "matmul-dtype": matmul_dtype,
    "psum-bank": psum_bank,
    "psum-accumulate": psum_accumulate,
    "psum-capacity": psum_capacity,
    "sbuf-capacity": sbuf_capacity,
    "dma-no-psum": dma_no_psum,
    "dma-element-count": dma_element_count,
    "transpose-size": transpose_size,
    "transpose-buffers": transpose_buffers,
    "transpose-dtype": transpose_dtype,
    "tensor-tensor-psum": tensor_tensor_psum,
    "scalar-copy-gen2": scalar_copy_gen2,
    "activation-bias": activation_bias,
    "memset-value": memset_value,
    "kernel-output": kernel_output,
}


def test_every_rule_has_a_kernel_that_breaks_it():
    assert set(BREAKERS) | {"kernel-input"} == set(RULES)


@pytest.mark.parametrize("rule", sorted(BREAKERS))
def test_breaking_a_rule_raises_an_error_naming_it(rule):
    kernel = jit(BREAKERS[rule])
    with emulation("trn1"), pytest.raises(NkiValidationError) as raised:
        kernel()
    assert raised.value.rule == rule
    assert str(raised.value).startswith(f"[{rule}] {RULES[rule]}")


def test_float64_inputs_are_refused():
    kernel = jit(lambda x: None)
    with pytest.raises(NkiValidationError, match=r"^\[kernel-input\]"):
        kernel(np.zeros((4, 4)))


def test_trn2_has_room_where_trn1_does_not():
    """200 KiB per partition overflows trn1's 192 KiB SBUF and fits trn2's 224 KiB."""
    kernel = jit(sbuf_capacity)
    with emulation("trn2") as session:
        kernel()
    assert session.traces[0].sbuf_peak_bytes == 200 * 1024


def test_rules_hold_in_trace_only_mode_too():
    kernel = jit(matmul_moving_fmax)
    with emulation("trn2", trace_only=True), pytest.raises(NkiValidationError, match=r"^\[matmul-moving-fmax\]"):
        kernel()


def test_the_kernel_that_keeps_every_rule_runs():
    @jit
    def kernel(a):
        tile = sbuf((128, 512), nl.bfloat16)
        nisa.dma_copy(dst=tile, src=a)
        acc = psum((128, 512))
        nisa.nc_matmul(acc, stationary=tile[:, 0:128], moving=tile, accumulate=False)
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        result = sbuf((128, 512))
        nisa.activation(dst=result, op=nl.copy, data=acc)
        nisa.dma_copy(dst=out, src=result)
        return out

    a = np.ones((128, 512), dtype=ml_dtypes.bfloat16)
    with emulation("trn1"):
        assert (kernel(a) == 128).all()
