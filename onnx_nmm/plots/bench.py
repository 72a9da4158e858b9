"""PNGs of the speed benchmarks: decode tokens/s against context length, one line per model (needs matplotlib)."""

from __future__ import annotations

import os

from onnx_nmm.errors import MissingDependencyError
from onnx_nmm.generation.decode_speed import Benchmark
from onnx_nmm.trainium.speed import TrainiumEstimate


def plot_benchmark(benchmark: Benchmark, path: str | os.PathLike) -> None:
    """The measured decode speed of `benchmark` (onnxruntime CPU)."""
    contexts = list(benchmark.options.contexts)
    lines = [(model.label, [model.decode_tokens_per_s(c) for c in contexts]) for model in benchmark.models]
    _plot_decode(lines, contexts, "decode tokens/s (median step)",
                 f"onnxruntime CPU, {benchmark.options.threads or 'default'} threads", path)


def plot_trainium(estimate: TrainiumEstimate, path: str | os.PathLike) -> None:
    """The modelled decode speed of `estimate` (one NeuronCore, or split over `tp`)."""
    contexts = list(estimate.options.contexts)
    lines = [(model.label, [1 / model.decode[c].seconds for c in contexts]) for model in estimate.models]
    cores = "one NeuronCore" if estimate.options.tp == 1 else f"split over {estimate.options.tp} NeuronCores"
    _plot_decode(lines, contexts, "decode tokens/s (modelled)",
                 f"{estimate.options.target}, {cores}, bfloat16, batch 1: modelled, not measured", path)


def _plot_decode(lines: list[tuple[str, list[float]]], contexts: list[int], ylabel: str, title: str,
                 path: str | os.PathLike) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("plotting needs matplotlib: pip install 'onnx-nmm[plot]'") from None
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, tokens_per_s in lines:
        axes.plot(contexts, tokens_per_s, "o-", label=label)
    axes.set_xscale("log", base=2)
    axes.set_xticks(contexts, [str(c) for c in contexts])
    axes.set_xlabel("context (tokens in the KV cache)")
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
