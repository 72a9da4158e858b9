"""The dense sweep: one decoder layer at a time, what narrowing its MLP would cost.

For layer i, with Xᵢ the dense model's residual stream before it on every calibration window (on disk):

    hᵀh       the Gram of its MLP's intermediate activation, on Xᵢ (kept on disk for the narrowing)
    ridge     chosen on the held-out windows' activation, as the in-memory rewrite chooses it on their Gram
    losses    the refit's relative error at every aligned width
    energies  ‖h·W_d‖² = tr(W_dᵀ C W_d) and ‖Xᵢ₊₁‖², what the MLP and the whole layer write on the calibration
              windows: the local proxy of damage_proxy.py
    damage    at two reference widths: at a calibration layer (damage_proxy.calibration_layers), the held-out
              windows run through this layer narrowed and every later layer dense, to the logits (paths: one per
              reference, all carried together, so each layer's weights are read once); at any other layer, the
              proxy scaled by what the calibration layers measured

then Xᵢ₊₁ = layer i (dense) of Xᵢ, from the same onnxruntime run as the Gram. The damages and losses are what
the quality budget spends (sensitivity.choose), as in memory; nothing but one layer and its Gram is ever held.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

from onnx_nmm.calibration.activation_stats import accumulated_grams
from onnx_nmm.calibration.tokens import TokenWindows
from onnx_nmm.decomposition.nystrom import MlpNarrowing, reference_width
from onnx_nmm.layerwise.carried import CarriedValues
from onnx_nmm.layerwise.damage_proxy import calibration_layers, local_proxy, reference_damages
from onnx_nmm.layerwise.probe import Key, Paths, damage_of_paths
from onnx_nmm.layerwise.segments import LayerSegments
from onnx_nmm.layerwise.work import LayerWork
from onnx_nmm.progress import Progress
from onnx_nmm.ranks.rank_plan import Narrowed, aligned_widths
from onnx_nmm.ranks.sensitivity import NarrowingCandidate


@dataclass
class LayerAnalysis:
    """What the dense sweep found for layer `layer`'s MLP."""

    layer: int
    name: str
    width: int
    parameters_per_neuron: int
    ridge: float
    mlp_energy: float  # ‖h·W_d‖² on the calibration windows
    stream_energy: float  # ‖Xᵢ₊₁‖², the residual stream after the layer on the same windows
    losses: dict[int, float] = field(default_factory=dict)
    references: list[tuple[int, float]] = field(default_factory=list)  # (width, damage at the output)

    def candidate(self) -> NarrowingCandidate:
        return NarrowingCandidate(self.name, self.width, self.parameters_per_neuron, None, losses=dict(self.losses),
                                  references=[(Narrowed(width, self.width), damage)
                                              for width, damage in self.references])

    def reference_widths(self, align: int) -> tuple[int, int]:
        """The middle and the lowest reference width (the same when the MLP has one width to narrow to)."""
        widths = _reference_widths(self.width, align)
        return widths[0], widths[-1]

    def proxy(self, width: int) -> float:
        """The local proxy of damage_proxy.py: the refit's error at `width` relative to the residual stream."""
        return local_proxy(self.losses[width], self.mlp_energy, self.stream_energy)

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"losses": {str(k): v for k, v in self.losses.items()}})

    @classmethod
    def from_json(cls, text: str) -> LayerAnalysis:
        values = json.loads(text)
        values["losses"] = {int(k): v for k, v in values["losses"].items()}
        values["references"] = [tuple(pair) for pair in values["references"]]
        return cls(**values)


