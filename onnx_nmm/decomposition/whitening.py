"""Activation-aware (whitened) truncated SVD: minimise ‖X·W − X·U·V‖_F, not ‖W − U·V‖_F.

SVD-LLM's recipe (docs/design.md §3): with G = XᵀX = S·Sᵀ (S lower, Cholesky), ‖X·A‖_F = ‖Sᵀ·A‖_F for
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

Two-sided (Fisher) weighting. With an output Gram G_out = T·Tᵀ as well (onnx_nmm.decomposition.fisher: the gradients
of the loss with respect to the layer's outputs), the error is measured as ‖Sᵀ·(W − U·V)·T‖_F, and the
truncated SVD of Sᵀ·W·T = P Σ Qᵀ minimises it. The same identity gives

    U·V = W · T Q_r · (T⁻ᵀ Q_r)ᵀ

— W projected obliquely: the leading directions T·Q_r of its outputs, read through the dual directions
T⁻ᵀ·Q_r (the two are biorthogonal). Without G_out, T = I and both are Q_r. Only T, which is damped to be
well conditioned, is ever inverted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from onnx_nmm.decomposition import lowrank

DAMPING_STEPS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)


@dataclass
class WhitenedDecomposition(lowrank.RankedFactors):
    """The decomposition of Sᵀ·W·T, with what is needed to form W's factors at any rank (T = I when
    only the inputs weigh the error)."""

    weight: np.ndarray  # W [K, N], float64
    directions: np.ndarray  # T·Q [N, q]: Q the right singular vectors of Sᵀ·W·T, by decreasing σ
    dual_directions: np.ndarray  # T⁻ᵀ·Q [N, q]; the same array as `directions` when T = I
    singular_values: np.ndarray  # σ [q] of Sᵀ·W·T (the weighted spectrum)
    total_energy: float  # ‖Sᵀ·W·T‖_F² (= ‖X·W‖_F² when T = I)
    conditioning: str  # "cholesky", "damped ε=…", or "eigendecomposition"

    @property
    def two_sided(self) -> bool:
        return self.dual_directions is not self.directions

    def factors(self, rank: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
        """U [K, rank] = W·(T Q_r)·D⁻¹ and V [rank, N] = D·(T⁻ᵀ Q_r)ᵀ, D balancing every column of U with
        the matching row of V (equal norms: the factors train and store in the same range)."""
        self.check_rank(rank)
        projected = self.weight @ self.directions[:, :rank]
        dual = self.dual_directions[:, :rank].T
        balance = np.sqrt(np.linalg.norm(projected, axis=0) / np.maximum(np.linalg.norm(dual, axis=1), 1e-300))
        balance = np.where(balance > 0, balance, 1.0)
        return (projected / balance).astype(dtype), (balance[:, None] * dual).astype(dtype)

    def relative_error(self, rank: int) -> float:
        """‖W − U·V‖_F / ‖W‖_F, the error in weight space."""
        total = float(np.sum(self.weight * self.weight))
        if total == 0.0:
            return 0.0
        if self.two_sided:
            residual = self.weight - (self.weight @ self.directions[:, :rank]) @ self.dual_directions[:, :rank].T
            return math.sqrt(float(np.sum(residual * residual)) / total)
        kept = float(np.sum((self.weight @ self.directions[:, :rank]) ** 2))  # Q orthonormal: ‖W‖² − ‖W Q_r‖²
        return math.sqrt(max(total - kept, 0.0) / total)

    def whitened_loss(self, rank: int) -> float:
        """‖Sᵀ(W − U·V)T‖_F / ‖Sᵀ·W·T‖_F: with T = I, ‖X·W − X·U·V‖_F / ‖X·W‖_F on the calibration
        activations (damped G if it was damped)."""
        if self.total_energy == 0.0:
            return 0.0
        return math.sqrt(self.truncated_energy(rank) / self.total_energy)


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


def weighted_spectrum(weight: np.ndarray, gram: np.ndarray, output_gram: np.ndarray | None = None) -> lowrank.Spectrum:
    """Every singular value of Sᵀ·W (or Sᵀ·W·T), as `whitened_decomposition` would find them."""
    whitened, _, _ = _weighted(weight, gram, output_gram)
    return lowrank.spectrum(whitened)


def _weighted(weight: np.ndarray, gram: np.ndarray,
              output_gram: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(Sᵀ·W·T, T or None, how S was obtained) for W [K, N], G [K, K] and optionally G_out [N, N]."""
    weight = np.asarray(weight, dtype=np.float64)
    if gram.shape != (weight.shape[0],) * 2:
        raise ValueError(f"Gram matrix {gram.shape} does not match the weight's input size {weight.shape[0]}")
    factor, conditioning = whitening_factor(gram)
    whitened = factor.T @ weight
    output_factor = None
    if output_gram is not None:
        if output_gram.shape != (weight.shape[1],) * 2:
            raise ValueError(f"output Gram matrix {output_gram.shape} does not match the weight's output size "
                             f"{weight.shape[1]}")
        output_factor = output_whitening_factor(output_gram)
        whitened = whitened @ output_factor
    return whitened, output_factor, conditioning


