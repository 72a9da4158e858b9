"""Step 1: the calibration statistics the method and the budget need, loaded or gathered
(calibration_data.CalibrationData.statistics):

    whiten, svd   XᵀX of every target's input, in onnxruntime (activation_stats)
    fisher        XᵀX and the output-gradient Grams GᵀG, in PyTorch (fisher)
    nystrom       XᵀX as for whiten, and hᵀh of every narrowed MLP's intermediate activation h on the
                  calibration windows held out of the statistics (the refit's ridge is chosen on them)

The model is not changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx_nmm.calibration.activation_stats import GramStatistics, collect_gram_matrices
from onnx_nmm.calibration.calibration_data import CalibrationData
from onnx_nmm.calibration.tokens import TokenWindows
from onnx_nmm.errors import DataError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.pipeline.targets import Targets
from onnx_nmm.progress import Progress


@dataclass
class Statistics:
    """What calibration gave: the Grams (None when nothing needs them), the held-out Grams of the narrowed MLPs'
    intermediate activations, and the ids of the windows the Grams came from (none when they were loaded)."""

    grams: GramStatistics | None = None
    held_out: GramStatistics | None = None
    windows: list[str] = field(default_factory=list)

    @property
    def description(self) -> str:
        return self.grams.description if self.grams is not None else ""


def calibration_data(options: RewriteOptions, source: ModelSource, progress: Progress) -> CalibrationData | None:
    """What the calibration options point at, decided once (a bad source is refused here, before any work); a
    quality budget, and a method that narrows MLPs, hold their windows out of it."""
    if options.calibration is None:
        return None
    ranks = options.ranks
    held_out = ranks.sensitivity_windows if ranks.measures_damage or options.strategy.narrows_mlps else 0
    return CalibrationData(options.calibration, source.model.graph, source, held_out, progress)


def gather_statistics(targets: Targets, data: CalibrationData | None, options: RewriteOptions, source: ModelSource,
                      progress: Progress) -> Statistics:
    """The statistics of `targets` that `options` need, from `data`."""
    if data is None or not options.needs_statistics:
        return Statistics()
    grams = data.statistics(source, targets.chosen, options.strategy.output_grams, options.factorization.seed,
                            progress)
    windows = list(data.windows().ids) if data.statistics_file is None else []
    held_out = None
    if targets.mlps and data.token_source is not None:
        budget = budget_windows(data, grams)
        inputs = {mlp.down.x.name: mlp.width for mlp in targets.mlps}
        with progress.phase(f"held-out activations ({budget.description})", total=budget.token_count) as phase:
            held_out = collect_gram_matrices(source, inputs, budget.batches(data.options.batch), budget.description,
                                             on_batch=phase.advance)
    return Statistics(grams, held_out, windows)


def budget_windows(data: CalibrationData, grams: GramStatistics | None) -> TokenWindows:
    """The windows the quality budgets are measured on: held out of the calibration windows, and of the windows
    loaded statistics came from (when their file names them)."""
    held_out = data.held_out_windows()
    shared = sorted(set(held_out.ids) & set(grams.windows if grams is not None else ()))
    if shared:
        raise DataError(f"the statistics in {data.statistics_file} came from {len(shared)} of the windows the "
                        f"quality budget is measured on ({', '.join(shared[:3])}{', …' if len(shared) > 3 else ''}): "
                        "give {samples} the window count they were gathered with, or gather them again",
                        samples="calibration.samples")
    return held_out
