"""nki.language for the emulator: data types, memory regions, tile sizes, tensor creation, loop helpers,
and the operators that nki.isa instructions take as `op` (names and signatures of NKI 0.6,
nki/api/nki/language/__init__.py)."""

from __future__ import annotations

import math

import numpy as np

from onnx_nmm.kernels.emulator import session
from onnx_nmm.kernels.emulator.dtypes import (  # noqa: F401  (re-exported NKI names)
    bfloat16,
    bool_,
    float8_e4m3,
    float8_e5m2,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from onnx_nmm.kernels.emulator.memory import MemoryRegion
from onnx_nmm.kernels.emulator.rules import require
from onnx_nmm.kernels.emulator.tensor import NkiTensor

sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm


class NKIObject:
    """Base class of the user-defined classes a kernel may take (NKI language guide, "Class Support")."""


class _TileSize:
    """nl.tile_size: the hardware tile limits (NeuronCore-v2 and -v3 values)."""

    pmax = 128
    psum_bank_fmax = 512
    psum_fmax = 512
    psum_bank_fmax_bytes = 2048
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512

    @property
    def psum_num_banks(self) -> int:
        return session.active_emulation().core.psum_banks

    @property
    def sbuf_fmax_bytes(self) -> int:
        return session.active_emulation().core.sbuf_partition_bytes


tile_size = _TileSize()


def is_hbm(buffer) -> bool:
    return buffer in (private_hbm, shared_hbm)


def is_on_chip(buffer) -> bool:
    return buffer in (sbuf, psum)


def is_psum(buffer) -> bool:
    return buffer is psum


def is_sbuf(buffer) -> bool:
    return buffer is sbuf


def ndarray(shape, dtype, buffer=sbuf, name: str = "", address=None) -> NkiTensor:
    """Allocate an uninitialized tensor (the emulator fills it with NaN, or 4 for integers)."""
    shape = tuple(int(s) for s in shape)
    require(all(s > 0 for s in shape), "index", lambda: f"shape {shape} has an empty dimension")
    if is_on_chip(buffer):
        require(shape[0] <= tile_size.pmax, "partition-max", lambda: f"{buffer.value} tensor of shape {shape}")
        require(len(shape) >= 2, "view", lambda: f"on-chip tensor of shape {shape} needs a free dimension")
    return NkiTensor(session.current_run().new_storage(buffer, shape, dtype))


def zeros(shape, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    """Allocate a tensor and fill it with zeros (a memset on the Vector engine)."""
    from onnx_nmm.kernels.emulator import isa

    tensor = ndarray(shape, dtype, buffer, name)
    isa.memset(tensor, 0)
    return tensor


def ds(start: int, size: int) -> slice:
    """A slice of `size` elements from `start` (nl.ds)."""
    return slice(start, start + size)


def affine_range(start, stop=None, step=1):
    """Alias of range(): loops are unrolled (NKI 0.6 deprecates the *_range helpers in favour of range)."""
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = affine_range
static_range = affine_range


def program_id(axis: int = 0) -> int:
    return 0


def num_programs(axes: int = 0) -> int:
    return 1


class _Operator:
    """An activation function or ALU operator, usable as the `op` of nki.isa instructions (fp32 math)."""

    def __init__(self, name: str, function):
        self.name = name
        self.function = function

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"the emulator implements nl.{self.name} as the op= of an nki.isa instruction only"
        )

    def __repr__(self):
        return f"nl.{self.name}"


def _silu(x):
    return x / (np.float32(1) + np.exp(-x))


def _gelu(x):
    return np.float32(0.5) * x * (np.float32(1) + _erf(x / np.float32(np.sqrt(2.0))))


def _gelu_tanh(x):
    inner = np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(inner))


_erf = np.vectorize(math.erf, otypes=[np.float32])

copy = _Operator("copy", lambda x: x)
silu = _Operator("silu", _silu)
gelu = _Operator("gelu", _gelu)
gelu_apprx_tanh = _Operator("gelu_apprx_tanh", _gelu_tanh)
relu = _Operator("relu", lambda x: np.maximum(x, np.float32(0)))
sigmoid = _Operator("sigmoid", lambda x: np.float32(1) / (np.float32(1) + np.exp(-x)))
tanh = _Operator("tanh", np.tanh)
exp = _Operator("exp", np.exp)
square = _Operator("square", np.square)
add = _Operator("add", np.add)
subtract = _Operator("subtract", np.subtract)
multiply = _Operator("multiply", np.multiply)
divide = _Operator("divide", np.divide)
maximum = _Operator("maximum", np.maximum)
minimum = _Operator("minimum", np.minimum)
