"""What a collective between the NeuronCores of one Trainium instance costs (modelled): the all-reduce and the
all-gather that join the ranks of a tensor-parallel group, over the chip's own fabric and NeuronLink.

    time = hops · per-hop latency + the bytes each rank sends / the bandwidth it sends them at

The bytes are the ring's, the least any algorithm sends (nccom-test.rst, "Bus Bandwidth Calculation"): an
all-reduce of a B-byte buffer over N ranks is a reduce-scatter then an all-gather, 2(N−1)/N · B from every rank;
an all-gather of a B-byte result, (N−1)/N · B. The hops are those of the algorithm the Neuron runtime picks at
that size (intranode-collective-comm.rst, "Algorithm Summary", its sweet ranges measured by AWS): Mesh below
1 MB, one routed write to every other chip and one exchange on the chip per phase; RDH to 56 MB, recursive
doubling over the chips, log2 of them, and one exchange on the chip; a ring above, N−1 hops per phase. Mesh's
routed writes over-subscribe links, which this leaves out: like the roofline, a lower bound.

A rank sends at its NeuronCore's DMA bandwidth while the group is on one chip, and at its share of the chip's
NeuronLink bandwidth (the ranks of a chip send at once) when it spans chips, whichever is less; ranks fill chips
in order. kernels/pricing/hardware.py has the instance figures and where each comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx_nmm.kernels.pricing.hardware import instance, neuron_core
from onnx_nmm.trainium.launch_costs import ELEMENT_BYTES

ALL_REDUCE, ALL_GATHER = "all-reduce", "all-gather"
MESH, RDH, RING = "mesh", "RDH", "ring"
MESH_BELOW_BYTES = 1 << 20  # "Mesh ... < 1MB" (intranode-collective-comm.rst, "Algorithm Summary")
RDH_BELOW_BYTES = 56 << 20  # "RDH ... 1-56MB"; above it, KangaRing, a ring (same page)


@dataclass(frozen=True)
class Collective:
    """One collective of a forward pass: `width` elements per token (the reduced buffer of an all-reduce, the
    gathered result of an all-gather), after `what`, priced over `ranks` NeuronCores at `tokens` tokens."""

    kind: str  # ALL_REDUCE or ALL_GATHER
    what: str  # the layer whose result it joins: "o_proj", "down_proj's X·U", "lm_head logits", ...
    width: int
    tokens: int
    ranks: int
    algorithm: str
    seconds: float
    sent_bytes: float  # what one rank sends

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.what}, {self.width}×bf16 per token)"


def collective(kind: str, what: str, width: int, tokens: int, ranks: int, target: str) -> Collective:
    """`kind` of `width` bfloat16 elements per token over the first `ranks` NeuronCores of `target`'s instance."""
    buffer = ELEMENT_BYTES * width * tokens
    phases = 2 if kind == ALL_REDUCE else 1  # an all-reduce is a reduce-scatter, then an all-gather
    sent = phases * (ranks - 1) / ranks * buffer
    algorithm = MESH if buffer < MESH_BELOW_BYTES else RDH if buffer < RDH_BELOW_BYTES else RING
    seconds = phases * hops_per_phase(algorithm, ranks, target) * instance(target).collective_hop_s \
        + sent / rank_bytes_per_s(ranks, target)
    return Collective(kind, what, width, tokens, ranks, algorithm, seconds, sent)


def hops_per_phase(algorithm: str, ranks: int, target: str) -> int:
    """The steps of one reduce-scatter or all-gather of `algorithm` over `ranks` NeuronCores."""
    chips, per_chip = _placement(ranks, target)
    on_chip = 1 if per_chip > 1 else 0  # the exchange between a chip's own ranks
    if algorithm == MESH:
        return (1 if chips > 1 else 0) + on_chip
    if algorithm == RDH:
        return math.ceil(math.log2(chips)) + on_chip
    return ranks - 1


def rank_bytes_per_s(ranks: int, target: str) -> float:
    """What one rank of a group of `ranks` sends at: its DMA engines' bandwidth on one chip; across chips, no more
    than its share of the chip's NeuronLink bandwidth."""
    chips, per_chip = _placement(ranks, target)
    dma = neuron_core(target).dma_bytes_per_s
    return dma if chips == 1 else min(dma, instance(target).neuronlink_bytes_per_s / per_chip)


def _placement(ranks: int, target: str) -> tuple[int, int]:
    """(chips, ranks per chip) of a group of `ranks` filling the instance's chips in order."""
    per_chip = min(ranks, instance(target).cores_per_chip)
    return math.ceil(ranks / per_chip), per_chip
