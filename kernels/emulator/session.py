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
from onnx_nmm.kernels.emulator.memory import MemoryRegion, OnChipAllocator, Storage
from onnx_nmm.kernels.emulator.trace import Instruction, KernelTrace
from onnx_nmm.kernels.hardware import NeuronCore, neuron_core

_PLATFORM_NAMES = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2"}


class Emulation:
    def __init__(self, target: str | NeuronCore = "trn2", trace_only: bool = False):
        self.core = neuron_core(target)
        self.trace_only = trace_only
        self.traces: list[KernelTrace] = []


class KernelRun:
    """One kernel launch: its allocators and the instructions it issued."""

    def __init__(self, emulation: Emulation, kernel: str):
        core = emulation.core
        self.emulation = emulation
        self.core = core
        self.trace_only = emulation.trace_only
        self.trace = KernelTrace(kernel=kernel, target=core.name)
        self.sbuf = OnChipAllocator("SBUF", core.sbuf_partition_bytes, 4, "sbuf-capacity")
        self.psum = OnChipAllocator("PSUM", core.psum_partition_bytes, core.psum_bank_bytes, "psum-capacity")

    def new_storage(self, buffer: MemoryRegion, shape: tuple[int, ...], dtype, data=None) -> Storage:
        dtype = dtypes.as_dtype(dtype)
        if data is None and not self.trace_only:
            data = np.full(int(np.prod(shape)), dtypes.sentinel(dtype), dtype)
        storage = Storage(buffer, shape, dtype, data)
        if buffer is MemoryRegion.sbuf:
            self.sbuf.allocate(storage)
        elif buffer is MemoryRegion.psum:
            self.psum.allocate(storage)
        return storage

    def record(self, instruction: Instruction) -> None:
        self.trace.instructions.append(instruction)

    def finish(self) -> KernelTrace:
        self.trace.sbuf_peak_bytes = self.sbuf.peak
        self.trace.psum_peak_bytes = self.psum.peak
        self.close()
        self.emulation.traces.append(self.trace)
        return self.trace

    def close(self) -> None:
        """Stop tracking allocations: views that outlive the launch (in a traceback, say) free nothing."""
        self.sbuf.closed = self.psum.closed = True


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
    except BaseException:
        run.close()
        raise
    else:
        run.finish()
    finally:
        _running.pop()
