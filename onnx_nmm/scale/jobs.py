"""One unit of a streamed rewrite's work: factorize one matrix and keep its factors in the work folder.

The same function runs in this process and in a Ray worker, under the same BLAS thread count, so a matrix's
factors are the same bytes wherever they are made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from onnx_nmm.passes import LinearLayer
from onnx_nmm.pipeline import LayerOutcome
from onnx_nmm.pipeline.factorizer import Factorizer
from onnx_nmm.scale.work_dir import WorkDir


@dataclass(frozen=True)
class FactorJob:
    index: int  # the matrix's place among the targets: names its files in the work folder
    layer: str  # the target's name (LinearLayer.name)
    rank: int


def blas_threads(threads: int) -> int:
    """The BLAS thread count a factorization runs with: `threads`, or every core of this machine."""
    return threads or os.cpu_count() or 1


def factorize_job(factorizer: Factorizer, layer: LinearLayer, job: FactorJob, work: WorkDir,
                  threads: int) -> LayerOutcome:
    """Factorize `layer` at the job's rank and record the factors, cast to the dtype they are stored in."""
    with threadpool_limits(limits=blas_threads(threads)):
        outcome, factors = factorizer.factorize(layer, job.rank)
    dtype = stored_dtype(factorizer, layer).numpy()
    work.record(job.index, factors.u.astype(dtype), factors.v.astype(dtype), outcome)
    return outcome


def stored_dtype(factorizer: Factorizer, layer: LinearLayer):
    """The ir.DataType the factors are stored in: the one asked for, else the weight's."""
    return factorizer.storage_dtype() or layer.dtype


def factor_arrays(work: WorkDir, index: int, dtype, k: int, n: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """A finished matrix's factors, memory-mapped from the work folder."""
    return (np.memmap(work.factor_path(index, "u"), dtype=dtype, mode="r", shape=(k, rank)),
            np.memmap(work.factor_path(index, "v"), dtype=dtype, mode="r", shape=(rank, n)))
