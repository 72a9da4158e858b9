"""Activation-aware SVD: lower output error than plain SVD, exact at full rank, finite when singular."""

import numpy as np
import pytest

from onnx_nmm.decomposition.lowrank import decompose
from onnx_nmm.decomposition.whitening import (
    activation_loss,
    output_whitening_factor,
    whitened_decomposition,
    whitening_factor,
)


def _correlated_inputs(tokens=4000, k=48, seed=0):
    """Features with a fast-decaying covariance spectrum, like real hidden states."""
    rng = np.random.default_rng(seed)
    mixing = rng.standard_normal((k, k)) * np.exp(-np.arange(k) / 6.0)
    return rng.standard_normal((tokens, k)) @ mixing.T


def _output_error(x, w, u, v):
    return np.linalg.norm(x @ w - x @ u @ v) / np.linalg.norm(x @ w)


@pytest.mark.parametrize("shape", [(48, 80), (48, 20)])
def test_whitening_beats_plain_svd_on_the_outputs(shape):
    x = _correlated_inputs(k=shape[0])
    w = np.random.default_rng(1).standard_normal(shape)
    gram = x.T @ x
    whitened = whitened_decomposition(w, gram)
    plain = decompose(w)
    for rank in (4, 8, 16):
        u, v = whitened.factors(rank, np.float64)
        pu, pv = plain.factors(rank, np.float64)
        assert _output_error(x, w, u, v) < 0.7 * _output_error(x, w, pu, pv)
        # the reported losses are the measured ones
        assert whitened.whitened_loss(rank) == pytest.approx(_output_error(x, w, u, v), rel=1e-6)
        assert activation_loss(gram, w, pu, pv) == pytest.approx(_output_error(x, w, pu, pv), rel=1e-6)
        assert whitened.relative_error(rank) == pytest.approx(np.linalg.norm(w - u @ v) / np.linalg.norm(w), rel=1e-6)


def test_whitened_factors_are_optimal_for_the_outputs():
    """X·U·V is the best rank-r approximation of X·W (Eckart–Young on X·W)."""
    x = _correlated_inputs(tokens=500, k=30)
    w = np.random.default_rng(2).standard_normal((30, 40))
    u, v = whitened_decomposition(w, x.T @ x).factors(6, np.float64)
    singular = np.linalg.svd(x @ w, compute_uv=False)
    optimal = np.sqrt(np.sum(singular[6:] ** 2) / np.sum(singular**2))
    assert _output_error(x, w, u, v) == pytest.approx(optimal, rel=1e-6)


def test_full_rank_whitening_is_exact():
    x = _correlated_inputs(k=24)
    w = np.random.default_rng(3).standard_normal((24, 40))
    u, v = whitened_decomposition(w, x.T @ x).factors(24, np.float64)
    np.testing.assert_allclose(u @ v, w, atol=1e-8)


def test_singular_gram_is_damped_and_gives_finite_factors():
    x = _correlated_inputs(tokens=10, k=32)  # fewer tokens than features: rank-10 Gram
    w = np.random.default_rng(4).standard_normal((32, 50))
    decomposition = whitened_decomposition(w, x.T @ x)
    assert decomposition.conditioning.startswith("damped")
    u, v = decomposition.factors(16, np.float64)
    assert np.all(np.isfinite(u)) and np.all(np.isfinite(v))
    assert _output_error(x, w, u, v) < 1e-2  # rank 16 ≥ rank(X): the outputs are kept


def test_a_gram_no_damping_fixes_falls_back_to_the_eigendecomposition():
    gram = np.zeros((8, 8))
    gram[0, 0] = -1.0  # indefinite: no damping step makes it positive definite
    factor, how = whitening_factor(gram)
    assert how == "eigendecomposition" and np.all(np.isfinite(factor))
    u, v = whitened_decomposition(np.ones((8, 5)), gram).factors(2)
    assert np.all(np.isfinite(u)) and np.all(np.isfinite(v))


def test_non_finite_gram_is_refused():
    gram = np.eye(4)
    gram[1, 1] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        whitened_decomposition(np.ones((4, 3)), gram)


