"""Activation-aware (whitened) truncated SVD: minimise ‖X·W − X·U·V‖_F, not ‖W − U·V‖_F.

SVD-LLM's recipe (DESIGN.md §5): with G = XᵀX = S·Sᵀ (S lower, Cholesky), ‖X·A‖_F = ‖Sᵀ·A‖_F for
any A, so truncating the SVD of Sᵀ·W = P Σ Qᵀ truncates exactly the output error. Its factors are
U = S⁻ᵀ P_r Σ_r^½ and V = Σ_r^½ Q_rᵀ, whose product is

    U·V = S⁻ᵀ P_r Σ_r Q_rᵀ = W · Q_r Q_rᵀ        (because W Q_r = S⁻ᵀ P Σ Qᵀ Q_r = S⁻ᵀ P_r Σ_r)

— W projected onto the principal directions of its outputs X·W. onnx-nmm builds the factors from that
identity, U = W Q_r D⁻¹ and V = D Q_rᵀ with D balancing the two factors' norms: no S⁻¹ is ever
formed, so the factors stay finite even where G is singular. The truncated loss is Σ_{i>r} σ_i².

G itself is made factorizable first. Too few calibration tokens, or dead features, make it singular:
its diagonal is damped, G + ε·mean(diag G)·I with growing ε, which also acts as a ridge term for the
input directions the calibration never excited; if no damping helps, a symmetric eigendecomposition
gives S = E Λ^½ (negative eigenvalues clipped). The report says which layers needed which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from onnx_nmm import lowrank

DAMPING_STEPS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)


@dataclass
class WhitenedDecomposition(lowrank.RankedFactors):
    """The decomposition of Sᵀ·W, with what is needed to form W's factors at any rank."""

    weight: np.ndarray  # W [K, N], float64
    directions: np.ndarray  # Q [N, q]: right singular vectors of Sᵀ·W, by decreasing σ
    singular_values: np.ndarray  # σ [q] of Sᵀ·W (the activation-weighted spectrum)
    total_energy: float  # ‖Sᵀ·W‖_F² = ‖X·W‖_F²
    conditioning: str  # "cholesky", "damped ε=…", or "eigendecomposition"

    def factors(self, rank: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
        """U [K, rank] = W Q_r D⁻¹ and V [rank, N] = D Q_rᵀ, D = diag(√‖W q_i‖) (balanced norms)."""
        self.check_rank(rank)
        directions = self.directions[:, :rank]
        projected = self.weight @ directions
        balance = np.sqrt(np.linalg.norm(projected, axis=0))
        balance = np.where(balance > 0, balance, 1.0)
        return (projected / balance).astype(dtype), (balance[:, None] * directions.T).astype(dtype)

    def relative_error(self, rank: int) -> float:
        """‖W − U·V‖_F / ‖W‖_F, the error in weight space (Q orthonormal: ‖W‖² − ‖W Q_r‖²)."""
        total = float(np.sum(self.weight * self.weight))
        if total == 0.0:
            return 0.0
        kept = float(np.sum((self.weight @ self.directions[:, :rank]) ** 2))
        return math.sqrt(max(total - kept, 0.0) / total)

    def whitened_loss(self, rank: int) -> float:
        """‖X·W − X·U·V‖_F / ‖X·W‖_F on the calibration activations (damped G if it was damped)."""
        if self.total_energy == 0.0:
            return 0.0
        kept = float(np.sum(self.singular_values[:rank] ** 2))
        return math.sqrt(max(self.total_energy - kept, 0.0) / self.total_energy)


def whitening_factor(gram: np.ndarray) -> tuple[np.ndarray, str]:
    """S with S·Sᵀ = G (or a damped G), and how it was obtained."""
    gram = np.asarray(gram, dtype=np.float64)
    if not np.all(np.isfinite(gram)):
        raise ValueError("the Gram matrix holds NaN or Inf")
    try:
        return np.linalg.cholesky(gram), "cholesky"
    except np.linalg.LinAlgError:
        pass
    scale = float(np.mean(np.diag(gram)))
    if scale > 0:
        for epsilon in DAMPING_STEPS:
            try:
                damped = gram + epsilon * scale * np.eye(len(gram))
                return np.linalg.cholesky(damped), f"damped ε={epsilon:g}"
            except np.linalg.LinAlgError:
                continue
    eigenvalues, eigenvectors = np.linalg.eigh(gram)
    return eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None)), "eigendecomposition"


def whitened_decomposition(weight: np.ndarray, gram: np.ndarray, method: str = "exact",
                           rank_hint: int | None = None, power_iterations: int = 2, oversample: int = 64,
                           seed: int = 0) -> WhitenedDecomposition:
    """Decompose Sᵀ·W for W [K, N] and the inputs' Gram matrix G [K, K]."""
    weight = np.asarray(weight, dtype=np.float64)
    if gram.shape != (weight.shape[0],) * 2:
        raise ValueError(f"Gram matrix {gram.shape} does not match the weight's input size {weight.shape[0]}")
    factor, conditioning = whitening_factor(gram)
    whitened = factor.T @ weight
    decomposition = lowrank.decompose(whitened, method, rank_hint=rank_hint, oversample=oversample,
                                      power_iterations=power_iterations, seed=seed)
    sigma = decomposition.singular_values
    safe = np.where(sigma > 0, sigma, 1.0)
    directions = (decomposition.scaled_right / safe[:, None]).T  # rows σ_i q_iᵀ → columns q_i
    return WhitenedDecomposition(weight=weight, directions=directions, singular_values=sigma,
                                 total_energy=decomposition.total_energy, conditioning=conditioning)


def activation_loss(gram: np.ndarray, weight: np.ndarray, u: np.ndarray, v: np.ndarray) -> float:
    """‖X·(W − U·V)‖_F / ‖X·W‖_F from G = XᵀX, for factors from any method."""
    weight = np.asarray(weight, dtype=np.float64)
    delta = weight - np.asarray(u, dtype=np.float64) @ np.asarray(v, dtype=np.float64)
    error = float(np.sum(delta * (gram @ delta)))
    total = float(np.sum(weight * (gram @ weight)))
    return math.sqrt(max(error, 0.0) / total) if total > 0 else 0.0
