"""The narrowing sweep: one decoder layer at a time, each MLP narrowed to the width the plan gives it (its
Gram read back from the analysis), and the held-out windows carried along two paths, dense and narrowed, to
measure what the whole plan costs at the output."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np

from onnx_nmm.decomposition.nystrom import MlpNarrowing
from onnx_nmm.layerwise.analysis import LayerAnalysis
from onnx_nmm.layerwise.probe import DENSE, Key, Paths, damage_of_paths
from onnx_nmm.layerwise.segments import LayerSegments
from onnx_nmm.layerwise.work import LayerWork
from onnx_nmm.passes.mlp_rules.mlp import Mlp
from onnx_nmm.pipeline.narrow import mlp_keeping, outcomes
from onnx_nmm.pipeline.report import LayerOutcome
from onnx_nmm.progress import Progress
from onnx_nmm.ranks.rank_plan import Dense, Narrowed, RankPlan

NARROWED: Key = (0, 0)  # the path of the narrowed model


def narrow_layers(segments: LayerSegments, analyses: list[LayerAnalysis], plan: RankPlan, held_out: np.ndarray,
                  metric: str, work: LayerWork, stage: str, progress: Progress
                  ) -> tuple[list[LayerOutcome], np.ndarray]:
    """Each layer's MLP narrowed as `plan` says (kept in `work`); the report's rows and the plan's damage on
    each held-out window."""
    score = segments.options.factorization.neuron_score
    done = [json.loads(text) for text in work.finished(stage)]
    paths = work.paths(stage, len(done)) if done else Paths(held_out, {DENSE: [{} for _ in held_out],
                                                                       NARROWED: [{} for _ in held_out]})
    with progress.phase("layer by layer: narrowing the MLPs", total=segments.layers) as phase:
        for _ in done:
            phase.advance(detail="resumed")
        for layer in range(len(done), segments.layers):
            mlp, analysis = segments.mlps[layer], analyses[layer]
            segment = segments.cut.segments[layer]
            choice = plan.get(mlp.down.name)
            rows: list[LayerOutcome] = []
            sessions = {}
            if isinstance(choice, Narrowed):
                narrowing = MlpNarrowing(work.gram(layer), mlp.down.weight_matrix(), score, ridge=analysis.ridge,
                                         ridge_chosen=True)
                kept = narrowing.kept(choice.width)
                refit = narrowing.refit(kept)
                work.save_narrowed(stage, layer, kept, refit)
                rows = outcomes(mlp, narrowing, mlp_keeping(mlp, kept, refit))
                del narrowing  # the Gram and its products (GBs at 8B): not beside the layer's sessions
                sessions[NARROWED] = segments.narrowed_session(layer, kept, refit)
            elif isinstance(choice, Dense):
                rows = _dense_rows(mlp, choice)
            paths = paths.through(segments, layer, segments.session(segment), {}, sessions)
            del sessions  # the layer's weights, twice: not beside the next layer's maths (GBs at 8B)
            work.finish_layer(stage, layer, json.dumps([asdict(row) for row in rows]), paths)
            done.append([asdict(row) for row in rows])
            phase.advance(detail=mlp.name)
    damage = damage_of_paths(segments, paths, metric)[NARROWED]
    return [LayerOutcome(**row) for rows in done for row in rows], damage


def dense_rows(segments: LayerSegments, dense: Dense) -> list[LayerOutcome]:
    """The report's rows of a plan that keeps every MLP dense, for `dense`'s reason."""
    return [row for mlp in segments.mlps for row in _dense_rows(mlp, dense)]


def _dense_rows(mlp: Mlp, dense: Dense) -> list[LayerOutcome]:
    return [LayerOutcome.of(projection, "dense", dense.reason, parameters_after=projection.parameters)
            for projection in mlp.layers]
