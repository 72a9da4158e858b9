"""The rewrite as a sequence of passes over one shared context (onnx-ir's pass infrastructure):

    model ─ GatherStatistics ─ PlanRanks ─ (NarrowMlps) ─ FactorizeLayers ─ (FuseMlps) ─ model'
              XᵀX, GᵀG          {layer: rank | Dense   narrower      SvdMatMul ops     SvdGatedMLP ops
                                 | Narrowed(width)}    MLPs (nystrom)

Each pass is a model → model unit (the first two only read the model); `rewrite` composes them.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

import onnx
import onnx_ir as ir

from onnx_nmm.calibration.calibration_data import check_source_files
from onnx_nmm.model_io import weight_bytes
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes.dense_mlp_fusion import fuse_every_mlp
from onnx_nmm.pipeline.context import RewriteContext, RewritePass
from onnx_nmm.pipeline.factorize import FactorizeLayers
from onnx_nmm.pipeline.narrow import NarrowMlps
from onnx_nmm.pipeline.plan import PlanRanks
from onnx_nmm.pipeline.report import LayerOutcome, RewriteReport, RewriteResult
from onnx_nmm.pipeline.statistics import GatherStatistics
from onnx_nmm.progress import Progress
from onnx_nmm.ranks.rank_plan import check_report_files
from onnx_nmm.teacher import record_calibration, record_dense_model


class FuseMlps(RewritePass):
    """Pass 4 (with fuse_mlp): each factorized MLP → one SvdGatedMLP (gate/up/down) or SvdMLP (fc1/fc2); each
    dense one (narrowed or not) → one GatedMLP or MLP."""

    label = "fusion"

    def run(self, model: ir.Model) -> bool:
        fused, unfused = fuse_every_mlp(model)
        self.context.report.fused_mlps, self.context.report.unfused_mlps = fused, unfused
        if not fused:
            reasons = Counter(unfused.values())
            said = "; ".join(f"{count} {reason}" for reason, count in reasons.most_common()) or "no MLP found"
            warnings.warn(f"no MLP could be fused: {said}", stacklevel=2)
        return bool(fused)


def rewrite_passes(context: RewriteContext) -> list[ir.passes.PassBase]:
    narrowing = [NarrowMlps(context)] if context.options.strategy.narrows_mlps else []
    fusion = [FuseMlps(context)] if context.options.fuse_mlp else []
    return [GatherStatistics(context), PlanRanks(context), *narrowing, FactorizeLayers(context), *fusion]


def rewrite(model: str | os.PathLike | ir.Model | onnx.ModelProto, options: RewriteOptions | None = None,
            progress: Progress | None = None) -> RewriteResult:
    """Factorize the linear layers of `model` (a path, or a model in memory, which is left unchanged) into
    SvdMatMul ops, as `options` say; the rewritten model and the report of what was done to each layer.

    Raises an OnnxNmmError subclass (errors.py) for anything the input or the options make impossible.
    """
    options = options or RewriteOptions()
    check_source_files(options.calibration)  # a missing file is said before the model loads
    check_report_files(options.ranks)
    source = ModelSource.of(model)
    context = RewriteContext(options, source, progress or Progress())
    context.report.weight_bytes_before = weight_bytes(source.model)
    try:
        ir.passes.Sequential(*rewrite_passes(context))(source.model)
    except ir.passes.PassError as error:
        raise _root_cause(error) from None
    context.report.weight_bytes_after = weight_bytes(source.model)
    calibration = context.options.calibration
    if context.options.check_answers and calibration is not None and calibration.tokenizer is not None:
        _check_answers(source, context, calibration.tokenizer)
    record_dense_model(source.model, source.path)  # finetune's teacher by default
    record_calibration(source.model, context.report.calibration)
    return RewriteResult(source.model, context.report, source.path, source.used_external_data)


def _check_answers(source: ModelSource, context: RewriteContext, tokenizer) -> None:
    """The rewritten model's greedy answers to the check prompts against the dense model's
    (onnx_nmm.generation.answers), in the report; a warning when they differ."""
    from onnx_nmm.calibration.tokens import load_tokenizer
    from onnx_nmm.generation.answers import check_answers

    with context.progress.phase("checking answers against the dense model"):
        rewritten = ModelSource(source.model, folder=source.folder)  # the in-memory model, described as its input
        check = check_answers(source.path or source.original, rewritten, load_tokenizer(tokenizer))
    context.report.answers = check.to_dict()
    if check.warning():
        warnings.warn(check.warning(), stacklevel=3)


def _root_cause(error: BaseException) -> BaseException:
    """The exception a pass raised, from under the PassErrors the pass infrastructure wraps it in."""
    while isinstance(error, ir.passes.PassError) and error.__cause__ is not None:
        error = error.__cause__
    return error


__all__ = ["FactorizeLayers", "FuseMlps", "GatherStatistics", "LayerOutcome", "NarrowMlps", "PlanRanks",
           "RewriteContext",
           "RewriteReport", "RewriteResult", "rewrite", "rewrite_passes"]
