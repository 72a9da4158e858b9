"""NkiTensor: a strided view of a storage, with the view operations of nki.language.NkiTensor.

Offsets and strides count elements of the storage. On-chip tensors (SBUF, PSUM) keep their partition
dimension first: an integer index on it keeps a size-1 dimension, it cannot be stepped or permuted away,
and a reshape keeps its size (nki/api/nki/language/__init__.py, NkiTensor).
"""

from __future__ import annotations

from math import prod

import numpy as np

from onnx_nmm.kernels.emulator.memory import MemoryRegion, Storage
from onnx_nmm.kernels.emulator.rules import require


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _reshaped_strides(old_shape, old_strides, new_shape):
    """Strides that view `old` as `new_shape` without copying, or None (PyTorch's computeStride)."""
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = old_strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[tensor_d]
        chunk_ends = tensor_d == 0 or (
            old_shape[tensor_d - 1] != 1 and old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride
        )
        if chunk_ends:
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_strides[view_d] = view_numel * chunk_base_stride
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = old_strides[tensor_d - 1]
                tensor_numel = view_numel = 1
    return tuple(new_strides) if view_d == -1 else None


class NkiTensor:
    """A view (shape, strides, offset) of a Storage in SBUF, PSUM or HBM."""

    __slots__ = ("_storage", "shape", "strides", "offset")

    def __init__(self, storage: Storage, shape=None, strides=None, offset: int = 0):
        self._storage = storage
        self.shape = tuple(storage.shape if shape is None else shape)
        self.strides = tuple(_row_major_strides(self.shape) if strides is None else strides)
        self.offset = offset

    # -- attributes of nki.language.NkiTensor ------------------------------------------------------------
    @property
    def dtype(self):
        return self._storage.dtype

    @property
    def buffer(self) -> MemoryRegion:
        return self._storage.buffer

    @property
    def name(self) -> str:
        return f"t{self._storage.id}"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return prod(self.shape)

    def __repr__(self):
        return f"NkiTensor({self.shape}, {self.dtype}, {self.buffer.value}, storage={self._storage.id})"

    # -- views ----------------------------------------------------------------------------------------------
    def __getitem__(self, key) -> NkiTensor:
        key = key if isinstance(key, tuple) else (key,)
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - len(key) + 1) + key[at + 1 :]
        require(len(key) <= len(self.shape), "index", lambda: f"{len(key)} indices for a {self.ndim}-d tensor {self}")
        on_chip = self._storage.on_chip
        shape, strides, offset = [], [], self.offset
        for dim in range(len(self.shape)):
            size, stride = self.shape[dim], self.strides[dim]
            k = key[dim] if dim < len(key) else slice(None)
            if isinstance(k, slice):
                start, stop, step = self._bounds(dim, k)
                require(not (dim == 0 and on_chip and step != 1), "partition-stride", lambda: f"step {step}")
                shape.append(len(range(start, stop, step)))
                strides.append(stride * step)
                offset += start * stride
            else:
                index = int(k) + (size if int(k) < 0 else 0)
                require(0 <= index < size, "index", lambda: f"index {k} of dimension {dim} (size {size}) of {self}")
                offset += index * stride
                if dim == 0 and on_chip:
                    shape.append(1)
                    strides.append(stride)
        return NkiTensor(self._storage, shape, strides, offset)

    def __setitem__(self, key, value):
        raise TypeError("assigning into an NkiTensor is the legacy NKI API; write with an nki.isa instruction")

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index: int) -> NkiTensor:
        key = [slice(None)] * self.ndim
        key[dim] = index
        return self[tuple(key)]

    def permute(self, dims) -> NkiTensor:
        dims = tuple(dims)
        require(sorted(dims) == list(range(self.ndim)), "view", lambda: f"permute{dims} of a {self.ndim}-d tensor")
        require(not (self._on_chip and dims[0] != 0), "view", lambda: f"permute{dims} moves the partition dimension")
        return NkiTensor(self._storage, [self.shape[d] for d in dims], [self.strides[d] for d in dims], self.offset)

    def reshape(self, shape) -> NkiTensor:
        shape = list(shape)
        if -1 in shape:
            known = prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = self.size // known
        require(prod(shape) == self.size, "view", lambda: f"reshape {self.shape} to {tuple(shape)}")
        require(not (self._on_chip and shape[0] != self.shape[0]), "view",
                lambda: f"reshape {self.shape} to {tuple(shape)}")
        strides = _reshaped_strides(self.shape, self.strides, shape)
        require(strides is not None, "view", lambda: f"reshape of a non-contiguous view {self.shape} to {tuple(shape)}")
        return NkiTensor(self._storage, shape, strides, self.offset)

    def _bounds(self, dim: int, k: slice) -> tuple[int, int, int]:
        size = self.shape[dim]
        start, stop, step = k.start, k.stop, k.step
        step = 1 if step is None else step
        start = 0 if start is None else start + size if start < 0 else start
        stop = size if stop is None else stop + size if stop < 0 else stop
        require(
            step >= 1 and 0 <= start < stop <= size,
            "index",
            lambda: f"slice {start}:{stop}:{step} of dimension {dim} (size {size}) of {self}",
        )
        return start, stop, step

    # -- what the emulator and its trace need ---------------------------------------------------------------
    @property
    def _on_chip(self) -> bool:
        return self._storage.on_chip

    @property
    def _free_size(self) -> int:
        """Elements per partition (on-chip) or per row of the first dimension (HBM)."""
        return prod(self.shape[1:])

    @property
    def _partition_start(self) -> int:
        return self.offset // self._storage.partition_elements

    def _array(self) -> np.ndarray:
        """A writable NumPy view of the elements (execute mode only)."""
        return self._view_of(self._storage.data)

    def _view_of(self, flat: np.ndarray) -> np.ndarray:
        """The view's elements within `flat`, an array laid out like the storage (its data or flags)."""
        itemsize = flat.dtype.itemsize
        return np.ndarray(self.shape, flat.dtype, flat, self.offset * itemsize,
                          tuple(s * itemsize for s in self.strides))

    def _write(self, values: np.ndarray) -> None:
        """Store `values` (computed in float32) with the view's dtype; casts to bf16 round to nearest even."""
        self._array()[...] = np.asarray(values).reshape(self.shape).astype(self.dtype)

    def _byte_range(self) -> tuple[int, int]:
        """[lo, hi) bytes of the storage the view touches (within one partition for on-chip views)."""
        storage = self._storage
        low = high = 0
        for d in range(1 if storage.on_chip else 0, len(self.shape)):
            reach = (self.shape[d] - 1) * self.strides[d]
            if reach < 0:
                low += reach
            else:
                high += reach
        start = self.offset % storage.partition_elements if storage.on_chip else self.offset
        return (start + low) * storage.dtype.itemsize, (start + high + 1) * storage.dtype.itemsize

    def _contiguous_elements(self) -> int:
        """Length of the innermost run of consecutive elements (within one partition for on-chip views)."""
        run = 1
        for d in range(self.ndim - 1, 0 if self._on_chip else -1, -1):
            if self.shape[d] == 1:
                continue
            if self.strides[d] != run:
                break
            run *= self.shape[d]
        return run
