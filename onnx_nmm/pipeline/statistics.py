"""Pass 1: the calibration statistics the methods and budgets need, loaded or gathered
(calibration_data.CalibrationData.statistics):

    whiten, svd   XᵀX of every target's input, in onnxruntime (activation_stats)
    fisher        XᵀX and the output-gradient Grams GᵀG, in PyTorch (fisher)
    nystrom       XᵀX as for whiten, and hᵀh of every narrowed MLP's intermediate activation h on the
                  calibration windows held out of the statistics (the refit's ridge is chosen on them)

The model is not changed.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_nmm.calibration.activation_stats import collect_gram_matrices
from onnx_nmm.pipeline.context import RewritePass, targets


class GatherStatistics(RewritePass):
    label = "calibration"

    def run(self, model: ir.Model) -> bool:
        context, options = self.context, self.context.options
        _, chosen, _ = targets(model, options)
        if options.needs_statistics:
            data = context.calibration_data()
            context.statistics = data.statistics(context.source, chosen, options.strategy.output_grams,
                                                 options.factorization.seed, context.progress)
            context.report.calibration = context.statistics.description
            if data.statistics_file is None:
                context.report.calibration_windows = list(data.windows().ids)
            mlps = context.mlps(targets(model, options)[0])
            if mlps and data.token_source is not None:
                held_out = context.budget_windows()
                inputs = {mlp.down.x.name: mlp.width for mlp in mlps}
                with context.progress.phase(f"held-out activations ({held_out.description})",
                                            total=held_out.token_count) as phase:
                    context.held_out_statistics = collect_gram_matrices(
                        context.source, inputs, held_out.batches(options.calibration.batch), held_out.description,
                        on_batch=phase.advance)
        return False
