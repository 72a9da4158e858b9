"""Pass 3 of a streamed rewrite: factorize the targets one matrix at a time (here or on Ray), keeping each
matrix's factors in the work folder as soon as they are made, then swap in SvdMatMul ops whose U and V are
references to those files, not arrays: the process holds one matrix's working set at a time, whatever the
model's size. Matrices a killed run finished are taken up from the folder, not factorized again.
"""

from __future__ import annotations

from dataclasses import replace

import onnx_ir as ir

from onnx_nmm.errors import ModelError
from onnx_nmm.passes import FactorizedLayer, SvdFactorizationPass
from onnx_nmm.pipeline import LayerOutcome
from onnx_nmm.pipeline.context import RewritePass, sites, targets
from onnx_nmm.ranks.rank_plan import Dense
from onnx_nmm.scale.jobs import FactorJob, factor_arrays, stored_dtype
from onnx_nmm.scale.work_dir import WorkDir


class StreamFactorizeLayers(RewritePass):
    """`make_executor(factorizer, layers)` gives what runs the jobs (ray_executor)."""

    label = "factorization"

    def __init__(self, context, work: WorkDir, make_executor):
        super().__init__(context)
        self.work, self.make_executor = work, make_executor

    def run(self, model: ir.Model) -> bool:
        context = self.context
        layers, chosen, skipped = targets(model, context.options)
        quantized = [layer for layer in chosen if layer.weight.quantized is not None]
        if quantized:
            raise ModelError(f"{quantized[0].module_path or quantized[0].name} is stored quantized: a streamed "
                             "rewrite factorizes float weights (bf16, fp16, fp32); rewrite quantized models in memory")
        factorizer = context.make_factorizer()
        jobs = [FactorJob(index, layer.name, context.plan[layer.name]) for index, layer in enumerate(chosen)
                if not isinstance(context.plan[layer.name], Dense)]
        outcomes: dict[str, LayerOutcome] = {}
        with context.progress.phase("factorizing", total=len(chosen)) as phase:
            for layer in chosen:
                if isinstance(context.plan[layer.name], Dense):
                    outcomes[layer.name] = LayerOutcome.of(layer, "dense", context.plan[layer.name].reason,
                                                           parameters_after=layer.parameters)
                    phase.advance(detail=layer.module_path or layer.name)
            todo = []
            for job in jobs:
                finished = self.work.finished(job.index)
                if finished is not None and finished.rank == job.rank:
                    outcomes[job.layer] = finished
                    phase.advance(detail=f"{finished.module_path or finished.name} (resumed)")
                else:
                    todo.append(job)
            by_name = {layer.name: layer for layer in chosen}
            for job, outcome in self.make_executor(factorizer, by_name).run(todo):
                outcomes[job.layer] = outcome
                phase.advance(detail=f"{outcome.module_path or outcome.name} ({outcome.seconds:.1f} s)")
        every_site = sites(layers, chosen)
        for job in jobs:
            self._swap(model, [site for site in every_site if site.name == job.layer], job, outcomes[job.layer],
                       factorizer)
        factorizer.decompositions.clear()
        context.report.layers = [outcomes.get(layer.name) or LayerOutcome.of(layer, "skipped", skipped[layer.name])
                                 for layer in {layer.name: layer for layer in layers}.values()]
        return bool(jobs)

    def _swap(self, model: ir.Model, layer_sites, job: FactorJob, outcome: LayerOutcome, factorizer) -> None:
        """Every site of one target → SvdMatMul, its U and V read from the work folder's files."""
        layer = layer_sites[0]
        dtype = stored_dtype(factorizer, layer)
        u, v = factor_arrays(self.work, job.index, dtype.numpy(), layer.k, layer.n, outcome.rank)
        options = self.context.options
        first = FactorizedLayer(layer=layer, u=u, v=v, align=options.ranks.align, storage=factorizer.storage_dtype(),
                                method=f"{options.method}/{options.factorization.svd}")
        surgery = SvdFactorizationPass([first] + [replace(first, layer=site) for site in layer_sites[1:]])
        surgery(model)
        for which, name in zip("uv", surgery.factor_names[layer.name]):
            value = model.graph.initializers[name]
            path = self.work.factor_path(job.index, which)
            value.const_value = ir.ExternalTensor(path.name, 0, path.stat().st_size, value.const_value.dtype,
                                                  shape=value.const_value.shape, name=name, base_dir=self.work.folder)
