"""Choose where and how much to compress within a quality budget (`max_ppl_increase`, `max_kl`, or `keep`
with the sensitivity budget).

1. A damage probe (pipeline.plan builds it): the model with every candidate factorized at full rank,
   lowered to PyTorch. It computes what the dense model does, and any layer can be switched to a rank-r
   truncation by swapping its factor parameters, whose names the factorization pass reported.
2. Sensitivity, precisely: the damage (increase of the mean next-token log-loss, or KL to the dense
   model's next-token distributions) on calibration windows with only that layer truncated, at two
   reference ranks: the middle and the lowest of its aligned ranks that save parameters. Cheaply,
   between them: the damage is piecewise linear in the layer's whitened truncation loss
   L(r)² = Σ_{i>r} σ_i² / Σ σ_i², through (0, 0) and the two measurements. The second one matters: the
   damage grows much faster than L(r)² at low ranks, and one reference scaled linearly made the greedy
   order send a few layers all the way to the lowest rank (SmolLM2, keep 0.9: 10 matrices at rank 32,
   perplexity 2.5× that of dense on held-out text, worse than truncating all 90 matrices uniformly;
   with both references 1.6×, docs/quality.md).
   With Fisher statistics nothing is measured here: the damage of every rank is the KL divergence the
   layer's weighted spectrum predicts (onnx_nmm.decomposition.fisher), in nats for every layer alike.
3. A greedy order of moves by parameters saved per unit of predicted damage, each layer going from dense
   down the lower convex hull of its (saving, damage) points (onnx_nmm.ranks.rank_allocation).
4. Within a quality budget: the longest prefix of that order whose real damage, measured with all its
   moves applied at once, stays within the budget (a binary search; the damages of layers roughly add up,
   which is what made the order, but the measurement decides). For a parameter target (keep with the
   sensitivity budget): the shortest prefix that removes enough parameters, its damage measured once.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnx_nmm.decomposition import fisher, lowrank
from onnx_nmm.decomposition.nystrom import MlpNarrowing
from onnx_nmm.errors import OptionError
from onnx_nmm.quality.metrics import log_softmax
from onnx_nmm.ranks import rank_allocation
from onnx_nmm.ranks.rank_plan import (
    Dense,
    Narrowed,
    RankOrWidth,
    RankPlan,
    aligned_ranks,
    aligned_widths,
    parameters,
)

METRICS = ("ppl", "kl")


@dataclass
class Candidate:
    """A target layer: its shape, whitened spectrum and factors at any rank, and its measured damage."""

    name: str
    k: int
    n: int
    # plain or whitened: its spectrum, and factors at any rank; None for a narrowed MLP, which has none
    decomposition: lowrank.RankedFactors | None
    references: list[tuple[RankOrWidth, float]] = field(default_factory=list)  # (rank, measured damage)
    fisher_tokens: int | None = None  # Fisher-weighted decomposition over this many tokens: damage is predicted

    def ranks(self, align: int) -> Sequence[RankOrWidth]:
        """Aligned ranks that save parameters, largest first."""
        return aligned_ranks(self.k, self.n, align)

    def reference_ranks(self, align: int) -> list[RankOrWidth]:
        """Where the damage is measured: the middle and the lowest of `ranks(align)`."""
        ranks = self.ranks(align)
        return sorted({ranks[(len(ranks) - 1) // 2], ranks[-1]}, reverse=True)

    def truncation_loss(self, rank: RankOrWidth) -> float:
        """L(r)² = Σ_{i>r} σ_i² / Σ σ_i² of the (whitened) spectrum."""
        assert isinstance(rank, int) and self.decomposition is not None, "a factorized layer's choices are ranks"
        total = self.decomposition.total_energy
        return self.decomposition.truncated_energy(rank) / total if total > 0 else 0.0

    def predicted_damage(self, rank: RankOrWidth | Dense) -> float:
        """Piecewise linear in the truncation loss through (0, 0) and the references (kept non-decreasing,
        as measurements are noisy); past the last reference its slope goes on. With Fisher statistics: the
        predicted KL."""
        if isinstance(rank, Dense):
            return 0.0
        if self.fisher_tokens is not None:
            assert isinstance(rank, int) and self.decomposition is not None, "Fisher statistics weigh factorized layers"
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

    def parameters(self, rank: RankOrWidth | Dense) -> int:
        return parameters(self.k, self.n, rank)


@dataclass
class NarrowingCandidate(Candidate):
    """A targeted MLP, narrowed as a module: its choices are kept widths (Narrowed), its truncation loss the
    refit's relative error E(S)/‖h·W_d‖² on the calibration activations (onnx_nmm.decomposition.nystrom). `k` is
    its width I and `n` the parameters one neuron costs, so k·n is its dense size. `losses` (width → error) are
    computed from `narrowing` when asked for, or given (the layer-wise rewrite keeps them, not the narrowing)."""

    narrowing: MlpNarrowing | None = field(default=None, kw_only=True)
    losses: dict[int, float] = field(default_factory=dict, repr=False, kw_only=True)

    def ranks(self, align: int) -> list[Narrowed]:
        return [Narrowed(width, self.k) for width in aligned_widths(self.k, align)]

    def truncation_loss(self, rank: RankOrWidth) -> float:
        assert isinstance(rank, Narrowed), "a narrowed MLP's choices are widths"
        if rank.width not in self.losses:  # with every width on the same grid: they cost about one
            assert self.narrowing is not None, "a candidate without its narrowing is given every loss"
            self.losses |= self.narrowing.relative_errors(loss_widths(self.k, rank.width))
        return self.losses[rank.width]

    def parameters(self, rank: RankOrWidth | Dense) -> int:
        if isinstance(rank, Dense):
            return self.k * self.n
        assert isinstance(rank, Narrowed), "a narrowed MLP's choices are widths"
        return rank.width * self.n


@dataclass
class BudgetChoice:
    """The ranks a quality budget chose, and how: what the report's `quality_budget` holds."""

    plan: RankPlan
    damage: float  # measured with all of the plan applied
    budget: float | None  # the damage allowed; None when the goal was a parameter count
    metric: str
    moves_applied: int
    moves_considered: int
    evaluations: list[tuple[int, float]] = field(default_factory=list)  # (prefix length, damage) measured
    # per candidate: (rank, damage) measured at its references, or predicted at every rank
    sensitivity: dict[str, list[tuple[RankOrWidth, float]]] = field(default_factory=dict)

    def to_dict(self, keep: float | None) -> dict:
        """As JSON holds it: a narrowed MLP's choices by their widths."""
        sensitivity = {name: [(rank.width if isinstance(rank, Narrowed) else rank, damage) for rank, damage in points]
                       for name, points in self.sensitivity.items()}
        return {"metric": self.metric, "budget": self.budget, "keep": keep, "measured": self.damage,
                "moves_applied": self.moves_applied, "moves_considered": self.moves_considered,
                "evaluations": self.evaluations, "sensitivity": sensitivity}


