import numpy as np
import pytest

from onnx_nmm.decomposition.lowrank import decompose
from onnx_nmm.ranks.rank_plan import block_aligned_rank, break_even_rank, energy_rank


@pytest.mark.parametrize(
    "hidden, intermediate, keep, rank",
    [  # the ranks NeuronMM's formula gives (docs/design.md §2)
        (2048, 8192, 0.80, 1280),
        (3072, 8192, 0.80, 1792),
        (4096, 14336, 0.80, 2560),
        (2048, 6144, 0.80, 1280),
        (2560, 9728, 0.80, 1664),
        (2048, 8192, 0.95, 1536),
    ],
)
def test_block_aligned_rank_matches_the_paper(hidden, intermediate, keep, rank):
    assert block_aligned_rank(hidden, intermediate, keep, 128) == rank
    assert block_aligned_rank(intermediate, hidden, keep, 128) == rank


def test_block_aligned_rank_is_a_multiple_of_align():
    for align in (1, 8, 32, 128):
        for keep in (0.1, 0.35, 0.5, 0.9):
            assert block_aligned_rank(576, 1536, keep, align) % align == 0


def test_keep_must_be_a_fraction():
    for keep in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError, match="keep"):
            block_aligned_rank(64, 64, keep, 8)


def test_break_even_rank():
    assert break_even_rank(2048, 8192) == pytest.approx(1638.4)
    # at the break-even rank the factors hold as many parameters as W
    k, n = 300, 600
    assert break_even_rank(k, n) * (k + n) == pytest.approx(k * n)


def test_energy_rank_counts_squared_singular_values():
    sigma = np.array([3.0, 2.0, 1.0, 0.5])  # energies 9, 4, 1, .25 of 14.25
    assert energy_rank(sigma, 9 / 14.25, 1) == 1
    assert energy_rank(sigma, 13 / 14.25, 1) == 2
    assert energy_rank(sigma, 13.5 / 14.25, 1) == 3
    assert energy_rank(sigma, 1.0, 1) == 4
    assert energy_rank(sigma, 0.5, 2) == 2  # aligned up, never beyond the matrix
    assert energy_rank(sigma, 1.0, 8) == 4


def _low_rank_plus_noise(k, n, rank, seed=0, noise=0.01):
    rng = np.random.default_rng(seed)
    signal = rng.standard_normal((k, rank)) @ rng.standard_normal((rank, n))
    return (signal + noise * rng.standard_normal((k, n))).astype(np.float32)


@pytest.mark.parametrize("shape", [(64, 200), (200, 64), (96, 96)])
def test_exact_decomposition_matches_lapack(shape):
    w = _low_rank_plus_noise(*shape, rank=10)
    decomposition = decompose(w, "exact")
    reference = np.linalg.svd(w.astype(np.float64), compute_uv=False)
    np.testing.assert_allclose(decomposition.singular_values, reference, rtol=1e-6, atol=1e-6 * reference[0])
    for rank in (1, 10, 30):
        u, v = decomposition.factors(rank, dtype=np.float64)
        optimal = np.sqrt(np.sum(reference[rank:] ** 2) / np.sum(reference**2))
        measured = np.linalg.norm(w - u @ v) / np.linalg.norm(w)
        assert measured == pytest.approx(optimal, rel=1e-5, abs=1e-7)
        assert decomposition.relative_error(rank) == pytest.approx(measured, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("shape", [(48, 130), (130, 48)])
def test_full_rank_factors_reproduce_the_matrix(shape):
    w = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    u, v = decompose(w, "exact").factors(min(shape))
    assert u.shape == (shape[0], min(shape)) and v.shape == (min(shape), shape[1])
    np.testing.assert_allclose(u @ v, w, atol=2e-5)


def test_factors_split_the_singular_values_evenly():
    w = _low_rank_plus_noise(40, 90, rank=5)
    u, v = decompose(w).factors(5, dtype=np.float64)
    np.testing.assert_allclose(np.linalg.norm(u, axis=0), np.linalg.norm(v, axis=1), rtol=1e-8)


@pytest.mark.parametrize("shape", [(300, 900), (900, 300)])
def test_randomized_decomposition_is_close_to_optimal(shape):
    # noise at the level of real weights' truncation error (5-20 %): the fp32 sketch is exact enough
    w = _low_rank_plus_noise(*shape, rank=40, seed=2, noise=1.0)
    exact = decompose(w, "exact")
    randomized = decompose(w, "randomized", rank_hint=48, oversample=16, power_iterations=2)
    for rank in (16, 40, 48):
        u, v = randomized.factors(rank, dtype=np.float64)
        measured = np.linalg.norm(w - u @ v) / np.linalg.norm(w)
        assert randomized.relative_error(rank) == pytest.approx(measured, rel=1e-4)
        assert measured <= exact.relative_error(rank) * 1.05 + 1e-6


def test_rank_deficient_and_zero_matrices_give_finite_factors():
    w = np.zeros((20, 30), np.float32)
    w[:, 0] = 1.0  # rank 1
    for matrix in (w, np.zeros((20, 30), np.float32)):
        for method in ("exact", "randomized"):
            u, v = decompose(matrix, method, rank_hint=8).factors(8)
            assert np.all(np.isfinite(u)) and np.all(np.isfinite(v))
            np.testing.assert_allclose(u @ v, matrix, atol=1e-6)


def test_non_finite_weights_are_refused():
    w = np.ones((4, 4), np.float32)
    w[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        decompose(w)


def test_rank_beyond_the_decomposition_is_refused():
    with pytest.raises(ValueError, match="rank"):
        decompose(np.ones((4, 6), np.float32)).factors(5)
