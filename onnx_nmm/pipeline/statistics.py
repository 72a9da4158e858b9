"""Pass 1: the calibration statistics the methods and budgets need, loaded or gathered.

    whiten, svd   XᵀX of every target's input, in onnxruntime (activation_stats)
    fisher        XᵀX and the output-gradient Grams GᵀG, in PyTorch (fisher)

Loaded from a file saved by an earlier rewrite when the options point at one; saved when asked. The
model is not changed.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_nmm.activation_stats import GramStatistics, collect_gram_matrices
from onnx_nmm.errors import DataError
from onnx_nmm.passes import LinearLayer
from onnx_nmm.pipeline.context import RewritePass, targets


class GatherStatistics(RewritePass):
    label = "calibration"

    def run(self, model: ir.Model) -> bool:
        context, options = self.context, self.context.options
        _, chosen, _ = targets(model, options)
        if not options.needs_statistics:
            return False
        statistics = context.calibration.saved_statistics()
        if statistics is None:
            statistics = self._gather(chosen)
            if options.calibration.save_statistics is not None:
                statistics.save(options.calibration.save_statistics)
        if options.method == "fisher" and not statistics.output_grams:
            raise DataError(f"{statistics.description or 'these statistics'} hold no output-gradient Grams, which "
                            "{method} fisher weighs by: calibrate on a text or token ids, or load statistics a "
                            "fisher rewrite saved", method="factorization.method")
        context.statistics = statistics
        context.report.calibration = statistics.description
        return False

    def _gather(self, chosen) -> GramStatistics:
        context, calibration = self.context, self.context.options.calibration
        windows = context.calibration.windows()
        with context.progress.phase(f"calibrating ({windows.description})", total=windows.token_count) as phase:
            if context.options.method == "fisher":
                from onnx_nmm.fisher import collect_fisher_statistics

                return collect_fisher_statistics(context.source, chosen, windows.batches(calibration.batch),
                                                 windows.description, seed=context.options.factorization.seed,
                                                 on_batch=phase.advance)
            return collect_gram_matrices(context.source, observed_inputs(chosen), windows.batches(calibration.batch),
                                         windows.description, on_batch=phase.advance)


def observed_inputs(layers: list[LinearLayer]) -> dict[str, int]:
    """The distinct inputs of `layers` (value name → width K): what calibration observes. Layers reading the
    same input (gate and up) share one Gram."""
    return {layer.x.name: layer.k for layer in layers}
