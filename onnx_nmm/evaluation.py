"""Perplexity of a model on a text, on any backend (`evaluate`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from onnx_nmm.backend_runner import Model, ModelRunner
from onnx_nmm.calibration_data import check_token_ids, read_tokens
from onnx_nmm.options import DEFAULT_WINDOW
from onnx_nmm.perplexity import PerplexityResult, Windows, perplexity, window_count
from onnx_nmm.progress import Progress


@dataclass(frozen=True)
class TextOptions:
    """A text to score and how it is cut: `text` a UTF-8 file (with `tokenizer`), an .npz whose input_ids are
    read as one sequence, or token ids [n] as an array; windows of `window` tokens (default: DEFAULT_WINDOW,
    or in fine-tuning the training windows' length) every `stride` (default: the window, disjoint), the
    first `max_windows` of them (default: the whole text)."""

    text: str | os.PathLike | np.ndarray
    tokenizer: str | os.PathLike | None = None
    window: int | None = None
    stride: int | None = None
    max_windows: int | None = None

    def __post_init__(self):
        self.windows(DEFAULT_WINDOW)  # Windows refuses an impossible window, stride or count

    def windows(self, default_window: int) -> Windows:
        window = self.window or default_window
        return Windows(window=window, stride=self.stride or window, max_windows=self.max_windows)

    @property
    def label(self) -> str:
        return "token ids" if isinstance(self.text, np.ndarray) else str(self.text)

    def tokens(self) -> np.ndarray:
        if isinstance(self.text, np.ndarray):
            return np.asarray(self.text, dtype=np.int64).reshape(-1)
        return read_tokens(self.text, self.tokenizer)


@dataclass
class Evaluation:
    model: str
    backend: str
    text: str
    text_tokens: int
    result: PerplexityResult

    def to_dict(self) -> dict:
        return {"model": self.model, "backend": self.backend, "text": self.text, "text_tokens": self.text_tokens,
                **self.result.to_dict()}


def evaluate(model: Model, text: TextOptions, backend: str = "ort", target: str = "trn2",
             progress: Progress | None = None) -> Evaluation:
    """Token-level perplexity of `model` (a causal LM, logits first) on the windows of `text`."""
    progress = progress or Progress()
    runner = ModelRunner(model, backend, target)
    tokens = text.tokens()
    check_token_ids(tokens, runner.vocabulary, text.label, runner.label)
    windows = text.windows(DEFAULT_WINDOW)
    with progress.phase("scoring windows", total=window_count(len(tokens), windows)) as phase:
        result = perplexity(runner.logits, tokens, windows, on_window=phase.advance)
    return Evaluation(runner.label, backend, text.label, int(len(tokens)), result)
