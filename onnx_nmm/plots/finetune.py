"""A PNG of a fine-tuning run: the loss of every step, its running mean, and the learning rate."""

from __future__ import annotations

import os

import numpy as np

from onnx_nmm.errors import MissingDependencyError
from onnx_nmm.training.factor_training import TrainingResult

RUNNING_MEAN_FRACTION = 0.1  # of the steps, at least one (the summary's "tenth")


def plot_loss_curve(result: TrainingResult, path: str | os.PathLike, title: str, loss_label: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("plotting needs matplotlib: pip install 'onnx-nmm[plot]'") from None
    steps = np.array([record.step for record in result.records])
    losses = np.array(result.losses)
    width = max(1, round(RUNNING_MEAN_FRACTION * len(losses)))
    running = np.convolve(losses, np.ones(width) / width, mode="valid")
    figure, axis = plt.subplots(figsize=(8, 4.5))
    axis.plot(steps, losses, color="tab:blue", alpha=0.35, linewidth=1, label=f"{loss_label} loss per step")
    axis.plot(steps[width - 1:], running, color="tab:blue", linewidth=2, label=f"running mean of {width} steps")
    axis.set_xlabel("step")
    axis.set_ylabel(f"{loss_label} loss")
    axis.set_title(title, fontsize=10)
    rate = axis.twinx()
    rate.plot(steps, [record.learning_rate for record in result.records], color="tab:gray", linestyle="--",
              linewidth=1, label="learning rate")
    rate.set_ylabel("learning rate")
    rate.set_ylim(bottom=0)
    handles = axis.get_legend_handles_labels()[0] + rate.get_legend_handles_labels()[0]
    axis.legend(handles, [handle.get_label() for handle in handles], loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
