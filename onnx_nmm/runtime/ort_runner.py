"""onnxruntime on CPU, the reference every other number is measured against.

Builds sessions with one-line errors, reads model inputs from an .npz file, and runs a session.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_nmm.errors import DataError, ExecutionError, ModelError


def create_session(model: str | os.PathLike | bytes, threads: int | None = None,
                   extra_config: dict[str, str] | None = None, label: str | os.PathLike | None = None,
                   initializers: dict[str, np.ndarray] | None = None) -> ort.InferenceSession:
    """A CPU session for a model file, or for serialized bytes (`label` names it in errors). `initializers`: the
    arrays of external weights by name, read where they are (the session keeps them alive), not from files."""
    options = ort.SessionOptions()
    options.log_severity_level = 4  # errors reach the user as one line of ours, not as onnxruntime's log
    if threads:
        options.intra_op_num_threads = threads
    for key, value in (extra_config or {}).items():
        options.add_session_config_entry(key, value)
    values = [ort.OrtValue.ortvalue_from_numpy(array) for array in (initializers or {}).values()]
    if values:
        options.add_external_initializers(list(initializers or {}), values)
    source = model if isinstance(model, bytes) else str(model)
    try:
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        session.external_initializers = (initializers, values)  # alive as long as the session that was handed them
        return session
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        name = label or ("the serialized model" if isinstance(model, bytes) else model)  # never its bytes
        raise ModelError(f"onnxruntime cannot load {name}: {message}") from None


def load_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of an .npz file, by key."""
    path = Path(path)
    try:
        with np.load(path) as archive:
            return {key: archive[key] for key in archive.files}
    except Exception as error:
        raise DataError(f"cannot read inputs from {path}: {error}; give an .npz saved with numpy.savez") from None


def run(session: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [output.name for output in session.get_outputs()]
    try:
        return dict(zip(names, session.run(names, inputs)))
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ExecutionError(f"onnxruntime failed to run the model: {message}") from None
