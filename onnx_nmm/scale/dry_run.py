"""A rewrite's plan before it runs: every target's shape and rank, parameters and bytes before and after, and
the time it would take, from one sample matrix factorized now and scaled to the others.

    t(K×N) = t_sample · (K·N·min(K, N)) / (K_s·N_s·min(K_s, N_s))       (dense SVD cost; modelled)

Nothing is written. Ranks come from the rule (keep, rank, ranks from a report); rules that choose ranks from
spectra or calibration cannot be planned without doing their work.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from threadpoolctl import threadpool_limits

from onnx_nmm.errors import OptionError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.pipeline import Factorizer, MlpNarrowings, Planner, Statistics, find_targets
from onnx_nmm.progress import Progress
from onnx_nmm.ranks.rank_plan import Dense, Narrowed
from onnx_nmm.scale.jobs import blas_threads


@dataclass
class PlannedLayer:
    name: str
    module_path: str
    role: str
    k: int
    n: int
    dtype: str
    rank: int | None  # None: stays dense
    reason: str
    parameters_before: int
    parameters_after: int
    bytes_before: int
    bytes_after: int
    seconds: float  # modelled from the sample (0 for a dense layer)


@dataclass
class RewritePlan:
    layers: list[PlannedLayer] = field(default_factory=list)
    sample: str = ""  # the matrix factorized to measure, K×N
    sample_seconds: float = 0.0  # measured
    threads: int = 1
    note: str = ""  # what the estimate leaves out

    @property
    def seconds(self) -> float:
        """Modelled time of every factorization, one after the other."""
        return sum(layer.seconds for layer in self.layers)

    def seconds_on(self, workers: int) -> float:
        """Modelled time on `workers` equal workers, matrices handed out largest first."""
        loads = [0.0] * workers
        for layer in sorted(self.layers, key=lambda layer: -layer.seconds):
            loads[loads.index(min(loads))] += layer.seconds
        return max(loads)


def plan_rewrite(model: str | os.PathLike, options: RewriteOptions | None = None, threads: int = 0) -> RewritePlan:
    """Plan the rewrite of the model at `model` and time one sample factorization (the largest target)."""
    options = options or RewriteOptions()
    if options.ranks.needs_spectra or options.calibration is not None:
        raise OptionError("a plan takes ranks from {keep}, rank or ranks from a report, without calibration: "
                          "drop {calibration} or the spectrum-based rule to plan", keep="ranks.keep",
                          calibration="calibration.source")
    source = ModelSource(Path(model))
    targets, statistics = find_targets(source.model, options), Statistics()
    factorizer = Factorizer(options.factorization, None, options.ranks.align)
    ranks = Planner(options, targets, factorizer, MlpNarrowings(statistics, options.factorization), None, statistics,
                    source, Progress()).choose(source.model).plan
    chosen = targets.chosen
    ranked = [layer for layer in chosen if not isinstance(ranks[layer.name], Dense)]
    plan = RewritePlan(threads=blas_threads(threads))
    cost = {}
    if ranked:
        sample = max(ranked, key=_svd_cost)
        sample_rank = ranks[sample.name]
        assert isinstance(sample_rank, int), "a plan without calibration narrows no MLP"
        with threadpool_limits(limits=plan.threads):
            start = time.perf_counter()
            factorizer.factorize(sample, sample_rank)
            plan.sample_seconds = time.perf_counter() - start
        plan.sample = f"{sample.module_path or sample.name} ({sample.k}×{sample.n})"
        cost = {layer.name: plan.sample_seconds * _svd_cost(layer) / _svd_cost(sample) for layer in ranked}
    storage = factorizer.storage_dtype()
    for layer in chosen:
        choice = ranks[layer.name]
        assert not isinstance(choice, Narrowed), "a plan without calibration narrows no MLP"
        itemsize = layer.dtype.itemsize
        if isinstance(choice, Dense):
            rank, reason, after, after_itemsize = None, choice.reason, layer.parameters, itemsize
        else:
            rank, reason, after = choice, "", choice * (layer.k + layer.n)
            after_itemsize = storage.itemsize if storage is not None else itemsize
        plan.layers.append(PlannedLayer(
            layer.name, layer.module_path, layer.role, layer.k, layer.n, layer.dtype.name.lower(), rank, reason,
            layer.parameters, after, int(layer.parameters * itemsize), int(after * after_itemsize),
            cost.get(layer.name, 0.0)))
    return plan


def _svd_cost(layer) -> int:
    return layer.k * layer.n * min(layer.k, layer.n)
