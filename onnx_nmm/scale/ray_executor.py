"""Where a streamed rewrite's factorizations run: in this process, one after the other, or as Ray tasks.

A Ray task gets the input model's path (shared storage: every node must see the model and the work folder at
the same paths), loads the graph (weights stay memory-mapped), factorizes its one matrix and writes the
factors into the work folder itself: neither weights nor factors pass through the driver, which only
receives report rows, as tasks finish, in one progress bar. The calibration statistics go to the object
store once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from pathlib import Path

from onnx_nmm.errors import MissingDependencyError, OptionError
from onnx_nmm.options import FactorizationOptions
from onnx_nmm.passes import LinearLayer
from onnx_nmm.pipeline import LayerOutcome
from onnx_nmm.pipeline.factorizer import Factorizer
from onnx_nmm.scale.jobs import FactorJob, factorize_job
from onnx_nmm.scale.options import LOCAL_RAY
from onnx_nmm.scale.work_dir import WorkDir


class LocalExecutor:
    """Every job in this process, in order."""

    def __init__(self, factorizer: Factorizer, layers: dict[str, LinearLayer], work: WorkDir, threads: int):
        self.factorizer, self.layers, self.work, self.threads = factorizer, layers, work, threads

    def run(self, jobs: Iterable[FactorJob]) -> Iterator[tuple[FactorJob, LayerOutcome]]:
        for job in jobs:
            yield job, factorize_job(self.factorizer, self.layers[job.layer], job, self.work, self.threads)


class RayExecutor:
    """Every job as a Ray task on the connected cluster (ray_cluster), each asking for `threads` CPUs (1 when 0)."""

    def __init__(self, model_path: Path, options: FactorizationOptions, statistics, align: int,
                 work: WorkDir, threads: int):
        self.ray = import_ray()
        self.model_path, self.options = model_path.resolve(), options
        self.statistics, self.align, self.work, self.threads = statistics, align, work, threads

    def run(self, jobs: Iterable[FactorJob]) -> Iterator[tuple[FactorJob, LayerOutcome]]:
        ray, jobs = self.ray, list(jobs)
        if not jobs:
            return
        task = ray.remote(num_cpus=self.threads or 1, max_retries=2)(_factorize_in_worker)
        statistics = ray.put(self.statistics)
        pending = {task.remote(str(self.model_path), self.options, statistics, self.align, job,
                               str(self.work.folder.resolve()), self.threads): job for job in jobs}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for reference in done:
                yield pending.pop(reference), ray.get(reference)


@contextlib.contextmanager
def ray_cluster(address: str | None, threads: int) -> Iterator[None]:
    """Connected to the Ray cluster at `address` (LOCAL_RAY: RAY_ADDRESS's, or one started here) while the block
    runs; nothing when `address` is None. A cluster this process was already connected to is left as it is.
    Refused when no node has the `threads` CPUs a task asks for (Ray would wait for one forever)."""
    if address is None:
        yield
        return
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address == LOCAL_RAY else address, log_to_driver=False)
    try:
        largest = max((node["Resources"].get("CPU", 0) for node in ray.nodes() if node.get("Alive")), default=0)
        if (threads or 1) > largest:
            raise OptionError(f"{{threads}} {threads} asks each Ray task for {threads} CPUs, and the largest node of "
                              f"the cluster has {largest:g}: give at most that", threads="stream.threads")
        yield
    finally:
        if started:
            ray.shutdown()


def import_ray():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("running on a Ray cluster needs ray: pip install 'onnx-nmm[ray]'") from None
    return ray


def _factorize_in_worker(model_path: str, options: FactorizationOptions, statistics, align: int, job: FactorJob,
                         folder: str, threads: int) -> LayerOutcome:
    layer = worker_targets(model_path)[job.layer]
    return factorize_job(Factorizer(options, statistics, align), layer, job, WorkDir(Path(folder)), threads)


@functools.lru_cache(maxsize=1)
def worker_targets(model_path: str) -> dict[str, LinearLayer]:
    """The model's linear layers by name, loaded once per worker process (weights memory-mapped, not read)."""
    from onnx_nmm.model_io import load_model
    from onnx_nmm.passes import find_linear_layers

    layers: dict[str, LinearLayer] = {}
    for layer in find_linear_layers(load_model(model_path)):
        layers.setdefault(layer.name, layer)
    return layers
