"""Pass 2: the rank plan — a rank for every target, or Dense(reason) — by the rule the options name.

    ranks_from          the plan of an earlier report                    rank_plan.plan_from_report
    max_ppl_increase,   measured damage on held-out calibration      sensitivity (through a probe: this
                        windows (never the statistics' own), a
    max_kl, sensitivity greedy along each layer's convex hull            model factorized at full rank)
    global budget       the uniform rule's parameters, spent by spectrum rank_allocation
    rank                one rank everywhere                              rank_plan.explicit_ranks
    energy              the rank holding a fraction of Σσ²               rank_plan.energy_choice
    keep                the block-aligned rank (DESIGN.md §4)            rank_plan.keep_choice

The model is not changed.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx_ir as ir

from onnx_nmm import rank_allocation, sensitivity
from onnx_nmm.passes import FactorizedLayer, LinearLayer, SvdFactorizationPass
from onnx_nmm.pipeline.context import RewritePass, sites, targets
from onnx_nmm.pipeline.factorizer import Factorizer
from onnx_nmm.rank_plan import (Dense, RankPlan, aligned_ranks, energy_choice, explicit_ranks, keep_choice,
                                parameters, plan_from_report)


class PlanRanks(RewritePass):
    label = "rank selection"

    def run(self, model: ir.Model) -> bool:
        layers, chosen, _ = targets(model, self.context.options)
        self.context.plan = self._plan(model, layers, chosen, self.context.make_factorizer())
        _warn_about_shared_weights(chosen, self.context.plan)
        return False

    def _plan(self, model: ir.Model, layers: list[LinearLayer], chosen: list[LinearLayer],
              factorizer: Factorizer) -> RankPlan:
        ranks = self.context.options.ranks
        if ranks.rule == "ranks_from":
            return plan_from_report(ranks.ranks_from, chosen, layers)
        if ranks.measures_damage:
            return self._measured(model, chosen, factorizer)
        if ranks.budget == "global":
            return self._global(chosen, factorizer)
        if ranks.rule == "rank":
            return explicit_ranks(chosen, ranks.rank)
        if ranks.rule == "energy":
            with self.context.progress.phase("choosing ranks by energy", total=len(chosen)) as phase:
                plan = {}
                for layer in chosen:
                    spectrum = factorizer.spectrum(layer)
                    plan[layer.name] = energy_choice(layer, spectrum.singular_values, ranks.energy, ranks.align)
                    phase.advance(detail=layer.module_path or layer.name)
                return plan
        return {layer.name: keep_choice(layer, ranks.keep, ranks.align) for layer in chosen}

    def _global(self, chosen: list[LinearLayer], factorizer: Factorizer) -> RankPlan:
        """The parameters uniform `keep` would keep, spent where each layer's spectrum says they remove the
        most truncation loss, or with Fisher statistics the most predicted KL."""
        ranks = self.context.options.ranks
        budget = sum(parameters(layer.k, layer.n, keep_choice(layer, ranks.keep, ranks.align)) for layer in chosen)
        fisher = self.context.options.method == "fisher"
        options, spectra = {}, []
        with self.context.progress.phase("analysing spectra", total=len(chosen)) as phase:
            for layer in chosen:
                spectrum = factorizer.spectrum(layer)
                if fisher:
                    options[layer.name] = rank_allocation.rank_options(
                        layer.k, layer.n, ranks.align, lambda rank: factorizer.predicted_kl(spectrum, rank))
                else:
                    spectra.append(rank_allocation.LayerSpectrum(layer.name, layer.k, layer.n,
                                                                 spectrum.singular_values))
                phase.advance(detail=layer.module_path or layer.name)
        if fisher:
            return rank_allocation.allocate_by_damage(options, sum(layer.parameters for layer in chosen) - budget)
        return rank_allocation.allocate_ranks(spectra, budget, ranks.align)

    def _measured(self, model: ir.Model, chosen: list[LinearLayer], factorizer: Factorizer) -> RankPlan:
        """A quality budget: ranks by the damage each does on calibration windows, measured on a probe (this
        model with every target at full rank) or, with Fisher statistics, predicted."""
        context, ranks = self.context, self.context.options.ranks
        metric = "kl" if ranks.rule == "max_kl" else "ppl"
        probe_model = model.clone()
        probe_layers, probe_targets, _ = targets(probe_model, context.options)
        probe_layers = sites(probe_layers, probe_targets)
        with context.progress.phase("decomposing every target", total=len(probe_layers)) as phase:
            for layer in probe_layers:
                factorizer.decompositions[layer.name] = factorizer.decompose(layer)
                phase.advance(detail=layer.module_path or layer.name)
        decompositions = factorizer.decompositions  # kept: the factorization reuses them
        factors = {name: decomposition.factors(decomposition.max_rank, np.float64)
                   for name, decomposition in decompositions.items()}  # one pair per target, for all its sites
        full_rank = [FactorizedLayer(layer, *factors[layer.name], align=ranks.align,
                                     method=f"{context.options.method}/exact") for layer in probe_layers]
        surgery = SvdFactorizationPass(full_rank)
        surgery(probe_model)
        held_out = context.budget_windows()  # never a window the statistics came from
        probe = sensitivity.DamageProbe(probe_model, surgery.factor_names, decompositions, held_out.tokens, metric,
                                         context.source)
        fisher_tokens = context.statistics.tokens if context.options.method == "fisher" else None
        candidates = [sensitivity.Candidate(layer.name, layer.k, layer.n, decompositions[layer.name],
                                            fisher_tokens=fisher_tokens)
                      for layer in chosen if aligned_ranks(layer.k, layer.n, ranks.align)]
        budget = None if ranks.budget == "sensitivity" else sensitivity.budget_in_nats(metric, getattr(ranks, ranks.rule))
        to_remove = math.ceil((1 - ranks.keep) * sum(l.parameters for l in chosen)) if budget is None else None
        kept_dense = Dense(f"kept dense: the most sensitive layers within the {ranks.quality_budget}")
        measuring = "measuring sensitivity" if fisher_tokens is None else "measuring the predicted choice"
        with context.progress.phase(measuring, total=len(candidates) if fisher_tokens is None else None) as phase:
            choice = sensitivity.choose(candidates, probe, ranks.align, metric, budget, to_remove, kept_dense,
                                        on_measured=lambda name: phase.advance(detail=f"sensitivity: {name}"))
        context.report.quality_budget = choice.to_dict(ranks.keep) | {
            "measured_on": held_out.description,
            "spread": sensitivity.spread_over_windows(metric, probe.damage_per_window(choice.plan), held_out.ids)}
        unaligned = Dense(f"no rank that is a multiple of {ranks.align} saves parameters")
        return {layer.name: choice.plan.get(layer.name, unaligned) for layer in chosen}


def _warn_about_shared_weights(chosen: list[LinearLayer], plan: RankPlan) -> None:
    """A weight another node also reads (a tied lm_head's embedding) stays in the model: its factors come on
    top, so the model grows. Say what it costs before the work is done."""
    for layer in chosen:
        rank = plan[layer.name]
        if layer.shared_with and not isinstance(rank, Dense):
            added = parameters(layer.k, layer.n, rank)
            warnings.warn(f"{layer.module_path or layer.name} shares its weight with {', '.join(layer.shared_with)} "
                          f"(a tied embedding), which keeps it: its rank-{rank} factors add {added / 1e6:.2f}M "
                          f"parameters ({added * layer.dtype.itemsize / 1e6:.1f} MB) instead of saving any; "
                          "leave it dense unless a faster product is the point", stacklevel=2)
