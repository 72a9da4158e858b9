"""The record of a streamed rewrite in progress: `<output>.partial/`, beside the output.

    manifest.json      the fingerprint of the input model and the options (what the factors were made from)
    NNNN.u, NNNN.v     a finished matrix's factors, raw bytes as the output stores them
    NNNN.json          its report row: written last, so its presence says the matrix is finished
    staging/           the output model while it is written, before it is renamed into place

Every file is written to a temporary name and renamed into place, so a run killed at any point (kill -9)
leaves only whole files; the next run with the same fingerprint takes them up. The folder is removed once
the output is in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np

from onnx_nmm.model_io import external_data_files, load_model, write_bytes_durably
from onnx_nmm.pipeline import LayerOutcome

MANIFEST = "manifest.json"


def work_dir_of(output: str | os.PathLike) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".partial")


def fingerprint(model_path: Path, settings: str) -> str:
    """What a resumed run must share with the killed one: the input's graph (hashed), its external data files
    (name, size, modification time — hashing hundreds of GB would take longer than the rewrite) and the
    settings that shape the factors."""
    digest = hashlib.sha256(model_path.read_bytes())
    for file in sorted(external_data_files(load_model(model_path))):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update(settings.encode())
    return digest.hexdigest()


class WorkDir:
    def __init__(self, folder: Path):
        self.folder = folder

    @classmethod
    def open(cls, output: str | os.PathLike, fingerprint: str, resume: bool) -> WorkDir:
        """The work folder for `output`: the killed run's if it made the same thing, else a fresh one (a
        warning says when another run's work is discarded)."""
        folder = work_dir_of(output)
        manifest = folder / MANIFEST
        if folder.exists():
            recorded = _read_json(manifest).get("fingerprint") if manifest.is_file() else None
            if resume and recorded == fingerprint:
                shutil.rmtree(folder / "staging", ignore_errors=True)
                return cls(folder)
            if resume:
                warnings.warn(f"{folder} holds an interrupted rewrite of another input or with other options: "
                              "starting afresh", stacklevel=3)
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        work = cls(folder)
        work.write_bytes(MANIFEST, json.dumps({"fingerprint": fingerprint}).encode())
        return work

    @property
    def staging(self) -> Path:
        path = self.folder / "staging"
        path.mkdir(exist_ok=True)
        return path

    def finished(self, index: int) -> LayerOutcome | None:
        """The report row of matrix `index` if a run finished it."""
        path = self.folder / f"{index:04d}.json"
        return LayerOutcome(**_read_json(path)) if path.is_file() else None

    def factor_path(self, index: int, which: str) -> Path:
        return self.folder / f"{index:04d}.{which}"

    def record(self, index: int, u: np.ndarray, v: np.ndarray, outcome: LayerOutcome) -> None:
        """Keep a finished matrix: its factors (already in their stored dtype), then its report row."""
        for which, factor in (("u", u), ("v", v)):
            self.write_bytes(self.factor_path(index, which).name, np.ascontiguousarray(factor).tobytes())
        self.write_bytes(f"{index:04d}.json", json.dumps(asdict(outcome)).encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        write_bytes_durably(self.folder / name, data)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def remove_if_empty(self) -> None:
        """Remove the folder if it records no finished matrix."""
        if not any(path.name != MANIFEST for path in self.folder.glob("*.json")):
            self.remove()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
