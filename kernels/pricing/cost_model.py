"""Modelled time of a kernel on one NeuronCore, from the emulator's instruction trace.

First the trace becomes a dependency graph: an instruction waits for the last writer of every byte it
reads, and a write waits for every earlier access of the bytes it overwrites (the same bytes: on-chip
addresses come from the emulator's allocator). Then an event-driven schedule plays the graph on the
engines. Each compute engine runs its instructions in program order, as its instruction queue does on the
hardware. Each HBM tensor's transfers go through one DMA queue, in program order, starting at least an issue
interval apart; the queues of different tensors run side by side, so a weight load is not held up behind a
store, and the DMA engines serve the transfers first come, first served.

Each instruction takes the time instruction_costs' formulas give it (the block planner prices its plans
with the same ones). A DMA transfer over P partitions is split over ceil(P/8) of the 16 queues (each engine
serves 8 partitions) and starts no earlier than ~1.3 us after it becomes ready; on trn1 ScalarE and VectorE
take turns to access PSUM.

The result is a model, not a measurement: the parameters are AWS's published numbers (hardware.py), one
calibration anchor checks the whole (docs/kernels.md), and there is no per-kernel correction anywhere.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from onnx_nmm.kernels.emulator.trace import ENGINES, Instruction, KernelTrace
from onnx_nmm.kernels.pricing.hardware import NeuronCore, neuron_core
from onnx_nmm.kernels.pricing.instruction_costs import (
    dma_seconds,
    elementwise_seconds,
    takes_psum_port,
    tensor_engine_seconds,
)

COMPUTE_ENGINES = ("pe", "act", "dve", "pool")


@dataclass
class KernelCost:
    """Modelled cost of one or more kernel launches (launches run one after another)."""

    target: str
    kernels: list[str]
    total_s: float
    busy_s: dict[str, float]  # time each engine works; "dma" is the 16 queues' work divided by 16
    hbm_read_bytes: int
    hbm_write_bytes: int
    flops: int
    pe_ideal_s: float  # time TensorE would need for the same FLOPs at its peak rate
    roofline_s: float  # per launch max(HBM bytes at core.memory_bytes_per_s, pe_ideal_s), summed
    sbuf_peak_bytes: int
    psum_peak_bytes: int
    instructions: int
    per_kernel_s: list[float] = field(default_factory=list)

    @property
    def pe_utilization(self) -> float:
        return self.pe_ideal_s / self.total_s if self.total_s else 0.0

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_read_bytes + self.hbm_write_bytes

    @property
    def over_roofline(self) -> float:
        """Modelled time over the physical limit: 1.0 is as fast as the hardware allows."""
        return self.total_s / self.roofline_s

    def then(self, other: KernelCost) -> KernelCost:
        """The cost of launching `other` after this."""
        return KernelCost(
            target=self.target,
            kernels=self.kernels + other.kernels,
            total_s=self.total_s + other.total_s,
            busy_s={e: self.busy_s[e] + other.busy_s[e] for e in ENGINES},
            hbm_read_bytes=self.hbm_read_bytes + other.hbm_read_bytes,
            hbm_write_bytes=self.hbm_write_bytes + other.hbm_write_bytes,
            flops=self.flops + other.flops,
            pe_ideal_s=self.pe_ideal_s + other.pe_ideal_s,
            roofline_s=self.roofline_s + other.roofline_s,
            sbuf_peak_bytes=max(self.sbuf_peak_bytes, other.sbuf_peak_bytes),
            psum_peak_bytes=max(self.psum_peak_bytes, other.psum_peak_bytes),
            instructions=self.instructions + other.instructions,
            per_kernel_s=self.per_kernel_s + other.per_kernel_s,
        )


def model_traces(traces: list[KernelTrace], target: str | NeuronCore | None = None) -> KernelCost:
    """Model kernel launches that run one after another."""
    if not traces:
        raise ValueError("no kernel was launched, so there is nothing to model")
    costs = [model_trace(trace, target) for trace in traces]
    total = costs[0]
    for cost in costs[1:]:
        total = total.then(cost)
    return total


def model_trace(trace: KernelTrace, target: str | NeuronCore | None = None, schedule: list | None = None) -> KernelCost:
    """Model one kernel launch on `target` (by default the NeuronCore it was traced for).

    If `schedule` is a list, it receives (ready, start, end) for every instruction, in trace order.
    """
    core = neuron_core(target or trace.target)
    instructions = trace.instructions
    successors, waiting = _dependencies(instructions)
    ready = [0.0] * len(instructions)
    times = [None] * len(instructions)
    queue_free = [0.0] * core.dma_engines
    dma_queues = _dma_queues(instructions)  # per HBM tensor: its transfers in program order
    next_issue: dict[int, float] = {}  # per HBM tensor: when its DMA queue can start another transfer
    dma_ready: dict[int, float] = {}  # transfers that are ready, waiting for their queue's turn
    psum_port_free = 0.0
    busy = dict.fromkeys(ENGINES, 0.0)

    heap = [(0.0, i) for i, count in enumerate(waiting) if count == 0]
    while heap:
        at, i = heapq.heappop(heap)
        ins = instructions[i]
        if ins.engine == "dma":
            dma_ready[i] = at
            queue = dma_queues[_hbm_tensor(ins)]
            issued = []
            while queue and queue[-1] in dma_ready:  # the queue's next transfers, as far as they are ready
                d = queue.pop()
                became_ready = dma_ready.pop(d)
                issue = max(became_ready + core.dma_fixed_latency_s, next_issue.get(id(queue), 0.0))
                start, end = _transfer(instructions[d], core, issue, queue_free, busy)
                next_issue[id(queue)] = issue + core.dma_issue_interval_s
                times[d] = (became_ready, start, end)
                issued.append(d)
        else:
            start = at
            waits_for_psum = takes_psum_port(core, ins.engine, ins.psum)
            if waits_for_psum:
                start = max(start, psum_port_free)
            end = start + _compute_seconds(ins, core)
            busy[ins.engine] += end - start
            if waits_for_psum:
                psum_port_free = end
            times[i] = (at, start, end)
            issued = [i]
        for d in issued:
            for j in successors[d]:
                ready[j] = max(ready[j], times[d][2])
                waiting[j] -= 1
                if waiting[j] == 0:
                    heapq.heappush(heap, (ready[j], j))

    if schedule is not None:
        schedule.extend(times)
    finish = max((end for _, _, end in times), default=0.0)
    pe_ideal = sum(
        ins.flops / (core.pe_bf16_flops / (core.pe_fp32_factor if ins.fp32 else 1)) for ins in instructions if ins.flops
    )
    hbm_read = sum(ins.hbm_read for ins in instructions)
    hbm_write = sum(ins.hbm_write for ins in instructions)
    return KernelCost(
        target=core.name,
        kernels=[trace.kernel],
        total_s=finish,
        busy_s=busy,
        hbm_read_bytes=hbm_read,
        hbm_write_bytes=hbm_write,
        flops=sum(ins.flops for ins in instructions),
        pe_ideal_s=pe_ideal,
        roofline_s=max((hbm_read + hbm_write) / core.memory_bytes_per_s, pe_ideal),
        sbuf_peak_bytes=trace.sbuf_peak_bytes,
        psum_peak_bytes=trace.psum_peak_bytes,
        instructions=len(instructions),
        per_kernel_s=[finish],
    )


def _compute_seconds(ins: Instruction, core: NeuronCore) -> float:
    if ins.engine == "pe":
        return tensor_engine_seconds(core, ins.size, ins.fp32, ins.transpose)
    return elementwise_seconds(core, ins.engine, ins.size, ins.inputs, ins.vector_gain)


def _dma_queues(instructions: list[Instruction]) -> dict[int, list[int]]:
    """Each HBM tensor's transfers, last first (the queue's next transfer is at the end)."""
    queues: dict[int, list[int]] = {}
    for i, ins in enumerate(instructions):
        if ins.engine == "dma":
            queues.setdefault(_hbm_tensor(ins), []).append(i)
    return {tensor: indices[::-1] for tensor, indices in queues.items()}


def _hbm_tensor(ins: Instruction) -> int:
    """The HBM tensor a transfer reads or writes: its transfers share one DMA queue."""
    return next(key for space, key, _, _ in ins.reads + ins.writes if space == "hbm")


def _transfer(ins: Instruction, core: NeuronCore, earliest: float, queue_free: list[float], busy: dict):
    """Split a DMA over the engines that free up first, from `earliest`; returns (first start, last end)."""
    partitions_per_engine = core.partitions // core.dma_engines
    pieces = min(core.dma_engines, max(1, -(-ins.partitions // partitions_per_engine)))
    busy_s = dma_seconds(core, ins.size, ins.run_bytes)  # the engines' work over all of them
    duration = busy_s * core.dma_engines / pieces
    first, last = float("inf"), 0.0
    for queue in heapq.nsmallest(pieces, range(core.dma_engines), key=queue_free.__getitem__):
        start = max(queue_free[queue], earliest)
        queue_free[queue] = start + duration
        first, last = min(first, start), max(last, start + duration)
    busy["dma"] += busy_s
    return first, last


def _dependencies(instructions: list[Instruction]) -> tuple[list[list[int]], list[int]]:
    """Successor lists and predecessor counts: data dependencies plus program order on each compute engine."""
    predecessors = [set() for _ in instructions]
    memory: dict[tuple, _AccessMap] = {}
    last_on_engine: dict[str, int] = {}
    for i, ins in enumerate(instructions):
        preds = predecessors[i]
        if ins.engine != "dma":
            if ins.engine in last_on_engine:
                preds.add(last_on_engine[ins.engine])
            last_on_engine[ins.engine] = i
        for space, key, low, high in ins.reads:
            memory.setdefault((space, key), _AccessMap(space)).read(i, ins.engine, low, high, preds)
        for space, key, low, high in ins.writes:
            memory.setdefault((space, key), _AccessMap(space)).write(i, low, high, preds)
    successors = [[] for _ in instructions]
    for i, preds in enumerate(predecessors):
        preds.discard(i)
        for p in preds:
            successors[p].append(i)
    return successors, [len(preds) for preds in predecessors]


class _AccessMap:
    """For one address space: who last wrote each byte range, and who read it since.

    Segment k covers [starts[k], starts[k+1]). Readers are kept as the last reader on each compute engine
    (an engine runs in order, so its last reader finishes after its earlier ones) plus every DMA reader.
    Reads of an HBM tensor the kernel never writes (its inputs) are not tracked: nothing waits on them.
    """

    def __init__(self, space: str):
        self.track_reads = space != "hbm"
        self.starts = [0]
        self.writer = [-1]
        self.readers = [()]  # tuples of (engine, instruction), at most one per compute engine, plus DMAs

    def read(self, i: int, engine: str, low: int, high: int, preds: set) -> None:
        first, last = self._split(low), self._split(high)
        for k in range(first, last):
            if self.writer[k] >= 0:
                preds.add(self.writer[k])
            if self.track_reads:
                kept = tuple(r for r in self.readers[k] if engine == "dma" or r[0] != engine)
                self.readers[k] = kept + ((engine, i),)

    def write(self, i: int, low: int, high: int, preds: set) -> None:
        first, last = self._split(low), self._split(high)
        for k in range(first, last):
            if self.writer[k] >= 0:
                preds.add(self.writer[k])
            preds.update(r[1] for r in self.readers[k])
        self.track_reads = True
        self.starts[first:last] = [low]
        self.writer[first:last] = [i]
        self.readers[first:last] = [()]

    def _split(self, address: int) -> int:
        """Index of the segment starting at `address`, splitting the segment that contains it."""
        k = bisect.bisect_right(self.starts, address) - 1
        if self.starts[k] != address:
            k += 1
            self.starts.insert(k, address)
            self.writer.insert(k, self.writer[k - 1])
            self.readers.insert(k, self.readers[k - 1])
        return k
