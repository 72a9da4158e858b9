"""Pass 1: the calibration statistics the methods and budgets need, loaded or gathered
(calibration_data.CalibrationData.statistics):

    whiten, svd   XᵀX of every target's input, in onnxruntime (activation_stats)
    fisher        XᵀX and the output-gradient Grams GᵀG, in PyTorch (fisher)

The model is not changed.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_nmm.pipeline.context import RewritePass, targets


class GatherStatistics(RewritePass):
    label = "calibration"

    def run(self, model: ir.Model) -> bool:
        context, options = self.context, self.context.options
        _, chosen, _ = targets(model, options)
        if options.needs_statistics:
            data = context.calibration_data()
            context.statistics = data.statistics(context.source, chosen, options.method,
                                                 options.factorization.seed, context.progress)
            context.report.calibration = context.statistics.description
            if data.statistics_file is None:
                context.report.calibration_windows = list(data.windows().ids)
        return False
