"""Helpers shared by the rewrite tests: rewrite a model file, run two models on the same inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

import onnx_nmm


def rewrite_file(source: Path, destination: Path, ranks: onnx_nmm.RankOptions,
                 selection: onnx_nmm.Selection = onnx_nmm.Selection()) -> onnx_nmm.RewriteReport:
    result = onnx_nmm.rewrite(source, onnx_nmm.RewriteOptions(ranks=ranks, selection=selection))
    result.save(destination)
    return result.report


def run_both(reference: Path, candidate: Path, batch: int, seq_len: int, seed: int, vocab: int = 1000):
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, vocab, (batch, seq_len), dtype=np.int64),
             "attention_mask": np.ones((batch, seq_len), np.int64)}
    expected = ort.InferenceSession(str(reference), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    actual = ort.InferenceSession(str(candidate), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return expected, actual


def assert_logits_close(expected: np.ndarray, actual: np.ndarray) -> None:
    """The exactness gate: within 1e-4·max|logits| absolute plus 1e-3 relative, element-wise."""
    limit = 1e-4 * np.abs(expected).max() + 1e-3 * np.abs(expected)
    worst = np.max(np.abs(expected - actual) - limit)
    assert worst <= 0, f"logits differ beyond the gate by {worst:.3e} (max |Δ| {np.abs(expected - actual).max():.3e})"
