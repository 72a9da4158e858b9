"""The rewrite as steps that take values and return what they made; onnx-ir passes where the model changes:

    model ─ gather_statistics ─ Planner.choose ─ (NarrowMlps) ─ FactorizeLayers ─ (FuseMlps) ─ model'
              Statistics         RankChoice:      NarrowedResult  FactorizedResult    FusedResult
              (XᵀX, GᵀG)         {layer: rank | Dense | Narrowed(width)}, what a budget measured

`rewrite` composes them and assembles the report from what each returned.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from onnx_nmm.calibration.calibration_data import CalibrationData, calibration_text, check_source_files
from onnx_nmm.decomposition import sequential
from onnx_nmm.errors import OptionError
from onnx_nmm.model_io import weight_bytes
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes.dense_mlp_fusion import fuse_every_mlp
from onnx_nmm.pipeline.factorize import FactorizedResult, FactorizeLayers
from onnx_nmm.pipeline.factorizer import Factorizer
from onnx_nmm.pipeline.narrow import MlpNarrowings, NarrowedResult, NarrowMlps
from onnx_nmm.pipeline.plan import Planner, RankChoice
from onnx_nmm.pipeline.report import LayerOutcome, RewriteReport, RewriteResult
from onnx_nmm.pipeline.statistics import Statistics, calibration_data, gather_statistics
from onnx_nmm.pipeline.targets import Targets, find_layers, find_targets
from onnx_nmm.progress import Progress
from onnx_nmm.ranks.rank_plan import check_report_files
from onnx_nmm.teacher import record_calibration, record_calibration_text, record_dense_model


@dataclass
class FusedResult(ir.passes.PassResult):
    """The fused MLPs' names, and why each MLP left alone was."""

    fused: list[str] = field(default_factory=list)
    unfused: dict[str, str] = field(default_factory=dict)


class FuseMlps(ir.passes.InPlacePass):
    """Each factorized MLP → one SvdGatedMLP (gate/up/down) or SvdMLP (fc1/fc2); each dense one (narrowed or
    not) → one GatedMLP or MLP."""

    def call(self, model: ir.Model) -> FusedResult:
        fused, unfused = fuse_every_mlp(model)
        if not fused:
            reasons = Counter(unfused.values())
            said = "; ".join(f"{count} {reason}" for reason, count in reasons.most_common()) or "no MLP found"
            warnings.warn(f"no MLP could be fused: {said}", stacklevel=2)
        return FusedResult(model, modified=bool(fused), fused=fused, unfused=unfused)


