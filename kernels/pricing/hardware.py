"""One NeuronCore of Trainium1 and Trainium2, and the instance whose cores a tensor-parallel group spans (its
chips and NeuronLink), as the AWS Neuron documentation describes them.

Every number here comes from the Neuron SDK documentation (github.com/aws-neuron/aws-neuron-sdk, snapshot of
SDK 2.32 / NKI 0.6.0); the comment beside it names the file. Two DMA parameters are fitted, within the bounds
those documents give, to the times AWS measured for its tutorial matmuls. The emulator uses the memory sizes
to enforce capacity, the block-size model uses everything to choose tiles, and the cost model turns the
emulator's instruction trace into a modelled time with it. Nothing here is measured by this project.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KIB = 1024

ARCH_TRN1 = "nki/guides/architecture/trainium_inferentia2_arch.rst"
ARCH_TRN2 = "nki/guides/architecture/trainium2_arch.rst"
DMA_GUIDE = "nki/deep-dives/nki-dma-bandwidth-guide.rst"
DMA_OVERVIEW = "nki/get-started/about/nki-dma-overview.rst"

# Fraction of peak DMA throughput against contiguous bytes per partition (per DMA descriptor), read off the
# figure "DMA Throughput varying Bytes per Partition for p_dim = 128" (nki/img/overviews/nki-dma-intro-1.jpg,
# shown in nki-dma-overview.rst), normalised to its 32 KiB plateau; readings are good to about ±2 %.
# The bandwidth guide states the same shape in words: < 256 B "severely overhead-bound", >= 2 KiB
# "approaches peak", >= 4 KiB "fully amortizes per-packet overhead".
DMA_EFFICIENCY_CURVE = (
    (32, 0.014),
    (64, 0.026),
    (128, 0.050),
    (256, 0.103),
    (512, 0.209),
    (1024, 0.424),
    (2048, 0.813),
    (4096, 0.966),
    (8192, 0.983),
    (16384, 0.993),
    (32768, 1.000),
)


@dataclass(frozen=True)
class NeuronCore:
    """The parameters of one NeuronCore that the emulator, the block-size model and the cost model use."""

    name: str
    nc_version: int  # nki.isa.nc_version: gen2 = Trn1/Inf2, gen3 = Trn2 (nki/api/nki/isa/__init__.py)

    # On-chip memories: 128 partitions each.
    partitions: int  # both archs: 128 partitions
    sbuf_partition_bytes: int
    psum_partition_bytes: int  # 16 KiB = 8 banks of 2 KiB (512 fp32), same on trn1 and trn2
    psum_bank_bytes: int

    # Tensor Engine: a 128x128 systolic array; one MultiplyMoving with moving free size N issues every
    # max(N, MM_INIT_LATENCY) cycles, and FP32 inputs cost about 4x ("Cost Model", ARCH_TRN1).
    pe_hz: float
    pe_min_cycles: int
    pe_fp32_factor: int
    pe_fp32_transpose_factor: int

    # Vector and Scalar engines: ~N cycles per input tile of N elements per partition, plus a static
    # overhead of ~100 cycles for short instructions ("Cost Model" of VectorE, ARCH_TRN1; the same notes
    # apply to ScalarE).
    dve_hz: float
    act_hz: float
    pool_hz: float
    short_instruction_overhead_cycles: int
    vector_perf_mode: bool  # trn2: 2-4x VectorE throughput for BF16/FP16 copies and tensor_tensor
    psum_shared_by_act_and_dve: bool  # trn1: VectorE and ScalarE cannot access PSUM in parallel

    # DMA: 16 engines per NeuronCore, each with a peak rate; every transfer waits ~1300 ns from its
    # semaphore to its start (DMA_GUIDE). The transfers of one HBM tensor go through one queue in order
    # ("DMA transfers within a queue ... are executed in order", DMA_OVERVIEW), each starting that ~1300 ns
    # after the one before, and every descriptor (one contiguous run per partition) costs its engine a fixed
    # overhead on top of its bytes. These two are fitted, within the ranges AWS's numbers allow, to AWS's
    # measured tutorial matmuls (docs/kernels.md, "The DMA model"; tools/tutorial_matmuls.py).
    dma_engines: int
    dma_engine_bytes_per_s: float
    dma_fixed_latency_s: float
    dma_issue_interval_s: float
    dma_descriptor_overhead_s: float | None  # None: hardware.DMA_EFFICIENCY_CURVE instead

    # HBM: the chip's bandwidth shared by its NeuronCores.
    hbm_core_bytes_per_s: float

    @property
    def dma_bytes_per_s(self) -> float:
        return self.dma_engines * self.dma_engine_bytes_per_s

    @property
    def memory_bytes_per_s(self) -> float:
        """The fastest one NeuronCore can move data from HBM: its DMA engines' peak or its share of HBM."""
        return min(self.dma_bytes_per_s, self.hbm_core_bytes_per_s)

    @property
    def pe_bf16_flops(self) -> float:
        """Peak dense BF16 FLOP/s: 128x128 MACs per cycle (92 TFLOPS on trn1, 79 on trn2 in the arch guides)."""
        return 2 * self.partitions * self.partitions * self.pe_hz

    @property
    def psum_banks(self) -> int:
        return self.psum_partition_bytes // self.psum_bank_bytes


