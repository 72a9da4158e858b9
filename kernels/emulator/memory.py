"""Where tensors live: memory regions, storages, and the SBUF/PSUM memories that enforce capacity by liveness.

An on-chip storage holds its bytes from its allocation (nl.ndarray) to the last instruction that touches
it, as the Neuron compiler allocates by liveness: a tile is free after its last use, whether or not the
kernel's Python code still holds a reference to it. So a list of tiles rebuilt in every iteration of a
loop costs one list, not two. Capacity is checked when the kernel returns, against the largest total of
storages live at one instruction, and addresses are assigned then.
"""

from __future__ import annotations

import bisect
import itertools
import os
import sys
from collections import Counter
from dataclasses import dataclass
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

    `data` is a flat NumPy array, or None when the emulator only traces. PSUM storages also remember, per
    element, whether an nc_matmul wrote it (for the accumulate rules).
    """

    __slots__ = ("id", "buffer", "on_chip", "shape", "partition_elements", "dtype", "data", "matmul_written")

    def __init__(self, buffer: MemoryRegion, shape: tuple[int, ...], dtype, data: np.ndarray | None):
        self.id = next(_storage_ids)
        self.buffer = buffer
        self.on_chip = buffer.on_chip
        self.shape = shape
        self.partition_elements = prod(shape[1:])  # elements per partition (on-chip) or per row (HBM)
        self.dtype = dtypes.as_dtype(dtype)
        self.data = data
        self.matmul_written = np.zeros(prod(shape), np.bool_) if buffer is MemoryRegion.psum else None


@dataclass
class Lifetime:
    """One storage's bytes per partition and the trace indices between which they are held."""

    size: int
    first: int  # index of the next instruction when the storage was allocated
    last: int  # index of the last instruction that touched it (its allocation point if none did)
    describe: str  # "(128, 512) bfloat16 from fused_mlp.py:88", for a capacity refusal
    address: int = 0


class OnChipMemory:
    """SBUF or PSUM of one kernel launch: the lifetimes of its storages, checked and placed at the end.

    Capacity is counted in bytes per partition (every on-chip tensor occupies the same free range on each
    of its partitions). `place` replays the lifetimes in allocation order, freeing each storage after its
    last use, and hands out addresses aligned to `granule` bytes (a PSUM bank for PSUM, whose allocations
    start at a bank boundary: nki/migration/index.rst). Addresses feed the cost model's tracking of which
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
        self.lifetimes: dict[int, Lifetime] = {}  # storage id -> lifetime, in allocation order
        self.peak = 0

    def allocate(self, storage: Storage, now: int) -> None:
        size = max(self.granule, -(-storage.partition_elements * storage.dtype.itemsize // self.granule) * self.granule)
        describe = f"{storage.shape} {storage.dtype} from {_kernel_line()}"
        require(size <= self.capacity, self.rule,
                lambda: f"one tensor {describe} needs {size} B per partition, "
                        f"over the {self.capacity} B of {self.memory}")
        self.lifetimes[storage.id] = Lifetime(size, now, now, describe)

    def touch(self, storage_id: int, now: int) -> None:
        self.lifetimes[storage_id].last = now

    def address(self, storage_id: int) -> int:
        return self.lifetimes[storage_id].address

    def place(self, instructions: list) -> None:
        """Check that what is live at once fits, then give every storage its address (see the class)."""
        live: list[Lifetime] = []
        blocks = _Blocks(self.capacity)
        peak_at, peak_live = 0, []
        for lifetime in self.lifetimes.values():
            for ended in [held for held in live if held.last < lifetime.first]:
                live.remove(ended)
                blocks.free(ended.address)
            lifetime.address = blocks.take(lifetime.size)
            live.append(lifetime)
            if blocks.in_use > self.peak:
                self.peak, peak_at, peak_live = blocks.in_use, lifetime.first, list(live)
        require(self.peak <= self.capacity, self.rule, lambda: self._overflow(peak_at, peak_live, instructions))

    def _overflow(self, at: int, live: list[Lifetime], instructions: list) -> str:
        where = f"instruction {at} ({instructions[at].op})" if at < len(instructions) else "the kernel's end"
        tiles = Counter(lifetime.describe for lifetime in live)
        listed = "; ".join(f"{count} x {describe}" for describe, count in tiles.most_common())
        return (f"{self.peak} B per partition are live at {where}, over the {self.capacity} B of {self.memory}: "
                f"{listed}")


class _Blocks:
    """Next-fit placement of blocks within one partition's bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_use = 0
        self._starts: list[int] = []  # sorted addresses of live blocks
        self._sizes: dict[int, int] = {}  # address -> size
        self._cursor = 0  # end of the last block taken: where next-fit looks first

    def take(self, size: int) -> int:
        address = self._next_fit(size)
        self._cursor = address + size
        bisect.insort(self._starts, address)
        self._sizes[address] = size
        self.in_use += size
        return address

    def free(self, address: int) -> None:
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


_EMULATOR_DIR = os.path.dirname(__file__)


def _kernel_line() -> str:
    """file:line of the kernel code that allocated, the first frame outside the emulator."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _EMULATOR_DIR:
        frame = frame.f_back
    if frame is None:
        return "the emulator"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
