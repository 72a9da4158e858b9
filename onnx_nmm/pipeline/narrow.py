"""Pass 3a (nystrom): narrow every MLP the plan gives a width, before the factorization of the other targets.

    plan  {gate, up, down: Narrowed(k)}   →   S = the k neurons kept, W_d' = the refit (onnx_nmm.decomposition.nystrom)
                                           →   NarrowMlpPass: X·W_g[:, S], X·W_u[:, S], h_S·W_d'

Each new weight is stored as its layer's was: float in the layer's dtype, a quantized weight quantized the
same way — the columns of the input projections exactly (their codes sliced), the refitted output
projection quantized again (onnx_nmm.decomposition.quantization).
"""

from __future__ import annotations

import time

import numpy as np
import onnx_ir as ir

from onnx_nmm.decomposition.nystrom import MlpNarrowing
from onnx_nmm.passes import LinearLayer
from onnx_nmm.passes.mlp_modules import Mlp
from onnx_nmm.passes.mlp_narrowing import NarrowedMlp, NarrowedWeight, NarrowMlpPass
from onnx_nmm.pipeline.context import RewritePass, targets
from onnx_nmm.pipeline.report import LayerOutcome
from onnx_nmm.ranks.rank_plan import Narrowed


class NarrowMlps(RewritePass):
    """`weight_names` maps each narrowed layer to the name of its new weight initializer."""

    label = "narrowing"

    def __init__(self, context):
        super().__init__(context)
        self.weight_names: dict[str, str] = {}

    def run(self, model: ir.Model) -> bool:
        context = self.context
        layers, chosen, _ = targets(model, context.options)
        mlps = [mlp for mlp in context.mlps(layers) if isinstance(context.plan.get(mlp.down.name), Narrowed)]
        if not mlps:
            return False
        made: dict[str, NarrowedMlp] = {}  # an MLP's narrowing, for its other sites
        items = []
        with context.progress.phase("narrowing MLPs", total=len({mlp.down.name for mlp in mlps})) as phase:
            for mlp in mlps:
                if mlp.down.name in made:  # another subgraph's site of the MLP: the same weights
                    first = made[mlp.down.name]
                    items.append(NarrowedMlp(mlp, first.kept, [NarrowedWeight(layer, w.matrix, w.quantized, w.bias)
                                                               for layer, w in zip(mlp.layers, first.weights)]))
                    continue
                start = time.perf_counter()
                width = context.plan[mlp.down.name].width
                narrowing = context.narrowing(mlp)
                made[mlp.down.name] = narrowed_mlp(mlp, narrowing, width)
                items.append(made[mlp.down.name])
                for outcome in outcomes(mlp, narrowing, made[mlp.down.name]):
                    outcome.seconds = time.perf_counter() - start
                    context.narrowed[outcome.name] = outcome
                phase.advance(detail=mlp.name)
        surgery = NarrowMlpPass(items)
        surgery(model)
        self.weight_names = surgery.weight_names
        return True


def narrowed_mlp(mlp: Mlp, narrowing: MlpNarrowing, width: int) -> NarrowedMlp:
    """The MLP at `width`: its kept neurons and every projection's new weight, stored as the layer's was."""
    kept = narrowing.kept(width)
    weights = [_input_columns(layer, kept) for layer in mlp.projections]
    return NarrowedMlp(mlp, kept, weights + [_stored(mlp.down, narrowing.refit(kept))])


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
