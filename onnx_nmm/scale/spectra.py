"""Before PlanRanks, on Ray, when the rank rule needs every target's spectrum (energy, the global budget): one
task per target computes its (weighted) singular values where the weights are, and PlanRanks reads them from
the factorizer instead of decomposing the targets one after the other in the driver. A spectrum is a vector
of min(K, N) numbers: that is all that comes back.
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
from threadpoolctl import threadpool_limits

from onnx_nmm.decomposition import lowrank
from onnx_nmm.options import FactorizationOptions
from onnx_nmm.passes import LinearLayer
from onnx_nmm.pipeline.context import RewritePass, targets
from onnx_nmm.pipeline.factorizer import Factorizer
from onnx_nmm.scale.jobs import blas_threads
from onnx_nmm.scale.ray_executor import import_ray, worker_targets


class SpectraOnRay(RewritePass):
    label = "spectra"

    def __init__(self, context, model_path: Path, threads: int):
        super().__init__(context)
        self.model_path, self.threads = model_path.resolve(), threads

    def run(self, model: ir.Model) -> bool:
        context, options = self.context, self.context.options
        if not options.ranks.needs_spectra or options.ranks.measures_damage or options.ranks.rule == "ranks_from":
            return False
        _, chosen, _ = targets(model, options)
        ray = import_ray()
        task = ray.remote(num_cpus=self.threads or 1)(_spectrum_in_worker)
        statistics = ray.put(context.statistics)
        spectra: dict[str, lowrank.RankedFactors] = {}
        with context.progress.phase("spectra on Ray", total=len(chosen)) as phase:
            pending = {task.remote(str(self.model_path), options.factorization, statistics, options.ranks.align,
                                   layer.name, self.threads): layer for layer in chosen}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for reference in done:
                    layer = pending.pop(reference)
                    spectra[layer.name] = ray.get(reference)
                    phase.advance(detail=layer.module_path or layer.name)
        context.factorizer = KnownSpectra(options.factorization, context.statistics, options.ranks.align, spectra)
        return False


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