def deficiency(gram: np.ndarray, tokens: int) -> str:
    """Why a Gram matrix XᵀX over `tokens` rows needed damping, in terms a user can act on."""
    diagonal = np.diag(gram)
    dead = int(np.sum(diagonal <= 1e-12 * max(float(diagonal.max()), 1e-300)))
    width = len(gram)
    if dead:
        return (f"{dead} of {width} input channels are zero on all calibration tokens (dead features; the damping "
                "keeps them harmless)")
    if tokens < width:
        return f"{tokens} calibration tokens for {width} input channels: calibrate on more tokens"
    return "some input channels are (nearly) linear combinations of others on the calibration data"


def whitened_decomposition(weight: np.ndarray, gram: np.ndarray, method: str = "exact",
                           rank_hint: int | None = None, power_iterations: int = 2, oversample: int = 64,
                           seed: int = 0, output_gram: np.ndarray | None = None) -> WhitenedDecomposition:
    """Decompose Sᵀ·W (or Sᵀ·W·T) for W [K, N], the inputs' Gram matrix G [K, K] and optionally the
    output-gradient Gram G_out [N, N]."""
    weight = np.asarray(weight, dtype=np.float64)
    whitened, output_factor, conditioning = _weighted(weight, gram, output_gram)
    decomposition = lowrank.decompose(whitened, method, rank_hint=rank_hint, oversample=oversample,
                                      power_iterations=power_iterations, seed=seed)
    sigma = decomposition.singular_values
    safe = np.where(sigma > 0, sigma, 1.0)
    directions = (decomposition.scaled_right / safe[:, None]).T  # rows σ_i q_iᵀ → columns q_i
    dual = directions
    if output_factor is not None:
        dual = np.linalg.solve(output_factor.T, directions)  # T⁻ᵀ Q
        directions = output_factor @ directions
    return WhitenedDecomposition(weight=weight, directions=directions, dual_directions=dual, singular_values=sigma,
                                 total_energy=decomposition.total_energy, conditioning=conditioning)


# Damping of the output-gradient Gram, relative to its mean diagonal. Estimated from a few thousand
# gradients, G_out is dominated by a few directions; the damping keeps every output direction weighted
# (a large damping gives back input-only whitening). On SmolLM2-135M, in side experiments not recorded
# in docs/quality.md, 0.1 beat 0.01, 0.001 and 1.0 at every budget tried.
OUTPUT_DAMPING = 0.1


def output_whitening_factor(output_gram: np.ndarray) -> np.ndarray:
    """T with T·Tᵀ = G_out + OUTPUT_DAMPING·mean(diag G_out)·I (lower triangular)."""
    output_gram = np.asarray(output_gram, dtype=np.float64)
    if not np.all(np.isfinite(output_gram)):
        raise ValueError("the output-gradient Gram matrix holds NaN or Inf")
    scale = float(np.mean(np.diag(output_gram)))
    if not scale > 0:
        raise ValueError("the output-gradient Gram matrix is zero: the loss does not depend on this layer")
    factor, _ = whitening_factor(output_gram + OUTPUT_DAMPING * scale * np.eye(len(output_gram)))
    return factor


def activation_loss(gram: np.ndarray, weight: np.ndarray, u: np.ndarray, v: np.ndarray) -> float:
    """‖X·(W − U·V)‖_F / ‖X·W‖_F from G = XᵀX, for factors from any method."""
    weight = np.asarray(weight, dtype=np.float64)
    delta = weight - np.asarray(u, dtype=np.float64) @ np.asarray(v, dtype=np.float64)
    error = float(np.sum(delta * (gram @ delta)))
    total = float(np.sum(weight * (gram @ weight)))
    return math.sqrt(max(error, 0.0) / total) if total > 0 else 0.0
