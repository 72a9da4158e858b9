"""onnxruntime on CPU, the reference every other number is measured against.

Builds sessions with one-line errors, and makes model inputs: token ids drawn at random from the
model's vocabulary, an all-ones attention mask, positions 0..S-1 — or whatever an .npz file holds.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_nmm.errors import DataError, ExecutionError, ModelError

_NUMPY_OF_ORT = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
}


def create_session(model: str | os.PathLike | bytes, threads: int | None = None,
                   extra_config: dict[str, str] | None = None, label: str | os.PathLike | None = None
                   ) -> ort.InferenceSession:
    """A CPU session for a model file, or for serialized bytes (`label` names it in errors)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    for key, value in (extra_config or {}).items():
        options.add_session_config_entry(key, value)
    source = model if isinstance(model, bytes) else str(model)
    try:
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelError(f"onnxruntime cannot load {label or model}: {message}") from None


def random_inputs(session: ort.InferenceSession, vocabulary: int | None, batch: int, seq_len: int,
                  seed: int) -> dict[str, np.ndarray]:
    """Inputs for a causal LM: random token ids below `vocabulary`, a full attention mask, positions 0..S-1."""
    if vocabulary is None:
        raise DataError("cannot tell the model's vocabulary size to draw token ids from; give the {inputs}",
                        inputs="inputs")
    tokens = np.random.default_rng(seed).integers(0, vocabulary, size=(batch, seq_len), dtype=np.int64)
    return token_inputs(session, tokens, seed)


def token_inputs(session: ort.InferenceSession, tokens: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    """The feeds of a causal LM for these token ids [B, S]: a full attention mask, positions 0..S-1."""
    batch, seq_len = tokens.shape
    rng = np.random.default_rng(seed)
    inputs = {}
    for spec in session.get_inputs():
        dtype = _NUMPY_OF_ORT.get(spec.type)
        if dtype is None:
            raise DataError(f"input '{spec.name}' has type {spec.type}, not token ids; give the {{inputs}}",
                            inputs="inputs")
        shape = _concrete_shape(spec, batch, seq_len)
        name = spec.name.lower()
        if np.issubdtype(dtype, np.integer):
            if "mask" in name:
                inputs[spec.name] = np.ones(shape, dtype)
            elif "position" in name:
                inputs[spec.name] = np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
            elif "type" in name:
                inputs[spec.name] = np.zeros(shape, dtype)
            else:
                inputs[spec.name] = tokens.astype(dtype).reshape(shape)
        elif dtype == np.bool_:
            inputs[spec.name] = np.ones(shape, dtype)
        else:
            inputs[spec.name] = rng.standard_normal(shape).astype(dtype)
    return inputs


def load_inputs(path: str | os.PathLike, session: ort.InferenceSession) -> dict[str, np.ndarray]:
    """Inputs from an .npz file whose keys are the model's input names."""
    path = Path(path)
    try:
        with np.load(path) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except Exception as error:
        raise DataError(f"cannot read inputs from {path}: {error}; give an .npz saved with numpy.savez") from None
    wanted = [spec.name for spec in session.get_inputs()]
    missing = [name for name in wanted if name not in arrays]
    if missing:
        raise DataError(f"{path} lacks model input(s) {', '.join(missing)}; it has {', '.join(arrays) or 'nothing'}")
    return {name: arrays[name] for name in wanted}


def run(session: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [output.name for output in session.get_outputs()]
    try:
        return dict(zip(names, session.run(names, inputs)))
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ExecutionError(f"onnxruntime failed to run the model: {message}") from None


def _concrete_shape(spec, batch: int, seq_len: int) -> tuple[int, ...]:
    shape = []
    for position, dim in enumerate(spec.shape):
        if isinstance(dim, int):
            shape.append(dim)
        elif dim is not None and "past" in str(dim).lower():
            shape.append(0)
        elif position == 0:
            shape.append(batch)
        elif position == 1 or dim is None or "seq" in str(dim).lower():
            shape.append(seq_len)
        else:
            raise DataError(f"input '{spec.name}' has a free dimension '{dim}'; give the {{inputs}}", inputs="inputs")
    return tuple(shape)
