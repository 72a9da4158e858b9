"""nki.jit and nki.simulate for the emulator: run a kernel function on NumPy arrays.

Like the official simulator (nki/guides/nki_simulator.rst), every array argument becomes an HBM tensor,
the kernel body runs eagerly, and returned tensors come back as NumPy arrays; inputs the kernel writes are
updated in place. In a trace-only emulation, arguments may be `Placeholder`s (shape and dtype, no data)
and the kernel returns placeholders.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from onnx_nmm.kernels.emulator import dtypes, session
from onnx_nmm.kernels.emulator.memory import MemoryRegion, Storage
from onnx_nmm.kernels.emulator.rules import require
from onnx_nmm.kernels.emulator.tensor import NkiTensor


@dataclass(frozen=True)
class Placeholder:
    """An HBM array known only by shape and dtype, for trace-only emulation."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", dtypes.as_dtype(self.dtype))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


class Kernel:
    """An @nki.jit kernel: calling it runs the function in the active emulation."""

    def __init__(self, function):
        self.function = function
        functools.update_wrapper(self, function)

    def __getitem__(self, lnc: int) -> Kernel:
        if lnc != 1:
            raise NotImplementedError("the emulator runs kernels on one NeuronCore (LNC=1)")
        return self

    def __call__(self, *args, **kwargs):
        # Thousands of small matmuls: BLAS threads only spin between them (5-10x slower on a busy machine).
        with session.kernel_run(self.function.__name__) as run, threadpool_limits(1, "blas"):
            args = [_to_hbm(run, value) for value in args]
            run.trace.input_shapes = tuple(arg.shape for arg in args if isinstance(arg, NkiTensor))
            kwargs = {name: _to_hbm(run, value) for name, value in kwargs.items()}
            return _from_hbm(run, self.function(*args, **kwargs))


def jit(fn=None, **options):
    """Decorate a kernel function (`@nki.jit` or `@nki.jit(...)`; options are accepted and ignored)."""
    if fn is None:
        return Kernel
    return Kernel(fn)


def simulate(kernel):
    """The kernel as a callable on NumPy arrays (here every kernel already is one)."""
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)


def _to_hbm(run: session.KernelRun, value):
    if isinstance(value, Placeholder):
        require(run.trace_only, "kernel-input", "a Placeholder argument outside a trace-only emulation")
        return NkiTensor(Storage(MemoryRegion.private_hbm, value.shape, value.dtype, None))
    if not isinstance(value, np.ndarray):
        return value
    require(value.ndim >= 1 and value.dtype in dtypes.SUPPORTED, "kernel-input",
            lambda: f"array {value.dtype}{value.shape}")
    data = None if run.trace_only else np.ascontiguousarray(value).reshape(-1)
    return NkiTensor(Storage(MemoryRegion.private_hbm, value.shape, value.dtype, data))


def _from_hbm(run: session.KernelRun, value):
    if isinstance(value, (tuple, list)):
        return type(value)(_from_hbm(run, item) for item in value)
    if not isinstance(value, NkiTensor):
        return value
    require(value.buffer is MemoryRegion.shared_hbm, "kernel-output", lambda: f"returned {value}")
    if run.trace_only:
        return Placeholder(value.shape, value.dtype)
    return value._array().copy()
