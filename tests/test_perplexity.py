"""Perplexity windows and scoring, checked against a model whose probabilities are known exactly."""

import math

import numpy as np
import pytest

from onnx_nmm.quality.perplexity import Windows, compare_on_text, perplexity


def bigram(table: np.ndarray):
    """A model whose next-token distribution depends only on the current token: p = table[current]."""
    log_table = np.log(table)
    return lambda tokens: log_table[tokens].astype(np.float32)


def _table(vocab, seed):
    rng = np.random.default_rng(seed)
    table = rng.random((vocab, vocab)) + 0.1
    return table / table.sum(axis=1, keepdims=True)


def test_each_token_is_scored_once():
    assert list(Windows(4, 4).spans(10)) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert list(Windows(4, 2).spans(10)) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert list(Windows(4, 4, max_windows=2).spans(100)) == [(0, 4, 1), (4, 8, 5)]


def test_bigram_perplexity_is_exact():
    table = _table(7, 0)
    tokens = np.random.default_rng(1).integers(0, 7, 50)
    result = perplexity(bigram(table), tokens, Windows(window=8, stride=8))
    scored = [t for begin, end, first in Windows(8, 8).spans(50) for t in range(first, end)]
    expected = -np.mean([math.log(table[tokens[t - 1], tokens[t]]) for t in scored])
    assert result.tokens_scored == len(scored) == 50 - 7  # the first token of every window has no context
    assert result.mean_nll == pytest.approx(expected, rel=1e-6)
    overlapping = perplexity(bigram(table), tokens, Windows(window=8, stride=3))
    assert overlapping.tokens_scored == 49  # sliding windows score every token after the first


def test_comparing_a_model_with_itself():
    model = bigram(_table(5, 2))
    tokens = np.random.default_rng(3).integers(0, 5, 40)
    comparison = compare_on_text(model, model, tokens, Windows(10, 10))
    assert comparison.top1_agreement == 1.0 and comparison.mean_kl == pytest.approx(0.0, abs=1e-12)
    other = compare_on_text(model, bigram(_table(5, 9)), tokens, Windows(10, 10))
    assert other.mean_kl > 0 and other.reference.perplexity == pytest.approx(comparison.reference.perplexity)


def test_windows_after_a_bos_hold_one_token_less_of_text_and_score_their_first():
    assert list(Windows(4, bos=7).spans(10)) == [(0, 3, 0), (3, 6, 3), (6, 9, 6), (9, 10, 9)]
    assert list(Windows(4, 2, bos=7).spans(7)) == [(0, 3, 0), (2, 5, 3), (4, 7, 5)]
    with pytest.raises(Exception, match="window"):
        Windows(4, 4, bos=7)  # a stride past the text of a window would skip tokens


def test_every_window_starts_with_bos_and_every_token_is_scored_once():
    table, seen = _table(8, 3), []
    model = bigram(table)

    def recording(tokens):
        seen.append(tokens[0].tolist())
        return model(tokens)

    tokens = np.random.default_rng(1).integers(0, 7, size=20)
    result = perplexity(recording, tokens, Windows(window=6, bos=7))
    assert all(window[0] == 7 for window in seen) and [w[1:] for w in seen] == [tokens[i:i + 5].tolist()
                                                                              for i in range(0, 20, 5)]
    previous = np.concatenate([[7], tokens[:-1]])
    previous[5::5] = 7  # each window's first token is predicted from BOS
    expected = -np.mean(np.log(table[previous, tokens]))
    assert result.tokens_scored == 20 and result.bos == 7
    assert result.mean_nll == pytest.approx(expected)
