"""A NumPy emulator of the subset of NKI (0.3+ API) that onnx-nmm's kernels use, with a trace for the cost model.

Import it the way kernels import NKI: `nki` is this package, `nl` its `language`, `nisa` its `isa`.
Beyond the official simulator it tracks SBUF and PSUM capacity, and it can skip the arithmetic
(`emulation(trace_only=True)`) so large shapes trace quickly.
"""

from onnx_nmm.kernels.emulator import isa, language
from onnx_nmm.kernels.emulator.jit import Kernel, Placeholder, jit, simulate
from onnx_nmm.kernels.emulator.rules import RULES, NkiValidationError
from onnx_nmm.kernels.emulator.session import emulation

__all__ = [
    "RULES",
    "Kernel",
    "NkiValidationError",
    "Placeholder",
    "emulation",
    "isa",
    "jit",
    "language",
    "simulate",
]
