"""Spending a parameter budget across layers by predicted damage (rank_allocation.cheapest_moves)."""

import pytest

from onnx_nmm.ranks.rank_allocation import KEPT_DENSE as DENSE
from onnx_nmm.ranks.rank_allocation import allocate_by_damage, cheapest_moves


def _layer(dense, damages):
    """(dense parameters, options) with rank r costing r·10 parameters and the given damage."""
    return dense, [(rank, rank * 10, damage) for rank, damage in damages.items()]


def test_moves_follow_each_layers_lower_convex_hull_in_order_of_saving_per_damage():
    options = {
        # rank 3 lies above the hull: 4 → 2 removes more parameters per damage than 4 → 3 does
        "a": _layer(100, {4: 0.1, 3: 0.5, 2: 0.6, 1: 3.0}),
        "b": _layer(100, {4: 0.05, 2: 2.0}),
    }
    moves = cheapest_moves(options)
    assert moves == [("b", 4), ("a", 4), ("a", 2), ("b", 2), ("a", 1)]
    slopes = {("b", 4): 0.05 / 60, ("a", 4): 0.1 / 60, ("a", 2): 0.5 / 20, ("b", 2): 1.95 / 20, ("a", 1): 2.4 / 10}
    assert [slopes[move] for move in moves] == sorted(slopes.values())


def test_a_rank_that_costs_more_than_a_lower_one_is_never_chosen():
    options = {"a": _layer(100, {4: 0.9, 2: 0.3})}  # noisy measurements: the lower rank is cheaper
    assert cheapest_moves(options) == [("a", 2)]


def test_allocation_removes_at_least_the_target_where_it_costs_least():
    options = {"a": _layer(100, {4: 0.1, 2: 0.6, 1: 3.0}), "b": _layer(100, {4: 0.05, 2: 2.0})}
    assert allocate_by_damage(options, 0) == {"a": DENSE, "b": DENSE}
    assert allocate_by_damage(options, 60) == {"a": DENSE, "b": 4}
    assert allocate_by_damage(options, 61) == {"a": 4, "b": 4}  # one move more, the next cheapest
    assert allocate_by_damage(options, 10**6) == {"a": 1, "b": 2}  # everything, when the target is out of reach


@pytest.mark.parametrize("target", [50, 120, 150])
def test_allocation_matches_exhaustive_search_on_convex_layers(target):
    from itertools import product

    options = {"a": _layer(100, {8: 0.01, 6: 0.05, 4: 0.2, 2: 1.0}),
               "b": _layer(100, {8: 0.02, 6: 0.04, 4: 0.1, 2: 0.5}),
               "c": _layer(100, {8: 0.3, 6: 0.7, 4: 1.2, 2: 2.0})}
    chosen = allocate_by_damage(options, target)

    def cost(ranks):
        removed = damage = 0
        for name, rank in ranks.items():
            if rank is not DENSE:
                parameters, hurt = next((p, d) for r, p, d in options[name][1] if r == rank)
                removed, damage = removed + 100 - parameters, damage + hurt
        return removed, damage

    removed, damage = cost(chosen)
    feasible = [cost(dict(zip(options, ranks))) for ranks in product(*[[DENSE, 8, 6, 4, 2]] * 3)]
    best = min(d for r, d in feasible if r >= removed)
    assert removed >= target and damage == pytest.approx(best)  # optimal for what it removes
