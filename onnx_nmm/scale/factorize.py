"""Step 3 of a streamed rewrite: factorize the targets one matrix at a time (here or on Ray), keeping each
matrix's factors in the work folder as soon as they are made, then swap in SvdMatMul ops whose U and V are
references to those files, not arrays: the process holds one matrix's working set at a time, whatever the
model's size. Matrices a killed run finished are taken up from the folder, not factorized again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import onnx_ir as ir

from onnx_nmm.errors import ModelError
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes import FactorizedLayer, FactorsPlaced, SvdFactorizationPass
from onnx_nmm.pipeline import Factorizer, LayerOutcome, find_layers
from onnx_nmm.progress import Progress
from onnx_nmm.ranks.rank_plan import Dense, RankPlan
from onnx_nmm.scale.jobs import FactorJob, factor_arrays, stored_dtype
from onnx_nmm.scale.work_dir import WorkDir


@dataclass
class StreamedResult(ir.passes.PassResult):
    """The report's row of every linear layer, once per target."""

    rows: list[LayerOutcome] = field(default_factory=list)


class StreamFactorizeLayers(ir.passes.InPlacePass):
    """Every target `plan` gives a rank, factorized by `factorizer` one matrix at a time into `work`.
    `make_executor(factorizer, layers)` gives what runs the jobs (ray_executor)."""

    def __init__(self, options: RewriteOptions, plan: RankPlan, factorizer: Factorizer, work: WorkDir,
                 make_executor, progress: Progress):
        super().__init__()
        self.options, self.plan, self.factorizer = options, plan, factorizer
        self.work, self.make_executor, self.progress = work, make_executor, progress

    def call(self, model: ir.Model) -> StreamedResult:
        targets = find_layers(model, self.options)
        layers, chosen, skipped = targets.layers, targets.chosen, targets.skipped
        quantized = [layer for layer in chosen if layer.weight.quantized is not None]
        if quantized:
            raise ModelError(f"{quantized[0].module_path or quantized[0].name} is stored quantized: a streamed "
                             "rewrite factorizes float weights (bf16, fp16, fp32); rewrite quantized models in memory")
        factorizer, plan = self.factorizer, self.plan
        # a rank for every target the plan does not keep dense: a streamed rewrite never narrows an MLP
        jobs = [FactorJob(index, layer.name, rank) for index, layer in enumerate(chosen)
                if isinstance(rank := plan[layer.name], int)]
        outcomes: dict[str, LayerOutcome] = {}
        with self.progress.phase("factorizing", total=len(chosen)) as phase:
            for layer in chosen:
                choice = plan[layer.name]
                if isinstance(choice, Dense):
                    outcomes[layer.name] = LayerOutcome.of(layer, "dense", choice.reason,
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
        every_site = targets.sites()
        for job in jobs:
            self._swap(model, [site for site in every_site if site.name == job.layer], job, factorizer)
        rows = [outcomes.get(layer.name) or LayerOutcome.of(layer, "skipped", skipped[layer.name])
                for layer in {layer.name: layer for layer in layers}.values()]
        return StreamedResult(model, modified=bool(jobs), rows=rows)

    def _swap(self, model: ir.Model, layer_sites, job: FactorJob, factorizer) -> None:
        """Every site of one target → SvdMatMul, its U and V read from the work folder's files."""
        layer = layer_sites[0]
        dtype = stored_dtype(factorizer, layer)
        u, v = factor_arrays(self.work, job.index, dtype.numpy(), layer.k, layer.n, job.rank)
        options = self.options
        first = FactorizedLayer(layer=layer, u=u, v=v, align=options.ranks.align, storage=factorizer.storage_dtype(),
                                method=f"{options.method}/{options.factorization.svd}")
        placed = SvdFactorizationPass([first] + [replace(first, layer=site) for site in layer_sites[1:]])(model)
        assert isinstance(placed, FactorsPlaced)
        for which, name in zip("uv", placed.factor_names[layer.name]):
            value = model.graph.initializers[name]
            factor = value.const_value
            assert factor is not None and isinstance(factor.shape, ir.Shape), "the surgery made the factor a tensor"
            path = self.work.factor_path(job.index, which)
            value.const_value = ir.ExternalTensor(path.name, 0, path.stat().st_size, factor.dtype,
                                                  shape=factor.shape, name=name, base_dir=self.work.folder)
