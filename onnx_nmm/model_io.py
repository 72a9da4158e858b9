"""Loading and saving models: checks that turn bad input into one-line errors, and atomic writes.

Models are onnx-ir `ir.Model`s: external data stays memory-mapped until a pass reads a tensor, so a
multi-GB model is never held twice. Saving writes into a temporary folder beside the destination,
validates the result there, then renames it into place: a failure leaves no partial file and never
touches an existing one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir

from onnx_nmm.errors import ModelError, OutputError

# Protobuf cannot serialize a single message above 2 GiB; bigger models must use external data.
PROTOBUF_LIMIT = 2**31 - 1


def load_model(path: str | os.PathLike) -> ir.Model:
    """Load an ONNX model (external data memory-mapped), or raise a ModelError saying what is wrong."""
    path = Path(path)
    check_model_path(path)
    try:
        model = ir.load(path)
    except Exception as error:  # protobuf raises DecodeError, RuntimeError or ValueError by version
        raise ModelError(f"{path} is not an ONNX model ({type(error).__name__}: {_first_line(error)}); "
                         "give a .onnx file, e.g. from torch.onnx.export") from None
    if not model.graph.outputs:
        raise ModelError(f"{path} parsed, but holds no graph outputs: it is not an ONNX model")
    _check_external_data(path, model)
    return model


def check_model_path(path: Path) -> None:
    """A ModelError when `path` is no file (a folder: what to give instead), before anything is read."""
    if path.is_dir():
        inside = sorted(path.glob("*.onnx"))
        if (path / "manifest.json").is_file() and inside:
            hint = "a folder compile wrote, which generate and bench read; give the model it came from"
        elif (path / "genai_config.json").is_file() and inside:
            hint = f"an onnxruntime-genai folder: give its model, {inside[0]}"
        elif (path / "config.json").is_file():
            hint = "a Hugging Face model folder: export it first (onnx-nmm export FOLDER -o model.onnx)"
        else:
            hint = f"give the .onnx file in it ({inside[0]})" if inside else "give the path of an .onnx model"
        raise ModelError(f"{path} is a folder, not a model: {hint}")
    if not path.is_file():
        raise ModelError(f"{path}: no such file; give the path of an .onnx model")


def external_data_files(model: ir.Model) -> set[Path]:
    """The external-data files the model's initializers live in."""
    return {Path(tensor.path) for tensor in _external_tensors(model)}


def uses_external_data(model: ir.Model) -> bool:
    return any(True for _ in _external_tensors(model))


def external_data_path(model_path: str | os.PathLike) -> Path:
    """Where a model written at `model_path` keeps its weights: `<name>.data` beside it."""
    model_path = Path(model_path)
    return model_path.with_name(model_path.name + ".data")


def check_new_output(destination: str | os.PathLike, overwrite: bool) -> None:
    """Refuse an output that exists unless `overwrite` (the CLI's --force: replace an existing output)."""
    if Path(destination).exists() and not Path(destination).is_dir() and not overwrite:
        raise OutputError(f"{destination} exists; choose another {{output}} or set {{overwrite}} to replace it",
                          output="output", overwrite="overwrite")


def check_output_path(source: str | os.PathLike, destination: str | os.PathLike, overwrite_input: bool) -> None:
    """Refuse to write over the input model (or its external data) unless `overwrite_input` is set, and to write
    a model where a folder is."""
    if Path(destination).is_dir():
        raise OutputError(f"the output {destination} is a folder: give {{output}} a file name in it, e.g. "
                          f"{Path(destination) / 'model.onnx'}", output="output")
    source, destination = Path(source).resolve(), Path(destination).resolve()
    clobbered = {destination, external_data_path(destination)} & {source, *_external_files_of(source)}
    if clobbered and not overwrite_input:
        names = ", ".join(sorted(p.name for p in clobbered))
        raise OutputError(f"the output {destination} would overwrite the input's {names}; choose another {{output}}, "
                          "or set {overwrite} to replace it", output="output", overwrite="overwrite_input")


