"""Rewriting models larger than one machine's memory: streamed, resumable, optionally on a Ray cluster, and
planned before it runs (docs/scale.md).

    options.py        StreamOptions: where the factorizations run, BLAS threads, resume
    streamed.py       rewrite_streamed: the rewrite straight to a file
    calibration.py    calibration windows split over Ray workers, their Grams summed
    spectra.py        the targets' spectra on Ray, for rank rules that read them
    factorize.py      the streamed factorization pass
    jobs.py           one matrix's factorization, the same here and in a Ray worker
    ray_executor.py   running the jobs in this process or as Ray tasks
    work_dir.py       <output>.partial/: finished matrices, written atomically, taken up on resume
    writer.py         the output written tensor by tensor
    dry_run.py        plan_rewrite: ranks, sizes and a measured time estimate, nothing written
"""

from onnx_nmm.scale.dry_run import PlannedLayer, RewritePlan, plan_rewrite
from onnx_nmm.scale.options import LOCAL_RAY, StreamOptions
from onnx_nmm.scale.streamed import rewrite_streamed
from onnx_nmm.scale.work_dir import work_dir_of

__all__ = ["LOCAL_RAY", "PlannedLayer", "RewritePlan", "StreamOptions", "plan_rewrite", "rewrite_streamed",
           "work_dir_of"]
