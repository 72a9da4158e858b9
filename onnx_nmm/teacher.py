"""Which dense model a rewritten one came from: recorded by `rewrite`, read by `finetune`, whose default
loss distils from it.

Next-token fine-tuning on a narrow text teaches the model that text (docs/quality.md: the dense SmolLM2
itself gains 8.5 % on the New Testament after 100 steps on the Old, and loses on modern prose); the dense
model's next-token distributions carry its general behaviour, so distilling from them restores what the
rewrite took without teaching a style. For that `finetune` needs the dense model: the rewrite writes its
absolute path into the output's metadata (`onnx_nmm.dense_model`), kept through later rewrites and
fine-tunings of the result.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx_ir as ir

DENSE_MODEL = "onnx_nmm.dense_model"
CALIBRATION = "onnx_nmm.calibration"  # what a calibrated rewrite was fitted to, in words
CALIBRATION_TEXT = "onnx_nmm.calibration_text"  # the text file it was calibrated on: finetune's prompts


def record_dense_model(model: ir.Model, source: Path | None) -> None:
    """Write the dense model's path into `model` (the one it was rewritten from, unless that one already
    names its own dense model)."""
    if source is not None and DENSE_MODEL not in model.metadata_props:
        model.metadata_props[DENSE_MODEL] = str(Path(source).resolve())


def record_calibration(model: ir.Model, description: str) -> None:
    """Write what the rewrite was calibrated on into `model`, when it was (`diff` reads it)."""
    if description:
        model.metadata_props[CALIBRATION] = description


def record_calibration_text(model: ir.Model, text: str | os.PathLike | None) -> None:
    """Write the absolute path of the calibration `text` (calibration_data.calibration_text) into `model`,
    unless it names one already: `finetune` starts windows with its passages."""
    if text is not None and CALIBRATION_TEXT not in model.metadata_props:
        model.metadata_props[CALIBRATION_TEXT] = str(Path(text).resolve())


def recorded_calibration_text(model: ir.Model) -> Path | None:
    """The text `model` was calibrated on, when the rewrite recorded it and the file is still there."""
    recorded = model.metadata_props.get(CALIBRATION_TEXT)
    return Path(recorded) if recorded and Path(recorded).is_file() else None


def recorded_dense_model(model: ir.Model) -> Path | None:
    """The dense model `model` was rewritten from, when the rewrite recorded it and the file is still there."""
    recorded = model.metadata_props.get(DENSE_MODEL)
    return Path(recorded) if recorded and Path(recorded).is_file() else None