def _output_gradient_gram(n, seed=5):
    """Gradients that care about a few output directions much more than about the rest."""
    rng = np.random.default_rng(seed)
    gradients = rng.standard_normal((4 * n, n)) @ (rng.standard_normal((n, n)) * np.exp(-np.arange(n) / 3.0))
    return gradients.T @ gradients


@pytest.mark.parametrize("shape", [(30, 40), (40, 30)])
def test_two_sided_factors_are_optimal_for_the_weighted_error(shape):
    """‖Sᵀ(W − UV)T‖ is the Eckart–Young optimum of SᵀWT, which input-only whitening misses."""
    k, n = shape
    x = _correlated_inputs(tokens=500, k=k)
    w = np.random.default_rng(6).standard_normal(shape)
    output_gram = _output_gradient_gram(n)
    s, t = np.linalg.cholesky(x.T @ x), output_whitening_factor(output_gram)

    def weighted(a):
        return np.linalg.norm(s.T @ a @ t)

    two_sided = whitened_decomposition(w, x.T @ x, output_gram=output_gram)
    singular = np.linalg.svd(s.T @ w @ t, compute_uv=False)
    for rank in (4, 10):
        u, v = two_sided.factors(rank, np.float64)
        assert weighted(w - u @ v) == pytest.approx(np.sqrt(np.sum(singular[rank:] ** 2)), rel=1e-6)
        assert two_sided.whitened_loss(rank) == pytest.approx(weighted(w - u @ v) / weighted(w), rel=1e-6)
        assert two_sided.truncated_energy(rank) == pytest.approx(weighted(w - u @ v) ** 2, rel=1e-6)
        assert two_sided.relative_error(rank) == pytest.approx(np.linalg.norm(w - u @ v) / np.linalg.norm(w), rel=1e-6)
        iu, iv = whitened_decomposition(w, x.T @ x).factors(rank, np.float64)
        assert weighted(w - iu @ iv) > 1.1 * weighted(w - u @ v)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_full_rank_two_sided_whitening_is_exact(shape):
    x = _correlated_inputs(k=shape[0])
    w = np.random.default_rng(7).standard_normal(shape)
    decomposition = whitened_decomposition(w, x.T @ x, output_gram=_output_gradient_gram(shape[1]))
    u, v = decomposition.factors(min(shape), np.float64)
    np.testing.assert_allclose(u @ v, w, atol=1e-8)


def test_an_isotropic_output_gram_gives_input_only_whitening():
    x = _correlated_inputs(k=32)
    w = np.random.default_rng(8).standard_normal((32, 48))
    u, v = whitened_decomposition(w, x.T @ x, output_gram=3.0 * np.eye(48)).factors(8, np.float64)
    iu, iv = whitened_decomposition(w, x.T @ x).factors(8, np.float64)
    np.testing.assert_allclose(u @ v, iu @ iv, atol=1e-10)


def test_two_sided_factors_are_balanced():
    """Each column of U and the matching row of V have the same norm, whatever the gradients' scale."""
    x = _correlated_inputs(k=32)
    w = np.random.default_rng(9).standard_normal((32, 48))
    u, v = whitened_decomposition(w, x.T @ x, output_gram=1e-8 * _output_gradient_gram(48)).factors(8, np.float64)
    np.testing.assert_allclose(np.linalg.norm(u, axis=0), np.linalg.norm(v, axis=1), rtol=1e-10)


def test_a_zero_output_gram_is_refused():
    with pytest.raises(ValueError, match="does not depend on this layer"):
        whitened_decomposition(np.ones((4, 3)), np.eye(4), output_gram=np.zeros((3, 3)))


def test_the_report_compares_with_plain_svd_at_the_same_rank(capsys, export, tmp_path):
    import json

    from onnx_nmm.cli import main

    report = tmp_path / "r.json"
    assert main([str(a) for a in ("rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", "random",
                                  "--calib-samples", "4", "--seq-len", "32", "--align", "32", "--keep", "0.5",
                                  "--report", report, "--quiet")]) == 0
    for layer in json.loads(report.read_text())["layers"]:
        if layer["status"] == "factorized":
            # plain SVD is the best possible in weight space, so the whitened factors cannot beat it there
            assert 0 < layer["plain_svd_error"] <= layer["relative_error"] + 1e-6
