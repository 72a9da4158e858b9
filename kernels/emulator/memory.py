"""Where tensors live: memory regions, storages, and the SBUF/PSUM allocators that enforce capacity.

A storage's on-chip bytes stay allocated while the kernel holds a Python reference to any view of it; the
storage is released when the last view goes (CPython reference counting makes this deterministic). So a
tile allocated inside a loop body is double-buffered — the next iteration's tile is allocated before the
previous one is dropped — much as the NKI compiler rotates buffers for loop-local tiles.
"""

from __future__ import annotations

import bisect
import itertools
from enum import Enum
from math import prod

import numpy as np

from onnx_nmm.kernels.emulator import dtypes
from onnx_nmm.kernels.emulator.rules import require


class MemoryRegion(Enum):
    """Memory regions of nki.language: sbuf, psum, private_hbm (alias hbm) and shared_hbm."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    @property
    def on_chip(self) -> bool:
        return self in (MemoryRegion.sbuf, MemoryRegion.psum)


_storage_ids = itertools.count(1)


class Storage:
    """The memory behind one allocation: its region, logical shape, dtype and (unless trace-only) data.

    `data` is a flat NumPy array, or None when the emulator only traces. On-chip storages have an
    `address` (bytes from the start of each partition) given by their allocator; PSUM storages also
    remember, per element, whether an nc_matmul wrote it (for the accumulate rules).
    """

    __slots__ = ("id", "buffer", "on_chip", "shape", "partition_elements", "dtype", "data", "address",
                 "matmul_written", "_release")

    def __init__(self, buffer: MemoryRegion, shape: tuple[int, ...], dtype, data: np.ndarray | None):
        self.id = next(_storage_ids)
        self.buffer = buffer
        self.on_chip = buffer.on_chip
        self.shape = shape
        self.partition_elements = prod(shape[1:])  # elements per partition (on-chip) or per row (HBM)
        self.dtype = dtypes.as_dtype(dtype)
        self.data = data
        self.address = 0
        self.matmul_written = np.zeros(prod(shape), np.bool_) if buffer is MemoryRegion.psum else None
        self._release = None

    def __del__(self):
        if self._release is not None:
            self._release(self.id)


class OnChipAllocator:
    """Places the storages of one on-chip memory and fails a kernel that needs more than the capacity.

    Capacity is counted in bytes per partition (every on-chip tensor occupies the same free range on each
    of its partitions). Addresses, aligned to `granule` bytes (a PSUM bank for PSUM, whose allocations
    start at a bank boundary: nki/migration/index.rst), feed the cost model's tracking of which
    instructions touch the same bytes. They are handed out next-fit — onward from the last allocation,
    wrapping around the partition — so freed space is reused as late as possible, the way a compiler
    rotates loop-local buffers through free SBUF: a next block's loads can then overlap the current
    block's compute whenever the memory has room for both.
    """

    def __init__(self, memory: str, capacity: int, granule: int, rule: str):
        self.memory = memory
        self.capacity = capacity
        self.granule = granule
        self.rule = rule
        self.in_use = 0
        self.peak = 0
        self._starts: list[int] = []  # sorted addresses of live blocks
        self._sizes: dict[int, int] = {}  # address -> size
        self._by_storage: dict[int, int] = {}  # storage id -> address
        self._cursor = 0  # end of the last allocation: where next-fit looks first
        self.closed = False

    def allocate(self, storage: Storage) -> None:
        size = max(self.granule, -(-storage.partition_elements * storage.dtype.itemsize // self.granule) * self.granule)
        require(
            self.in_use + size <= self.capacity,
            self.rule,
            lambda: f"allocating {storage.shape} {storage.dtype} needs {size} B per partition with "
            f"{self.in_use} B already in use, over the {self.capacity} B of {self.memory}",
        )
        address = self._next_fit(size)
        self._cursor = address + size
        bisect.insort(self._starts, address)
        self._sizes[address] = size
        self._by_storage[storage.id] = address
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        storage.address = address
        storage._release = self.release

    def release(self, storage_id: int) -> None:
        if self.closed:
            return
        address = self._by_storage.pop(storage_id)
        self._starts.remove(address)
        self.in_use -= self._sizes.pop(address)

    def _next_fit(self, size: int) -> int:
        """The first gap of `size` bytes at or after the cursor, else from the start; past the capacity
        only when the live blocks leave no such gap (the capacity check counts bytes, not addresses)."""
        for origin in (self._cursor, 0):
            candidate = origin
            for start in self._starts:
                end = start + self._sizes[start]
                if end <= candidate:
                    continue
                if start - candidate >= size:
                    break
                candidate = max(candidate, end)
            if candidate + size <= self.capacity:
                return candidate
        return max([self.capacity] + [start + self._sizes[start] for start in self._starts])
