"""The layer-wise budget's search: the longest greedy prefix measured within the budget, in few sweeps."""

import numpy as np

from onnx_nmm.layerwise.budget_search import longest_prefix_within


def _search(predicted, measured_over_predicted, budget, sweeps=6):
    calls = []

    def measure(prefix):
        calls.append(prefix)
        return predicted[prefix] * measured_over_predicted

    low, measured = longest_prefix_within(predicted, budget, measure, sweeps)
    return low, measured, calls


def test_a_prediction_that_is_right_ends_the_search_in_the_band_below_the_budget():
    predicted = np.arange(21) * 0.001  # 20 moves, 1 mnat each
    low, measured, calls = _search(predicted, 1.0, budget=0.0125)
    assert (low, calls) == (12, [11, 12])  # aimed at 95 % of the budget (11.9 mnat), then one move on


def test_damages_that_add_up_to_more_than_predicted_are_found_from_above_in_a_few_sweeps():
    predicted = np.arange(101) * 0.001
    low, measured, calls = _search(predicted, 1.5, budget=0.03)  # the last prefix within: 20 (30 mnat)
    assert calls[0] == 28  # where the prediction alone puts 95 % of the budget; measured 42 mnat, over
    assert 0.9 * 0.03 <= measured[low] <= 0.03 and low in (19, 20) and len(calls) == 2


def test_what_it_returns_was_measured_within_the_budget_even_when_it_runs_out_of_sweeps():
    predicted = np.concatenate([[0.0], np.full(50, 0.001)]).cumsum()
    rng = np.random.default_rng(0)
    noisy = predicted * (1 + rng.uniform(0, 3, len(predicted)))  # not even monotone

    low, measured = longest_prefix_within(predicted, 0.02, lambda prefix: float(noisy[prefix]), sweeps=2)
    assert measured[low] <= 0.02 and len(measured) <= 3


def test_a_budget_that_the_first_move_breaks_keeps_everything_dense():
    predicted = np.array([0.0, 0.01, 0.02])
    low, measured, calls = _search(predicted, 10.0, budget=0.005)
    assert low == 0 and measured[0] == 0.0 and calls == [1]  # one sweep shows the first move is over


def test_two_misses_on_one_side_bisect_the_bracket():
    predicted = np.arange(101) * 0.001
    measure = lambda prefix: 0.001 * prefix if prefix <= 10 else 0.5  # noqa: E731  a cliff after 10 moves

    calls = []
    low, measured = longest_prefix_within(predicted, 0.05, lambda p: calls.append(p) or measure(p), sweeps=8)
    assert low == 10 and calls[:2] == [47, 4]  # over; then the interpolation to it aims far too low
    assert all(measured[prefix] <= 0.05 for prefix in measured if prefix <= low)