def save_derived(model: ir.Model, path: str | os.PathLike, source_path: Path | None, source_used_external_data: bool,
                 external_data: bool | None = None, overwrite_input: bool = False) -> Path:
    """Write a model made from the one at `source_path` (None: made in memory) atomically, checked by
    onnx.checker first, the input's onnxruntime-genai config carried beside it. `external_data`: weights to
    `<name>.data`; None = as the input did, or when the weights pass protobuf's 2 GB. Refuses to write over the
    input unless `overwrite_input`."""
    if source_path is not None:
        check_output_path(source_path, path, overwrite_input)
    if external_data is None:
        external_data = source_used_external_data
    external_data = external_data or weight_bytes(model) > PROTOBUF_LIMIT
    written = save_model(model, path, external_data=external_data,
                         validate=functools.partial(check_model_file, source=source_path))
    if source_path is not None:
        carry_genai_config(source_path, written)
    return written


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


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temporary file renamed into place, with the permissions a plain
    `open` would give (tempfile's are private)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".onnx-nmm-", delete=False,
                                     encoding="utf-8") as handle:
        handle.write(text)
        staged = Path(handle.name)
    make_public(staged)
    staged.replace(path)
    return path


def write_bytes_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` through `.NAME.tmp` beside it, synced to disk, then renamed into place: a work
    folder's record is whole or absent, even after kill -9 or a power cut."""
    staged = path.with_name(f".{path.name}.tmp")
    with staged.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staged, path)


def make_public(path: str | os.PathLike) -> None:
    """Give a file or folder made by tempfile (private: 0600, 0700) the permissions a plain open or mkdir
    would."""
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_model_file(path: Path, source: str | os.PathLike | None = None) -> None:
    """onnx.checker with full_check (shape inference included), by path so > 2 GB models work.

    An error the `source` model already has is not the rewrite's (onnxruntime-genai's builder writes
    contrib ops under the default domain's opset, which the checker refuses): then the written model must
    load in onnxruntime instead, and a warning says so.
    """
    error = _checker_error(path)
    if error is None:
        return
    if source is not None and _checker_error(Path(source)) == error:
        from onnx_nmm.runtime.ort_runner import create_session

        create_session(path, label="the rewritten model")
        warnings.warn(f"the input already fails onnx.checker ({error}); the rewritten model was checked by loading it "
                      "in onnxruntime instead", stacklevel=2)
        return
    raise ModelError(f"the rewritten model fails onnx.checker: {error} (a bug in onnx-nmm: please report it with "
                     "the input model)")


def _checker_error(path: Path) -> str | None:
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as error:
        return _first_line(error)
    return None


# onnxruntime-genai's model folder: the generator reads these beside the model.
GENAI_CONFIG = "genai_config.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def carry_genai_config(source: Path, output: Path) -> Path | None:
    """Give a model written from an onnxruntime-genai folder the same companions: its genai_config.json with the
    decoder's filename changed to the output's, and the tokenizer files, in the output's folder. Nothing is
    written over the input's own folder (a warning says what to change); the path of the config written, or None."""
    config_path = source.parent / GENAI_CONFIG
    if not config_path.is_file():
        return None
    if output.parent.resolve() == source.parent.resolve():
        warnings.warn(f"{config_path} still names {source.name}: onnxruntime-genai runs {output.name} once the "
                      "config's decoder filename is changed, or write the output into a folder of its own",
                      stacklevel=2)
        return None
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["filename"] = output.name
    written = write_text_atomically(output.parent / GENAI_CONFIG, json.dumps(config, indent=4))
    for name in _TOKENIZER_FILES:
        if (source.parent / name).is_file() and not (output.parent / name).exists():
            shutil.copy2(source.parent / name, output.parent / name)
    return written


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
            raise ModelError(f"{path} keeps its weights in external data file '{tensor.location}', which is missing "
                             f"(looked for {file}); copy it next to the model")
        needed = (tensor.offset or 0) + (tensor.length or 0)
        if file.stat().st_size < needed:
            raise ModelError(f"external data file {file} is truncated: tensor '{tensor.name}' needs {needed} bytes, "
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
