"""Step 3a (nystrom): narrow every MLP the plan gives a width, before the factorization of the other targets.

    plan  {gate, up, down: Narrowed(k)}   →   S = the k neurons kept, W_d' = the refit (onnx_nmm.decomposition.nystrom)
                                           →   NarrowMlpPass: X·W_g[:, S], X·W_u[:, S], h_S·W_d'

Each new weight is stored as its layer's was: float in the layer's dtype, a quantized weight quantized the
same way — the columns of the input projections exactly (their codes sliced), the refitted output
projection quantized again (onnx_nmm.decomposition.quantization).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.decomposition.nystrom import MlpNarrowing, reference_width
from onnx_nmm.options import FactorizationOptions
from onnx_nmm.passes import LinearLayer
from onnx_nmm.passes.mlp_narrowing import NarrowedMlp, NarrowedWeight, NarrowMlpPass, WeightsNarrowed
from onnx_nmm.passes.mlp_rules.mlp import Mlp
from onnx_nmm.pipeline.report import LayerOutcome
from onnx_nmm.pipeline.statistics import Statistics
from onnx_nmm.progress import Progress
from onnx_nmm.ranks.rank_plan import Narrowed, RankPlan


class MlpNarrowings:
    """Each MLP's Nyström compression from the calibration statistics, made once (the plan and the narrowing
    share it)."""

    def __init__(self, statistics: Statistics, options: FactorizationOptions):
        self.statistics, self.options = statistics, options
        self._made: dict[str, MlpNarrowing] = {}

    def of(self, mlp: Mlp) -> MlpNarrowing:
        if mlp.down.name not in self._made:
            assert self.statistics.grams is not None, "a method that narrows MLPs is calibrated"
            gram = self.statistics.grams.gram(mlp.down.x.name)
            narrowing = MlpNarrowing(gram, mlp.down.weight_matrix(), self.options.neuron_score)
            held_out = self.statistics.held_out
            if held_out is not None:  # its Gram serves this choice alone: freed after (GBs on 0.5B)
                gram_held_out = held_out.gram(mlp.down.x.name)
                del held_out.grams[mlp.down.x.name]
                narrowing.choose_ridge(gram_held_out, reference_width(mlp.width))
            self._made[mlp.down.name] = narrowing
        return self._made[mlp.down.name]


@dataclass
class NarrowedResult(ir.passes.PassResult):
    """`rows`: the report's row of each narrowed layer; `weight_names`: each narrowed layer's new weight."""

    rows: dict[str, LayerOutcome] = field(default_factory=dict)
    weight_names: dict[str, str] = field(default_factory=dict)


class NarrowMlps(ir.passes.InPlacePass):
    """Every one of `mlps` (each site) the plan gives a width, narrowed to it."""

    def __init__(self, mlps: list[Mlp], plan: RankPlan, narrowings: MlpNarrowings, progress: Progress):
        super().__init__()
        self.mlps, self.plan, self.narrowings, self.progress = mlps, plan, narrowings, progress

    def call(self, model: ir.Model) -> NarrowedResult:
        mlps = [mlp for mlp in self.mlps if isinstance(self.plan.get(mlp.down.name), Narrowed)]
        if not mlps:
            return NarrowedResult(model, modified=False)
        made: dict[str, NarrowedMlp] = {}  # an MLP's narrowing, for its other sites
        items, rows = [], {}
        with self.progress.phase("narrowing MLPs", total=len({mlp.down.name for mlp in mlps})) as phase:
            for mlp in mlps:
                if mlp.down.name in made:  # another subgraph's site of the MLP: the same weights
                    first = made[mlp.down.name]
                    items.append(NarrowedMlp(mlp, first.kept, [NarrowedWeight(layer, w.matrix, w.quantized, w.bias)
                                                               for layer, w in zip(mlp.layers, first.weights)]))
                    continue
                start = time.perf_counter()
                choice = self.plan[mlp.down.name]
                assert isinstance(choice, Narrowed)
                narrowing = self.narrowings.of(mlp)
                made[mlp.down.name] = narrowed_mlp(mlp, narrowing, choice.width)
                items.append(made[mlp.down.name])
                for outcome in outcomes(mlp, narrowing, made[mlp.down.name]):
                    outcome.seconds = time.perf_counter() - start
                    rows[outcome.name] = outcome
                phase.advance(detail=mlp.name)
        narrowed = NarrowMlpPass(items)(model)
        assert isinstance(narrowed, WeightsNarrowed)
        return NarrowedResult(model, modified=True, rows=rows, weight_names=narrowed.weight_names)


def narrowed_mlp(mlp: Mlp, narrowing: MlpNarrowing, width: int) -> NarrowedMlp:
    """The MLP at `width`: its kept neurons and every projection's new weight, stored as the layer's was."""
    kept = narrowing.kept(width)
    return mlp_keeping(mlp, kept, narrowing.refit(kept))


def mlp_keeping(mlp: Mlp, kept: np.ndarray, refit: np.ndarray) -> NarrowedMlp:
    """The MLP keeping the neurons `kept`, its output projection `refit` [k, H]: each weight stored as its layer's
    was."""
    weights = [_input_columns(layer, kept) for layer in mlp.projections]
    return NarrowedMlp(mlp, kept, weights + [_stored(mlp.down, refit)])


def outcomes(mlp: Mlp, narrowing: MlpNarrowing, narrowed: NarrowedMlp) -> list[LayerOutcome]:
    """The report's rows of a narrowed MLP's layers; the output projection's says what the refit misses."""
    width = narrowed.width
    rows = []
    for layer, weight in zip(mlp.layers, narrowed.weights):
        after = layer.k * width if layer is not mlp.down else width * layer.n
        stored = weight.quantized.nbytes if weight.quantized is not None else weight.matrix.size * layer.dtype.itemsize
        rows.append(LayerOutcome.of(layer, "narrowed", f"{width} of {mlp.width} neurons kept", width=width,
                                    parameters_after=after, bytes_after=int(stored)))
    down_weight = narrowed.weights[-1].matrix.astype(np.float64)
    rows[-1].whitened_loss = float(np.sqrt(narrowing.relative_error(narrowed.kept, down_weight)))
    chosen = "chosen on held-out windows" if narrowing.ridge_chosen else "the default"
    rows[-1].reason += f"; refit with ridge ρ={narrowing.ridge:g} ({chosen})"
    return rows


def _input_columns(layer: LinearLayer, kept: np.ndarray) -> NarrowedWeight:
    """An input projection keeping the columns `kept`: its codes sliced when it is stored quantized."""
    bias = layer.bias_vector()
    bias = None if bias is None else bias[kept]
    columns = np.ascontiguousarray(layer.weight_matrix()[:, kept])
    if layer.weight.quantized is None:
        return NarrowedWeight(layer, columns, bias=bias)
    from onnx_nmm.decomposition.quantization import kept_columns

    return NarrowedWeight(layer, columns, kept_columns(layer.weight.quantized, layer.n, kept, columns), bias)


def _stored(layer: LinearLayer, matrix: np.ndarray) -> NarrowedWeight:
    """A new weight for `layer`, quantized as its weight is (float in its dtype otherwise)."""
    if layer.weight.quantized is None:
        return NarrowedWeight(layer, matrix.astype(layer.dtype.numpy()))
    from onnx_nmm.decomposition.quantization import quantize_like

    return NarrowedWeight(layer, matrix.astype(np.float32), quantize_like(layer.weight.quantized, matrix))
