"""Write a model whose weights lie in files (the input's external data, the factors in the work folder) to
`<output>` and `<output>.data`, one tensor at a time, through buffered reads: the process never holds more
than one chunk of weights, and memory-mapped pages never pile up in its RSS.

    tensor by tensor  →  staging/<name>.data   (offsets aligned to ALIGNMENT)
    graph             →  staging/<name>         (the proto, weights referenced, a few MB)
    checked (onnx.checker, by path), then renamed into place: the data file first, the model last
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from onnx_nmm.model_io import external_data_path

ALIGNMENT = 4096  # offsets of the tensors in the data file: page-aligned, so they memory-map cheaply
# Smaller tensors stay in the graph (onnx.save's default threshold): shapes and axes that onnx.checker's shape
# inference must read, which it cannot from external data.
INLINE_BYTES = 1024
CHUNK = 64 * 2**20  # bytes copied per read


def write_streamed(model: ir.Model, output: Path, staging: Path,
                   validate: Callable[[Path], None] | None = None) -> Path:
    """Write `model` to `output` with every initializer of its main graph of INLINE_BYTES or more in
    `<output>.data`, the smaller ones in the graph; on return the model's initializers reference that file."""
    data_name = external_data_path(output).name
    staged_data, staged_model = staging / data_name, staging / output.name
    placed: dict[str, tuple[int, int]] = {}
    with staged_data.open("wb") as out:
        for name, value in model.graph.initializers.items():
            if value.const_value is None:
                continue
            if value.const_value.nbytes < INLINE_BYTES:
                value.const_value = ir.tensor(value.const_value.numpy(), name=name)
                continue
            out.write(b"\0" * (-out.tell() % ALIGNMENT))
            offset = out.tell()
            _copy_tensor(value.const_value, out)
            placed[name] = (offset, out.tell() - offset)
    for name, (offset, length) in placed.items():
        value = model.graph.initializers[name]
        tensor = value.const_value
        assert tensor is not None and isinstance(tensor.shape, ir.Shape), "a placed initializer is a tensor"
        value.const_value = ir.ExternalTensor(data_name, offset, length, tensor.dtype, shape=tensor.shape, name=name,
                                              base_dir=staging)
    staged_model.write_bytes(ir.to_proto(model).SerializeToString())
    if validate is not None:
        validate(staged_model)
    output.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged_data, external_data_path(output))
    os.replace(staged_model, output)
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value.base_dir = str(output.parent)
    return output


def _copy_tensor(tensor: ir.TensorProtocol, out) -> None:
    """The tensor's bytes as ONNX stores them: read from its file in chunks, or serialized if in memory."""
    if isinstance(tensor, ir.ExternalTensor):
        offset = tensor.offset or 0  # none given: the tensor starts the file
        remaining = tensor.length if tensor.length is not None else os.path.getsize(tensor.path) - offset
        with open(tensor.path, "rb") as source:
            source.seek(offset)
            while remaining:
                chunk = source.read(min(CHUNK, remaining))
                if not chunk:
                    raise OSError(f"{tensor.path} ended before tensor {tensor.name}'s {tensor.length} bytes")
                out.write(chunk)
                remaining -= len(chunk)
        tensor.release()
        return
    out.write(tensor.tobytes())
