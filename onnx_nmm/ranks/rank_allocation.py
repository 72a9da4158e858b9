"""Spend a model-wide parameter budget across layers.

`allocate_ranks` (`--budget global` with input-only whitening): each layer's loss at rank r is its
relative truncation loss Σ_{i>r} σ_i² / Σ σ_i² (whitened when calibration is given, so it measures the
error of the layer's outputs). Starting every layer at one aligned block, the allocator repeatedly grows
the layer whose next block of `align` singular values removes the most loss per parameter added, until
the budget is spent; a layer grown past its break-even rank goes back to dense, which costs K·N and
removes all its loss. Since σ² decreases, each layer's gain per block decreases, and taking the best gain
first is the natural greedy order.

`cheapest_moves` / `allocate_by_damage` (`--budget global` with Fisher statistics, and the quality
budgets): when every rank of every layer has a damage in one unit shared by all layers (predicted nats),
layers start dense and the moves that remove parameters are taken in order of parameters removed per unit
of damage. A layer's moves follow the lower convex hull of its (parameters removed, damage) points, so a
move may jump over ranks whose extra saving is not worth their damage — the first aligned step off dense
saves little (576×1536: rank 416 removes 1 % of the matrix), and stepping one rank at a time would pass a
layer over in favour of layers already compressed. Along a hull the saving per damage decreases, so one
order sorted by it keeps every layer's moves in sequence.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from onnx_nmm.ranks.rank_plan import Dense, RankOrWidth, RankPlan, aligned_ranks, break_even_rank, parameters

KEPT_DENSE = Dense("the global budget keeps it dense")


@dataclass
class LayerSpectrum:
    name: str
    k: int
    n: int
    singular_values: np.ndarray  # descending

    def loss_fractions(self) -> np.ndarray:
        energy = np.asarray(self.singular_values, dtype=np.float64) ** 2
        total = energy.sum()
        return energy / total if total > 0 else np.zeros_like(energy)


def allocate_ranks(layers: list[LayerSpectrum], budget: int, align: int) -> RankPlan:
    """Rank per layer name with total parameters ≤ `budget` where possible."""
    ranks: RankPlan = {}
    spent = 0
    heap: list[tuple[float, int, str]] = []
    by_name = {layer.name: layer for layer in layers}
    fractions = {layer.name: layer.loss_fractions() for layer in layers}
    for order, layer in enumerate(layers):
        first = min(align, len(layer.singular_values))
        ranks[layer.name] = first
        spent += first * (layer.k + layer.n)
        _push(heap, layer, first, fractions[layer.name], align, order)
    while heap:
        negative_gain, order, name = heapq.heappop(heap)
        layer, rank = by_name[name], ranks[name]
        assert isinstance(rank, int), "only layers still factorized are on the heap"
        step_rank, step_cost = _next_step(layer, rank, align)
        if spent + step_cost > budget:
            continue  # does not fit; a cheaper step elsewhere may
        spent += step_cost
        ranks[name] = step_rank
        if not isinstance(step_rank, Dense):
            _push(heap, layer, step_rank, fractions[name], align, order)
    return ranks


def _next_step(layer: LayerSpectrum, rank: int, align: int) -> tuple[int | Dense, int]:
    """The next rank (or dense) after `rank`, and its extra parameter cost."""
    grown = min(rank + align, len(layer.singular_values))
    if grown >= break_even_rank(layer.k, layer.n) or grown == rank:
        return KEPT_DENSE, layer.k * layer.n - rank * (layer.k + layer.n)
    return grown, (grown - rank) * (layer.k + layer.n)


def _push(heap, layer: LayerSpectrum, rank: int, fractions: np.ndarray, align: int, order: int) -> None:
    step_rank, cost = _next_step(layer, rank, align)
    removed = fractions[rank:].sum() if isinstance(step_rank, Dense) else fractions[rank:step_rank].sum()
    if cost > 0 and removed > 0:
        heapq.heappush(heap, (-removed / cost, order, layer.name))


RankOption = tuple[RankOrWidth, int, float]  # (rank or width, parameters at that choice, damage)


def rank_options(k: int, n: int, align: int, damage_of: Callable[[int], float]) -> tuple[int, list[RankOption]]:
    """A K×N layer's dense parameter count and its (rank, parameters, damage) at every aligned rank that
    saves parameters: what `cheapest_moves` and `allocate_by_damage` choose among."""
    return k * n, [(rank, parameters(k, n, rank), damage_of(rank)) for rank in aligned_ranks(k, n, align)]


def cheapest_moves(options: dict[str, tuple[int, list[RankOption]]]) -> list[tuple[str, RankOrWidth]]:
    """(layer, new rank or width) moves, most parameters removed per damage first.

    `options[name]` = (the layer's dense parameter count, its rank options); every layer starts dense, at
    zero damage.
    """
    moves = []
    for order, (name, (dense, ranks)) in enumerate(options.items()):
        hull = _lower_hull([(0, 0.0, KEPT_DENSE)] + sorted((dense - count, damage, rank)
                                                            for rank, count, damage in ranks))
        for (removed_before, damage_before, _), (removed, damage, rank) in zip(hull, hull[1:]):
            assert not isinstance(rank, Dense), "the hull is dense at its first point only"
            moves.append(((damage - damage_before) / (removed - removed_before), order, removed, name, rank))
    return [(name, rank) for *_, name, rank in sorted(moves)]


def allocate_by_damage(options: dict[str, tuple[int, list[RankOption]]], parameters_to_remove: int) -> RankPlan:
    """Rank per layer removing at least `parameters_to_remove` parameters, or as many as all moves remove,
    along `cheapest_moves`."""
    ranks: RankPlan = dict.fromkeys(options, KEPT_DENSE)
    removed = 0
    for name, rank in cheapest_moves(options):
        if removed >= parameters_to_remove:
            break
        dense, choices = options[name]
        before = dense if isinstance(ranks[name], Dense) else next(p for r, p, _ in choices if r == ranks[name])
        removed += before - next(p for r, p, _ in choices if r == rank)
        ranks[name] = rank
    return ranks


HullPoint = tuple[int, float, RankOrWidth | Dense]  # (parameters removed, damage, the choice)


def _lower_hull(points: Sequence[HullPoint]) -> list[HullPoint]:
    """The lower convex hull of (x, y, label) points sorted by x, from the first point on."""
    hull: list[HullPoint] = []
    for point in points:
        while len(hull) >= 2 and _turns_clockwise_or_straight(hull[-2], hull[-1], point):
            hull.pop()
        if hull and point[0] == hull[-1][0]:
            continue  # the same saving again: the cheaper one is already in
        hull.append(point)
    return hull


def _turns_clockwise_or_straight(a, b, c) -> bool:
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0]) <= 0
