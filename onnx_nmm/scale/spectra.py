"""Before the plan, on Ray, when the rank rule needs every target's spectrum (energy, the global budget): one
task per target computes its (weighted) singular values where the weights are, and the Planner reads them from
the factorizer instead of decomposing the targets one after the other in the driver. A spectrum is a vector
of min(K, N) numbers: that is all that comes back.
"""

from __future__ import annotations

from pathlib import Path

from threadpoolctl import threadpool_limits

from onnx_nmm.decomposition import lowrank
from onnx_nmm.options import FactorizationOptions, RewriteOptions
from onnx_nmm.passes import LinearLayer
from onnx_nmm.pipeline import Factorizer, Statistics, Targets
from onnx_nmm.progress import Progress
from onnx_nmm.scale.jobs import blas_threads
from onnx_nmm.scale.ray_executor import import_ray, worker_targets


def factorizer_with_spectra_on_ray(targets: Targets, statistics: Statistics, options: RewriteOptions,
                                   model_path: Path, threads: int, progress: Progress) -> Factorizer:
    """The factorizer of a rewrite on Ray: knowing every target's spectrum when the rank rule reads them."""
    ranks = options.ranks
    if not ranks.needs_spectra or ranks.measures_damage or ranks.rule == "ranks_from":
        return Factorizer(options.factorization, statistics.grams, ranks.align)
    ray = import_ray()
    task = ray.remote(num_cpus=threads or 1)(_spectrum_in_worker)
    grams = ray.put(statistics.grams)
    spectra: dict[str, lowrank.RankedFactors] = {}
    with progress.phase("spectra on Ray", total=len(targets.chosen)) as phase:
        pending = {task.remote(str(model_path.resolve()), options.factorization, grams, ranks.align, layer.name,
                               threads): layer for layer in targets.chosen}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for reference in done:
                layer = pending.pop(reference)
                spectra[layer.name] = ray.get(reference)
                phase.advance(detail=layer.module_path or layer.name)
    return KnownSpectra(options.factorization, statistics.grams, ranks.align, spectra)


class KnownSpectra(Factorizer):
    """A factorizer that already knows some targets' spectra."""

    def __init__(self, options: FactorizationOptions, statistics, align: int,
                 spectra: dict[str, lowrank.RankedFactors]):
        super().__init__(options, statistics, align)
        self.spectra = spectra

    def spectrum(self, layer: LinearLayer) -> lowrank.RankedFactors:
        return self.spectra[layer.name] if layer.name in self.spectra else super().spectrum(layer)


def _spectrum_in_worker(model_path: str, options: FactorizationOptions, statistics, align: int, name: str,
                        threads: int) -> lowrank.RankedFactors:
    with threadpool_limits(limits=blas_threads(threads)):
        return Factorizer(options, statistics, align).spectrum(worker_targets(model_path)[name])
