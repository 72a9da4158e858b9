"""The values carried from segment to segment (the residual stream, sometimes a shape), for every window
batch, in files: one .npy per value and batch, memory-mapped when read, so that the windows' activations
never sit in RAM all at once. A value is deleted once no later segment reads it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np


class CarriedValues:
    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def put(self, name: str, batch: int, array: np.ndarray) -> None:
        path = self._path(name, batch)
        staged = path.with_name(f".{path.name}.tmp")
        with staged.open("wb") as handle:
            np.save(handle, np.ascontiguousarray(array))
        os.replace(staged, path)

    def get(self, name: str, batch: int) -> np.ndarray:
        return np.load(self._path(name, batch), mmap_mode="r")

    def of_batch(self, names: list[str], batch: int) -> dict[str, np.ndarray]:
        """The values `names` of batch `batch`: what a segment reads of those before it."""
        return {name: self.get(name, batch) for name in names}

    def drop(self, name: str) -> None:
        for path in self.folder.glob(f"{_slug(name)}-*.npy"):
            path.unlink()

    def _path(self, name: str, batch: int) -> Path:
        return self.folder / f"{_slug(name)}-{batch:05d}.npy"


def _slug(name: str) -> str:
    """A file name for a value name (which may hold '/', ':' or '.'), unique by its hash."""
    readable = "".join(c if c.isalnum() else "_" for c in name)[-40:]
    return f"{readable}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"