DamageOf = Callable[[RankPlan], float]


def greedy_moves(candidates: list[Candidate], align: int) -> list[tuple[str, RankOrWidth]]:
    """(candidate, new rank) moves, most parameters saved per predicted damage first, each candidate's
    along the lower convex hull of its (saving, damage) points (rank_allocation.cheapest_moves)."""
    return rank_allocation.cheapest_moves({c.name: (c.parameters(Dense("")), [
        (rank, c.parameters(rank), c.predicted_damage(rank)) for rank in c.ranks(align)]) for c in candidates})


def plan_after(moves: list[tuple[str, RankOrWidth]], candidates: list[Candidate], kept_dense: Dense) -> RankPlan:
    plan: RankPlan = {c.name: kept_dense for c in candidates}
    for name, rank in moves:
        plan[name] = rank
    return plan


def select_within_budget(candidates: list[Candidate], align: int, budget: float, metric: str, damage_of: DamageOf,
                         kept_dense: Dense) -> BudgetChoice:
    """The longest greedy prefix whose measured damage (`damage_of(plan)`) is at most `budget`."""
    moves = greedy_moves(candidates, align)
    measured: dict[int, float] = {0: 0.0}

    def damage(prefix: int) -> float:
        if prefix not in measured:
            measured[prefix] = damage_of(plan_after(moves[:prefix], candidates, kept_dense))
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
    return BudgetChoice(plan_after(moves[:low], candidates, kept_dense), damage(low), budget, metric, low, len(moves),
                        sorted(measured.items()))


def select_for_parameters(candidates: list[Candidate], align: int, parameters_to_remove: int, metric: str,
                          damage_of: DamageOf, kept_dense: Dense) -> BudgetChoice:
    """The shortest greedy prefix removing at least `parameters_to_remove` parameters, its damage measured.

    Raises OptionError when even every move together removes fewer.
    """
    moves = greedy_moves(candidates, align)
    by_name = {c.name: c for c in candidates}
    plan: RankPlan = {c.name: kept_dense for c in candidates}
    removed = 0
    for applied, (name, rank) in enumerate(moves, start=1):
        removed += by_name[name].parameters(plan[name]) - by_name[name].parameters(rank)
        plan[name] = rank
        if removed >= parameters_to_remove:
            damage = damage_of(plan)
            return BudgetChoice(plan, damage, None, metric, applied, len(moves), [(applied, damage)])
    raise OptionError(f"removing {parameters_to_remove:,} parameters is more than every target at its lowest aligned "
                      f"rank removes ({removed:,}): raise {{keep}} or lower {{align}}", keep="ranks.keep",
                      align="ranks.align")


