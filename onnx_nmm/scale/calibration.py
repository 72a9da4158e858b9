"""Step 1 of a streamed rewrite on Ray: the calibration windows split into one contiguous share per worker,
each worker running the original model in onnxruntime on its share and returning its XᵀX sums; the driver adds
them in share order. Grams add exactly, so the result is the serial one up to the order of float64 sums.

    G = Σ_shares Σ_batches X_bᵀX_b

Each worker runs the whole model: every Ray node needs the model's weights in memory (onnxruntime). Saved
statistics are loaded, and fisher's gradient statistics are gathered here in PyTorch, as without Ray.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from onnx_nmm.calibration.activation_stats import GramStatistics, collect_gram_matrices
from onnx_nmm.calibration.calibration_data import CalibrationData, observed_inputs
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.pipeline import Statistics, Targets, gather_statistics
from onnx_nmm.progress import Progress
from onnx_nmm.scale.ray_executor import import_ray


def gather_statistics_on_ray(targets: Targets, data: CalibrationData | None, options: RewriteOptions,
                             source: ModelSource, model_path: Path, progress: Progress) -> Statistics:
    """gather_statistics, the XᵀX sums split over the Ray cluster's workers (saved statistics are loaded, and
    fisher's gathered, as without Ray)."""
    if data is None or not options.needs_statistics or data.statistics_file is not None \
            or options.strategy.output_grams:
        return gather_statistics(targets, data, options, source, progress)
    windows = data.windows()
    batches = list(windows.batches(data.options.batch))
    ray = import_ray()
    workers = max(1, min(len(batches), int(ray.cluster_resources().get("CPU", 1))))
    shares = [batches[i::workers] for i in range(workers)]  # interleaved: equal shares of equal batches
    task = ray.remote(num_cpus=1)(_gram_share)
    inputs = observed_inputs(targets.chosen)
    with progress.phase(f"calibrating on {workers} Ray workers ({windows.description})",
                        total=windows.token_count) as phase:
        pending = {task.remote(str(model_path.resolve()), inputs, share, windows.description): index
                   for index, share in enumerate(shares)}
        parts: dict[int, GramStatistics] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for reference in done:
                parts[pending.pop(reference)] = part = ray.get(reference)
                phase.advance(part.tokens)
    grams = summed([parts[index] for index in range(workers)], windows.description)
    grams.windows = tuple(windows.ids)
    if data.options.save_statistics is not None:
        grams.save(data.options.save_statistics)
    return Statistics(grams)


def summed(parts: list[GramStatistics], description: str) -> GramStatistics:
    """The statistics of the union of the parts' windows: their Grams and token counts added, in order."""
    grams = {}
    for name in parts[0].grams:
        grams[name] = parts[0].grams[name].copy()
        for part in parts[1:]:
            grams[name] += part.grams[name]
    return GramStatistics(grams, sum(part.tokens for part in parts), description)


def _gram_share(model_path: str, inputs: dict[str, int], batches: list[np.ndarray], description: str) -> GramStatistics:
    return collect_gram_matrices(ModelSource(model_path), inputs, batches, description)
