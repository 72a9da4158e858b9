"""The cost model: per-instruction costs from AWS's numbers, overlap of engines, and the calibration anchor."""

import dataclasses

import pytest

from onnx_nmm.kernels import dense_matmul_lhsT, estimate, lowrank_unfused
from onnx_nmm.kernels.emulator import Placeholder, emulation, jit
from onnx_nmm.kernels.emulator import isa as nisa
from onnx_nmm.kernels.emulator import language as nl
from onnx_nmm.kernels.pricing.blocking import DensePlan, plan_dense
from onnx_nmm.kernels.pricing.cost_model import model_trace, model_traces
from onnx_nmm.kernels.pricing.hardware import TRN1, TRN2, dma_efficiency

# AWS's fully optimized NKI matmul tutorial, bf16 [4096,8192] @ [8192,8192] on trn1.32xlarge: 6.97 ms, 85.24 %
# HFU (SDK v2.26.0 general/nki/tutorials/matrix_multiplication.rst).
ANCHOR_MS = 6.97
ANCHOR_SHAPES = ((8192, 4096), (8192, 8192))  # lhsT [K, M], rhs [K, N]
TUTORIAL_BLOCKS = DensePlan(m_stripe=2048, m_block=2048, n_block=1024, k_tiles=8)


def cost(kernel, *inputs, target="trn1"):
    with emulation(target, trace_only=True) as session:
        kernel(*inputs)
    return model_traces(session.traces, target)


def sbuf(shape, dtype=nl.bfloat16):
    tile = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    nisa.memset(tile, 0.0)
    return tile


def matmuls(count, moving, dtype=nl.bfloat16):
    @jit
    def kernel():
        stationary, data = sbuf((128, 128), dtype), sbuf((128, moving), dtype)
        acc = nl.ndarray((128, moving), dtype=nl.float32, buffer=nl.psum)
        for i in range(count):
            nisa.nc_matmul(acc, stationary=stationary, moving=data, accumulate=i > 0)

    return kernel


@pytest.mark.parametrize(
    ("target", "moving", "dtype", "cycles"),
    [(TRN1, 512, nl.bfloat16, 512), (TRN1, 32, nl.bfloat16, 64), (TRN1, 512, nl.float32, 4 * 512),
     (TRN2, 256, nl.bfloat16, 256)],
)
def test_a_matmul_costs_its_moving_free_size_in_tensor_engine_cycles(target, moving, dtype, cycles):
    modelled = cost(matmuls(100, moving, dtype), target=target.name)
    assert modelled.busy_s["pe"] == pytest.approx(100 * cycles / target.pe_hz)


def test_dma_time_is_bytes_over_bandwidth_times_the_efficiency_of_its_contiguous_runs():
    @jit
    def kernel(a):
        tile = nl.ndarray((128, 4096), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=a)  # 8 KiB contiguous per partition
        for j in range(16):  # the same bytes again, 512 B per partition per transfer
            nisa.dma_copy(dst=tile[:, j * 256 : (j + 1) * 256], src=a[:, j * 256 : (j + 1) * 256])

    modelled = cost(kernel, Placeholder((128, 4096), "bfloat16"))
    nbytes = 128 * 4096 * 2
    expected = nbytes / TRN1.dma_bytes_per_s * (1 / dma_efficiency(8192, TRN1) + 1 / dma_efficiency(512, TRN1))
    assert modelled.busy_s["dma"] == pytest.approx(expected)
    assert modelled.hbm_read_bytes == 2 * nbytes and modelled.hbm_write_bytes == 0


def test_the_dma_efficiency_curve_follows_the_published_figure():
    assert dma_efficiency(2048) == pytest.approx(0.813)
    assert dma_efficiency(4096) == pytest.approx(0.966)
    assert dma_efficiency(32768) == dma_efficiency(1 << 20) == 1.0
    sizes = [2**k for k in range(2, 16)]  # rising up to the 32 KiB plateau
    assert all(dma_efficiency(a) < dma_efficiency(b) for a, b in zip(sizes, sizes[1:]))