def rewrite(model: str | os.PathLike | ir.Model | onnx.ModelProto, options: RewriteOptions | None = None,
            progress: Progress | None = None) -> RewriteResult:
    """Factorize the linear layers of `model` (a path, or a model in memory, which is left unchanged) into
    SvdMatMul ops, or narrow its MLPs, as `options` say; the rewritten model and the report of what was done to
    each layer.

    Raises an OnnxNmmError subclass (errors.py) for anything the input or the options make impossible.
    """
    options, progress = options or RewriteOptions(), progress or Progress()
    if options.sequential and options.strategy.narrows_mlps:
        raise OptionError("sequential calibration refits narrowed MLPs in the layer-wise rewrite only: rewrite "
                          "layer by layer ({stream}), or give {mode} independent", stream="rewrite_streamed",
                          mode="calibration.mode")
    check_source_files(options.calibration)  # a missing file is said before the model loads
    check_report_files(options.ranks)
    source = ModelSource.of(model)
    targets = find_targets(source.model, options)
    data = calibration_data(options, source, progress)  # a bad calibration source is refused before any work
    report = RewriteReport.of(options, source.model)
    with report.timed("calibration"):
        statistics = gather_statistics(targets, data, options, source, progress)
    report.calibration, report.calibration_windows = statistics.description, statistics.windows
    factorizer = Factorizer(options.factorization, statistics.grams, options.ranks.align)
    narrowings = MlpNarrowings(statistics, options.factorization)
    with report.timed("rank selection"):
        choice = Planner(options, targets, factorizer, narrowings, data, statistics, source, progress).choose(
            source.model)
    report.quality_budget = choice.quality_budget
    narrowed = _narrowed(source.model, targets, choice, narrowings, report, progress)
    label = "sequential calibration and factorization" if options.sequential else "factorization"
    with report.timed(label):
        observer = _observer(options, source, data)
        factorized = FactorizeLayers(options, choice.plan, factorizer, progress, narrowed.rows, targets.not_narrowed,
                                     observer)(source.model)
    assert isinstance(factorized, FactorizedResult)
    factorizer.decompositions.clear()
    report.layers = factorized.rows
    if options.fuse_mlp:
        with report.timed("fusion"):
            fused = FuseMlps()(source.model)
        assert isinstance(fused, FusedResult)
        report.fused_mlps, report.unfused_mlps = fused.fused, fused.unfused
    report.weight_bytes_after = weight_bytes(source.model)
    calibration = options.calibration
    if options.check_answers and calibration is not None and calibration.tokenizer is not None:
        _check_answers(source, report, calibration.tokenizer, progress)
    record_dense_model(source.model, source.path)  # finetune's teacher by default
    record_calibration(source.model, report.calibration)
    if calibration is not None:
        record_calibration_text(source.model, calibration_text(calibration))  # finetune's prompts by default
    return RewriteResult(source.model, report, source.path, source.used_external_data)


def _narrowed(model: ir.Model, targets: Targets, choice: RankChoice, narrowings: MlpNarrowings,
              report: RewriteReport, progress: Progress) -> NarrowedResult:
    """The MLPs narrowed (a method that narrows them), or nothing done."""
    if not targets.mlps:
        return NarrowedResult(model, modified=False)
    with report.timed("narrowing"):
        narrowed = NarrowMlps(targets.mlps, choice.plan, narrowings, progress)(model)
    assert isinstance(narrowed, NarrowedResult)
    return narrowed


def _observer(options: RewriteOptions, source: ModelSource, data: CalibrationData | None
              ) -> sequential.GroupObserver | None:
    """With sequential calibration: what runs the dense and the partly compressed model on the calibration
    windows, a group of layers at a time."""
    if not options.sequential:
        return None
    assert data is not None, "sequential calibration is calibration"
    return sequential.GroupObserver(source, data.windows().batches(data.options.batch))


def _check_answers(source: ModelSource, report: RewriteReport, tokenizer, progress: Progress) -> None:
    rewritten = ModelSource(source.model, folder=source.folder)  # the in-memory model, described as its input
    check_rewritten_answers(source.path or source.original, rewritten, report, tokenizer, progress)


def check_rewritten_answers(dense, rewritten, report: RewriteReport, tokenizer, progress: Progress) -> None:
    """The rewritten model's greedy answers to the check prompts against the dense model's
    (onnx_nmm.generation.answers), in the report; a warning when they differ. The models are anything
    model_source.ModelSource takes, run one after the other."""
    from onnx_nmm.calibration.tokens import load_tokenizer
    from onnx_nmm.generation.answers import check_answers

    with progress.phase("checking answers against the dense model"):
        check = check_answers(dense, rewritten, load_tokenizer(tokenizer))
    report.answers = check.to_dict()
    if check.warning():
        warnings.warn(check.warning(), stacklevel=4)


__all__ = ["calibration_data", "check_rewritten_answers",
           "Factorizer", "FactorizedResult", "FactorizeLayers", "find_layers", "find_targets",
           "FusedResult", "FuseMlps", "gather_statistics", "LayerOutcome", "MlpNarrowings", "NarrowedResult",
           "NarrowMlps", "Planner", "RankChoice", "RewriteReport", "RewriteResult", "rewrite", "Statistics", "Targets"]
