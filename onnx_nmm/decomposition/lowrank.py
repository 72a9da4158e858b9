"""Truncated SVD of a weight matrix (the rules that pick its rank are in rank_plan).

A weight W (K×N) becomes U (K×r) · V (r×N) with U = P_r·√Σ_r and V = √Σ_r·Q_rᵀ, from W = P Σ Qᵀ:
the √Σ split keeps both factors in the same numeric range (they are stored in W's dtype, maybe bf16).

Two ways to get the leading singular triplets:

- `exact`: eigendecomposition of the Gram matrix of the short side, in float64 (W Wᵀ = P Σ² Pᵀ when
  K ≤ N, then Σ Qᵀ = Pᵀ W). Float64 keeps every singular value above 1e-8·σ_max exact to fp32
  precision, which is all a truncation needs, and it runs as one BLAS-3 product plus a symmetric
  eigensolver: ~1.7 s for 2048×8192 on two cores where LAPACK's gesdd takes ~9 s.
- `randomized`: Halko–Martinsson–Tropp range finder with power iterations run on the fp32 Gram
  matrix of the short side, orthonormalized by Cholesky-QR (BLAS-3; Householder QR is the slow part
  of textbook implementations), then an exact float64 decomposition of W projected on the basis. It
  skips the full eigensolver; its error is exactly measurable (see `Decomposition.relative_error`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SVD_METHODS = ("exact", "randomized")


class RankedFactors:
    """What every decomposition offers: how many triplets it holds, the energy a truncation leaves out,
    and factors at a checked rank."""

    singular_values: np.ndarray  # descending
    total_energy: float  # the decomposed matrix's ‖·‖_F², float64

    @property
    def max_rank(self) -> int:
        return len(self.singular_values)

    def check_rank(self, rank: int) -> None:
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} outside 1..{self.max_rank}")

    def truncated_energy(self, rank: int) -> float:
        """Σ_{i>rank} σ_i², the squared Frobenius error of the rank-`rank` truncation."""
        return max(self.total_energy - float(np.sum(self.singular_values[:rank].astype(np.float64) ** 2)), 0.0)


@dataclass
class Spectrum(RankedFactors):
    """Every singular value of a matrix and its energy: enough to choose a rank, not to form factors."""

    singular_values: np.ndarray
    total_energy: float


def spectrum(w: np.ndarray) -> Spectrum:
    """All singular values of `w`, from the eigenvalues of the short side's float64 Gram matrix (the same
    values `decompose(w, "exact")` finds, without its vectors)."""
    w64 = np.asarray(w, dtype=np.float64)
    short = w64 @ w64.T if w64.shape[0] <= w64.shape[1] else w64.T @ w64
    eigenvalues = np.sort(np.clip(np.linalg.eigvalsh(short), 0.0, None))[::-1]
    return Spectrum(singular_values=np.sqrt(eigenvalues), total_energy=float(np.sum(w64 * w64)))


@dataclass
class Decomposition(RankedFactors):
    """W ≈ left · diag(σ) · right, triplets sorted by decreasing σ (only the leading ones may be held).

    `scaled_right` holds σ_i·q_iᵀ as its rows (= leftᵀ·W), which avoids dividing by tiny σ.
    """

    left: np.ndarray  # [K, q], orthonormal columns
    singular_values: np.ndarray  # [q], descending
    scaled_right: np.ndarray  # [q, N]
    total_energy: float  # ‖W‖_F², float64

    def factors(self, rank: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
        """U [K, rank] = P_r·√Σ_r and V [rank, N] = √Σ_r·Q_rᵀ, in `dtype`."""
        self.check_rank(rank)
        root = np.sqrt(self.singular_values[:rank])
        safe_root = np.where(root > 0, root, 1.0)
        u = self.left[:, :rank] * root
        v = self.scaled_right[:rank] / safe_root[:, None]
        return u.astype(dtype), v.astype(dtype)

    def relative_error(self, rank: int) -> float:
        """‖W − U·V‖_F / ‖W‖_F. Exact: U·V is W's orthogonal projection onto the leading left vectors."""
        if self.total_energy == 0.0:
            return 0.0
        return math.sqrt(self.truncated_energy(rank) / self.total_energy)