def test_each_descriptor_costs_its_bytes_at_the_engine_rate_plus_a_fixed_overhead():
    moving = 2048 / TRN1.dma_engine_bytes_per_s
    assert dma_efficiency(2048, TRN1) == pytest.approx(moving / (moving + TRN1.dma_descriptor_overhead_s))
    assert dma_efficiency(256, TRN1) < dma_efficiency(2048, TRN1) < dma_efficiency(32768, TRN1) < 1.0
    figure_instead = dataclasses.replace(TRN1, dma_descriptor_overhead_s=None)
    assert dma_efficiency(2048, figure_instead) == dma_efficiency(2048)


def test_transfers_of_one_tensor_start_an_issue_interval_apart():
    """The DMA queues, one per HBM tensor: 64 small loads of one tensor take 64 issue intervals; the same loads
    spread over two tensors take half as long."""

    def loads(tensors):
        @jit
        def kernel(*sources):
            for j in range(64):
                tile = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
                nisa.dma_copy(dst=tile, src=sources[j % tensors][:, (j // tensors) * 64:(j // tensors + 1) * 64])

        return kernel

    core = TRN1
    one = cost(loads(1), Placeholder((128, 4096), "bfloat16"), target=core)
    two = cost(loads(2), Placeholder((128, 4096), "bfloat16"), Placeholder((128, 4096), "bfloat16"), target=core)
    assert one.total_s == pytest.approx(63 * 1.3e-6 + TRN1.dma_fixed_latency_s, rel=0.02)
    assert two.total_s == pytest.approx(31 * 1.3e-6 + TRN1.dma_fixed_latency_s, rel=0.04)
    without_interval = dataclasses.replace(core, dma_issue_interval_s=0.0)
    assert cost(loads(1), Placeholder((128, 4096), "bfloat16"), target=without_interval).total_s < 0.3 * one.total_s


def test_a_tensors_transfers_are_issued_in_program_order():
    """One queue per HBM tensor, in order: a load whose buffer is free at once still waits behind an earlier
    load of the same tensor that waits for its buffer; a load of another tensor does not."""

    def kernel_loading(later_source):
        @jit
        def kernel(a, b):
            busy = sbuf((128, 512))  # written by VectorE before the first load may overwrite it
            nisa.tensor_copy(dst=busy, src=sbuf((128, 512)))
            nisa.dma_copy(dst=busy, src=a[:, 0:512])
            nisa.dma_copy(dst=nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.sbuf), src=later_source(a, b))

        return kernel

    schedules = {}
    for name, source in (("same tensor", lambda a, b: a[:, 512:1024]), ("other tensor", lambda a, b: b[:, 0:512])):
        with emulation("trn1", trace_only=True) as session:
            kernel_loading(source)(Placeholder((128, 1024), "bfloat16"), Placeholder((128, 1024), "bfloat16"))
        (trace,) = session.traces
        schedule = []
        model_trace(trace, "trn1", schedule=schedule)
        first, second = [times for ins, times in zip(trace.instructions, schedule) if ins.engine == "dma"]
        schedules[name] = (first, second)
    first, second = schedules["same tensor"]
    assert second[1] >= first[1] + TRN1.dma_issue_interval_s  # issued after the earlier one, an interval apart
    first, second = schedules["other tensor"]
    assert second[1] < first[1]  # its own queue: it goes while the first waits for its buffer


@pytest.mark.parametrize("dependent", [False, True])
def test_engines_overlap_unless_one_waits_for_the_others_data(dependent):
    @jit
    def kernel(a):
        loaded = nl.ndarray((128, 4096), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=loaded, src=a)
        stationary = sbuf((128, 128))
        moving = loaded[:, 0:512] if dependent else sbuf((128, 512))
        acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        for i in range(20):  # about as long as the load
            nisa.nc_matmul(acc, stationary=stationary, moving=moving, accumulate=i > 0)

    modelled = cost(kernel, Placeholder((128, 4096), "bfloat16"))
    pe, dma = modelled.busy_s["pe"], modelled.busy_s["dma"]
    if dependent:
        assert modelled.total_s > pe + dma
    else:
        assert max(pe, dma) < modelled.total_s < 0.8 * (pe + dma)


@pytest.mark.parametrize(("target", "shared"), [("trn1", True), ("trn2", False)])
def test_scalar_and_vector_engines_take_turns_at_psum_on_trn1_only(target, shared):
    @jit
    def kernel():
        for _ in range(50):
            first = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            second = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            nisa.activation(dst=nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf), op=nl.copy, data=first)
            nisa.tensor_copy(dst=nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf), src=second)

    modelled = cost(kernel, target=target)
    act, dve = modelled.busy_s["act"], modelled.busy_s["dve"]
    if shared:
        assert modelled.total_s >= act + dve - 1e-12
    else:
        assert modelled.total_s < 0.8 * (act + dve)


