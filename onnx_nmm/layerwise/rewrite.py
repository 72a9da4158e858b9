"""The rewrite one decoder layer at a time, straight to a file: the default flow (MLPs narrowed within a
quality budget) in the memory of one layer, for models that do not fit in memory several times over.

    cut at the residual stream (cut.py)
    analysis sweep   dense: each layer's Gram, ridge, refit losses, damage at two widths   analysis.py
    choose           the greedy moves of the in-memory budget, their damages predicted      sensitivity.greedy_moves
    narrowing sweep  each MLP narrowed; the plan's damage measured at the output          narrowing.py
                     (a budget of damage: sweeps search the longest greedy prefix within it) budget_search.py
    sequential       (--calib-mode sequential) one more sweep: the plan's kept neurons        sequential.py
                     refitted to the compressed model's inputs, written if within the budget
    assembly         the narrowed weights into the graph, written tensor by tensor          scale/writer.py
    answers          with a tokenizer, the check prompts' answers of the output against the input's, one
                     model in onnxruntime at a time

Every stage keeps what it finished in `<output>.partial/` (work.py): killed, the same call takes up after the
last finished layer and writes the same bytes.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnx_nmm import __version__
from onnx_nmm.calibration.calibration_data import calibration_text, check_source_files
from onnx_nmm.calibration.tokens import TokenWindows
from onnx_nmm.errors import OptionError
from onnx_nmm.layerwise.analysis import LayerAnalysis, analyse_layers
from onnx_nmm.layerwise.budget_search import MAX_SWEEPS, longest_prefix_within
from onnx_nmm.layerwise.narrowing import dense_rows, narrow_layers
from onnx_nmm.layerwise.segments import LayerSegments
from onnx_nmm.layerwise.sequential import SEQUENTIAL, refit_sequentially
from onnx_nmm.layerwise.work import LayerWork
from onnx_nmm.model_io import carry_genai_config, check_model_file, check_output_path, weight_bytes
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes.mlp_narrowing import NarrowMlpPass
from onnx_nmm.pipeline import (
    RewriteReport,
    RewriteResult,
    calibration_data,
    check_rewritten_answers,
    find_targets,
)
from onnx_nmm.pipeline.narrow import mlp_keeping
from onnx_nmm.pipeline.report import LayerOutcome
from onnx_nmm.pipeline.statistics import budget_windows
from onnx_nmm.progress import Progress
from onnx_nmm.ranks import sensitivity
from onnx_nmm.ranks.rank_plan import Dense, Narrowed, RankOrWidth, RankPlan, keep_width
from onnx_nmm.scale.work_dir import WorkDir, fingerprint
from onnx_nmm.scale.writer import INLINE_BYTES, write_streamed
from onnx_nmm.teacher import record_calibration, record_calibration_text, record_dense_model


def rewrite_layerwise(model: str | os.PathLike, output: str | os.PathLike, options: RewriteOptions | None = None,
                      progress: Progress | None = None, resume: bool = True) -> RewriteResult:
    """Narrow the MLPs of the decoder at `model` as `options` say, one layer at a time, into `output` (weights
    in `<output>.data`). Raises an OnnxNmmError subclass for bad input."""
    options, progress = options or RewriteOptions(), progress or Progress()
    _refuse_unsupported(options)
    check_source_files(options.calibration)
    model_path, output = Path(model), Path(output)
    check_output_path(model_path, output, overwrite_input=False)
    source = ModelSource(model_path)
    targets = find_targets(source.model, options)
    segments = LayerSegments.of(source, targets, options)
    report = RewriteReport.of(options, source.model)
    with report.timed("calibration"):
        data = calibration_data(options, source, progress)
    assert data is not None, "narrowing MLPs is calibrated (RewriteOptions refuses it without)"
    work = LayerWork(WorkDir.open(output, fingerprint(model_path, f"layerwise|{__version__}|{options!r}"), resume))
    calibration, held_out = data.windows(), budget_windows(data, None)
    report.calibration, report.calibration_windows = calibration.description, list(calibration.ids)
    ranks = options.ranks
    metric = ranks.damage_metric
    batch = options.calibration.batch if options.calibration is not None else 1
    try:
        with report.timed("analysis sweep"):
            analyses = analyse_layers(segments, calibration, held_out, batch, metric, work, progress)
        with report.timed("narrowing sweeps"):
            choice, rows, damage, stage = _narrowed_within_budget(segments, analyses, held_out, metric, work,
                                                                  progress)
        narrows = any(isinstance(width, Narrowed) for width in choice.plan.values())  # else nothing to refit
        refitted = None
        if options.sequential and narrows:
            with report.timed("sequential refit"):
                refitted = refit_sequentially(segments, analyses, stage, calibration, batch, held_out.tokens, metric,
                                              work, progress)
    except Exception:
        work.work.remove_if_empty()  # refused before a layer was finished: nothing to take up
        raise
    report.layers = rows
    if ranks.measures_damage or refitted is not None:
        report.quality_budget = choice.to_dict(ranks.keep) | {
            "measured_on": held_out.description, "layer_by_layer": True,
            "spread": sensitivity.spread_over_windows(metric, damage, held_out.ids)}
    if refitted is not None:
        stage = _sequential_if_within(report, choice.budget, stage, *refitted, held_out.ids)
    with progress.phase("writing"), report.timed("writing"):
        _assemble(source, segments, work, stage)
        report.weight_bytes_after = weight_bytes(source.model)
        record_dense_model(source.model, model_path)
        record_calibration(source.model, report.calibration)
        if options.calibration is not None:
            record_calibration_text(source.model, calibration_text(options.calibration))  # finetune's prompts
        write_streamed(source.model, output, work.work.staging, functools.partial(check_model_file, source=model_path))
    carry_genai_config(model_path, output)
    work.work.remove()
    tokenizer = options.calibration.tokenizer if options.calibration is not None else None
    if options.check_answers and tokenizer is not None:
        check_rewritten_answers(model_path, output, report, tokenizer, progress)
    return RewriteResult(source.model, report, model_path, True)


def _narrowed_within_budget(segments: LayerSegments, analyses: list[LayerAnalysis], held_out: TokenWindows,
                            metric: str, work: LayerWork, progress: Progress
                            ) -> tuple[sensitivity.BudgetChoice, list[LayerOutcome], np.ndarray, str]:
    """The plan, the report's rows, the plan's damage per held-out window and the narrowing stage that holds its
    weights: with a budget of damage, the longest greedy prefix measured within it (budget_search)."""
    options = segments.options
    ranks = options.ranks
    if not (ranks.measures_damage and ranks.budget != "sensitivity"):
        choice = _choose(analyses, segments, options, metric)
        rows, damage = narrow_layers(segments, analyses, choice.plan, held_out.tokens, metric, work, "narrowing",
                                     progress)
        choice.damage = sensitivity.held_out_damage(damage, held_out.ids)
        return choice, rows, damage, "narrowing"
    candidates: list[sensitivity.Candidate] = [analysis.candidate() for analysis in analyses]
    moves = sensitivity.greedy_moves(candidates, ranks.align)
    kept_dense = Dense(f"kept dense: the most sensitive layers within the {ranks.quality_budget}")

    def plan(prefix: int) -> RankPlan:
        return _by_layer(segments, sensitivity.plan_after(moves[:prefix], candidates, kept_dense))

    sweeps = {0: (dense_rows(segments, kept_dense), np.zeros(len(held_out.tokens)))}  # nothing narrowed: no sweep

    def measure(prefix: int) -> float:
        sweeps[prefix] = narrow_layers(segments, analyses, plan(prefix), held_out.tokens, metric, work,
                                       _stage(prefix), progress)
        return sensitivity.held_out_damage(sweeps[prefix][1], held_out.ids)

    allowed = _allowed(options, metric)
    low, measured = longest_prefix_within(_predicted_prefixes(candidates, moves), allowed, measure, MAX_SWEEPS)
    for prefix in measured:
        if prefix != low:
            work.drop_narrowed(_stage(prefix))
    choice = sensitivity.BudgetChoice(plan(low), measured[low], allowed, metric, low, len(moves),
                                      sorted(measured.items()), sensitivity.sensitivity_of(candidates, ranks.align))
    if low == 0 and moves:
        warnings.warn(f"narrowing any MLP costs more than the {ranks.quality_budget} on the held-out windows: "
                      "every MLP is kept dense; give a larger budget, or --keep", stacklevel=3)
    rows, damage = sweeps[low]
    return choice, rows, damage, _stage(low)


def _sequential_if_within(report: RewriteReport, budget: float | None, stage: str, rows: list[LayerOutcome],
                          damage: np.ndarray, ids: list[str]) -> str:
    """The stage to write: the sequential refit's, its rows in `report`, if its damage on the held-out windows
    `ids` (sensitivity.held_out_damage) is within `budget` or there is no budget of damage; else `stage`, the
    searched plan's, in a warning. Both damages are in the report's quality budget."""
    measured = sensitivity.held_out_damage(damage, ids)
    written = budget is None or measured <= budget
    report.quality_budget["sequential"] = {"measured": measured, "written": written}
    if not written:
        warnings.warn(f"the sequential refit measured {measured:.4g} nats over the budget of "
                      f"{budget:.4g}: the independent fit was written", stacklevel=3)
        return stage
    refitted = {row.name: row for row in rows}
    report.layers = [refitted.get(row.name, row) for row in report.layers]
    return SEQUENTIAL


def _predicted_prefixes(candidates: list[sensitivity.Candidate], moves: list) -> list[float]:
    """The predicted damage (the candidates' damages added up) of every greedy prefix, from no move on."""
    by_name = {candidate.name: candidate for candidate in candidates}
    widths: dict[str, RankOrWidth | Dense] = {candidate.name: Dense("") for candidate in candidates}
    predicted = [0.0]
    for name, width in moves:
        widths[name] = width
        predicted.append(sum(by_name[name].predicted_damage(chosen) for name, chosen in widths.items()))
    return predicted


def _stage(prefix: int) -> str:
    """The narrowing sweep of the first `prefix` greedy moves."""
    return f"narrowing-{prefix:05d}"


def _refuse_unsupported(options: RewriteOptions) -> None:
    if not options.strategy.narrows_mlps:
        raise OptionError("the layer-wise rewrite narrows MLPs ({method} nystrom); with another method, stream the "
                          "factorization (--stream)", method="factorization.method")
    if options.selection.targets != "mlp":
        raise OptionError("the layer-wise rewrite narrows the MLPs alone: give {targets} mlp",
                          targets="selection.targets")
    if options.ranks.rule not in ("keep", "max_ppl_increase", "max_kl") or options.ranks.budget == "global":
        raise OptionError("the layer-wise rewrite chooses widths by {keep} or a quality budget",
                          keep="ranks.keep")
    if options.fuse_mlp:
        raise OptionError("{fuse_mlp} is not done by the layer-wise rewrite: rewrite, then fuse",
                          fuse_mlp="fuse_mlp")


def _allowed(options: RewriteOptions, metric: str) -> float:
    ranks = options.ranks
    return sensitivity.budget_in_nats(metric, getattr(ranks, ranks.rule))


def _choose(analyses: list[LayerAnalysis], segments: LayerSegments, options: RewriteOptions, metric: str
            ) -> sensitivity.BudgetChoice:
    """The uniform keep, or (--budget sensitivity) the keep's parameters removed where the predicted damages,
    added up, are least."""
    ranks = options.ranks
    candidates: list[sensitivity.Candidate] = [analysis.candidate() for analysis in analyses]
    if not ranks.measures_damage:
        assert ranks.keep is not None, "keep is the rule when no budget is"
        plan: RankPlan = {analysis.name: keep_width(analysis.width, ranks.keep, ranks.align) for analysis in analyses}
        return sensitivity.BudgetChoice(_by_layer(segments, plan), 0.0, None, metric, 0, 0)
    dense = sum(candidate.parameters(Dense("")) for candidate in candidates)
    assert ranks.keep is not None, "a sensitivity budget removes the keep's share of the parameters"
    to_remove = math.ceil((1 - ranks.keep) * dense)

    def predicted(plan: RankPlan) -> float:
        return sum(candidate.predicted_damage(plan.get(candidate.name, Dense(""))) for candidate in candidates)

    kept_dense = Dense(f"kept dense: the most sensitive layers within the {ranks.quality_budget}")
    choice = sensitivity.choose(candidates, predicted, ranks.align, metric, None, to_remove, kept_dense)
    plan = {candidate.name: choice.plan.get(candidate.name, kept_dense) for candidate in candidates}
    choice.plan = _by_layer(segments, plan)
    return choice


def _by_layer(segments: LayerSegments, widths: RankPlan) -> RankPlan:
    """Each MLP's choice, under its output projection's name (what the narrowing sweep reads)."""
    return {mlp.down.name: widths[mlp.name] for mlp in segments.mlps}


def _assemble(source: ModelSource, segments: LayerSegments, work: LayerWork, stage: str) -> None:
    """Every MLP narrowed in `stage` (each of its sites) into `source`'s model, one layer at a time, each new
    weight moved to a file in the work folder at once: no more than one layer's weights are held."""
    sites: dict[str, list] = {}
    for mlp in find_targets(source.model, segments.options).mlps:
        sites.setdefault(mlp.down.name, []).append(mlp)
    for layer, mlp in enumerate(segments.mlps):
        narrowed = work.narrowed(stage, layer)
        if narrowed is None:
            continue
        kept, refit = narrowed
        NarrowMlpPass([mlp_keeping(site, kept, refit) for site in sites[mlp.down.name]])(source.model)
        _to_files(source.model, work.folder / f"weights-{layer:04d}.bin")


def _to_files(model: ir.Model, path: Path) -> None:
    """The model's in-memory initializers of INLINE_BYTES or more, written to `path` and referenced there."""
    with path.open("wb") as out:
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.nbytes < INLINE_BYTES:
                continue
            offset = out.tell()
            out.write(tensor.tobytes())
            assert isinstance(tensor.shape, ir.Shape), "an initializer has a shape"
            value.const_value = ir.ExternalTensor(path.name, offset, out.tell() - offset, tensor.dtype,
                                                  shape=tensor.shape, name=name, base_dir=str(path.parent))
