"""Perplexity of a model on a text, on any backend (`evaluate`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from onnx_nmm.calibration.calibration_data import check_token_ids, check_token_sources, read_tokens
from onnx_nmm.options import DEFAULT_WINDOW
from onnx_nmm.progress import Progress
from onnx_nmm.quality.perplexity import PerplexityResult, Windows, perplexity, window_count
from onnx_nmm.runtime.backend_runner import Model, ModelRunner


@dataclass(frozen=True)
class TextOptions:
    """A text to score and how it is cut: `text` a UTF-8 file (with `tokenizer`), an .npz whose input_ids are
    read as one sequence, or token ids [n] as an array; windows of `window` tokens (default: DEFAULT_WINDOW,
    or in fine-tuning the training windows' length) every `stride` (default: the window, disjoint), the
    first `max_windows` of them (default: the whole text). When the tokenizer starts a text with a BOS
    token, every window starts with it (window − 1 tokens of text after it), unless not `bos`; token ids
    given as such are taken as they are."""

    text: str | os.PathLike | np.ndarray
    tokenizer: str | os.PathLike | None = None
    window: int | None = None
    stride: int | None = None
    max_windows: int | None = None
    bos: bool = True

    def __post_init__(self):
        Windows(self.window or DEFAULT_WINDOW, self.stride, self.max_windows)  # refuses an impossible window or count

    def check(self) -> None:
        """The text is there and not empty, and a text file has a tokenizer that is one: said before a model
        loads, not after."""
        if not isinstance(self.text, np.ndarray):
            check_token_sources([self.text], self.tokenizer, "tokenizer")

    def read(self, default_window: int) -> tuple[np.ndarray, Windows]:
        """The text's token ids, and the windows to score them in (a window of `default_window` unless set)."""
        if isinstance(self.text, np.ndarray):
            tokens, bos = np.asarray(self.text, dtype=np.int64).reshape(-1), None
        else:
            tokens, bos = read_tokens(self.text, self.tokenizer)
        return tokens, Windows(self.window or default_window, self.stride, self.max_windows, bos if self.bos else None)

    @property
    def label(self) -> str:
        return "token ids" if isinstance(self.text, np.ndarray) else str(self.text)


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
    text.check()
    runner = ModelRunner(model, backend, target)
    tokens, windows = text.read(DEFAULT_WINDOW)
    check_token_ids(tokens, runner.vocabulary, text.label, runner.label)
    with progress.phase("scoring windows", total=window_count(len(tokens), windows)) as phase:
        result = perplexity(runner.logits, tokens, windows, on_window=phase.advance)
    return Evaluation(runner.label, backend, text.label, int(len(tokens)), result)