def test_vector_engine_costs_two_cycles_per_element_for_two_inputs_and_trn2_bf16_goes_faster():
    @jit
    def kernel():
        a, b = sbuf((128, 512)), sbuf((128, 512))
        for _ in range(10):
            nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)

    trn1 = cost(kernel, target="trn1").busy_s["dve"]
    trn2 = cost(kernel, target="trn2").busy_s["dve"]
    memsets = 2 * 512  # the operands' two memsets: one pass each
    assert trn1 == pytest.approx((10 * 2 * 512 + memsets) / TRN1.dve_hz)
    assert trn2 == pytest.approx((10 * 2 * 512 / 2 + memsets) / TRN2.dve_hz)


def test_launches_in_sequence_add_up():
    modelled = estimate(lowrank_unfused, (256, 512), (512, 128), (128, 1024), target="trn1")
    assert modelled.kernels == ["dense_matmul", "dense_matmul"]
    assert modelled.total_s == pytest.approx(sum(modelled.per_kernel_s))
    assert modelled.hbm_write_bytes == (256 * 128 + 256 * 1024) * 2


@pytest.mark.parametrize("blocks", ["tutorial", "model"])
def test_the_tutorial_matmul_lands_within_20_percent_of_its_measured_6_97_ms(blocks):
    """The calibration anchor: no correction factor, only the published engine numbers."""
    lhsT, rhs = ANCHOR_SHAPES
    plan = TUTORIAL_BLOCKS if blocks == "tutorial" else plan_dense(4096, 8192, 8192, "bfloat16", True, "trn1")
    modelled = estimate(dense_matmul_lhsT, lhsT, rhs, target="trn1", plan=plan)
    assert modelled.total_s * 1e3 == pytest.approx(ANCHOR_MS, rel=0.20)
    assert 0.80 <= modelled.pe_utilization <= 1.0
    assert modelled.flops == 2 * 4096 * 8192 * 8192


def test_one_dma_engine_moves_32_kib_in_the_time_the_dma_overview_measured():
    """nki-dma-overview.rst, example 1: A[4, 4096] bf16 from HBM to SBUF on trn2 uses one DMA engine for
    1416 ns (a check of the per-engine rate and the descriptor overhead, which it bounds to <= 16 ns)."""

    @jit
    def kernel(a):
        nisa.dma_copy(dst=nl.ndarray((4, 4096), dtype=nl.bfloat16, buffer=nl.sbuf), src=a)

    modelled = cost(kernel, Placeholder((4, 4096), "bfloat16"), target="trn2")
    one_engine_s = modelled.busy_s["dma"] * TRN2.dma_engines
    assert one_engine_s == pytest.approx(1416e-9, rel=0.05)
    assert modelled.total_s == pytest.approx(TRN2.dma_fixed_latency_s + one_engine_s)