TRN1 = NeuronCore(
    name="trn1",
    nc_version=2,
    partitions=128,
    sbuf_partition_bytes=192 * KIB,  # "a 24MiB SBUF ... one SBUF partitions has 192KiB" (ARCH_TRN1)
    psum_partition_bytes=16 * KIB,  # "a 2MiB PSUM ... one PSUM partition has 16KiB" (ARCH_TRN1)
    psum_bank_bytes=2 * KIB,  # one matmul output fits one 2 KiB bank per partition (ARCH_TRN1)
    pe_hz=2.8e9,  # Tensor engine 2.8 GHz (ARCH_TRN1 engine table)
    pe_min_cycles=64,  # MM_INIT_LATENCY = 64 TensorE cycles on NeuronCore-v2 (ARCH_TRN1 "Cost Model")
    pe_fp32_factor=4,  # "For FP32 input data type, the instruction cost is roughly 4x higher" (ARCH_TRN1)
    pe_fp32_transpose_factor=4,  # a transpose is a matmul against identity on NeuronCore-v2 (ARCH_TRN1)
    dve_hz=1.12e9,  # Vector engine 1.12 GHz (ARCH_TRN1 engine table)
    act_hz=1.4e9,  # Scalar engine 1.4 GHz (ARCH_TRN1 engine table)
    pool_hz=1.4e9,  # GpSimd engine 1.4 GHz (ARCH_TRN1 engine table)
    short_instruction_overhead_cycles=100,  # "static instruction overhead of 100 engine cycles" (ARCH_TRN1)
    vector_perf_mode=False,
    psum_shared_by_act_and_dve=True,  # "VectorE and ScalarE can access PSUM in parallel ... disallowed in
    # NeuronCore-v2" (ARCH_TRN2, "Data Movement Updates")
    dma_engines=16,  # "16 parallel DMA engines" per NeuronCore-v2 (ARCH_TRN1)
    dma_engine_bytes_per_s=17e9,  # TRN1 "17 B/ns" per engine, 272 GB/s aggregate (DMA_GUIDE table)
    dma_fixed_latency_s=1.3e-6,  # "semaphore-to-start latency (~1300 ns cross-engine)" (DMA_GUIDE)
    dma_issue_interval_s=1.3e-6,  # DMA_GUIDE's ~1300 ns per transfer, paid in turn within one queue
    dma_descriptor_overhead_s=12e-9,  # <= 16 ns (DMA_OVERVIEW example 1), 0-25 ns (the tutorial fit)
    hbm_core_bytes_per_s=820e9 / 2,  # 820 GB/s per Trainium1 chip of 2 NeuronCores (ARCH_TRN1)
)

TRN2 = NeuronCore(
    name="trn2",
    nc_version=3,
    partitions=128,
    sbuf_partition_bytes=224 * KIB,  # "28MiB (or, 128 partitions of 224KiB)" (ARCH_TRN2)
    psum_partition_bytes=16 * KIB,  # "PSUM capacity remains the same at 2MiB" (ARCH_TRN2)
    psum_bank_bytes=2 * KIB,
    pe_hz=2.4e9,  # Tensor engine 2.4 GHz (ARCH_TRN2 engine table); 79 BF16 TFLOPS
    pe_min_cycles=64,  # documented for NeuronCore-v2 only; assumed unchanged on v3
    pe_fp32_factor=4,  # 20 FP32 vs 79 BF16 dense TFLOPS (ARCH_TRN2 "Tensor Engine")
    pe_fp32_transpose_factor=2,  # transpose mode: "2x speedup in FP32 transpose" (ARCH_TRN2)
    dve_hz=0.96e9,  # Vector engine 0.96 GHz (ARCH_TRN2 engine table)
    act_hz=1.2e9,  # Scalar engine 1.2 GHz (ARCH_TRN2 engine table)
    pool_hz=1.2e9,  # GpSimd engine 1.2 GHz (ARCH_TRN2 engine table)
    short_instruction_overhead_cycles=100,  # ARCH_TRN1 notes, which ARCH_TRN2 keeps for NeuronCore-v3
    vector_perf_mode=True,  # "Vector Engine Performance Mode" (ARCH_TRN2)
    psum_shared_by_act_and_dve=False,
    dma_engines=16,  # "each NeuronCore-v3 is typically paired with 16x DMA engines" (ARCH_TRN2)
    dma_engine_bytes_per_s=23e9,  # TRN2 "23 B/ns" per engine, 368 GB/s aggregate (DMA_GUIDE table)
    dma_fixed_latency_s=1.3e-6,  # DMA_GUIDE (not given per generation)
    dma_issue_interval_s=1.3e-6,  # as trn1
    dma_descriptor_overhead_s=12e-9,  # as trn1
    hbm_core_bytes_per_s=2.9e12 / 8,  # 2.9 TB/s per Trainium2 chip of 8 NeuronCores (ARCH_TRN2: "3TB/s")
)

