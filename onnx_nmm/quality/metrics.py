"""How far a candidate output is from the reference: element errors, and next-token statistics.

For every output: the largest absolute error, that error relative to the reference's largest
magnitude (|a − b|max / |a|max, stable where elements are near zero), and the cosine similarity.
For logits (last axis = vocabulary): how often the argmax token agrees, and the mean KL divergence
KL(P_ref ‖ P_candidate) of the next-token distributions over all positions, in nats.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class OutputComparison:
    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    cosine: float
    mismatched: int  # elements outside atol + rtol·|reference| (0 when no tolerance is given)
    top1_agreement: float | None = None
    mean_kl: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def compare(name: str, reference: np.ndarray, candidate: np.ndarray, atol: float | None = None,
            rtol: float | None = None, logits: bool | None = None) -> OutputComparison:
    """Compare one output. `logits=None` guesses from the name and rank."""
    if reference.shape != candidate.shape:
        raise ValueError(f"output {name}: shapes differ, {reference.shape} vs {candidate.shape}")
    a = reference.astype(np.float64)
    b = candidate.astype(np.float64)
    difference = np.abs(a - b)
    scale = float(np.max(np.abs(a))) if a.size else 0.0
    max_abs = float(difference.max()) if a.size else 0.0
    comparison = OutputComparison(
        name=name, shape=tuple(reference.shape), max_abs=max_abs,
        max_rel=max_abs / scale if scale > 0 else float(max_abs > 0),
        cosine=cosine_similarity(a, b),
        mismatched=count_mismatched(a, b, atol, rtol),
    )
    if logits if logits is not None else looks_like_logits(name, reference):
        comparison.top1_agreement = top1_agreement(a, b)
        comparison.mean_kl = mean_kl_divergence(a, b)
    return comparison


def looks_like_logits(name: str, array: np.ndarray) -> bool:
    return np.issubdtype(array.dtype, np.floating) and array.ndim >= 2 and (
        "logit" in name.lower() or array.shape[-1] >= 1000)


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    if norm == 0:
        return 1.0 if np.array_equal(a, b) else 0.0
    return float(np.vdot(a.ravel(), b.ravel()) / norm)


def count_mismatched(a: np.ndarray, b: np.ndarray, atol: float | None, rtol: float | None) -> int:
    if atol is None and rtol is None:
        return 0
    limit = (atol or 0.0) + (rtol or 0.0) * np.abs(a)
    return int(np.count_nonzero(np.abs(a - b) > limit))


def top1_agreement(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> float:
    return float(np.mean(reference_logits.argmax(-1) == candidate_logits.argmax(-1)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def mean_kl_divergence(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax(reference) ‖ softmax(candidate)), in nats."""
    log_p = log_softmax(reference_logits.astype(np.float64))
    log_q = log_softmax(candidate_logits.astype(np.float64))
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    return float(np.mean(kl))
