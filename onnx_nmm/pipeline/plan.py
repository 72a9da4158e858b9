"""Step 2: the rank plan — a rank for every target, Dense(reason), or with nystrom a kept width for every
targeted MLP (Narrowed, on each of its projections) — by the rule the options name.

    ranks_from          the plan of an earlier report                    rank_plan.plan_from_report
    max_ppl_increase,   measured damage on held-out calibration      sensitivity (through a probe: this
                        windows (never the statistics' own), a
    max_kl, sensitivity greedy along each layer's convex hull            model factorized at full rank)
    global budget       the uniform rule's parameters, spent by spectrum rank_allocation
    rank                one rank everywhere                              rank_plan.explicit_ranks
    energy              the rank holding a fraction of Σσ²               rank_plan.energy_choice
    keep                the block-aligned rank (docs/design.md §2)            rank_plan.keep_choice
                        (nystrom: the block-aligned width)               rank_plan.keep_width

The budgets spend parameters across layers and methods alike: an MLP's narrowing is one more candidate,
its choices the widths, its loss the refit's relative error (onnx_nmm.decomposition.nystrom). The model is not changed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.calibration.calibration_data import CalibrationData
from onnx_nmm.errors import OptionError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes import FactorizedLayer, FactorsPlaced, LinearLayer, SvdFactorizationPass
from onnx_nmm.passes.mlp_narrowing import NarrowedMlp, NarrowedWeight, NarrowMlpPass, WeightsNarrowed
from onnx_nmm.passes.mlp_rules.mlp import Mlp
from onnx_nmm.pipeline.factorizer import Factorizer
from onnx_nmm.pipeline.narrow import MlpNarrowings
from onnx_nmm.pipeline.statistics import Statistics, budget_windows
from onnx_nmm.pipeline.targets import Targets, find_targets
from onnx_nmm.progress import Progress
from onnx_nmm.ranks import rank_allocation, sensitivity
from onnx_nmm.ranks.rank_plan import (
    Dense,
    Narrowed,
    RankPlan,
    aligned_ranks,
    energy_choice,
    explicit_ranks,
    keep_choice,
    keep_width,
    parameters,
    plan_from_report,
)
from onnx_nmm.runtime.graph_probe import first_step


@dataclass
class RankChoice:
    """The plan, and with a quality budget what it measured (RewriteReport.quality_budget)."""

    plan: RankPlan
    quality_budget: dict = field(default_factory=dict)


class Planner:
    """Chooses the plan of `targets` by the rule `options` name. The calibration `data` and `statistics` give
    the windows a quality budget is measured on; `source` is the model the probe's tokens run through."""

    def __init__(self, options: RewriteOptions, targets: Targets, factorizer: Factorizer, narrowings: MlpNarrowings,
                 data: CalibrationData | None, statistics: Statistics, source: ModelSource, progress: Progress):
        self.options, self.targets, self.factorizer, self.narrowings = options, targets, factorizer, narrowings
        self.data, self.statistics, self.source, self.progress = data, statistics, source, progress
        self.quality_budget: dict = {}

    def choose(self, model: ir.Model) -> RankChoice:
        """The plan for `model` (not changed)."""
        targets, self.quality_budget = self.targets, {}
        plan = self._plan(model, targets.layers, targets.chosen, self.factorizer, targets.mlps)
        _warn_about_shared_weights(targets.chosen, plan)
        return RankChoice(plan, self.quality_budget)

    def _plan(self, model: ir.Model, layers: list[LinearLayer], chosen: list[LinearLayer],
              factorizer: Factorizer, mlps: list[Mlp]) -> RankPlan:
        ranks = self.options.ranks
        if ranks.ranks_from is not None:
            plan = plan_from_report(ranks.ranks_from, chosen, layers)
            if not mlps and any(isinstance(choice, Narrowed) for choice in plan.values()):
                raise OptionError("{ranks_from} narrows MLPs: give {method} nystrom as the rewrite it reports did",
                                  ranks_from="ranks.ranks_from", method="factorization.method")
            return plan
        narrowed = {layer.name for mlp in mlps for layer in mlp.layers}
        chosen = [layer for layer in chosen if layer.name not in narrowed]  # the targets left to factorize
        if ranks.measures_damage:
            return self._measured(model, chosen, factorizer, mlps)
        if ranks.budget == "global":
            return self._global(chosen, factorizer, mlps)
        if ranks.rank is not None:
            return explicit_ranks(chosen, ranks.rank)
        if ranks.energy is not None:
            with self.progress.phase("choosing ranks by energy", total=len(chosen)) as phase:
                plan = {}
                for layer in chosen:
                    spectrum = factorizer.spectrum(layer)
                    plan[layer.name] = energy_choice(layer, spectrum.singular_values, ranks.energy, ranks.align)
                    phase.advance(detail=layer.module_path or layer.name)
                return plan
        assert ranks.keep is not None, "keep is the rule when no other is given"
        plan = {layer.name: keep_choice(layer, ranks.keep, ranks.align) for layer in chosen}
        return plan | _by_layer(mlps, {mlp.name: keep_width(mlp.width, ranks.keep, ranks.align) for mlp in mlps})

    def _global(self, chosen: list[LinearLayer], factorizer: Factorizer, mlps: list[Mlp]) -> RankPlan:
        """The parameters uniform `keep` would keep, spent where each layer's spectrum says they remove the
        most truncation loss, or with Fisher statistics the most predicted KL; with narrowed MLPs, where the
        loss of every layer's output (whitened truncation, or the narrowing's refit error) is least."""
        ranks = self.options.ranks
        assert ranks.keep is not None, "a global budget spends the parameters keep keeps"
        budget = sum(parameters(layer.k, layer.n, keep_choice(layer, ranks.keep, ranks.align)) for layer in chosen)
        fisher = self.options.strategy.output_grams
        options, spectra = {}, []
        with self.progress.phase("analysing spectra", total=len(chosen)) as phase:
            for layer in chosen:
                spectrum = factorizer.spectrum(layer)
                if fisher:
                    options[layer.name] = rank_allocation.rank_options(
                        layer.k, layer.n, ranks.align, lambda rank: factorizer.predicted_kl(spectrum, rank))
                elif mlps:
                    candidate = sensitivity.Candidate(layer.name, layer.k, layer.n, spectrum)
                    options[layer.name] = rank_allocation.rank_options(layer.k, layer.n, ranks.align,
                                                                       candidate.truncation_loss)
                else:
                    spectra.append(rank_allocation.LayerSpectrum(layer.name, layer.k, layer.n,
                                                                 spectrum.singular_values))
                phase.advance(detail=layer.module_path or layer.name)
        if mlps:
            candidates = self._narrowing_candidates(mlps)
            budget += sum(candidate.parameters(keep_width(candidate.k, ranks.keep, ranks.align))
                          for candidate in candidates)
            with self.progress.phase("ordering neurons", total=len(candidates)) as phase:
                for candidate in candidates:
                    options[candidate.name] = (candidate.parameters(Dense("")), [
                        (width, candidate.parameters(width), candidate.truncation_loss(width))
                        for width in candidate.ranks(ranks.align)])
                    phase.advance(detail=candidate.name)
        if fisher or mlps:
            dense = sum(layer.parameters for layer in chosen) + sum(mlp.parameters() for mlp in _unique(mlps))
            plan = rank_allocation.allocate_by_damage(options, dense - budget)
            return _by_layer(mlps, plan) | {layer.name: plan[layer.name] for layer in chosen}
        return rank_allocation.allocate_ranks(spectra, budget, ranks.align)

    def _narrowing_candidates(self, mlps: list[Mlp]) -> list[sensitivity.NarrowingCandidate]:
        """Every targeted MLP (once, whatever its sites) as a candidate of the budgets."""
        return [sensitivity.NarrowingCandidate(mlp.name, mlp.width, mlp.parameters_per_neuron, None,
                                               narrowing=self.narrowings.of(mlp)) for mlp in _unique(mlps)]

    def _measured(self, model: ir.Model, chosen: list[LinearLayer], factorizer: Factorizer,
                  mlps: list[Mlp]) -> RankPlan:
        """A quality budget: ranks (and widths) by the damage each does on calibration windows, measured on a
        probe (this model with every target at full rank, every narrowed MLP at full width) or, with Fisher
        statistics, predicted."""
        ranks = self.options.ranks
        metric = ranks.damage_metric
        assert self.data is not None, "a quality budget needs calibration data (RewriteOptions refuses it without)"
        held_out = budget_windows(self.data, self.statistics.grams)  # never a window the statistics came from
        probe = self._probe(model, chosen, factorizer, mlps, held_out.tokens, metric)
        decompositions = factorizer.decompositions  # kept: the factorization reuses them
        grams = self.statistics.grams
        fisher_tokens = grams.tokens if grams is not None and self.options.strategy.output_grams else None
        candidates = [sensitivity.Candidate(layer.name, layer.k, layer.n, decompositions[layer.name],
                                            fisher_tokens=fisher_tokens)
                      for layer in chosen if aligned_ranks(layer.k, layer.n, ranks.align)]
        candidates += [candidate for candidate in self._narrowing_candidates(mlps) if candidate.ranks(ranks.align)]
        budget = (None if ranks.budget == "sensitivity"
                  else sensitivity.budget_in_nats(metric, getattr(ranks, ranks.rule)))
        dense = sum(layer.parameters for layer in chosen) + sum(mlp.parameters() for mlp in _unique(mlps))
        # the sensitivity budget (keep's rule) removes the parameters keep would, where they do the least damage
        to_remove = math.ceil((1 - ranks.keep) * dense) if ranks.keep is not None else None
        if ranks.sensitivity_from is not None:
            sensitivity.references_from(ranks.sensitivity_from, candidates, metric)
        kept_dense = Dense(f"kept dense: the most sensitive layers within the {ranks.quality_budget}")
        unmeasured = [c for c in candidates if c.fisher_tokens is None and not c.references]
        if unmeasured:
            with self.progress.phase("measuring sensitivity", total=len(unmeasured)) as phase:
                sensitivity.measure_references(unmeasured, probe, ranks.align,
                                               on_measured=lambda name: phase.advance(detail=name))
        with self.progress.phase(f"choosing within the {ranks.quality_budget}") as phase:
            def measured(plan):  # each plan tried is one run over the held-out windows
                damage = sensitivity.held_out_damage(probe.damage_per_window(plan), held_out.ids)
                phase.advance()
                return damage

            choice = sensitivity.choose(candidates, measured, ranks.align, metric, budget, to_remove, kept_dense)
        self.quality_budget = choice.to_dict(ranks.keep) | {
            "measured_on": held_out.description,
            "spread": sensitivity.spread_over_windows(metric, probe.damage_per_window(choice.plan), held_out.ids)}
        unaligned = Dense(f"no rank that is a multiple of {ranks.align} saves parameters")
        plan = {name: choice.plan.get(name, unaligned) for name in [layer.name for layer in chosen]
                + [mlp.name for mlp in mlps]}
        return _by_layer(mlps, plan) | {layer.name: plan[layer.name] for layer in chosen}

    def _probe(self, model: ir.Model, chosen: list[LinearLayer], factorizer: Factorizer, mlps: list[Mlp],
               tokens: np.ndarray, metric: str) -> sensitivity.DamageProbe:
        """The damage probe: this model with every target at full rank and every narrowed MLP at full width,
        lowered to PyTorch. Each stage is let go once the next holds the weights (the ONNX model once it is a
        proto, the proto once it is lowered): at most two copies of the model are ever alive."""
        from onnx_nmm.lowering import lower

        probe_model = model.clone()
        factored = {layer.name for layer in chosen}
        probe_targets = find_targets(probe_model, self.options)
        probe_layers = [layer for layer in probe_targets.sites() if layer.name in factored]
        if probe_layers:
            with self.progress.phase("decomposing every target", total=len(probe_layers)) as phase:
                for layer in probe_layers:
                    factorizer.decompositions[layer.name] = factorizer.decompose(layer)
                    phase.advance(detail=layer.module_path or layer.name)
        decompositions = factorizer.decompositions
        factors = {name: decomposition.factors(decomposition.max_rank)
                   for name, decomposition in decompositions.items()}  # one pair per target, which all its sites read
        placed = SvdFactorizationPass([FactorizedLayer(layer, *factors[layer.name],
                                                       align=self.options.ranks.align,
                                                       method=f"{factorizer.method}/exact")
                                       for layer in probe_layers])(probe_model)
        assert isinstance(placed, FactorsPlaced)
        factor_names = placed.factor_names
        narrowings = self._full_width(probe_model, mlps)
        ir.external_data.load_to_model(probe_model)  # the lowering reads weights from the proto
        proto = ir.to_proto(probe_model)
        del probe_model, placed, factors
        module = lower(first_step(proto), consume=True)
        del proto
        return sensitivity.DamageProbe(module, factor_names, decompositions, tokens, metric, self.source, narrowings)

    def _full_width(self, probe_model: ir.Model, mlps: list[Mlp]) -> dict:
        """Every targeted MLP of the probe model narrowed to its full width with float weights (the same
        function, its output weight now a plain initializer): for each MLP, its narrowing and the name of that
        weight, which the probe swaps for the refit at any width."""
        if not mlps:
            return {}
        names = {mlp.down.name for mlp in mlps}
        probe_mlps = [mlp for mlp in find_targets(probe_model, self.options).mlps if mlp.down.name in names]
        weights: dict[str, list[np.ndarray]] = {}  # one set per MLP, which every site of it reads
        for mlp in probe_mlps:
            weights.setdefault(mlp.down.name, [layer.weight_matrix() for layer in mlp.layers])
        narrowed = NarrowMlpPass([NarrowedMlp(mlp, np.arange(mlp.width), [
            NarrowedWeight(layer, matrix) for layer, matrix in zip(mlp.layers, weights[mlp.down.name])])
            for mlp in probe_mlps])(probe_model)
        assert isinstance(narrowed, WeightsNarrowed)
        return {mlp.name: (self.narrowings.of(mlp), narrowed.weight_names[mlp.down.name]) for mlp in mlps}


def _unique(mlps: list[Mlp]) -> list[Mlp]:
    """One site of each MLP."""
    return list({mlp.down.name: mlp for mlp in reversed(mlps)}.values())[::-1]


def _by_layer(mlps: list[Mlp], widths: dict) -> RankPlan:
    """Each MLP's choice (a width, or Dense) on every one of its projections."""
    return {layer.name: widths[mlp.name] for mlp in mlps for layer in mlp.layers}


def _warn_about_shared_weights(chosen: list[LinearLayer], plan: RankPlan) -> None:
    """A weight another node also reads (a tied lm_head's embedding) stays in the model: its factors come on
    top, so the model grows. Say what it costs before the work is done."""
    for layer in chosen:
        rank = plan[layer.name]
        if layer.shared_with and isinstance(rank, int):
            added = parameters(layer.k, layer.n, rank)
            warnings.warn(f"{layer.module_path or layer.name} shares its weight with {', '.join(layer.shared_with)}, "
                          f"which keeps it: its rank-{rank} factors add {added / 1e6:.2f}M "
                          f"parameters ({added * layer.dtype.itemsize / 1e6:.1f} MB) instead of saving any; "
                          "leave it dense unless a faster product is the point", stacklevel=2)
