"""Compress an MLP as a module: keep k of its I intermediate neurons and refit the output projection
(MoDeGPT's Nyström compression of the MLP, arXiv 2408.09632).

With h = f(X·W_g, X·W_u) the intermediate activation (tokens × I), C = Σ hᵀh its correlation over the
calibration tokens (the Gram of the output projection's input, gathered as for whitening) and W_d [I, H]:

    keep       S ⊂ {1..I}, |S| = k, the neurons by a score (NEURON_SCORES)
    refit      W_d' = argmin ‖h·W_d − h_S·W'‖² + λ‖W' − W_d[S]‖²
                    = (C_SS + λ·I)⁻¹ (C_S: W_d + λ·W_d[S])
    error      E(S) = ‖h·W_d − h_S·W_d'‖² = tr(W_dᵀ C W_d) − 2 tr(W_d'ᵀ C_S: W_d) + tr(W_d'ᵀ C_SS W_d')

and the input projections simply lose the columns outside S. The ridge pulls the refit towards the rows
it replaces rather than towards zero (MoDeGPT's ridge): λ → ∞ keeps W_d[S] as it was, λ → 0 is the plain
least-squares refit, which fits the calibration text's activations best and, in a probe on SmolLM2
calibrated on the Old Testament, carried least to modern prose — in between did better on both texts than
either end. λ = ρ·tr(C)/I, ρ chosen on the Gram of calibration windows held out of C (the error above with
the held-out Gram, at `reference_width`), else RIDGE_DEFAULT.

Scores:
    leverage    ridge leverage diag(C (C + λI)⁻¹): the neurons the others explain least (MoDeGPT)
    energy      C_jj · ‖W_d[j, :]‖²: what a neuron alone writes into the residual stream
    greedy      backward elimination on E: drop, one block at a time, the neurons whose removal (with the
                refit) raises E least, ‖X_j‖² / (A⁻¹)_jj for X = A⁻¹B, A = C_SS + λI, B = C_S: W_d — the
                Optimal Brain Surgeon criterion for a row of the output projection
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg

NEURON_SCORES = ("energy", "leverage", "greedy")
DEFAULT_SCORE = "energy"
RIDGE_DEFAULT = 1e-1  # ρ when no held-out Gram is there to choose it
RIDGE_CANDIDATES = (1e-3, 1e-2, 1e-1, 1.0)
# The share of an MLP's neurons kept where ρ is chosen: one choice serves every width of the MLP.
REFERENCE_KEEP = 0.875
# Rows of an I×I matrix handled at once where a whole copy would be GBs (an 8B model's I is 14336).
BLOCK_ROWS = 1024
# Backward elimination drops this share of the neurons still to go at each step (at least one).
_ELIMINATION_STEPS = 64


@dataclass
class MlpNarrowing:
    """One MLP's Nyström compression: its intermediate correlation `gram` C [I, I] (float64) and output weight
    `down` W_d [I, H]; the neurons kept at any width, their refit, and its error."""

    gram: np.ndarray
    down: np.ndarray
    score: str = DEFAULT_SCORE
    ridge: float = RIDGE_DEFAULT
    ridge_chosen: bool = False  # ρ chosen on held-out activations (choose_ridge), not RIDGE_DEFAULT
    _order: np.ndarray | None = field(default=None, repr=False)  # neurons, the first to drop first
    _gram_down: np.ndarray | None = field(default=None, repr=False)  # C·W_d [I, H], once computed

    def __post_init__(self):
        if self.score not in NEURON_SCORES:
            raise ValueError(f"score must be one of {NEURON_SCORES}, got {self.score!r}")
        self.down = np.asarray(self.down, np.float64)

    @property
    def width(self) -> int:
        return len(self.gram)

    @property
    def damping(self) -> float:
        """λ: ρ times the mean diagonal of C."""
        return self.ridge * float(np.trace(self.gram)) / self.width

    def kept(self, width: int) -> np.ndarray:
        """The `width` neurons kept, ascending."""
        if not 0 < width <= self.width:
            raise ValueError(f"width must be in [1, {self.width}], got {width}")
        return np.sort(self.order()[self.width - width:])

    def order(self) -> np.ndarray:
        """Every neuron, the first to drop first (the greedy order is one backward elimination to one neuron)."""
        if self._order is None:
            if self.score == "greedy":
                self._order = _elimination_order(self.gram, self.down, self.damping)
            else:
                self._order = np.argsort(self._scores(), kind="stable")
        return self._order

    def gram_down(self) -> np.ndarray:
        """C·W_d, computed once: every refit, error and energy reads it (an I²·H product: minutes at 8B)."""
        if self._gram_down is None:
            self._gram_down = self.gram @ self.down
        return self._gram_down

    def output_energy(self) -> float:
        """‖h·W_d‖² = tr(W_dᵀ C W_d): what the MLP writes into the residual stream on the calibration activations."""
        return float(np.einsum("ih,ih->", self.down, self.gram_down()))

    def refit(self, kept: np.ndarray) -> np.ndarray:
        """W_d' [k, H]: the output weight on the kept neurons' activations, ridge-pulled towards W_d[S]."""
        if len(kept) == self.width:
            return self.down.copy()  # every neuron kept: the refit is exact, and W_d itself
        try:
            return _solved_in_place(*self._normal_equations(kept))
        except np.linalg.LinAlgError:  # not positive definite (λ = 0 on a singular C)
            return np.linalg.solve(*self._normal_equations(kept))

    def _normal_equations(self, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A = C_SS + λI and B = C_S:·W_d + λ·W_d[S], each in one copy: no k×I copy of C, and B made in the
        Fortran order LAPACK solves it in, a block of rows at a time."""
        damping = self.damping
        a = self.gram[np.ix_(kept, kept)]
        a[np.diag_indices_from(a)] += damping
        b = np.empty((len(kept), self.down.shape[1]), order="F")
        gram_down = self.gram_down()
        for start in range(0, len(kept), BLOCK_ROWS):
            rows = kept[start:start + BLOCK_ROWS]
            b[start:start + BLOCK_ROWS] = gram_down[rows] + damping * self.down[rows]
        return a, b

    def relative_error(self, kept: np.ndarray, refit: np.ndarray, gram: np.ndarray | None = None,
                       gram_down: np.ndarray | None = None) -> float:
        """E(S) / ‖h·W_d‖² on the activations whose correlation is `gram` (default: the calibration's C), with
        `gram_down` its product with W_d when the caller has it; C_SS read a block of rows at a time (no k×k
        copy)."""
        c = self.gram if gram is None else gram
        w = self.down
        cw = gram_down if gram_down is not None else self.gram_down() if gram is None else c @ w
        full = np.einsum("ih,ih->", w, cw)
        cross = np.einsum("ih,ih->", cw[kept], refit)  # tr(W_dᵀ C_:S W_d'), C symmetric
        narrowed = sum(np.einsum("ih,ih->", refit[rows], c[np.ix_(kept[rows], kept)] @ refit)
                       for start in range(0, len(kept), BLOCK_ROWS) for rows in [slice(start, start + BLOCK_ROWS)])
        return float(max(full - 2 * cross + narrowed, 0.0) / full) if full > 0 else 0.0

    def relative_errors(self, widths: list[int]) -> dict[int, float]:
        """relative_error of the refit at each width, all at once: the kept sets are nested (the order keeps the
        same neurons first), so one Cholesky factor of the ordered C + λI serves every width.

        With A = C_PP + λI (P the neurons by priority), A = L·Lᵀ, B = (C·W_d + λ·W_d)_P and Y = L⁻¹B, the refit
        on the first k is X_k = (L⁻ᵀ)_kk·Y_k (a triangular matrix's leading block inverts to the inverse's), and
        E_k = tr(W_dᵀ C W_d) − ‖Y_k‖² + λ(2·tr(W_kᵀ X_k) − ‖X_k‖²); X grows block by block as k does.
        Falls back to one refit per width when C + λI is not positive definite (λ = 0 on a singular C)."""
        c, w, damping = self.gram, self.down, self.damping
        priority = self.order()[::-1]
        damped = c[np.ix_(priority, priority)]  # C_PP + λI, the one I×I copy (an MLP's Gram is GBs at 8B)
        damped[np.diag_indices_from(damped)] += damping
        try:
            lower_inverse = _inverse_cholesky_factor(damped)
        except np.linalg.LinAlgError:
            return {width: self.relative_error(kept, self.refit(kept))
                    for width in widths for kept in [self.kept(width)]}
        ordered = w[priority]
        full = self.output_energy()
        rhs = self.gram_down()[priority]  # I×H matrices are GBs at 8B too: one at a time where it can be
        rhs += damping * ordered
        y = lower_inverse @ rhs
        del rhs
        upper_inverse = lower_inverse.T  # L⁻ᵀ
        explained = np.concatenate([[0.0], np.cumsum(np.einsum("ih,ih->i", y, y))])
        fit = np.zeros_like(y)  # X_k in its first k rows
        errors, done = {}, 0
        for width in sorted(set(widths)):
            if not 0 < width <= self.width:
                raise ValueError(f"width must be in [1, {self.width}], got {width}")
            for start in range(0, width, BLOCK_ROWS):  # a block of rows at a time: no width×H temporary
                stop = min(start + BLOCK_ROWS, width)
                fit[start:stop] += upper_inverse[start:stop, done:width] @ y[done:width]
            done = width
            ridge = damping * (2 * np.einsum("ih,ih->", ordered[:width], fit[:width])
                               - np.einsum("ih,ih->", fit[:width], fit[:width]))
            error = full - explained[width] + ridge
            errors[width] = float(max(error, 0.0) / full) if full > 0 else 0.0
        return errors

    def choose_ridge(self, held_out_gram: np.ndarray, width: int) -> float:
        """ρ among RIDGE_CANDIDATES whose refit at `width` errs least on held-out activations whose correlation is
        `held_out_gram`; kept as self.ridge."""
        held_out_down = held_out_gram @ self.down  # the same for every ridge
        return self._ridge_erring_least(width, lambda kept, refit: self.relative_error(kept, refit, held_out_gram,
                                                                                        held_out_down))

    def choose_ridge_on_rows(self, held_out: np.ndarray, width: int) -> float:
        """choose_ridge on the held-out activations themselves, rows [tokens, I]: the same error, ‖h·W_d −
        h_S·W_d'‖² / ‖h·W_d‖², without an I×I Gram where there are fewer rows than neurons."""
        target = held_out @ self.down  # float64, the same for every ridge
        full = float(np.einsum("th,th->", target, target))

        def error(kept: np.ndarray, refit: np.ndarray) -> float:
            residual = target - held_out[:, kept] @ refit
            return float(np.einsum("th,th->", residual, residual) / full) if full > 0 else 0.0

        return self._ridge_erring_least(width, error)

    def _ridge_erring_least(self, width: int, error: Callable[[np.ndarray, np.ndarray], float]) -> float:
        kept = self.kept(width)
        errors = {}
        for ridge in RIDGE_CANDIDATES:
            self.ridge = ridge
            errors[ridge] = error(kept, self.refit(kept))
        self.ridge, self.ridge_chosen = min(errors, key=errors.__getitem__), True
        return self.ridge

    def _scores(self) -> np.ndarray:
        c, w = self.gram, self.down
        if self.score == "energy":
            return np.diag(c) * np.einsum("ih,ih->i", w, w)
        return np.diag(np.linalg.solve(c + self.damping * np.eye(self.width), c))  # leverage; C symmetric


