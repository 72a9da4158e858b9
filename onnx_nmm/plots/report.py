"""A PNG of the rewrite report: rank and loss of every targeted layer (needs matplotlib)."""

from __future__ import annotations

import os

from onnx_nmm.errors import MissingDependencyError
from onnx_nmm.rewrite import RewriteReport


def plot_report(report: RewriteReport, path: str | os.PathLike, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("plotting needs matplotlib: pip install 'onnx-nmm[plot]'") from None
    layers = [layer for layer in report.layers if layer.status != "skipped"]
    positions = range(len(layers))
    figure, (ranks, losses) = plt.subplots(2, 1, figsize=(max(8, 0.18 * len(layers)), 7), sharex=True)
    ranks.bar(positions, [layer.rank or 0 for layer in layers],
              color=["tab:blue" if layer.status == "factorized" else "tab:gray" for layer in layers])
    ranks.set_ylabel("rank (gray: left dense)")
    ranks.set_title(title or f"{report.rule}; {report.method}")
    losses.plot(positions, [layer.relative_error if layer.relative_error is not None else float("nan")
                            for layer in layers], "o-", markersize=3, label="‖W − UV‖ / ‖W‖")
    if any(layer.plain_svd_error is not None for layer in layers):
        losses.plot(positions, [layer.plain_svd_error if layer.plain_svd_error is not None else float("nan")
                                for layer in layers], "x--", markersize=3,
                    label="plain SVD at the same rank: ‖W − W_r‖ / ‖W‖")
    if any(layer.whitened_loss is not None for layer in layers):
        losses.plot(positions, [layer.whitened_loss if layer.whitened_loss is not None else float("nan")
                                for layer in layers], "s-", markersize=3, label="‖X(W − UV)‖ / ‖XW‖ (calibration)")
    losses.set_ylabel("relative error")
    losses.set_ylim(bottom=0)
    losses.legend()
    losses.set_xticks(list(positions))
    losses.set_xticklabels([f"{layer.module_path.split('layers.')[-1]}" for layer in layers], rotation=90,
                           fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