def log_loss_and_kl_per_window(logits: np.ndarray, tokens: np.ndarray, reference_log_probs: np.ndarray
                               ) -> tuple[np.ndarray, np.ndarray]:
    """Per window of [B, S]: the mean next-token negative log-likelihood, and the mean KL(reference ‖ model).
    In float64, with PyTorch's threads (a vocabulary of 50k makes each call 100M exponentials)."""
    import torch

    log_probs = torch.log_softmax(torch.from_numpy(np.ascontiguousarray(logits[:, :-1])).double(), dim=-1)
    targets = torch.from_numpy(np.ascontiguousarray(tokens[:, 1:]))
    nll = -log_probs.gather(-1, targets[..., None])[..., 0].mean(dim=1)
    reference = torch.from_numpy(reference_log_probs)
    kl = (reference.exp() * (reference - log_probs)).sum(dim=-1).mean(dim=1)
    return nll.numpy(), kl.numpy()


def log_loss_and_kl_by_positions(logits: np.ndarray, tokens: np.ndarray, reference_logits: np.ndarray,
                                 positions: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """What log_loss_and_kl_per_window gives, from the reference's logits, `positions` next-token predictions at a
    time: a float64 copy of one chunk of a 150k vocabulary at once (64 positions: 78 MB), never of a window."""
    predicted = logits.shape[1] - 1
    nll, kl = np.zeros(len(logits)), np.zeros(len(logits))
    for start in range(0, predicted, positions):
        end = min(start + positions, predicted)
        reference = log_softmax(reference_logits[:, start:end].astype(np.float64))
        chunk_nll, chunk_kl = log_loss_and_kl_per_window(logits[:, start:end + 1], tokens[:, start:end + 1], reference)
        nll += chunk_nll * (end - start)
        kl += chunk_kl * (end - start)
    return nll / predicted, kl / predicted


def next_token_nll_by_positions(logits: np.ndarray, tokens: np.ndarray, positions: int = 64) -> np.ndarray:
    """Per window of [B, S]: the mean next-token negative log-likelihood that log_loss_and_kl_per_window gives,
    without the log-probabilities: each prediction's log-sum-exp less its target's logit, in float64, `positions`
    predictions at a time (one exponential per logit, where the log-probabilities and the KL take three)."""
    import torch

    predicted = logits.shape[1] - 1
    targets = torch.from_numpy(np.ascontiguousarray(tokens[:, 1:]))
    nll = torch.zeros(len(logits), dtype=torch.float64)
    for start in range(0, predicted, positions):
        end = min(start + positions, predicted)
        chunk = torch.from_numpy(np.ascontiguousarray(logits[:, start:end])).double()
        target_logits = chunk.gather(-1, targets[:, start:end, None])[..., 0]
        nll += (torch.logsumexp(chunk, dim=-1) - target_logits).sum(dim=1)
    return (nll / predicted).numpy()


def held_out_damage(per_window: np.ndarray, ids: list[str]) -> float:
    """The damage a budget holds: the mean over each source's held-out windows (an id names its source,
    `source#index`), the largest of them. A budget then holds on the calibration text and on the windows the model
    wrote itself alike, not on their average: a plan shaped by the calibration text damages the model's own
    writing (the nearest the rewrite has to the user's next text) several times as much."""
    return max(_source_means(per_window, ids).values())


def _source_means(per_window: np.ndarray, ids: list[str]) -> dict[str, float]:
    """The mean damage over each source's windows, by source (an id names its source, `source#index`)."""
    sources = np.array([window.rsplit("#", 1)[0] for window in ids])
    return {str(source): float(np.mean(per_window[sources == source])) for source in dict.fromkeys(sources)}


def spread_over_windows(metric: str, per_window: np.ndarray, ids: list[str]) -> dict:
    """How a measured damage varies over the windows it was measured on: for "ppl" as perplexity increases
    (exp(Δ log-loss) − 1, so 0.1 = +10 %), for "kl" in nats."""
    values = np.expm1(per_window) if metric == "ppl" else np.asarray(per_window)
    by_source = _source_means(np.asarray(per_window), ids)
    return {"unit": "perplexity increase" if metric == "ppl" else "KL (nats)", "windows": list(ids),
            "per_window": [float(v) for v in values], "mean": float(values.mean()),
            "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
            "min": float(values.min()), "max": float(values.max()),
            "by_source": {source: math.expm1(mean) if metric == "ppl" else mean for source, mean in by_source.items()}}


class DamageProbe:
    """The damage of any ranks of the candidates, measured on calibration windows.

    `module` is the model lowered to PyTorch with every candidate factorized at full rank (so it computes what
    the dense model does), its factor initializers named by `factor_names`; `decompositions` give each
    candidate's factors at any rank.
    The damage is the increase of the mean log-loss ("ppl") or the mean KL to the dense model ("kl"). The
    windows should be held out of those the statistics came from (CalibrationData.held_out_windows): a
    budget measured on the windows the factors were fitted to promises more than it keeps.
    `source` (a model_source.ModelSource) is the model `module` was made from: it has the same inputs.
    """

    def __init__(self, module, factor_names: dict[str, tuple[str, str]], decompositions: dict,
                 tokens: np.ndarray, metric: str, source,
                 narrowings: dict[str, tuple[MlpNarrowing, str]] | None = None):
        from onnx_nmm.lowering import CausalLmInputs, factor_parameters, weights_as_parameters

        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        self.module = module
        self.narrowings = narrowings or {}
        self.parameters = factor_parameters(self.module) | weights_as_parameters(
            self.module, [weight for _, weight in self.narrowings.values()])
        missing = [name for pair in factor_names.values() for name in pair if name not in self.parameters]
        if missing:
            raise RuntimeError(f"the lowered model has no factor parameters {missing[:3]}")
        self.factor_names, self.decompositions, self.metric = factor_names, decompositions, metric
        self.tokens = tokens
        self.inputs = CausalLmInputs(source)(tokens)
        # the KL needs the dense next-token distributions (numpy, once); the log-loss increase only the dense loss
        self.reference = log_softmax(self._logits()[:, :-1].astype(np.float64)) if metric == "kl" else None
        self.base_per_window = self._losses() if metric == "ppl" else np.zeros(len(tokens))

    def __call__(self, plan: RankPlan) -> float:
        return float(self.damage_per_window(plan).mean())

    def damage_per_window(self, plan: RankPlan) -> np.ndarray:
        """The damage of `plan` on each window: the log-loss increase ("ppl") or the KL ("kl")."""
        import torch

        originals = {}
        for name, array in self._swapped(plan):
            originals[name] = self.parameters[name].data
            self.parameters[name].data = torch.from_numpy(array)
        try:
            return self._losses() - self.base_per_window
        finally:
            for factor, data in originals.items():
                self.parameters[factor].data = data

    def _losses(self) -> np.ndarray:
        """Each window's log-loss ("ppl") or KL to the dense model ("kl"), under the parameters as they are."""
        if self.metric == "ppl":
            return next_token_nll_by_positions(self._logits(), self.tokens)
        assert self.reference is not None, "a KL probe keeps the dense log-probabilities"
        return log_loss_and_kl_per_window(self._logits(), self.tokens, self.reference)[1]

    def _swapped(self, plan: RankPlan):
        """(parameter, the array it holds under `plan`): each factor at its rank; a narrowed MLP's output weight
        with its refit in the kept rows and zeros in the others, which computes what the narrower MLP does."""
        for name, choice in plan.items():
            if isinstance(choice, Narrowed):
                narrowing, weight = self.narrowings[name]
                kept = narrowing.kept(choice.width)
                rows = np.zeros_like(narrowing.down, dtype=np.float32)
                rows[kept] = narrowing.refit(kept)
                yield weight, rows
            elif not isinstance(choice, Dense):
                yield from zip(self.factor_names[name], self.decompositions[name].factors(choice, np.float32))

    def _logits(self) -> np.ndarray:
        from onnx_nmm.lowering import call_lowered

        outputs = call_lowered(self.module, *self.inputs)
        return (outputs[0] if isinstance(outputs, (tuple, list)) else outputs).numpy()


def loss_widths(width: int, asked: int) -> list[int]:
    """The widths whose refit errors are computed together when one of them (`asked`) is asked for."""
    return [*aligned_widths(width, math.gcd(asked, 32)), asked]


def measure_references(candidates: list[Candidate], damage_of: DamageOf, align: int,
                       on_measured: Callable[[str], None] | None = None) -> None:
    """Measure each candidate's damage at its reference ranks, unless Fisher statistics predict it or an
    earlier rewrite measured it (`references_from`)."""
    for candidate in candidates:
        if candidate.fisher_tokens is None and not candidate.references:
            candidate.references = [(rank, damage_of({candidate.name: rank}))
                                    for rank in candidate.reference_ranks(align)]
            if on_measured is not None:
                on_measured(candidate.name)


def choose(candidates: list[Candidate], damage_of: DamageOf, align: int, metric: str, budget: float | None,
           parameters_to_remove: int | None, kept_dense: Dense) -> BudgetChoice:
    """With the candidates' references measured (measure_references): the plan within `budget` of damage, or
    the one removing `parameters_to_remove` at the least damage."""
    if parameters_to_remove is not None:
        chosen = select_for_parameters(candidates, align, parameters_to_remove, metric, damage_of, kept_dense)
    else:
        assert budget is not None, "the goal is a budget of damage or a count of parameters to remove"
        chosen = select_within_budget(candidates, align, budget, metric, damage_of, kept_dense)
    chosen.sensitivity = sensitivity_of(candidates, align)
    return chosen


def sensitivity_of(candidates: list[Candidate], align: int) -> dict[str, list[tuple[RankOrWidth, float]]]:
    """What the report shows of each candidate: its measured references, or its predicted damage at every rank."""
    return {c.name: c.references or [(rank, c.predicted_damage(rank)) for rank in c.ranks(align)] for c in candidates}


def references_from(report: str | os.PathLike, candidates: list[Candidate], metric: str) -> None:
    """Give each candidate the references an earlier rewrite of the same model measured (its report's quality
    budget, with the same metric), so that a budget at another keep does not measure them again."""
    try:
        budget = json.loads(Path(report).read_text())["quality_budget"]
        measured, their_metric = budget["sensitivity"], budget["metric"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise OptionError(f"{{sensitivity_from}} {report} is not the report of a rewrite with a quality budget "
                          f"({error})", sensitivity_from="ranks.sensitivity_from") from None
    missing = [c.name for c in candidates if c.fisher_tokens is None and c.name not in measured]
    if their_metric != metric or missing:
        why = f"measured {their_metric}, not {metric}" if their_metric != metric else f"has no {missing[0]}"
        raise OptionError(f"{{sensitivity_from}} {report} {why}: it reports another rewrite's budget",
                          sensitivity_from="ranks.sensitivity_from")
    for candidate in candidates:
        if candidate.fisher_tokens is None:
            candidate.references = [(Narrowed(choice, candidate.k) if isinstance(candidate, NarrowingCandidate)
                                     else choice, damage) for choice, damage in measured[candidate.name]]


def budget_in_nats(metric: str, allowed: float) -> float:
    """A perplexity increase (0.1 = +10 %) as the log-loss increase it allows; a KL budget as it is."""
    return math.log1p(allowed) if metric == "ppl" else allowed


def describe_measurement(quality_budget: dict) -> str:
    """One line on what a quality budget measured, where, and how much it varied from window to window."""
    spread = quality_budget.get("spread")
    if not spread:
        return ""
    ppl = spread["unit"] == "perplexity increase"
    show = (lambda v: f"{v:+.1%}") if ppl else (lambda v: f"{v:.4f} nats")
    allowed = quality_budget.get("budget")
    target = "" if allowed is None else f" (budget {show(math.expm1(allowed)) if ppl else show(allowed)})"
    count, measured = len(spread["windows"]), quality_budget["measured"]
    sequential = quality_budget.get("sequential")
    refit = "" if sequential is None else (
        f"Refitted sequentially: {show(math.expm1(sequential['measured']) if ppl else sequential['measured'])}, "
        + ("which was written. " if sequential["written"] else "over the budget: the independent fit was written. "))
    sources = spread.get("by_source", {})  # each source's mean damage, in the spread's unit
    worst = "" if len(sources) < 2 else " (the worst source's mean; " + ", ".join(
        f"{source} {show(mean)}" for source, mean in sources.items()) + ")"
    return (f"{'perplexity increase' if ppl else 'KL to the dense model'} measured on {count} calibration "
            f"window{'s' if count != 1 else ''} held out of the statistics: "
            f"{show(math.expm1(measured) if ppl else measured)}{worst}"
            f"{target}; per window {show(spread['min'])} … {show(spread['max'])}, "
            f"std {show(spread['std']).lstrip('+')}. {refit}"
            "A budget holds for text like the calibration text; other text may lose more (docs/quality.md).")