def optimal_relative_error(w: np.ndarray, rank: int) -> float:
    """‖W − W_r‖_F / ‖W‖_F of the best rank-r approximation (plain truncated SVD), from eigenvalues only."""
    values = spectrum(w)
    energies = values.singular_values**2
    total = float(energies.sum())
    return math.sqrt(max(float(energies[rank:].sum()), 0.0) / total) if total > 0 else 0.0


def decompose(w: np.ndarray, method: str = "exact", rank_hint: int | None = None,
              oversample: int = 64, power_iterations: int = 2, seed: int = 0) -> Decomposition:
    """Leading singular triplets of `w` (2-D). `randomized` computes rank_hint + oversample of them."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a matrix, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("the matrix holds NaN or Inf")
    if method == "exact":
        return _gram_decomposition(w)
    if method == "randomized":
        if rank_hint is None:
            raise ValueError("the randomized SVD needs the target rank")
        return _randomized_decomposition(w, rank_hint, oversample, power_iterations, seed)
    raise ValueError(f"unknown SVD method {method!r}; choose from {', '.join(SVD_METHODS)}")


def _gram_decomposition(w: np.ndarray) -> Decomposition:
    k, n = w.shape
    if k > n:
        return _transposed(_gram_decomposition(w.T))
    w64 = w.astype(np.float64)
    eigenvalues, eigenvectors = np.linalg.eigh(w64 @ w64.T)
    order = np.argsort(eigenvalues)[::-1]
    left = eigenvectors[:, order]
    return Decomposition(
        left=left,
        singular_values=np.sqrt(np.clip(eigenvalues[order], 0.0, None)),
        scaled_right=left.T @ w64,
        total_energy=float(np.sum(w64 * w64)),
    )


def _randomized_decomposition(w: np.ndarray, rank: int, oversample: int, power_iterations: int,
                              seed: int) -> Decomposition:
    k, n = w.shape
    if k > n:
        return _transposed(_randomized_decomposition(w.T, rank, oversample, power_iterations, seed))
    width = min(rank + oversample, k)
    # Range finder on the short side's Gram matrix G = W·Wᵀ (K×K, fp32): every power iteration is a
    # K×K product instead of two passes over W. A Rayleigh–Ritz step on the small matrix BᵀGB orders
    # the basis B; W is then projected on it once, and the row norms of that projection are the
    # singular values, so `relative_error` stays exact whatever G's rounding.
    a = w if w.dtype in (np.float32, np.float64) else w.astype(np.float32)
    gram = a @ a.T
    rng = np.random.default_rng(seed)
    basis = _orthonormal(gram @ rng.standard_normal((k, width), dtype=a.dtype))
    for _ in range(power_iterations):
        basis = _orthonormal(gram @ basis.astype(a.dtype))
    narrow = basis.astype(a.dtype)
    ritz_values, ritz_vectors = np.linalg.eigh((narrow.T @ (gram @ narrow)).astype(np.float64))
    left = basis @ ritz_vectors[:, np.argsort(ritz_values)[::-1]]
    scaled_right = (left.astype(a.dtype).T @ a).astype(np.float64)  # rows σ_i·q_iᵀ of the projection
    return Decomposition(
        left=left,
        singular_values=np.linalg.norm(scaled_right, axis=1),
        scaled_right=scaled_right,
        total_energy=float(np.sum(np.square(a, dtype=np.float64))),
    )


def _orthonormal(y: np.ndarray) -> np.ndarray:
    """Orthonormal basis of y's columns (float64) by one Cholesky-QR pass; Householder if y is singular.

    One pass leaves an orthogonality error of about eps·cond(y)², ~1e-8 here: plenty for a range
    finder, whose basis only has to span the right space.
    """
    q = y.astype(np.float64)
    try:
        r = np.linalg.cholesky(q.T @ q)  # lower: q = (q r⁻ᵀ) rᵀ
        return q @ np.linalg.inv(r).T
    except np.linalg.LinAlgError:
        return np.linalg.qr(q)[0]


def _transposed(d: Decomposition) -> Decomposition:
    """The decomposition of Wᵀ turned into one of W (swap sides, move σ to the other factor)."""
    sigma = d.singular_values
    safe = np.where(sigma > 0, sigma, 1.0)
    right_unit = d.scaled_right / safe[:, None]  # rows q_iᵀ of Wᵀ = columns of W's left side
    return Decomposition(
        left=right_unit.T,
        singular_values=sigma,
        scaled_right=(d.left * sigma).T,
        total_energy=d.total_energy,
    )
