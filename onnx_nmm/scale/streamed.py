"""A rewrite straight to a file, for models larger than memory: the in-memory rewrite's passes with the
factorization streamed (factorize.py), resumable, optionally spread over a Ray cluster.

    load graph (weights memory-mapped) ─ gather_statistics ─ Planner ─ StreamFactorizeLayers ─ write_streamed
                                         on Ray: windows split   one matrix at a time,         tensor by tensor,
                                         over workers, Grams     recorded in <output>.partial  renamed into place
                                         summed (calibration.py);
                                         then every spectrum, when
                                         the rank rule needs them
                                         (spectra.py)

The input is never written; the output appears only when whole, and `<output>.partial/` is removed then.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np

from onnx_nmm import __version__
from onnx_nmm.calibration.calibration_data import check_source_files
from onnx_nmm.errors import OptionError
from onnx_nmm.model_io import carry_genai_config, check_model_file, check_output_path, weight_bytes
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.pipeline import (
    Factorizer,
    MlpNarrowings,
    Planner,
    RewriteReport,
    RewriteResult,
    Statistics,
    calibration_data,
    find_targets,
    gather_statistics,
)
from onnx_nmm.progress import Progress
from onnx_nmm.scale.calibration import gather_statistics_on_ray
from onnx_nmm.scale.factorize import StreamedResult, StreamFactorizeLayers
from onnx_nmm.scale.options import StreamOptions
from onnx_nmm.scale.ray_executor import LocalExecutor, RayExecutor, import_ray, ray_cluster
from onnx_nmm.scale.spectra import factorizer_with_spectra_on_ray
from onnx_nmm.scale.work_dir import WorkDir, fingerprint
from onnx_nmm.scale.writer import write_streamed
from onnx_nmm.teacher import record_dense_model


def rewrite_streamed(model: str | os.PathLike, output: str | os.PathLike, options: RewriteOptions | None = None,
                     stream: StreamOptions | None = None, progress: Progress | None = None) -> RewriteResult:
    """Rewrite the model at `model` into `output` (weights in `<output>.data`) without holding the model in
    memory; killed at any point, the same call takes up where it stopped and writes the same bytes.

    The result's model references the written files. Raises an OnnxNmmError subclass for bad input.
    """
    options = (options or RewriteOptions()).streamable()  # its defaults are the ones a stream can run
    stream, progress = stream or StreamOptions(), progress or Progress()
    if options.strategy.narrows_mlps:
        if stream.ray is not None:
            raise OptionError("narrowing MLPs runs layer by layer on this machine, not on Ray: drop {ray}, or stream "
                              "a factorization ({method} whiten or fisher) on Ray", ray="stream.ray",
                              method="factorization.method")
        from onnx_nmm.layerwise.rewrite import rewrite_layerwise

        return rewrite_layerwise(model, output, options, progress, resume=stream.resume)
    _refuse_in_memory_only(options)
    check_source_files(options.calibration)  # a missing text or tokenizer is said before the model loads
    if stream.ray is not None:
        import_ray()  # a missing ray is said before any work
    model_path, output = Path(model), Path(output)
    source = ModelSource(model_path)
    check_output_path(model_path, output, overwrite_input=False)
    data = calibration_data(options, source, progress)  # a bad calibration source is refused here
    report = RewriteReport.of(options, source.model)
    with ray_cluster(stream.ray, stream.threads):  # so is a cluster that cannot run the tasks
        work = WorkDir.open(output, fingerprint(model_path, _settings(options, stream)), stream.resume)
        try:
            report.layers = _factorized(source, model_path, data, options, stream, work, report, progress).rows
        except Exception:
            work.remove_if_empty()  # bad input found before any matrix was finished: nothing to resume
            raise
    report.weight_bytes_after = weight_bytes(source.model)
    record_dense_model(source.model, model_path)  # as the in-memory rewrite does: finetune's default teacher
    with progress.phase("writing"):
        write_streamed(source.model, output, work.staging, functools.partial(check_model_file, source=model_path))
    carry_genai_config(model_path, output)
    work.remove()
    return RewriteResult(source.model, report, model_path, True)


def _factorized(source: ModelSource, model_path: Path, data, options: RewriteOptions, stream: StreamOptions,
                work: WorkDir, report: RewriteReport, progress: Progress) -> StreamedResult:
    """The statistics, the plan and the streamed factorization of `source`'s model (changed in place)."""
    targets = find_targets(source.model, options)
    statistics = (gather_statistics(targets, data, options, source, progress) if stream.ray is None
                  else gather_statistics_on_ray(targets, data, options, source, model_path, progress))
    report.calibration, report.calibration_windows = statistics.description, statistics.windows
    if stream.ray is None:
        factorizer = Factorizer(options.factorization, statistics.grams, options.ranks.align)
    else:
        factorizer = factorizer_with_spectra_on_ray(targets, statistics, options, model_path, stream.threads,
                                                    progress)
    choice = Planner(options, targets, factorizer, MlpNarrowings(statistics, options.factorization), data,
                     statistics, source, progress).choose(source.model)
    make_executor = functools.partial(_executor, statistics, options, stream, work, model_path)
    result = StreamFactorizeLayers(options, choice.plan, factorizer, work, make_executor, progress)(source.model)
    factorizer.decompositions.clear()
    assert isinstance(result, StreamedResult)
    return result


def _executor(statistics: Statistics, options: RewriteOptions, stream: StreamOptions, work: WorkDir,
              model_path: Path, factorizer, layers):
    if stream.ray is None:
        return LocalExecutor(factorizer, layers, work, stream.threads)
    return RayExecutor(model_path, options.factorization, statistics.grams, options.ranks.align, work,
                       stream.threads)


def _settings(options: RewriteOptions, stream: StreamOptions) -> str:
    """What shapes the factors' bytes: the options, the BLAS threads, onnx-nmm's version (not where they run).
    Token ids given as an array are hashed (their repr elides the middle); files are named by path."""
    tokens = options.calibration.source if options.calibration is not None else None
    digest = ""
    if isinstance(tokens, np.ndarray):
        digest = hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()
    return f"{__version__}|{options!r}|{digest}|threads={stream.threads}"


def _refuse_in_memory_only(options: RewriteOptions) -> None:
    """Steps that need the whole model in memory, or many passes over it."""
    if options.sequential:
        raise OptionError("sequential calibration reruns the partly compressed model after every group: a streamed "
                          "rewrite does not do it; use {mode} independent", mode="calibration.mode")
    if options.ranks.measures_damage:
        raise OptionError("{rule} measures damage on a probe model held in memory: a streamed rewrite takes "
                          "{keep}, rank, energy, a global budget or ranks from a report",
                          rule=f"ranks.{'budget' if options.ranks.budget == 'sensitivity' else options.ranks.rule}",
                          keep="ranks.keep")
    if options.fuse_mlp:
        raise OptionError("{fuse_mlp} is not done by a streamed rewrite yet: rewrite, then fuse in memory",
                          fuse_mlp="fuse_mlp")
