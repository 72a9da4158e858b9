"""Token-level perplexity over fixed windows of a text, and two models compared on the same windows.

Windows start every `stride` tokens and hold `window` tokens; each token is scored once, by the
first window in which it has context (the sliding-window protocol of Hugging Face's perplexity
guide: with stride < window, later windows score only their new tokens, with the earlier ones as
context). With stride = window the windows are disjoint and each scores its last window−1 tokens.

    perplexity = exp( mean over scored tokens of −log p(token | its window's previous tokens) )
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

from onnx_nmm import metrics
from onnx_nmm.errors import DataError, OptionError

# token ids [1, S] → logits [1, S, vocab]: a model on some backend (backend_runner.ModelRunner.logits)
LogitsFn = Callable[[np.ndarray], np.ndarray]


@dataclass
class Windows:
    """Where the windows lie in a token sequence."""

    window: int
    stride: int
    max_windows: int | None = None

    def __post_init__(self):
        if self.window < 2 or self.stride < 1 or self.stride > self.window:
            raise OptionError(f"need {{window}} ≥ 2 and 1 ≤ {{stride}} ≤ {{window}}, got window {self.window}, stride "
                              f"{self.stride}", window="window", stride="stride")
        if self.max_windows is not None and self.max_windows < 1:
            raise OptionError("{max_windows} must be a positive integer", max_windows="max_windows")

    def spans(self, length: int) -> Iterator[tuple[int, int, int]]:
        """(begin, end, first scored position) of every window over `length` tokens."""
        scored_up_to, count = 1, 0
        for begin in range(0, max(length - 1, 0), self.stride):
            end = min(begin + self.window, length)
            if end - begin < 2 or end <= scored_up_to:
                break
            yield begin, end, max(scored_up_to, begin + 1)
            scored_up_to, count = end, count + 1
            if end == length or (self.max_windows is not None and count >= self.max_windows):
                break


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens_scored: int
    windows: int
    window: int
    stride: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TextComparison:
    reference: PerplexityResult
    candidate: PerplexityResult
    top1_agreement: float  # over scored positions
    mean_kl: float  # KL(P_reference ‖ P_candidate) of the next-token distributions, nats

    def to_dict(self) -> dict:
        return {"reference": self.reference.to_dict(), "candidate": self.candidate.to_dict(),
                "top1_agreement": self.top1_agreement, "mean_kl": self.mean_kl}


def perplexity(model: LogitsFn, tokens: np.ndarray, windows: Windows,
               on_window: Callable[[], None] | None = None) -> PerplexityResult:
    nll = _NllSum()
    for begin, end, first in windows.spans(len(tokens)):
        log_probabilities = _next_token_log_probabilities(model, tokens, begin, end)
        nll.add(log_probabilities, tokens, begin, end, first)
        if on_window is not None:
            on_window()
    return nll.result(windows)


def compare_on_text(reference: LogitsFn, candidate: LogitsFn, tokens: np.ndarray,
                    windows: Windows, on_window: Callable[[], None] | None = None) -> TextComparison:
    """Both models on the same windows: perplexities, top-1 agreement and KL at every scored position."""
    nll_reference, nll_candidate = _NllSum(), _NllSum()
    agree, kl, positions = 0.0, 0.0, 0
    for begin, end, first in windows.spans(len(tokens)):
        log_p = _next_token_log_probabilities(reference, tokens, begin, end)
        log_q = _next_token_log_probabilities(candidate, tokens, begin, end)
        nll_reference.add(log_p, tokens, begin, end, first)
        nll_candidate.add(log_q, tokens, begin, end, first)
        scored = slice(first - begin - 1, end - begin - 1)  # rows predicting the scored tokens
        p, q = log_p[scored], log_q[scored]
        agree += float(np.sum(p.argmax(-1) == q.argmax(-1)))
        kl += float(np.sum(np.exp(p) * (p - q)))
        positions += len(p)
        if on_window is not None:
            on_window()
    return TextComparison(nll_reference.result(windows), nll_candidate.result(windows),
                          agree / positions if positions else float("nan"), kl / positions if positions else float("nan"))


def window_count(length: int, windows: Windows) -> int:
    return sum(1 for _ in windows.spans(length))


class _NllSum:
    def __init__(self):
        self.total, self.count, self.windows = 0.0, 0, 0

    def add(self, log_probabilities: np.ndarray, tokens: np.ndarray, begin: int, end: int, first: int) -> None:
        targets = tokens[first:end]
        rows = log_probabilities[first - begin - 1: end - begin - 1]  # row i predicts token begin+i+1
        self.total -= float(np.sum(rows[np.arange(len(targets)), targets]))
        self.count += len(targets)
        self.windows += 1

    def result(self, windows: Windows) -> PerplexityResult:
        if self.count == 0:
            raise DataError("the text is too short to score a single token; give a longer text")
        mean = self.total / self.count
        return PerplexityResult(perplexity=math.exp(mean), mean_nll=mean, tokens_scored=self.count,
                                windows=self.windows, window=windows.window, stride=windows.stride)


def _next_token_log_probabilities(model: LogitsFn, tokens: np.ndarray, begin: int, end: int) -> np.ndarray:
    return metrics.log_softmax(model(tokens[None, begin:end])[0].astype(np.float64))
