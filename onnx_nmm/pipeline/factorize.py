"""Step 3: factorize every target the plan gives a rank, and swap in SvdMatMul ops.

    independent   every layer from W and the statistics (one SvdFactorizationPass)
    sequential    group by group in graph order (layers reading one input form a group): observe the
                  group's input in the dense and the partly compressed model, fit, swap, go on
                  (onnx_nmm.decomposition.sequential)

Weights are read one at a time and their memory-mapped storage released right after, so the process
never holds two full copies of the weights: the original stays on disk, the factors (smaller than the
weights they replace, cast to their stored dtype as soon as they are made) are the only new arrays. For
models larger than memory, onnx_nmm.scale streams the factors to disk instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import onnx_ir as ir

from onnx_nmm.decomposition import sequential
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes import FactorizedLayer, FactorsPlaced, SvdFactorizationPass
from onnx_nmm.pipeline.factorizer import Factorizer
from onnx_nmm.pipeline.report import LayerOutcome
from onnx_nmm.pipeline.targets import find_layers
from onnx_nmm.progress import Progress
from onnx_nmm.ranks.rank_plan import Dense, Narrowed, RankPlan


@dataclass
class FactorizedResult(ir.passes.PassResult):
    """`rows`: the report's row of every linear layer, once per target; `factor_names`: each factorized layer's
    U and V initializers."""

    rows: list[LayerOutcome] = field(default_factory=list)
    factor_names: dict[str, tuple[str, str]] = field(default_factory=dict)


class FactorizeLayers(ir.passes.InPlacePass):
    """Every target `plan` gives a rank, factorized by `factorizer`. `narrowed`: the rows of the layers the
    narrowing did; `not_narrowed`: an MLP's module path → why it was not narrowed (said on its projections'
    rows). With sequential calibration, `observer` runs the dense and the partly compressed model on the
    calibration windows."""

    def __init__(self, options: RewriteOptions, plan: RankPlan, factorizer: Factorizer, progress: Progress,
                 narrowed: dict[str, LayerOutcome] | None = None, not_narrowed: dict[str, str] | None = None,
                 observer: sequential.GroupObserver | None = None):
        super().__init__()
        self.options, self.plan, self.factorizer, self.progress = options, plan, factorizer, progress
        self.narrowed, self.not_narrowed, self.observer = narrowed or {}, not_narrowed or {}, observer

    def call(self, model: ir.Model) -> FactorizedResult:
        targets = find_layers(model, self.options)  # afresh: the narrowing changed the model
        layers, chosen, skipped = targets.layers, targets.chosen, targets.skipped
        plan, factorizer, observer = self.plan, self.factorizer, self.observer
        factor_names: dict[str, tuple[str, str]] = {}
        every_site = targets.sites()
        groups = sequential.layer_groups(every_site) if observer is not None else [every_site]
        outcomes: dict[str, LayerOutcome] = {}
        made: dict[str, FactorizedLayer] = {}  # a target's factors, for its other sites
        description = "observing and factorizing" if observer is not None else "factorizing"
        with self.progress.phase(description, total=len(chosen)) as phase:
            if observer is not None:
                observer.prepare({group[0].x.name: group[0].k for group in groups})
            for group in groups:
                ranked = [layer for layer in group if isinstance(plan[layer.name], int)]
                statistics = observer.observe(model, group[0].x.name) if observer is not None and ranked else None
                factorized = []
                for layer in group:
                    choice = plan[layer.name]
                    if isinstance(choice, Narrowed):  # done by NarrowMlps
                        outcomes[layer.name] = self.narrowed[layer.name]
                    elif isinstance(choice, Dense):
                        outcomes[layer.name] = LayerOutcome.of(layer, "dense", choice.reason,
                                                               parameters_after=layer.parameters)
                    elif layer.name in made:  # another subgraph's site of a target: the same factors
                        factorized.append(replace(made[layer.name], layer=layer))
                        continue
                    else:
                        outcomes[layer.name], factors = factorizer.factorize(layer, choice, statistics)
                        made[layer.name] = _as_stored(factors)
                        factorized.append(made[layer.name])
                    phase.advance(detail=layer.module_path or layer.name)
                placed = SvdFactorizationPass(factorized)(model)
                assert isinstance(placed, FactorsPlaced)
                factor_names.update(placed.factor_names)
        factorizer.decompositions.clear()
        rows = {layer.name: outcomes.get(layer.name) or LayerOutcome.of(layer, "skipped", skipped[layer.name])
                for layer in layers}  # one row per target, however many subgraphs hold it
        for row in rows.values():  # nystrom: an MLP projection factorized or kept, as its MLP could not be narrowed
            why = self.not_narrowed.get(row.module_path.rsplit(".", 1)[0]) if row.status != "skipped" else None
            if why:
                row.reason = "; ".join(filter(None, [row.reason, f"not narrowed: {why}"]))
        return FactorizedResult(model, modified=bool(factor_names), rows=list(rows.values()),
                                factor_names=factor_names)


def _as_stored(factors: FactorizedLayer) -> FactorizedLayer:
    """Float factors cast now to the dtype they are stored in (what the surgery would do at the end): every
    target's factors wait for the surgery, and in float64 a Llama-3-8B's would take 27 GB instead of 7."""
    if factors.quantized is not None:
        return factors
    dtype = (factors.storage or factors.layer.dtype).numpy()
    return replace(factors, u=factors.u.astype(dtype), v=factors.v.astype(dtype))