def _solved_in_place(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """X for A·X = B in B's memory (Fortran order), A symmetric positive definite in C order: LAPACK's posv runs
    on Aᵀ, the same matrix in Fortran order, so neither is copied (the k×k copy is GBs at 8B). Raises
    LinAlgError when A is not positive definite, A then overwritten."""
    _, solution, info = scipy.linalg.lapack.dposv(a.T, b, lower=0, overwrite_a=1, overwrite_b=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"not positive definite (posv info {info})")
    return solution


def _inverse_cholesky_factor(matrix: np.ndarray) -> np.ndarray:
    """L⁻¹ for L·Lᵀ = `matrix` (symmetric positive definite, C order), in `matrix`'s own memory: LAPACK's
    potrf and trtri run on its transpose, the same symmetric matrix in Fortran order, as the upper factor U = Lᵀ,
    so no second I×I copy is made. Raises LinAlgError when `matrix` is not positive definite."""
    upper, info = scipy.linalg.lapack.dpotrf(matrix.T, lower=0, clean=0, overwrite_a=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"not positive definite (potrf info {info})")
    upper_inverse, info = scipy.linalg.lapack.dtrtri(upper, lower=0, overwrite_c=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"singular factor (trtri info {info})")
    lower_inverse = upper_inverse.T
    _zero_above_diagonal(lower_inverse)  # what potrf and trtri left of the input above the diagonal
    return lower_inverse


def _zero_above_diagonal(matrix: np.ndarray) -> None:
    """np.tril in place, a block of rows at a time (no second copy of the matrix)."""
    for start in range(0, len(matrix), BLOCK_ROWS):
        matrix[start:start + BLOCK_ROWS] = np.tril(matrix[start:start + BLOCK_ROWS], k=start)


def reference_width(width: int) -> int:
    """The width ρ is chosen at."""
    return max(1, round(REFERENCE_KEEP * width))


def _elimination_order(gram: np.ndarray, down: np.ndarray, damping: float) -> np.ndarray:
    """Neurons in the order backward elimination drops them, the last one left last."""
    remaining = np.arange(len(gram))
    inverse = np.linalg.inv(gram + damping * np.eye(len(gram)))
    fit = inverse @ (gram @ down)  # X = A⁻¹B, the refit on the neurons remaining
    dropped: list[int] = []
    while len(remaining) > 1:
        step = max(1, len(remaining) // _ELIMINATION_STEPS)
        cost = np.einsum("ih,ih->i", fit, fit) / np.diag(inverse)
        drop = np.argsort(cost, kind="stable")[:step]
        stay = np.setdiff1d(np.arange(len(remaining)), drop)
        # Removing rows/columns J of A: A_RR⁻¹ = (A⁻¹)_RR − (A⁻¹)_RJ ((A⁻¹)_JJ)⁻¹ (A⁻¹)_JR; X follows.
        coupling = np.linalg.solve(inverse[np.ix_(drop, drop)], inverse[np.ix_(drop, stay)]).T
        fit = fit[stay] - coupling @ fit[drop]
        inverse = inverse[np.ix_(stay, stay)] - coupling @ inverse[np.ix_(drop, stay)]
        dropped.extend(remaining[drop])
        remaining = remaining[stay]
    return np.array(dropped + list(remaining))
