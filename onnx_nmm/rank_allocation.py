"""`--budget global`: spend a model-wide parameter budget where it removes the most truncation loss.

Each layer's loss at rank r is its relative truncation loss Σ_{i>r} σ_i² / Σ σ_i² (whitened when
calibration is given, so it measures the error of the layer's outputs). Starting every layer at one
aligned block, the allocator repeatedly grows the layer whose next block of `align` singular values
removes the most loss per parameter added, until the budget is spent; a layer grown past its
break-even rank goes back to dense, which costs K·N and removes all its loss. Since σ² decreases,
each layer's gain per block decreases, and taking the best gain first is the natural greedy order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from onnx_nmm import lowrank

DENSE = None


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


def allocate_ranks(layers: list[LayerSpectrum], budget: int, align: int) -> dict[str, int | None]:
    """Rank per layer name (None: stay dense) with total parameters ≤ `budget` where possible."""
    ranks: dict[str, int | None] = {}
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
        step_rank, step_cost = _next_step(layer, rank, align)
        if spent + step_cost > budget:
            continue  # does not fit; a cheaper step elsewhere may
        spent += step_cost
        ranks[name] = step_rank
        if step_rank is not DENSE:
            _push(heap, layer, step_rank, fractions[name], align, order)
    return ranks


def parameters(layer: LayerSpectrum, rank: int | None) -> int:
    return layer.k * layer.n if rank is DENSE else rank * (layer.k + layer.n)


def _next_step(layer: LayerSpectrum, rank: int, align: int) -> tuple[int | None, int]:
    """The next rank (or dense) after `rank`, and its extra parameter cost."""
    grown = min(rank + align, len(layer.singular_values))
    if grown >= lowrank.break_even_rank(layer.k, layer.n) or grown == rank:
        return DENSE, layer.k * layer.n - rank * (layer.k + layer.n)
    return grown, (grown - rank) * (layer.k + layer.n)


def _push(heap, layer: LayerSpectrum, rank: int, fractions: np.ndarray, align: int, order: int) -> None:
    step_rank, cost = _next_step(layer, rank, align)
    removed = fractions[rank:].sum() if step_rank is DENSE else fractions[rank:step_rank].sum()
    if cost > 0 and removed > 0:
        heapq.heappush(heap, (-removed / cost, order, layer.name))
