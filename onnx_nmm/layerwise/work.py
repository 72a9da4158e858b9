"""What a layer-wise rewrite has finished, in `<output>.partial/` (scale.work_dir: fingerprinted, every file
written whole and renamed into place). The layer is the unit of work:

    <stage>-NNNN.json      layer NNNN's result in a stage (analysis, narrowing, sequential): written last, it says the
                           layer is finished
    <stage>-NNNN.npz       the held-out windows' paths after that layer (probe.Paths)
    gram-NNNN.npy          the layer's MLP Gram hᵀh (the analysis; the narrowing reads it)
    <stage>-narrowed-NNNN.npz  the neurons kept and the refitted output projection (a narrowing sweep; removed
                           when the budget's search does not choose that sweep's plan)
    dense-calibration/     the calibration windows' residual stream before the next layer (carried.py)
    sequential-calibration/  the same in the model narrowed and refitted so far (sequential.py)

Run again after a kill: each stage takes up after its last finished layer.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from onnx_nmm.layerwise.probe import Paths
from onnx_nmm.scale.work_dir import WorkDir


class LayerWork:
    def __init__(self, work: WorkDir):
        self.work = work

    @property
    def folder(self) -> Path:
        return self.work.folder

    def finished(self, stage: str) -> list[str]:
        """The results of the layers a run finished in `stage`, from layer 0 on, up to the first missing one."""
        texts: list[str] = []
        while (path := self.folder / f"{stage}-{len(texts):04d}.json").is_file():
            texts.append(path.read_text())
        return texts

    def finish_layer(self, stage: str, layer: int, result: str, paths: Paths) -> None:
        """Layer `layer` done in `stage`: the paths after it, then its result."""
        buffer = io.BytesIO()
        np.savez(buffer, allow_pickle=False, **paths.save())
        self.work.write_bytes(f"{stage}-{layer:04d}.npz", buffer.getvalue())
        self.work.write_bytes(f"{stage}-{layer:04d}.json", result.encode())
        previous = self.folder / f"{stage}-{layer - 1:04d}.npz"
        previous.unlink(missing_ok=True)

    def paths(self, stage: str, finished: int) -> Paths:
        with np.load(self.folder / f"{stage}-{finished - 1:04d}.npz") as arrays:
            return Paths.load(arrays)

    def save_gram(self, layer: int, gram: np.ndarray) -> None:
        """Written straight to its file (an 8B model's MLP Gram is 1.6 GB: no second copy in memory)."""
        path = self.folder / f"gram-{layer:04d}.npy"
        staged = path.with_name(f".{path.name}.tmp")
        with staged.open("wb") as handle:
            np.save(handle, gram)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staged, path)

    def gram(self, layer: int) -> np.ndarray:
        """Read into one array (memory-mapped, its pages would count in the process's RSS beside a copy)."""
        return np.load(self.folder / f"gram-{layer:04d}.npy")

    def save_narrowed(self, stage: str, layer: int, kept: np.ndarray, refit: np.ndarray) -> None:
        buffer = io.BytesIO()
        np.savez(buffer, kept=kept, refit=refit)
        self.work.write_bytes(f"{stage}-narrowed-{layer:04d}.npz", buffer.getvalue())

    def drop_narrowed(self, stage: str) -> None:
        """The narrowed weights of a sweep whose plan was not chosen (an 8B model's are GBs); its results stay."""
        for path in self.folder.glob(f"{stage}-narrowed-*.npz"):
            path.unlink()

    def narrowed(self, stage: str, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        path = self.folder / f"{stage}-narrowed-{layer:04d}.npz"
        if not path.is_file():
            return None
        with np.load(path) as arrays:
            return arrays["kept"], arrays["refit"]
