"""The instruction trace the emulator records for the cost model: one record per nki.isa instruction.

A record holds what the cost model prices (sizes, dtypes, engine) and which bytes the instruction reads and
writes, so the model can order instructions by their data dependencies. It holds no tensors or data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Engines of a NeuronCore: TensorE, ScalarE (activation), VectorE, GpSimdE, and the DMA engines.
ENGINES = ("pe", "act", "dve", "pool", "dma")

# An access: (address space, storage key, first byte, end byte). "hbm" uses the storage id and bytes within
# that tensor. On-chip spaces ("sbuf", "psum") do the same while the kernel runs; when it returns, the
# emulator places its storages and rewrites them to key 0 and byte addresses within a partition.
Access = tuple


@dataclass(slots=True)
class Instruction:
    op: str
    engine: str
    reads: tuple[Access, ...]
    writes: tuple[Access, ...]
    size: int = 0  # PE: moving free size; ACT/DVE/Pool: elements per partition; DMA: bytes moved
    inputs: int = 1  # ACT/DVE/Pool: tensors read per element
    fp32: bool = False  # PE: float32 operands
    transpose: bool = False  # PE: a transpose (not useful FLOPs)
    flops: int = 0  # PE: 2 * contraction * stationary free * moving free
    vector_gain: int = 1  # DVE: speed-up the trn2 performance mode allows for these operands
    psum: bool = False  # ACT/DVE: touches PSUM
    partitions: int = 0  # DMA: partitions of the on-chip side
    run_bytes: int = 0  # DMA: contiguous bytes per descriptor
    hbm_read: int = 0
    hbm_write: int = 0


@dataclass
class KernelTrace:
    """Everything one kernel launch did, in program order, with its peak on-chip memory per partition."""

    kernel: str
    target: str
    input_shapes: tuple[tuple[int, ...], ...] = ()  # of the tensors passed positionally
    instructions: list[Instruction] = field(default_factory=list)
    sbuf_peak_bytes: int = 0
    psum_peak_bytes: int = 0
