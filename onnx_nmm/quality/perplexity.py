"""Token-level perplexity over fixed windows of a text, and two models compared on the same windows.

Windows start every `stride` tokens and hold `window` tokens; each token is scored once, by the
first window in which it has context (the sliding-window protocol of Hugging Face's perplexity
guide: with stride < window, later windows score only their new tokens, with the earlier ones as
context). With stride = window the windows are disjoint and each scores its last window−1 tokens.

When the tokenizer starts every text with a BOS token, so does every window: the model sees BOS and
window−1 tokens of the text, and scores all of them (the first from BOS alone). A model trained with
BOS is lost without it: scoring windows that lack it measures mostly that confusion.

    perplexity = exp( mean over scored tokens of −log p(token | its window's previous tokens) )
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

from onnx_nmm.errors import DataError, OptionError
from onnx_nmm.quality import metrics

# token ids [1, S] → logits [1, S, vocab]: a model on some backend (backend_runner.ModelRunner.logits)
LogitsFn = Callable[[np.ndarray], np.ndarray]


@dataclass
class Windows:
    """Where the windows lie in a token sequence."""

    window: int  # tokens the model sees, BOS included
    stride: int | None = None  # None: disjoint windows of text
    max_windows: int | None = None
    bos: int | None = None  # the BOS token id every window starts with, or None

    def __post_init__(self):
        if self.stride is None:
            self.stride = self.text_window
        if self.window < 2 or self.stride < 1 or self.stride > self.text_window:
            raise OptionError(f"need {{window}} ≥ 2 and 1 ≤ {{stride}} ≤ {{window}}"
                              f"{' − 1 (BOS)' if self.bos is not None else ''}"
                              f", got window {self.window}, stride {self.stride}", window="window", stride="stride")
        if self.max_windows is not None and self.max_windows < 1:
            raise OptionError("{max_windows} must be a positive integer", max_windows="max_windows")

    @property
    def text_window(self) -> int:
        """Tokens of the text in a window."""
        return self.window - (self.bos is not None)

    @property
    def unscored(self) -> int:
        """Text tokens at a window's start that nothing predicts: the first one, unless BOS does."""
        return 0 if self.bos is not None else 1

    def spans(self, length: int) -> Iterator[tuple[int, int, int]]:
        """(begin, end, first scored position) of every window over `length` tokens of text."""
        assert self.stride is not None, "__post_init__ gives disjoint windows their stride"
        scored_up_to, count = self.unscored, 0
        for begin in range(0, max(length - self.unscored, 0), self.stride):
            end = min(begin + self.text_window, length)
            if end - begin < 1 + self.unscored or end <= scored_up_to:
                break
            yield begin, end, max(scored_up_to, begin + self.unscored)
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
    bos: int | None = None  # the BOS token id every window started with

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
        log_probabilities = _next_token_log_probabilities(model, tokens, begin, end, windows.bos)
        nll.add(log_probabilities[first - begin - windows.unscored:], tokens[first:end])
        if on_window is not None:
            on_window()
    return nll.result(windows)


def compare_on_text(reference: LogitsFn, candidate: LogitsFn, tokens: np.ndarray,
                    windows: Windows, on_window: Callable[[], None] | None = None) -> TextComparison:
    """Both models on the same windows: perplexities, top-1 agreement and KL at every scored position."""
    nll_reference, nll_candidate = _NllSum(), _NllSum()
    agree, kl, positions = 0.0, 0.0, 0
    for begin, end, first in windows.spans(len(tokens)):
        scored = slice(first - begin - windows.unscored, None)  # the rows predicting the scored tokens
        p = _next_token_log_probabilities(reference, tokens, begin, end, windows.bos)[scored]
        q = _next_token_log_probabilities(candidate, tokens, begin, end, windows.bos)[scored]
        nll_reference.add(p, tokens[first:end])
        nll_candidate.add(q, tokens[first:end])
        agree += float(np.sum(p.argmax(-1) == q.argmax(-1)))
        kl += float(np.sum(np.exp(p) * (p - q)))
        positions += len(p)
        if on_window is not None:
            on_window()
    return TextComparison(nll_reference.result(windows), nll_candidate.result(windows),
                          agree / positions if positions else float("nan"),
                          kl / positions if positions else float("nan"))


def window_count(length: int, windows: Windows) -> int:
    return sum(1 for _ in windows.spans(length))


class _NllSum:
    def __init__(self):
        self.total, self.count, self.windows = 0.0, 0, 0

    def add(self, rows: np.ndarray, targets: np.ndarray) -> None:
        """`rows[i]`: the log-probabilities that predicted `targets[i]`."""
        self.total -= float(np.sum(rows[np.arange(len(targets)), targets]))
        self.count += len(targets)
        self.windows += 1

    def result(self, windows: Windows) -> PerplexityResult:
        if self.count == 0:
            raise DataError("the text is too short to score a single token; give a longer text")
        mean = self.total / self.count
        assert windows.stride is not None, "__post_init__ gives disjoint windows their stride"
        return PerplexityResult(perplexity=math.exp(mean), mean_nll=mean, tokens_scored=self.count,
                                windows=self.windows, window=windows.window, stride=windows.stride, bos=windows.bos)


def _next_token_log_probabilities(model: LogitsFn, tokens: np.ndarray, begin: int, end: int,
                                  bos: int | None) -> np.ndarray:
    """The model's next-token log-probabilities over the window tokens[begin:end] (after `bos` if given):
    row i predicts token begin + i + 1, or begin + i after a BOS."""
    ids = tokens[begin:end] if bos is None else np.concatenate([[bos], tokens[begin:end]])
    return metrics.log_softmax(model(ids[None].astype(np.int64))[0, :-1].astype(np.float64))