def analyse_layers(segments: LayerSegments, calibration: TokenWindows, held_out: TokenWindows, batch: int,
                   metric: str, work: LayerWork, progress: Progress) -> list[LayerAnalysis]:
    """Every layer's analysis, taking up the layers a killed run finished."""
    options = segments.options
    align, score = options.ranks.align, options.factorization.neuron_score
    measured_layers = calibration_layers(segments.layers, options.ranks.reference_layers)
    stream = CarriedValues(work.folder / "dense-calibration")
    batches = list(calibration.batches(batch))
    done = [LayerAnalysis.from_json(text) for text in work.finished("analysis")]
    paths = work.paths("analysis", len(done)) if done else Paths.start(held_out.tokens)
    with progress.phase("layer by layer: what narrowing each MLP costs", total=segments.layers) as phase:
        for _ in done:
            phase.advance(detail="resumed")
        for layer in range(len(done), segments.layers):
            segment, mlp = segments.cut.segments[layer], segments.mlps[layer]
            last = layer + 1 == segments.layers  # the calibration windows go no further than the last layer
            stream_energy = 0.0

            def keep(index: int, outputs: list[np.ndarray], segment=segment, last=last) -> None:
                nonlocal stream_energy
                residual = outputs[0].reshape(-1)  # the boundary: the residual stream after the layer
                stream_energy += float(np.einsum("i,i->", residual, residual, dtype=np.float64))
                if not last:  # the next layer's inputs
                    for name, value in zip(segment.outputs, outputs):
                        stream.put(name, index, value)

            session, plan = segments.gram_session(layer)
            feeds = (segments.feeds(segment, tokens, stream.of_batch(segment.carried_inputs, index))
                     for index, tokens in enumerate(batches))
            gram = accumulated_grams(session, plan, feeds, on_outputs=keep).gram(mlp.down.x.name or "")
            del session  # the maths holds the Gram (GBs at 8B) without the layer's weights beside it
            held = held_out_rows(segments, layer, paths)
            narrowing = MlpNarrowing(gram, mlp.down.weight_matrix(), score)
            ridge = narrowing.choose_ridge_on_rows(held, reference_width(mlp.width))
            del gram, held
            losses, mlp_energy, references = _narrowing_costs(narrowing, align, work, layer, layer in measured_layers)
            del narrowing
            branches = {(layer, width): segments.narrowed_session(layer, *references[width]) for width in references}
            paths = paths.through(segments, layer, segments.session(segment), branches)
            del branches  # two narrowed copies of the layer: not beside the next layer's Grams and maths
            analysis = LayerAnalysis(layer, mlp.name, mlp.width, mlp.parameters_per_neuron, ridge, mlp_energy,
                                     stream_energy, losses)
            work.finish_layer("analysis", layer, analysis.to_json(), paths)
            done.append(analysis)
            drop_unread(stream, segments, layer)
            phase.advance(detail=mlp.name)
    _set_references(done, damage_of_paths(segments, paths, metric), measured_layers, align)
    return done


def held_out_rows(segments: LayerSegments, layer: int, paths: Paths) -> np.ndarray:
    """Layer `layer`'s MLP intermediate activation on the held-out windows (their dense path), rows [tokens, I]:
    a few windows' rows are a fraction of the I×I Gram at an 8B MLP (60 MB against 1.6 GB)."""
    session = segments.activation_session(layer)
    return np.concatenate([session.run(None, feeds)[0] for feeds in paths.dense_feeds(segments, layer)])


def _set_references(analyses: list[LayerAnalysis], damages: dict[Key, np.ndarray], measured_layers: list[int],
                    align: int) -> None:
    """Each layer's damage at its reference widths: the mean over the held-out windows of its paths' at a
    calibration layer, the proxy scaled by theirs elsewhere (damage_proxy.reference_damages)."""
    widths = [analysis.reference_widths(align) for analysis in analyses]
    measured = {layer: [float(damages[(layer, width)].mean()) for width in widths[layer]] for layer in measured_layers}
    proxies = [[analysis.proxy(width) for width in widths[analysis.layer]] for analysis in analyses]
    for analysis, damage in zip(analyses, reference_damages(proxies, measured)):
        analysis.references = list(dict(zip(widths[analysis.layer], damage)).items())


def _narrowing_costs(narrowing: MlpNarrowing, align: int, work: LayerWork, layer: int, measured: bool
                     ) -> tuple[dict[int, float], float, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """From the MLP's narrowing (its ridge chosen): the refit's error at every aligned width, ‖h·W_d‖², and (at a
    layer whose damage is `measured`) the kept neurons and refit at each reference width; the Gram kept in
    `work`."""
    losses = narrowing.relative_errors(aligned_widths(narrowing.width, align))
    references = {width: (kept, narrowing.refit(kept)) for width in _reference_widths(narrowing.width, align)
                  if measured for kept in [narrowing.kept(width)]}
    work.save_gram(layer, narrowing.gram)
    return losses, narrowing.output_energy(), references


def _reference_widths(width: int, align: int) -> list[int]:
    """Where an MLP of `width` neurons has its damage measured: the middle and the lowest aligned width
    (sensitivity.Candidate.reference_ranks)."""
    candidate = NarrowingCandidate("", width, 1, None)
    return [choice.width for choice in candidate.reference_ranks(align) if isinstance(choice, Narrowed)]


def drop_unread(stream: CarriedValues, segments: LayerSegments, layer: int) -> None:
    """Values no segment after `layer` reads."""
    for name in segments.unread_after(layer):
        stream.drop(name)
