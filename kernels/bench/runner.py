"""Run kernels on the emulator, or get their modelled cost on Trainium without doing the arithmetic.

`kernel` is an @nki.jit kernel (dense_matmul, fused_xuv, fused_svd_mlp, ...) or a plain function that
launches several (lowrank_unfused); a cost covers every launch, one after another.
"""

from __future__ import annotations

from onnx_nmm.kernels.emulator import Placeholder, emulation
from onnx_nmm.kernels.emulator.trace import KernelTrace
from onnx_nmm.kernels.nki_kernels.nki_api import USING_EMULATOR
from onnx_nmm.kernels.pricing.cost_model import KernelCost, model_traces


def run(kernel, *arrays, target: str = "trn2", **options):
    """Run `kernel` on NumPy arrays (float32 or ml_dtypes.bfloat16) on the emulator; returns its result."""
    _require_emulator()
    with emulation(target):
        return kernel(*arrays, **options)


def trace(kernel, *shapes, dtype="bfloat16", target: str = "trn2", **options) -> list[KernelTrace]:
    """The instruction traces of `kernel` on inputs of these shapes (trace-only: nothing is computed)."""
    _require_emulator()
    with emulation(target, trace_only=True) as session:
        kernel(*(Placeholder(shape, dtype) for shape in shapes), **options)
    return session.traces


def estimate(kernel, *shapes, dtype="bfloat16", target: str = "trn2", **options) -> KernelCost:
    """Modelled cost of `kernel` on inputs of these shapes: time per engine, overlapped total, HBM bytes
    read and written, PE utilisation, peak SBUF/PSUM per partition. Every number is modelled."""
    return model_traces(trace(kernel, *shapes, dtype=dtype, target=target, **options), target)


def _require_emulator() -> None:
    if not USING_EMULATOR:
        raise RuntimeError(
            "the real NKI package is installed, so kernels call it instead of the emulator; "
            "set ONNX_NMM_NKI=emulator to run or estimate kernels on the CPU"
        )
