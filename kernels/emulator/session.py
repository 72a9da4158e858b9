"""The emulation a kernel runs in: which NeuronCore, whether to compute or only trace, and what was traced.

`emulation(target, trace_only)` is a context manager; every @nki.jit call inside it appends a KernelTrace
to its `traces`. A kernel called outside one runs in a fresh emulation of the target named by
NEURON_PLATFORM_TARGET_OVERRIDE (as for the official simulator), trn2 by default.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from onnx_nmm.kernels.emulator import dtypes
from onnx_nmm.kernels.emulator.memory import MemoryRegion, OnChipMemory, Storage
from onnx_nmm.kernels.emulator.trace import Instruction, KernelTrace
from onnx_nmm.kernels.pricing.hardware import NeuronCore, neuron_core

_PLATFORM_NAMES = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2"}


class Emulation:
    def __init__(self, target: str | NeuronCore = "trn2", trace_only: bool = False):
        self.core = neuron_core(target)
        self.trace_only = trace_only
        self.traces: list[KernelTrace] = []


class KernelRun:
    """One kernel launch: its on-chip memories and the instructions it issued."""

    def __init__(self, emulation: Emulation, kernel: str):
        core = emulation.core
        self.emulation = emulation
        self.core = core
        self.trace_only = emulation.trace_only
        self.trace = KernelTrace(kernel=kernel, target=core.name)
        self.memories = {
            MemoryRegion.sbuf: OnChipMemory("SBUF", core.sbuf_partition_bytes, 4, "sbuf-capacity"),
            MemoryRegion.psum: OnChipMemory("PSUM", core.psum_partition_bytes, core.psum_bank_bytes, "psum-capacity"),
        }

    def new_storage(self, buffer: MemoryRegion, shape: tuple[int, ...], dtype, data=None) -> Storage:
        dtype = dtypes.as_dtype(dtype)
        if data is None and not self.trace_only:
            data = np.full(int(np.prod(shape)), dtypes.sentinel(dtype), dtype)
        storage = Storage(buffer, shape, dtype, data)
        if buffer.on_chip:
            self.memories[buffer].allocate(storage, len(self.trace.instructions))
        return storage

    def touch(self, storage: Storage) -> None:
        """The instruction about to be recorded accesses this on-chip storage."""
        self.memories[storage.buffer].touch(storage.id, len(self.trace.instructions))

    def record(self, instruction: Instruction) -> None:
        self.trace.instructions.append(instruction)

    def finish(self) -> KernelTrace:
        """Check and place the on-chip memories by liveness, and give the trace its byte addresses."""
        instructions = self.trace.instructions
        for memory in self.memories.values():
            memory.place(instructions)
        for ins in instructions:
            ins.reads = tuple(map(self._placed, ins.reads))
            ins.writes = tuple(map(self._placed, ins.writes))
        self.trace.sbuf_peak_bytes = self.memories[MemoryRegion.sbuf].peak
        self.trace.psum_peak_bytes = self.memories[MemoryRegion.psum].peak
        self.emulation.traces.append(self.trace)
        return self.trace

    def _placed(self, access: tuple) -> tuple:
        space, key, low, high = access
        if space == "hbm":
            return access
        address = self.memories[MemoryRegion(space)].address(key)
        return (space, 0, address + low, address + high)


_emulations: list[Emulation] = []
_running: list[KernelRun] = []


@contextlib.contextmanager
def emulation(target: str | NeuronCore = "trn2", trace_only: bool = False):
    """Run the kernels called inside on `target`; with `trace_only`, check and trace without arithmetic."""
    session = Emulation(target, trace_only)
    _emulations.append(session)
    try:
        yield session
    finally:
        _emulations.remove(session)


def active_emulation() -> Emulation:
    if _emulations:
        return _emulations[-1]
    name = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    if name not in _PLATFORM_NAMES:
        raise ValueError(f"NEURON_PLATFORM_TARGET_OVERRIDE={name!r}: the emulator models trn1 and trn2")
    return Emulation(_PLATFORM_NAMES[name])


def current_run() -> KernelRun:
    if not _running:
        raise RuntimeError("NKI tensors and instructions exist only inside an @nki.jit kernel call")
    return _running[-1]


@contextlib.contextmanager
def kernel_run(kernel: str):
    if _running:
        raise RuntimeError(f"{kernel} called inside {_running[-1].trace.kernel}: sub-kernels must not be @nki.jit")
    run = KernelRun(active_emulation(), kernel)
    _running.append(run)
    try:
        yield run
        run.finish()
    finally:
        _running.pop()
