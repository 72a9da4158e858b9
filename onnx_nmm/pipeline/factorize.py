"""Pass 3: factorize every target the plan gives a rank, and swap in SvdMatMul ops.

    independent   every layer from W and the statistics (one SvdFactorizationPass)
    sequential    group by group in graph order (layers reading one input form a group): observe the
                  group's input in the dense and the partly compressed model, fit, swap, go on
                  (onnx_nmm.sequential)

Weights are read one at a time and their memory-mapped storage released right after, so the process
never holds two full copies of the weights: the original stays on disk, the factors (smaller than the
weights they replace) are the only new arrays.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_nmm import sequential
from onnx_nmm.passes import SvdFactorizationPass
from onnx_nmm.pipeline.context import RewritePass, targets
from onnx_nmm.pipeline.report import LayerOutcome
from onnx_nmm.rank_plan import Dense


class FactorizeLayers(RewritePass):
    """`factor_names` maps each factorized layer to the names of its U and V initializers. With sequential
    calibration an `observer` may be given (one running the model on other feeds than token ids); by default
    it runs the calibration windows."""

    def __init__(self, context, observer: sequential.GroupObserver | None = None):
        super().__init__(context)
        self.observer = observer
        self.factor_names: dict[str, tuple[str, str]] = {}

    @property
    def label(self) -> str:
        return "sequential calibration and factorization" if self.context.options.sequential else "factorization"

    def run(self, model: ir.Model) -> bool:
        context = self.context
        layers, chosen, skipped = targets(model, context.options)
        plan, factorizer = context.plan, context.make_factorizer()
        observer = self._observer()
        groups = sequential.layer_groups(chosen) if observer is not None else [chosen]
        outcomes: dict[str, LayerOutcome] = {}
        description = "observing and factorizing" if observer is not None else "factorizing"
        with context.progress.phase(description, total=len(chosen)) as phase:
            if observer is not None:
                observer.prepare({group[0].x.name: group[0].k for group in groups})
            for group in groups:
                ranked = [layer for layer in group if not isinstance(plan[layer.name], Dense)]
                statistics = observer.observe(model, group[0].x.name) if observer is not None and ranked else None
                factorized = []
                for layer in group:
                    choice = plan[layer.name]
                    if isinstance(choice, Dense):
                        outcomes[layer.name] = LayerOutcome.of(layer, "dense", choice.reason,
                                                               parameters_after=layer.parameters)
                    else:
                        outcomes[layer.name], factors = factorizer.factorize(layer, choice, statistics)
                        factorized.append(factors)
                    phase.advance(detail=layer.module_path or layer.name)
                surgery = SvdFactorizationPass(factorized)
                surgery(model)
                self.factor_names.update(surgery.factor_names)
        factorizer.decompositions.clear()
        context.report.layers = [outcomes.get(layer.name) or LayerOutcome.of(layer, "skipped", skipped[layer.name])
                                 for layer in layers]
        return bool(self.factor_names)

    def _observer(self) -> sequential.GroupObserver | None:
        context = self.context
        if not context.options.sequential or self.observer is not None:
            return self.observer
        windows = context.calibration_windows()
        return sequential.GroupObserver(context.source, windows.batches(context.options.calibration.batch))
