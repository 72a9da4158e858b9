"""Choose where and how much to compress within a quality budget (`rewrite --max-ppl-increase / --max-kl`).

1. Lower an exact full-rank whitened rewrite of the targets to PyTorch: it computes what the dense model
   does, and any one layer can be switched to a rank-r truncation by swapping its factor parameters.
2. Sensitivity, precisely: the damage (increase of the mean next-token log-loss, or KL to the dense
   model's next-token distributions) on calibration windows with only that layer truncated, at two
   reference ranks: the middle and the lowest of its aligned ranks that save parameters. Cheaply,
   between them: the damage is piecewise linear in the layer's whitened truncation loss
   L(r)² = Σ_{i>r} σ_i² / Σ σ_i², through (0, 0) and the two measurements. The second one matters: the
   damage grows much faster than L(r)² at low ranks, and one reference scaled linearly made the greedy
   order send a few layers all the way to the lowest rank (SmolLM2, keep 0.9: 10 matrices at rank 32,
   perplexity 2.5× that of dense on held-out text, worse than truncating all 90 matrices uniformly;
   with both references 1.6×, docs/quality.md).
   With Fisher statistics (`--method fisher`) nothing is measured here: the damage of every rank is the
   KL divergence the layer's weighted spectrum predicts (onnx_nmm.fisher), in nats for every layer alike.
3. A greedy order of moves by parameters saved per unit of predicted damage, each layer going from dense
   down the lower convex hull of its (saving, damage) points (onnx_nmm.rank_allocation).
4. Within a quality budget: the longest prefix of that order whose real damage, measured with all its
   moves applied at once, stays within the budget (a binary search; the damages of layers roughly add up,
   which is what made the order, but the measurement decides). For a parameter target (`--keep F
   --budget sensitivity`): the shortest prefix that removes enough parameters, its damage measured once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from onnx_nmm import fisher, lowrank, rank_allocation
from onnx_nmm.errors import UserError

DENSE = None


@dataclass
class Candidate:
    """A target layer: its shape, whitened spectrum and factors at any rank, and its measured damage."""

    name: str
    factor_names: tuple[str, str]  # U and V initializer names in the full-rank rewrite
    k: int
    n: int
    decomposition: object  # whitening.WhitenedDecomposition
    references: list[tuple[int, float]] = field(default_factory=list)  # (rank, measured damage)
    fisher_tokens: int | None = None  # Fisher-weighted decomposition over this many tokens: damage is predicted

    def ranks(self, align: int) -> list[int]:
        """Aligned ranks that save parameters, largest first."""
        return lowrank.aligned_ranks(self.k, self.n, align)

    def reference_ranks(self, align: int) -> list[int]:
        """Where the damage is measured: the middle and the lowest of `ranks(align)`."""
        ranks = self.ranks(align)
        return sorted({ranks[(len(ranks) - 1) // 2], ranks[-1]}, reverse=True)

    def truncation_loss(self, rank: int) -> float:
        return self.decomposition.whitened_loss(rank) ** 2

    def predicted_damage(self, rank: int | None) -> float:
        """Piecewise linear in the truncation loss through (0, 0) and the references (kept non-decreasing,
        as measurements are noisy); past the last reference its slope goes on. With Fisher statistics: the
        predicted KL."""
        if rank is DENSE:
            return 0.0
        if self.fisher_tokens is not None:
            return fisher.predicted_kl(self.decomposition.truncated_energy(rank), self.fisher_tokens)
        if not self.references:
            return 0.0
        points = sorted((self.truncation_loss(r), damage) for r, damage in self.references)
        losses = np.array([0.0] + [loss for loss, _ in points])
        damages = np.maximum.accumulate([0.0] + [max(damage, 0.0) for _, damage in points])
        loss = self.truncation_loss(rank)
        if loss <= losses[-1]:
            return float(np.interp(loss, losses, damages))
        run = losses[-1] - losses[-2]
        slope = (damages[-1] - damages[-2]) / run if run > 0 else 0.0
        return float(damages[-1] + slope * (loss - losses[-1]))

    def parameters(self, rank: int | None) -> int:
        return self.k * self.n if rank is DENSE else rank * (self.k + self.n)


@dataclass
class Selection:
    ranks: dict[str, int | None]  # chosen rank per candidate (None: stays dense)
    damage: float  # measured with all of them applied
    budget: float | None  # the damage allowed; None when the goal was a parameter count
    metric: str
    moves_applied: int
    moves_considered: int
    evaluations: list[tuple[int, float]] = field(default_factory=list)  # (prefix length, damage) measured
    # per candidate: (rank, damage) measured at its references, or predicted at every rank
    sensitivity: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def greedy_moves(candidates: list[Candidate], align: int) -> list[tuple[str, int]]:
    """(candidate, new rank) moves, most parameters saved per predicted damage first, each candidate's
    along the lower convex hull of its (saving, damage) points (rank_allocation.cheapest_moves)."""
    return rank_allocation.cheapest_moves({c.name: rank_allocation.rank_options(c.k, c.n, align, c.predicted_damage)
                                           for c in candidates})


def ranks_after(moves: list[tuple[str, int]], candidates: list[Candidate]) -> dict[str, int | None]:
    ranks: dict[str, int | None] = {c.name: DENSE for c in candidates}
    for name, rank in moves:
        ranks[name] = rank
    return ranks


def select_within_budget(candidates: list[Candidate], align: int, budget: float, metric: str,
                         damage_of: Callable[[dict[str, int | None]], float]) -> Selection:
    """The longest greedy prefix whose measured damage (`damage_of(ranks)`) is at most `budget`."""
    moves = greedy_moves(candidates, align)
    measured: dict[int, float] = {0: 0.0}

    def damage(prefix: int) -> float:
        if prefix not in measured:
            measured[prefix] = damage_of(ranks_after(moves[:prefix], candidates))
        return measured[prefix]

    low, high = 0, len(moves)  # damage(low) ≤ budget; find the largest such prefix
    if damage(high) <= budget:
        low = high
    while high - low > 1:
        middle = (low + high) // 2
        if damage(middle) <= budget:
            low = middle
        else:
            high = middle
    return Selection(ranks_after(moves[:low], candidates), damage(low), budget, metric, low, len(moves),
                     sorted(measured.items()))


def select_for_parameters(candidates: list[Candidate], align: int, parameters_to_remove: int, metric: str,
                          damage_of: Callable[[dict[str, int | None]], float]) -> Selection:
    """The shortest greedy prefix removing at least `parameters_to_remove` parameters, its damage measured.

    Raises UserError when even every move together removes fewer.
    """
    moves = greedy_moves(candidates, align)
    by_name = {c.name: c for c in candidates}
    ranks: dict[str, int | None] = {c.name: DENSE for c in candidates}
    removed = 0
    for applied, (name, rank) in enumerate(moves, start=1):
        removed += by_name[name].parameters(ranks[name]) - by_name[name].parameters(rank)
        ranks[name] = rank
        if removed >= parameters_to_remove:
            damage = damage_of(ranks)
            return Selection(ranks, damage, None, metric, applied, len(moves), [(applied, damage)])
    raise UserError(f"removing {parameters_to_remove:,} parameters is more than every target at its lowest aligned "
                    f"rank removes ({removed:,}): raise --keep or lower --align")


def mean_log_loss_and_kl(logits: np.ndarray, tokens: np.ndarray, reference_log_probs: np.ndarray) -> tuple[float, float]:
    """Mean next-token negative log-likelihood of `tokens`, and mean KL(reference ‖ model), over [B, S] windows."""
    from onnx_nmm.metrics import log_softmax

    log_probs = log_softmax(logits[:, :-1].astype(np.float64))
    targets = tokens[:, 1:]
    nll = -np.take_along_axis(log_probs, targets[..., None], axis=-1).mean()
    kl = np.sum(np.exp(reference_log_probs) * (reference_log_probs - log_probs), axis=-1).mean()
    return float(nll), float(kl)


METRICS = ("ppl", "kl")


def choose_ranks(model_path, selection, statistics, tokens: np.ndarray, align: int, metric: str,
                 budget: float | None = None, keep: float | None = None, use_fisher: bool = False,
                 on_step: Callable[[str], None] | None = None) -> Selection:
    """Ranks for the selected layers of the model at `model_path`, by their damage on `tokens` [B, S]: the
    increase of mean log-loss ("ppl", budget = log(1 + allowed relative increase)) or the mean KL to the
    dense model ("kl", nats). Either within `budget` of damage, or keeping the fraction `keep` of the
    selected layers' parameters at the least damage. Needs whitening statistics of every target; with
    `use_fisher`, their output-gradient statistics too, which predict every damage instead of measuring it
    (`on_step` then hears of nothing)."""
    import onnx_ir as ir
    import torch

    from onnx_nmm import whitening
    from onnx_nmm.lowering import call_lowered, factor_parameters, lower
    from onnx_nmm.model_io import load_model
    from onnx_nmm.passes import FactorizedLayer, SvdFactorizationPass, find_linear_layers, select_layers

    model = load_model(model_path)
    layers, _ = select_layers(find_linear_layers(model), selection)
    candidates, full_rank = [], []
    for layer in layers:
        output_gram = statistics.output_gram(layer.name) if use_fisher else None
        decomposition = whitening.whitened_decomposition(layer.weight_matrix(), statistics.gram(layer.x.name),
                                                         output_gram=output_gram)
        u, v = decomposition.factors(decomposition.max_rank, dtype=np.float64)
        method = "fisher" if use_fisher else "whiten"
        full_rank.append(FactorizedLayer(layer=layer, u=u, v=v, align=align, method=f"{method}/exact"))
        base = layer.weight.name.removesuffix(".weight") if layer.weight.is_initializer else layer.name
        candidate = Candidate(layer.name, (f"{base}.svd_u", f"{base}.svd_v"), layer.k, layer.n, decomposition,
                              fisher_tokens=statistics.tokens if use_fisher else None)
        if candidate.ranks(align):
            candidates.append(candidate)
    SvdFactorizationPass(full_rank)(model)
    ir.external_data.load_to_model(model)  # the lowering reads weights from the proto, not from beside the input
    module = lower(ir.to_proto(model))
    parameters = factor_parameters(module)
    missing = [c.name for c in candidates if any(name not in parameters for name in c.factor_names)]
    if missing:
        raise RuntimeError(f"factor parameters not found for {missing[:3]}")
    originals = {name: parameter.data for name, parameter in parameters.items()}
    batch = torch.from_numpy(tokens.astype(np.int64))
    mask = torch.ones_like(batch)

    def logits() -> np.ndarray:
        return call_lowered(module, batch, mask).numpy()

    from onnx_nmm.metrics import log_softmax

    reference = log_softmax(logits()[:, :-1].astype(np.float64))
    base_nll, _ = mean_log_loss_and_kl(logits(), tokens, reference)
    by_name = {c.name: c for c in candidates}

    def damage_of(ranks: dict[str, int | None]) -> float:
        for name, rank in ranks.items():
            if rank is not DENSE:
                u, v = by_name[name].decomposition.factors(rank, dtype=np.float32)
                parameters[by_name[name].factor_names[0]].data = torch.from_numpy(u)
                parameters[by_name[name].factor_names[1]].data = torch.from_numpy(v)
        nll, kl = mean_log_loss_and_kl(logits(), tokens, reference)
        for name in ranks:
            for factor in by_name[name].factor_names:
                parameters[factor].data = originals[factor]
        return nll - base_nll if metric == "ppl" else kl

    if not use_fisher:  # Fisher statistics predict every damage; otherwise measure two references per candidate
        for candidate in candidates:
            candidate.references = [(rank, damage_of({candidate.name: rank}))
                                    for rank in candidate.reference_ranks(align)]
            if on_step is not None:
                on_step(candidate.name)
    if keep is not None:
        target = math.ceil((1 - keep) * sum(layer.parameters for layer in layers))
        chosen = select_for_parameters(candidates, align, target, metric, damage_of)
    else:
        chosen = select_within_budget(candidates, align, budget, metric, damage_of)
    chosen.sensitivity = {c.name: c.references or [(rank, c.predicted_damage(rank)) for rank in c.ranks(align)]
                          for c in candidates}
    return chosen
