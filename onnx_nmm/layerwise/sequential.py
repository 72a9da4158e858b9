"""The sequential refit (--calib-mode sequential), once the budget's search has chosen the plan: one more sweep
in which each narrowed MLP keeps the neurons S the chosen sweep kept and its output projection is refitted to
what the compressed model feeds it (the sequential calibration of GPTQ and SliceGPT), one layer at a time.

With X̃ᵢ the calibration windows' residual stream before layer i in the model narrowed and refitted up to it
(X̃₀ = X₀, the embedding's: nothing comes before the first layer) and h̃ layer i's MLP intermediate activation
on X̃ᵢ, the layer dense:

    C̃       = Σ h̃ᵀh̃                                       the Gram on the compressed model's inputs
    W_d'    = (C̃_SS + λI)⁻¹ (C̃_S: W_d + λ·W_d[S])         MlpNarrowing's refit of the same S, with the
                                                           analysis' ridge ρ (λ = ρ·tr(C̃)/I)
    X̃ᵢ₊₁    = layer i, its MLP keeping S with W_d', on X̃ᵢ   (a layer the plan keeps dense: dense)

so each refit fits the dense MLP's output on the inputs the narrowed layers before it make, not on the dense
model's. The held-out windows go along two paths, dense and refitted, to measure the result's damage at the
output, as a narrowing sweep does. What it costs: each narrowed layer runs twice on the calibration windows (its
Gram, then its narrowed outputs), each dense one once, and the held-out windows once more on two paths.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np

from onnx_nmm.calibration.activation_stats import accumulated_grams
from onnx_nmm.calibration.tokens import TokenWindows
from onnx_nmm.decomposition.nystrom import MlpNarrowing
from onnx_nmm.layerwise.analysis import LayerAnalysis, drop_unread
from onnx_nmm.layerwise.carried import CarriedValues
from onnx_nmm.layerwise.narrowing import NARROWED
from onnx_nmm.layerwise.probe import DENSE, Paths, damage_of_paths
from onnx_nmm.layerwise.segments import LayerSegments
from onnx_nmm.layerwise.work import LayerWork
from onnx_nmm.pipeline.narrow import mlp_keeping, outcomes
from onnx_nmm.pipeline.report import LayerOutcome
from onnx_nmm.progress import Progress

SEQUENTIAL = "sequential"  # the stage holding the refits (work.py)


def refit_sequentially(segments: LayerSegments, analyses: list[LayerAnalysis], chosen: str,
                       calibration: TokenWindows, batch: int, held_out: np.ndarray, metric: str, work: LayerWork,
                       progress: Progress) -> tuple[list[LayerOutcome], np.ndarray]:
    """Each MLP narrowed in the stage `chosen` refitted to the compressed model's inputs (kept in `work` as the
    stage SEQUENTIAL), taking up the layers a killed run finished; the report's rows of the refitted MLPs and
    the refitted model's damage on each held-out window."""
    stream = CarriedValues(work.folder / "sequential-calibration")
    batches = list(calibration.batches(batch))
    done = [json.loads(text) for text in work.finished(SEQUENTIAL)]
    paths = work.paths(SEQUENTIAL, len(done)) if done else Paths(held_out, {DENSE: [{} for _ in held_out],
                                                                            NARROWED: [{} for _ in held_out]})
    with progress.phase("layer by layer: refitting the narrowed MLPs to the compressed model's inputs",
                        total=segments.layers) as phase:
        for _ in done:
            phase.advance(detail="resumed")
        for layer in range(len(done), segments.layers):
            mlp, segment = segments.mlps[layer], segments.cut.segments[layer]
            narrowed = work.narrowed(chosen, layer)
            rows: list[LayerOutcome] = []
            sessions = {}
            if narrowed is not None:
                kept, _ = narrowed
                refit, rows = _refit(stream, segments, layer, batches, kept, analyses[layer].ridge)
                work.save_narrowed(SEQUENTIAL, layer, kept, refit)
                sessions[NARROWED] = segments.narrowed_session(layer, kept, refit)
            dense = segments.session(segment)
            if layer + 1 < segments.layers:  # the calibration windows go no further than the last layer
                _forward(stream, segments, layer, sessions.get(NARROWED, dense), batches)
            paths = paths.through(segments, layer, dense, {}, sessions)
            del dense, sessions  # the layer's weights, twice: not beside the next layer's Gram and maths
            work.finish_layer(SEQUENTIAL, layer, json.dumps([asdict(row) for row in rows]), paths)
            done.append([asdict(row) for row in rows])
            drop_unread(stream, segments, layer)
            phase.advance(detail=mlp.name)
    damage = damage_of_paths(segments, paths, metric)[NARROWED]
    return [LayerOutcome(**row) for rows in done for row in rows], damage


def _refit(stream: CarriedValues, segments: LayerSegments, layer: int, batches: list[np.ndarray], kept: np.ndarray,
           ridge: float) -> tuple[np.ndarray, list[LayerOutcome]]:
    """W_d' of layer `layer`'s MLP keeping the neurons `kept`, fitted on C̃ with the ridge `ridge`, and the
    report's rows of that MLP; the Gram is gone when it returns (GBs at 8B), before the layer's sessions come."""
    mlp = segments.mlps[layer]
    narrowing = MlpNarrowing(_gram(stream, segments, layer, batches), mlp.down.weight_matrix(), ridge=ridge,
                             ridge_chosen=True)
    refit = narrowing.refit(kept)
    rows = outcomes(mlp, narrowing, mlp_keeping(mlp, kept, refit))
    rows[-1].reason += "; refitted to the compressed model's inputs"
    return refit, rows


def _gram(stream: CarriedValues, segments: LayerSegments, layer: int, batches: list[np.ndarray]) -> np.ndarray:
    """C̃: the Gram of layer `layer`'s MLP intermediate activation, the layer dense, on the windows of `stream`."""
    segment, mlp = segments.cut.segments[layer], segments.mlps[layer]
    session, plan = segments.gram_session(layer)
    feeds = (segments.feeds(segment, tokens, stream.of_batch(segment.carried_inputs, index))
             for index, tokens in enumerate(batches))
    return accumulated_grams(session, plan, feeds).gram(mlp.down.x.name or "")


def _forward(stream: CarriedValues, segments: LayerSegments, layer: int, session, batches: list[np.ndarray]) -> None:
    """The windows of `stream` through layer `layer` by `session`: the next layer's inputs, in `stream`."""
    segment = segments.cut.segments[layer]
    for index, tokens in enumerate(batches):
        feeds = segments.feeds(segment, tokens, stream.of_batch(segment.carried_inputs, index))
        for name, value in zip(segment.outputs, session.run(segment.outputs, feeds)):
            stream.put(name, index, value)

