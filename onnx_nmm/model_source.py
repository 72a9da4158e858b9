"""A model given as a path or in memory, and the views of it that each consumer needs.

The passes change `model`, never the caller's: a file is loaded afresh, an in-memory model is cloned
(its tensors shared, not copied). onnxruntime and the PyTorch lowering read the *original* model, from
`graph_proto()` (external weights left where they lie, in `weights_folder`) or `full_proto()`.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx_ir as ir

from onnx_nmm.errors import ModelError
from onnx_nmm.model_io import load_model, uses_external_data
from onnx_nmm.runtime import ort_runner


class ModelSource:
    """`folder`: for an in-memory model, the folder whose files describe it (an onnxruntime-genai folder's
    genai_config.json), as a file's own folder does."""

    def __init__(self, model: str | os.PathLike | ir.Model | onnx.ModelProto, folder: str | os.PathLike | None = None):
        if isinstance(model, ModelSource):
            raise TypeError("already a ModelSource")
        self.path: Path | None = None
        self.original: ir.Model | None = None
        self.folder = Path(folder) if folder is not None else None
        if isinstance(model, (str, os.PathLike)):
            self.path = Path(model)
            self.folder = self.path.parent
            self.model = load_model(self.path)
        elif isinstance(model, (ir.Model, onnx.ModelProto)):
            self.original = model if isinstance(model, ir.Model) else ir.serde.deserialize_model(model)
            self.model = self.original.clone()
        else:
            raise TypeError(f"a model is a path, an onnx_ir.Model or an onnx.ModelProto, not {type(model).__name__}")
        self.used_external_data = uses_external_data(self.model)

    @classmethod
    def of(cls, model) -> ModelSource:
        return model if isinstance(model, ModelSource) else cls(model)

    @property
    def label(self) -> str:
        return str(self.path) if self.path is not None else "the in-memory model"

    @property
    def weights_folder(self) -> str:
        """The folder the original model's external data files are relative to."""
        if self.path is not None:
            return str(self.path.parent.resolve())
        assert self.original is not None, "a model without a path is held in memory"
        folders = {str(Path(value.const_value.base_dir).resolve())
                   for value in self.original.graph.initializers.values()
                   if isinstance(value.const_value, ir.ExternalTensor)}
        if len(folders) > 1:
            raise ModelError(f"the in-memory model reads external data from {len(folders)} folders; save it once "
                             "(onnx_ir.save with external data) and pass its path")
        return folders.pop() if folders else os.getcwd()

    def graph_proto(self) -> onnx.ModelProto:
        """The original model as a proto, external weights not loaded (their references kept)."""
        if self.path is not None:
            return onnx.load(str(self.path), load_external_data=False)
        assert self.original is not None, "a model without a path is held in memory"
        return ir.to_proto(self.original)

    def full_proto(self) -> onnx.ModelProto:
        """The original model as a proto with every weight loaded (what the PyTorch lowering reads)."""
        proto = self.graph_proto()
        onnx.load_external_data_for_model(proto, self.weights_folder)
        return proto

    def session(self, threads: int | None = None):
        """An onnxruntime CPU session of the original model."""
        if self.path is not None:
            return ort_runner.create_session(self.path, threads)
        return self.session_of(self.graph_proto(), threads)

    def session_of(self, proto: onnx.ModelProto, threads: int | None = None):
        """An onnxruntime session of `proto` (a graph derived from this model), its external weights read from
        this model's folder."""
        try:
            serialized = proto.SerializeToString()
        except ValueError:
            raise ModelError(f"{self.label} holds more than 2 GB of weights in memory; save it with external data "
                             "and pass its path") from None
        return ort_runner.create_session(serialized, threads, label=self.label,
                                         extra_config={"session.model_external_initializers_file_folder_path":
                                                       self.weights_folder})
