"""Loading and saving models: checks that turn bad input into one-line errors, and atomic writes.

Models are onnx-ir `ir.Model`s: external data stays memory-mapped until a pass reads a tensor, so a
multi-GB model is never held twice. Saving writes into a temporary folder beside the destination,
validates the result there, then renames it into place: a failure leaves no partial file and never
touches an existing one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir

from onnx_nmm.errors import UserError

# Protobuf cannot serialize a single message above 2 GiB; bigger models must use external data.
PROTOBUF_LIMIT = 2**31 - 1


def load_model(path: str | os.PathLike) -> ir.Model:
    """Load an ONNX model (external data memory-mapped), or raise a UserError saying what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file; give the path of an .onnx model")
    try:
        model = ir.load(path)
    except Exception as error:  # protobuf raises DecodeError, RuntimeError or ValueError by version
        raise UserError(f"{path} is not an ONNX model ({type(error).__name__}: {_first_line(error)}); "
                        "give a .onnx file, e.g. from torch.onnx.export") from None
    if not model.graph.outputs:
        raise UserError(f"{path} parsed, but holds no graph outputs: it is not an ONNX model")
    _check_external_data(path, model)
    return model


def external_data_files(model: ir.Model) -> set[Path]:
    """The external-data files the model's initializers live in."""
    return {Path(tensor.path) for tensor in _external_tensors(model)}


def uses_external_data(model: ir.Model) -> bool:
    return any(True for _ in _external_tensors(model))


def external_data_path(model_path: str | os.PathLike) -> Path:
    """Where a model written at `model_path` keeps its weights: `<name>.data` beside it."""
    model_path = Path(model_path)
    return model_path.with_name(model_path.name + ".data")


def check_output_path(source: str | os.PathLike, destination: str | os.PathLike, force: bool) -> None:
    """Refuse to write over the input model (or its external data) unless `force` is set."""
    source, destination = Path(source).resolve(), Path(destination).resolve()
    clobbered = {destination, external_data_path(destination)} & {source, *_external_files_of(source)}
    if clobbered and not force:
        raise UserError(f"the output {destination} would overwrite the input's {', '.join(sorted(p.name for p in clobbered))}; "
                        "choose another -o, or pass --force to replace it")


def save_model(model: ir.Model, path: str | os.PathLike, external_data: bool,
               validate: Callable[[Path], None] | None = None) -> Path:
    """Write `model` to `path` (weights to `<name>.data` if `external_data`), atomically.

    `validate(temporary_path)` runs on the written files before they are moved into place; if it
    raises, nothing is left on disk.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = external_data_path(path).name
    with _temporary_folder(path.parent) as folder:
        staged = folder / path.name
        ir.save(model, staged, external_data=data_name if external_data else None)
        if validate is not None:
            validate(staged)
        if (folder / data_name).exists():
            os.replace(folder / data_name, path.with_name(data_name))
        os.replace(staged, path)
    return path


def check_model_file(path: Path) -> None:
    """onnx.checker with full_check (shape inference included), by path so > 2 GB models work."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as error:
        raise UserError(f"the rewritten model fails onnx.checker: {_first_line(error)} "
                        "(a bug in onnx-nmm: please report it with the input model)") from None


def weight_bytes(model: ir.Model) -> int:
    return sum(value.const_value.nbytes for value in model.graph.initializers.values()
               if value.const_value is not None)


@contextlib.contextmanager
def _temporary_folder(parent: Path) -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix=".onnx-nmm-", dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _external_tensors(model: ir.Model) -> Iterator[ir.ExternalTensor]:
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            yield value.const_value


def _check_external_data(path: Path, model: ir.Model) -> None:
    for tensor in _external_tensors(model):
        file = Path(tensor.path)
        if not file.is_file():
            raise UserError(f"{path} keeps its weights in external data file '{tensor.location}', which is missing "
                            f"(looked for {file}); copy it next to the model")
        needed = tensor.offset + tensor.length if tensor.length is not None else tensor.offset
        if file.stat().st_size < needed:
            raise UserError(f"external data file {file} is truncated: tensor '{tensor.name}' needs {needed} bytes, "
                            f"the file has {file.stat().st_size}; copy the complete file")


def _external_files_of(model_path: Path) -> set[Path]:
    """External-data files of a model on disk, read without loading any weights."""
    if not model_path.is_file():
        return set()
    try:
        proto = onnx.load(str(model_path), load_external_data=False)
    except Exception:
        return set()
    files = set()
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                files.add((model_path.parent / entry.value).resolve())
    return files


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
