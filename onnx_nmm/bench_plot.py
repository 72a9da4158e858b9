"""A PNG of a speed benchmark: decode tokens/s against context length, one line per model (needs matplotlib)."""

from __future__ import annotations

import os

from onnx_nmm.benchmark import Benchmark
from onnx_nmm.errors import MissingDependencyError


def plot_benchmark(benchmark: Benchmark, path: str | os.PathLike) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("plotting needs matplotlib: pip install 'onnx-nmm[plot]'") from None
    contexts = list(benchmark.options.contexts)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for model in benchmark.models:
        axes.plot(contexts, [model.decode_tokens_per_s(c) for c in contexts], "o-", label=model.label)
    axes.set_xscale("log", base=2)
    axes.set_xticks(contexts, [str(c) for c in contexts])
    axes.set_xlabel("context (tokens in the KV cache)")
    axes.set_ylabel("decode tokens/s (median step)")
    axes.set_ylim(bottom=0)
    axes.set_title(f"onnxruntime CPU, {benchmark.options.threads or 'default'} threads", fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
