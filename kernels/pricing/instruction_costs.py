"""What one instruction costs on a NeuronCore: the formulas of the cost model, in one place.

The trace-based model (cost_model.model_trace) prices every instruction of a traced kernel with these, and
the block planner (blocking.estimate_plan) prices the instructions it counts in a candidate plan's loop nest
with the same ones, so the two agree on every engine's busy time by construction.

- TensorE: max(moving free size, 64) cycles per nc_matmul, 4x for FP32 inputs; a transpose is a matmul
  against an identity whose moving free size is the input's partition count (FP32 4x on trn1, 2x on trn2).
- ScalarE / VectorE / GpSimd: N cycles per input of N elements per partition, +100 cycles when N < 128;
  trn2's VectorE performance mode divides the cycles by the gain its operands allow.
- PSUM: on trn1 ScalarE and VectorE take turns at PSUM's port.
- DMA: the bytes at the 16 queues' aggregate rate times the efficiency of the contiguous run per
  descriptor (hardware.dma_efficiency).
"""

from onnx_nmm.kernels.pricing.hardware import NeuronCore, dma_efficiency


def tensor_engine_seconds(core: NeuronCore, moving: int, fp32: bool, transpose: bool = False) -> float:
    """One nc_matmul with this moving free size, or one TensorE transpose of `moving` partitions."""
    factor = core.pe_fp32_transpose_factor if transpose else core.pe_fp32_factor
    return max(moving, core.pe_min_cycles) * (factor if fp32 else 1) / core.pe_hz


def elementwise_seconds(core: NeuronCore, engine: str, elements: int, inputs: int = 1, vector_gain: int = 1) -> float:
    """One ScalarE ("act"), VectorE ("dve") or GpSimd ("pool") instruction over `elements` per partition,
    reading `inputs` tensors; `vector_gain` is the speed-up trn2's performance mode allows its operands."""
    cycles = max(1, inputs) * elements
    if engine == "dve" and core.vector_perf_mode:
        cycles /= vector_gain
    if elements < core.partitions:
        cycles += core.short_instruction_overhead_cycles
    return cycles / {"act": core.act_hz, "dve": core.dve_hz, "pool": core.pool_hz}[engine]


def takes_psum_port(core: NeuronCore, engine: str, touches_psum: bool) -> bool:
    """Whether the instruction must wait its turn at PSUM: trn1's ScalarE and VectorE share one port."""
    return touches_psum and core.psum_shared_by_act_and_dve and engine in ("act", "dve")


def dma_seconds(core: NeuronCore, nbytes: int, run_bytes: int) -> float:
    """Busy time of the DMA queues (their work divided by their number) to move `nbytes` in contiguous
    runs of `run_bytes` per descriptor."""
    return nbytes / (core.dma_bytes_per_s * dma_efficiency(run_bytes, core))