NEURON_CORES = {"trn1": TRN1, "trn2": TRN2}
TRAINIUM_TARGETS = tuple(NEURON_CORES)  # every target the kernels are planned and priced for


def neuron_core(target: str | NeuronCore) -> NeuronCore:
    """The NeuronCore description for a target name ("trn1", "trn2") or a description itself."""
    if isinstance(target, NeuronCore):
        return target
    try:
        return NEURON_CORES[target]
    except KeyError:
        raise ValueError(f"unknown Trainium target {target!r}; use one of {', '.join(TRAINIUM_TARGETS)}") from None


def dma_efficiency(contiguous_bytes: float, core: NeuronCore | None = None) -> float:
    """Fraction of peak DMA bandwidth reached when each descriptor moves `contiguous_bytes` bytes.

    With a core whose dma_descriptor_overhead_s is set: the bytes' time at the engine's rate over that time
    plus the overhead. Otherwise interpolated in log2(bytes) between the readings of DMA_EFFICIENCY_CURVE;
    proportional to the size below the first reading (the overhead-bound regime) and 1 above the plateau.
    """
    if core is not None and core.dma_descriptor_overhead_s is not None:
        moving = contiguous_bytes / core.dma_engine_bytes_per_s
        return moving / (moving + core.dma_descriptor_overhead_s)
    points = DMA_EFFICIENCY_CURVE
    if contiguous_bytes <= points[0][0]:
        return points[0][1] * contiguous_bytes / points[0][0]
    if contiguous_bytes >= points[-1][0]:
        return points[-1][1]
    position = math.log2(contiguous_bytes)
    for (size_lo, eff_lo), (size_hi, eff_hi) in zip(points, points[1:]):
        if contiguous_bytes <= size_hi:
            fraction = (position - math.log2(size_lo)) / (math.log2(size_hi) - math.log2(size_lo))
            return eff_lo + fraction * (eff_hi - eff_lo)
    raise AssertionError("unreachable: the curve covers every size")


INSTANCE_TRN1 = "about-neuron/arch/neuron-hardware/trn1-arch.rst"
INSTANCE_TRN2 = "about-neuron/arch/neuron-hardware/trn2-arch.rst"
CHIP_COMPARISON = "about-neuron/arch/neuron-hardware/trainium2.rst"
INTRANODE_COLLECTIVES = "neuron-runtime/explore/intranode-collective-comm.rst"


@dataclass(frozen=True)
class Instance:
    """The largest instance of a Trainium generation, as a tensor-parallel group sees it: its chips, the
    NeuronCores on each (each one rank, priced as `neuron_core` prices one), and the NeuronLink between chips."""

    name: str
    chips: int
    cores_per_chip: int
    neuronlink_bytes_per_s: float  # one chip's NeuronLink bandwidth to the other chips of the instance
    collective_hop_s: float  # one step of a collective algorithm from one rank to the next

    @property
    def cores(self) -> int:
        return self.chips * self.cores_per_chip


TRN1_32XLARGE = Instance(
    name="trn1.32xlarge",
    chips=16,  # "Trn1.32xlarge ... 16" Trainium chips, in a 2D torus of NeuronLink-v2 (INSTANCE_TRN1)
    cores_per_chip=2,  # "each Trainium include 2 x NeuronCore-v2" (trainium.rst): 32 NeuronCores
    neuronlink_bytes_per_s=384e9,  # "Inter-chip Interconnect (GB/sec/chip)": Trainium 384 (CHIP_COMPARISON)
    # "the per-hop latency of Ring/KangaRing is about 1-2 us (HBM load dependent)" (INTRANODE_COLLECTIVES):
    # the middle of that range. The page gives no figure per generation; trn1 is assumed to be the same.
    collective_hop_s=1.5e-6,
)

TRN2_48XLARGE = Instance(
    name="trn2.48xlarge",
    chips=16,  # "16 Trainium2 chips connected using a 4x4, 2D Torus" of NeuronLink-v3 (INSTANCE_TRN2)
    # "Every Trainium2 chip contains eight NeuronCore-V3 cores" (trainium2.rst): 128 ranks at LNC=1. NxD's
    # default, LNC=2, makes one rank of two of them (64 ranks); a rank here is one core, as TRN2 prices one.
    cores_per_chip=8,
    # "Intra-instance NeuronLink-v3 bandwidth (GB/sec/chip)": 1,024 (INSTANCE_TRN2); the chip's 1.28 TB/s
    # (CHIP_COMPARISON) adds the 256 GB/s that link instances of an UltraServer
    neuronlink_bytes_per_s=1024e9,
    collective_hop_s=1.5e-6,  # as trn1: "about 1-2 us" per hop (INTRANODE_COLLECTIVES)
)

INSTANCES = {"trn1": TRN1_32XLARGE, "trn2": TRN2_48XLARGE}


def instance(target: str) -> Instance:
    """The instance whose NeuronCores a tensor-parallel group of `target` ("trn1", "trn2") spans."""
    neuron_core(target)  # an unknown target is refused as neuron_core refuses it
    return INSTANCES[target]
