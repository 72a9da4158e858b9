"""Sequential calibration on a two-layer linear network, where the right answer can be computed."""

import graphs
import numpy as np
import onnx
import pytest
from onnx import helper

from onnx_nmm import CalibrationOptions, FactorizationOptions, RankOptions, RewriteOptions
from onnx_nmm.calibration.activation_stats import collect_gram_matrices
from onnx_nmm.calibration.calibration_data import observed_inputs
from onnx_nmm.decomposition.sequential import RIDGE, GroupObserver
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes import find_linear_layers
from onnx_nmm.pipeline import FactorizeLayers, Factorizer, MlpNarrowings, Planner, Statistics, find_targets
from onnx_nmm.progress import Progress

K, HIDDEN, N, RANK = 24, 32, 20, 6


def _two_layer_network(path):
    """Y = (X · W1) · W2, named like an MLP's up and down projections."""
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["H"], name="/model/layers.0/mlp/up_proj/MatMul"),
             helper.make_node("MatMul", ["H", "W2"], ["Y"], name="/model/layers.0/mlp/down_proj/MatMul")]
    onnx.save(graphs.model(nodes, {"W1": graphs.weight(K, HIDDEN, 1), "W2": graphs.weight(HIDDEN, N, 2)}, k=K), path)


def _batches():
    rng = np.random.default_rng(0)
    mixing = rng.standard_normal((K, K)) * np.exp(-np.arange(K) / 5.0)  # correlated features
    return [(rng.standard_normal((4, 100, K)) @ mixing.T).astype(np.float32) for _ in range(5)]


def _float_feeds(x):
    return {"X": x}


def _factors(model, name):
    return (model.graph.initializers[f"{name}.svd_u"].const_value.numpy().astype(np.float64),
            model.graph.initializers[f"{name}.svd_v"].const_value.numpy().astype(np.float64))


def _rewrite(path, sequential: bool):
    """The plan and factorization steps on their own, calibrated on float batches (not token ids): the
    sequential observer, or Grams gathered beforehand."""
    source = ModelSource(path)
    calibration = CalibrationOptions(source="random", mode="sequential" if sequential else "independent")
    options = RewriteOptions(ranks=RankOptions(rank=RANK), calibration=calibration,
                             factorization=FactorizationOptions(method="whiten"))
    observer, statistics = None, Statistics()
    if sequential:
        observer = GroupObserver(source, _batches(), make_feeds=_float_feeds)
    else:
        statistics = Statistics(collect_gram_matrices(source, observed_inputs(find_linear_layers(source.model)),
                                                      _batches(), make_feeds=_float_feeds))
    factorizer = Factorizer(options.factorization, statistics.grams, options.ranks.align)
    targets = find_targets(source.model, options)
    plan = Planner(options, targets, factorizer, MlpNarrowings(statistics, options.factorization), None, statistics,
                   source, Progress()).choose(source.model).plan
    FactorizeLayers(options, plan, factorizer, Progress(), observer=observer)(source.model)
    return source.model


@pytest.fixture
def network(tmp_path):
    path = tmp_path / "two_layers.onnx"
    _two_layer_network(path)
    x = np.concatenate([batch.reshape(-1, K) for batch in _batches()]).astype(np.float64)
    return path, x, graphs.weight(K, HIDDEN, 1).astype(np.float64), graphs.weight(HIDDEN, N, 2).astype(np.float64)


def test_the_second_layer_gets_the_closed_form_optimum(network):
    path, x, w1, w2 = network
    model = _rewrite(path, sequential=True)
    u1, v1 = _factors(model, "W1")
    u2, v2 = _factors(model, "W2")
    # Given the compressed first layer, the best rank-r map from its output X_c to the dense X·W1·W2,
    # regularized towards W2: an augmented least-squares fit, then the rank-r truncation of its fitted values.
    compressed, dense = x @ u1 @ v1, x @ w1
    ridge = RIDGE * np.mean(np.sum(compressed**2, axis=0))
    stacked = np.vstack([compressed, np.sqrt(ridge) * np.eye(HIDDEN)])
    full = np.linalg.lstsq(stacked, np.vstack([dense @ w2, np.sqrt(ridge) * w2]), rcond=None)[0]
    _, _, right = np.linalg.svd(compressed @ full, full_matrices=False)
    optimum = full @ right[:RANK].T @ right[:RANK]
    # the factors are stored in W's dtype (float32): agreement to fp32 rounding of the factors
    np.testing.assert_allclose(u2 @ v2, optimum, rtol=0, atol=1e-4 * np.abs(optimum).max())


def test_sequential_beats_independent_end_to_end(network):
    path, x, w1, w2 = network
    errors = {}
    for sequential in (False, True):
        model = _rewrite(path, sequential)
        u1, v1 = _factors(model, "W1")
        u2, v2 = _factors(model, "W2")
        errors[sequential] = np.linalg.norm(x @ w1 @ w2 - x @ u1 @ v1 @ u2 @ v2) / np.linalg.norm(x @ w1 @ w2)
    # the second layer is the exact optimum given the first (up to the ridge), so strictly better
    assert errors[True] < errors[False]


def test_the_first_layer_is_plain_whitening(network):
    """Nothing precedes it, so its compressed and dense inputs agree and sequential = independent."""
    path, *_ = network
    sequential, independent = _rewrite(path, True), _rewrite(path, False)
    (su, sv), (iu, iv) = _factors(sequential, "W1"), _factors(independent, "W1")
    np.testing.assert_allclose(su @ sv, iu @ iv, atol=1e-5)
