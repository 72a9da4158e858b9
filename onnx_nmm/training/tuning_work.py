"""What a layer-by-layer fine-tuning has finished (layer_by_layer.py), in `<output>.partial/` beside its output:

    manifest.json      what the work was made from: the model file (its bytes hashed, its external data files by
                       name, size and modification time), the windows and the options
    stream/, targets/  the training windows' residual stream before the next layer, the dense layer's outputs
    layer-NNNN.bin     layer NNNN's tuned weights, raw bytes as the model stores them
    layer-NNNN.json    its summary: written last, so its presence says the layer is finished

Every file is written to a temporary name and renamed into place, so a run killed at any point leaves only whole
files, which the same call takes up. Without an output (or a model file), a temporary folder, never taken up.
(The streamed rewrite keeps its work the same way, in scale/work_dir.py, a layer above this package.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from onnx_nmm.model_io import external_data_files, write_bytes_durably
from onnx_nmm.model_source import ModelSource

MANIFEST = "manifest.json"


class TuningWork:
    def __init__(self, folder: Path):
        self.folder = folder

    @classmethod
    def open(cls, source: ModelSource, output: str | os.PathLike | None, settings: str) -> TuningWork:
        """The folder for tuning `source` into `output` with `settings` (the windows and options, in words): a
        killed run's when it did the same, else a fresh one."""
        if output is None or source.path is None:
            return cls(Path(tempfile.mkdtemp(prefix="onnx-nmm-finetune-")))
        output = Path(output)
        folder = output.with_name(output.name + ".partial")
        fingerprint = _fingerprint(source, settings)
        manifest = folder / MANIFEST
        if manifest.is_file() and json.loads(manifest.read_text()).get("fingerprint") == fingerprint:
            return cls(folder)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        work = cls(folder)
        work.write_bytes(MANIFEST, json.dumps({"fingerprint": fingerprint}).encode())
        return work

    def write_bytes(self, name: str, data: bytes) -> None:
        write_bytes_durably(self.folder / name, data)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def remove_if_empty(self) -> None:
        """Remove the folder if it records no finished layer."""
        if not any(path.name != MANIFEST for path in self.folder.glob("*.json")):
            self.remove()


def _fingerprint(source: ModelSource, settings: str) -> str:
    assert source.path is not None, "only a model file's work is taken up"
    digest = hashlib.sha256(source.path.read_bytes())
    for file in sorted(external_data_files(source.model)):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update(settings.encode())
    return digest.hexdigest()
