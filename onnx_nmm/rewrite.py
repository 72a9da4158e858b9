"""The rewrite: find linear layers, choose ranks, factorize, swap in SvdMatMul ops.

    model ─ find_linear_layers ─ select_layers ─┬─ per layer: rank rule → (whitened) SVD → factors
                                                └─ SvdFactorizationPass(factors) ─ model'

With `--budget global` the ranks come from a first pass over every layer's spectrum
(onnx_nmm.rank_allocation): by each layer's relative truncation loss, or with Fisher statistics by the
KL divergence each rank is predicted to add (onnx_nmm.fisher); the factors from a second.

Weights are read one at a time and their memory-mapped storage released right after factorization,
so the process never holds two full copies of the weights: the original stays on disk, the factors
(smaller than the weights they replace) are the only new arrays.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm import fisher, lowrank, rank_allocation, sequential, whitening
from onnx_nmm.activation_stats import GramStatistics
from onnx_nmm.errors import UserError
from onnx_nmm.passes import (FactorizedLayer, LinearLayer, Selection, SvdFactorizationPass, find_linear_layers,
                             select_layers)

FULL_RANK = "full"


@dataclass(frozen=True)
class RankRule:
    """How each matrix's rank is chosen: exactly one of `keep`, `rank`, `energy` drives it.

    keep:   fraction of the matrix's parameters kept, block-aligned (DESIGN.md §4);
    rank:   the same explicit rank everywhere (an int, or "full" for min(K, N)); always factorized,
            even where it saves nothing, because the user asked for it;
    energy: the smallest aligned rank holding this fraction of Σσ².
    """

    keep: float | None = 0.8
    rank: int | str | None = None
    energy: float | None = None
    align: int = 128

    def __post_init__(self):
        if sum(x is not None for x in (self.keep, self.rank, self.energy)) != 1:
            raise UserError("give exactly one of --keep, --rank and --energy")
        if self.keep is not None and not 0.0 < self.keep <= 1.0:
            raise UserError(f"--keep must be in (0, 1] (the fraction of parameters kept), got {self.keep}")
        if self.energy is not None and not 0.0 < self.energy <= 1.0:
            raise UserError(f"--energy must be in (0, 1], got {self.energy}")
        if self.align < 1:
            raise UserError(f"--align must be a positive integer, got {self.align}")
        if isinstance(self.rank, int) and self.rank < 1:
            raise UserError(f"--rank must be a positive integer or 'full', got {self.rank}")

    def describe(self) -> str:
        if self.keep is not None:
            return f"keep={self.keep}, align={self.align}"
        if self.rank is not None:
            return f"rank={self.rank}"
        return f"energy={self.energy}, align={self.align}"

    def rank_before_svd(self, k: int, n: int) -> tuple[int | None, str | None]:
        """(rank, None) when the rank is known without the spectrum, (None, reason) to stay dense,
        (None, None) when the spectrum is needed."""
        if self.rank is not None:
            return (min(k, n) if self.rank == FULL_RANK else int(self.rank)), None
        if self.energy is not None:
            return None, None
        rank = lowrank.block_aligned_rank(k, n, self.keep, self.align)
        return _saving_check(rank, k, n, self.align)

    def rank_from_spectrum(self, k: int, n: int, singular_values: np.ndarray) -> tuple[int | None, str | None]:
        rank = lowrank.energy_rank(singular_values, self.energy, self.align)
        return _saving_check(rank, k, n, self.align)


def _saving_check(rank: int, k: int, n: int, align: int) -> tuple[int | None, str | None]:
    if rank == 0:
        return None, f"rank rounds to 0 at align {align} (use a smaller --align)"
    if rank >= lowrank.break_even_rank(k, n):
        return None, f"rank {rank} saves nothing (break-even {lowrank.break_even_rank(k, n):.0f})"
    return rank, None


@dataclass
class LayerOutcome:
    """One row of the rewrite report."""

    name: str
    module_path: str
    role: str
    group: str
    k: int
    n: int
    dtype: str
    status: str  # "factorized", "dense", or "skipped"
    reason: str = ""
    rank: int | None = None
    parameters_before: int = 0
    parameters_after: int = 0
    relative_error: float | None = None  # ‖W − UV‖_F / ‖W‖_F
    whitened_loss: float | None = None  # ‖X(W − UV)‖_F / ‖XW‖_F on the calibration set (fisher: ‖Sᵀ(W − UV)T‖ / ‖SᵀWT‖)
    predicted_kl: float | None = None  # fisher: the mean KL per token this layer's truncation adds, to second order
    plain_svd_error: float | None = None  # ‖W − W_r‖_F / ‖W‖_F of plain SVD at the same rank (for comparison)
    conditioning: str = ""  # how XᵀX was factorized: cholesky, damped ε=…, eigendecomposition
    seconds: float = 0.0


@dataclass
class RewriteReport:
    rule: str
    selection: str
    method: str
    calibration: str = ""
    layers: list[LayerOutcome] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase, filled by the caller
    fused_mlps: list[str] = field(default_factory=list)  # SvdGatedMLP nodes made by --fuse-mlp
    quality_budget: dict = field(default_factory=dict)  # how the sensitivity pass chose the ranks

    @property
    def factorized(self) -> list[LayerOutcome]:
        return [layer for layer in self.layers if layer.status == "factorized"]

    def totals(self) -> dict[str, float]:
        targeted = [layer for layer in self.layers if layer.status != "skipped"]
        before = sum(layer.parameters_before for layer in targeted)
        after = sum(layer.parameters_after for layer in targeted)
        return {
            "layers_found": len(self.layers),
            "layers_factorized": len(self.factorized),
            "parameters_before": before,
            "parameters_after": after,
            "kept_fraction": after / before if before else 1.0,
        }

    def to_dict(self) -> dict:
        return {"rule": self.rule, "selection": self.selection, "method": self.method,
                "calibration": self.calibration, "totals": self.totals(), "seconds": self.seconds,
                "fused_mlps": self.fused_mlps, "quality_budget": self.quality_budget,
                "layers": [asdict(layer) for layer in self.layers]}


METHODS = ("svd", "whiten", "fisher")
BUDGETS = ("uniform", "global", "sensitivity")


@dataclass(frozen=True)
class FactorizationOptions:
    """method: plain SVD of W, SVD-LLM whitening (needs calibration statistics), or Fisher-weighted
    (two-sided) whitening (needs output-gradient statistics too, onnx_nmm.fisher);
    svd: how the inner SVD is computed (lowrank.SVD_METHODS); budget: one keep fraction per matrix
    (uniform), one parameter budget for all targets spent where it removes most loss (global), or where
    it damages the model least (sensitivity: the ranks come from onnx_nmm.sensitivity, as forced ranks)."""

    method: str = "svd"
    svd: str = "exact"
    power_iterations: int = 2
    oversample: int = 64
    seed: int = 0
    budget: str = "uniform"

    def describe(self) -> str:
        inner = self.svd
        if self.svd == "randomized":
            inner = f"randomized(power_iterations={self.power_iterations}, oversample={self.oversample})"
        return f"{self.method}, {inner} SVD, {self.budget} budget"


def rewrite_model(model: ir.Model, rule: RankRule, selection: Selection = Selection(),
                  options: FactorizationOptions = FactorizationOptions(), statistics: GramStatistics | None = None,
                  observer: sequential.GroupObserver | None = None,
                  forced_ranks: dict[str, int | None] | None = None, forced_reason: str = "",
                  on_layer: Callable[[LayerOutcome], None] | None = None,
                  on_start: Callable[[int], None] | None = None) -> RewriteReport:
    """Factorize the selected linear layers of `model` in place; return what was done to each.

    `statistics` (XᵀX of each target's input) drive whitening and let plain SVD report its
    activation loss. With an `observer`, calibration is sequential: each group of layers is fitted to
    the dense outputs from the inputs the already-compressed model feeds it (onnx_nmm.sequential), and
    applied before the next group is observed. `forced_ranks` (layer name → rank, or None to stay dense
    because of `forced_reason`) overrides the rank rule, e.g. ranks chosen within a quality budget.
    `on_start(n)` is told how many steps follow, `on_layer` hears about each finished one (for progress
    bars). Raises UserError when nothing can be targeted.
    """
    _check_options(rule, options, statistics, observer)
    if options.budget == "sensitivity" and forced_ranks is None:
        raise ValueError("the sensitivity budget's ranks come from sensitivity.choose_ranks: pass them as forced_ranks")
    layers = find_linear_layers(model)
    if not layers:
        raise UserError("no linear layer found: looked for MatMul/Gemm nodes whose second input is a constant weight "
                        "(an initializer or a Constant, possibly behind Identity/Transpose/Cast)")
    chosen, skipped = select_layers(layers, selection)
    if not chosen:
        raise UserError(f"none of the {len(layers)} linear layers matches {selection.describe()}; "
                        "see `onnx-nmm inspect` for their names and roles")
    _check_explicit_rank(chosen, rule)
    report = RewriteReport(rule=rule.describe(), selection=selection.describe(), method=options.describe(),
                           calibration=statistics.description if statistics else "")
    factorizer = _Factorizer(rule, options, statistics)
    if forced_ranks is None and options.budget == "global":
        if on_start is not None:
            on_start(2 * len(chosen))
        forced_ranks, forced_reason = factorizer.allocate(chosen, on_layer), "the global budget keeps it dense"
    elif on_start is not None:
        on_start(len(chosen))
    outcomes: dict[int, LayerOutcome] = {}
    groups = sequential.layer_groups(chosen) if observer is not None else [chosen]
    if observer is not None:
        observer.prepare({group[0].x.name: group[0].k for group in groups})
    for group in groups:
        observed = observer is not None and not all(factorizer.stays_dense(layer, forced_ranks) for layer in group)
        group_stats = observer.observe(model, group[0].x.name) if observed else None
        factorized: list[FactorizedLayer] = []
        for layer in group:
            if forced_ranks is not None:
                outcome, factors = factorizer.factorize(layer, forced_ranks.get(layer.name), True, group_stats,
                                                        forced_reason)
            else:
                outcome, factors = factorizer.factorize(layer, None, False, group_stats)
            outcomes[id(layer)] = outcome
            if factors is not None:
                factorized.append(factors)
            if on_layer is not None:
                on_layer(outcome)
        SvdFactorizationPass(factorized)(model)
    report.layers = [outcomes.get(id(layer)) or _outcome(layer, "skipped", skipped[layer.name]) for layer in layers]
    return report


class _Factorizer:
    """Turns one layer into factors (or a reason to stay dense) under the rule and options."""

    def __init__(self, rule: RankRule, options: FactorizationOptions, statistics: GramStatistics | None):
        self.rule, self.options, self.statistics = rule, options, statistics

    def decompose(self, layer: LinearLayer, weight: np.ndarray, rank_hint: int | None, gram: np.ndarray | None = None,
                  svd: str | None = None):
        o = self.options
        if gram is not None or o.method in ("whiten", "fisher"):
            gram = gram if gram is not None else self.statistics.gram(layer.x.name)
            output_gram = self.statistics.output_gram(layer.name) if o.method == "fisher" else None
            return whitening.whitened_decomposition(weight, gram, svd or o.svd, rank_hint, o.power_iterations,
                                                    o.oversample, o.seed, output_gram)
        return lowrank.decompose(weight, o.svd, rank_hint=rank_hint, oversample=o.oversample,
                                 power_iterations=o.power_iterations, seed=o.seed)

    def allocate(self, layers: list[LinearLayer], on_layer) -> dict[str, int | None]:
        """First pass of --budget global: every layer's full spectrum, then ranks for the same total
        parameter count as the uniform rule would give — by predicted KL with Fisher statistics, else by
        relative truncation loss."""
        spectra, options, budget = [], {}, 0
        for layer in layers:
            rank, _ = self.rule.rank_before_svd(layer.k, layer.n)
            budget += layer.parameters if rank is None else rank * (layer.k + layer.n)
            weight = layer.weight_matrix()
            _release(layer)
            decomposition = self.decompose(layer, weight, None, svd="exact")
            if self.options.method == "fisher":
                options[layer.name] = rank_allocation.rank_options(
                    layer.k, layer.n, self.rule.align,
                    lambda r: fisher.predicted_kl(decomposition.truncated_energy(r), self.statistics.tokens))
            else:
                spectra.append(rank_allocation.LayerSpectrum(layer.name, layer.k, layer.n,
                                                             decomposition.singular_values))
            if on_layer is not None:
                on_layer(_outcome(layer, "analysed"))
        if self.options.method == "fisher":
            return rank_allocation.allocate_by_damage(options, sum(layer.parameters for layer in layers) - budget)
        return rank_allocation.allocate_ranks(spectra, budget, self.rule.align)

    def stays_dense(self, layer: LinearLayer, forced_ranks: dict[str, int | None] | None) -> bool:
        """Whether the layer is known to stay dense before any decomposition (sequential calibration need
        not observe its input)."""
        if forced_ranks is not None:
            return forced_ranks.get(layer.name) is None
        rank, reason = self.rule.rank_before_svd(layer.k, layer.n)
        return rank is None and reason is not None

    def factorize(self, layer: LinearLayer, forced_rank: int | None, use_forced: bool,
                  group_stats: sequential.GroupStatistics | None = None,
                  forced_reason: str = "") -> tuple[LayerOutcome, FactorizedLayer | None]:
        """Factors for `layer`; with `group_stats` (sequential calibration) fitted to the dense outputs from
        the compressed model's inputs, otherwise to W itself (plain SVD or whitening)."""
        start = time.perf_counter()
        if use_forced:
            rank, reason = forced_rank, None if forced_rank is not None else forced_reason
        else:
            rank, reason = self.rule.rank_before_svd(layer.k, layer.n)
        if rank is None and reason is not None:
            return _outcome(layer, "dense", reason, parameters_after=layer.parameters), None
        weight = layer.weight_matrix()
        _release(layer)
        if group_stats is None:
            decomposition = self.decompose(layer, weight, rank)
        else:
            target = sequential.least_squares_target(weight.astype(np.float64), group_stats)
            decomposition = self.decompose(layer, target, rank, gram=group_stats.compressed)
        if rank is None:
            rank, reason = self.rule.rank_from_spectrum(layer.k, layer.n, decomposition.singular_values)
            if rank is None:
                return _outcome(layer, "dense", reason, parameters_after=layer.parameters), None
        u, v = decomposition.factors(rank, dtype=np.float64)
        if not (np.all(np.isfinite(u)) and np.all(np.isfinite(v))):
            raise UserError(f"factorizing {layer.name} gave non-finite factors; nothing was written "
                            "(please report this with the model)")
        outcome = _outcome(layer, "factorized", rank=rank, parameters_after=rank * (layer.k + layer.n),
                           relative_error=decomposition.relative_error(rank))
        if group_stats is not None:
            outcome.relative_error = float(np.linalg.norm(weight - u @ v) / max(np.linalg.norm(weight), 1e-30))
            outcome.whitened_loss = sequential.sequential_loss(weight, u, v, group_stats)
            outcome.conditioning = decomposition.conditioning
        elif isinstance(decomposition, whitening.WhitenedDecomposition):
            outcome.whitened_loss = decomposition.whitened_loss(rank)
            outcome.conditioning = decomposition.conditioning
            if decomposition.two_sided:
                outcome.predicted_kl = fisher.predicted_kl(decomposition.truncated_energy(rank), self.statistics.tokens)
        if isinstance(decomposition, whitening.WhitenedDecomposition):
            outcome.plain_svd_error = lowrank.optimal_relative_error(weight, rank)
        elif self.statistics is not None and layer.x.name in self.statistics.grams:
            outcome.whitened_loss = whitening.activation_loss(self.statistics.grams[layer.x.name], weight, u, v)
        if rank >= lowrank.break_even_rank(layer.k, layer.n):
            outcome.reason = "explicit rank saves nothing"
        outcome.seconds = time.perf_counter() - start
        return outcome, FactorizedLayer(layer=layer, u=u, v=v, align=self.rule.align,
                                        method=f"{self.options.method}/{self.options.svd}")


def target_inputs(model: ir.Model, selection: Selection) -> dict[str, int]:
    """The distinct input values of the selected layers (name → width K): what calibration observes.
    Layers reading the same input (gate and up) share one entry."""
    chosen, _ = select_layers(find_linear_layers(model), selection)
    return {layer.x.name: layer.k for layer in chosen}


def _check_options(rule: RankRule, options: FactorizationOptions, statistics: GramStatistics | None,
                   observer: sequential.GroupObserver | None) -> None:
    if options.method not in METHODS:
        raise UserError(f"--method must be one of {', '.join(METHODS)}")
    if options.method == "whiten" and statistics is None and observer is None:
        raise UserError("--method whiten needs calibration data: pass --calib")
    if options.method == "fisher" and (statistics is None or not statistics.output_grams):
        raise UserError("--method fisher needs output-gradient statistics: pass --calib with a text (and "
                        "--tokenizer) or token ids, or statistics saved by a fisher rewrite's --save-calib-stats")
    if observer is not None and options.method not in ("whiten", "fisher"):
        raise UserError("sequential calibration fits whitened factors: use it with --method whiten or fisher")
    if observer is not None and options.budget == "global" and statistics is None:
        raise UserError("--budget global ranks layers by their independent statistics: gather them too")
    if options.svd == "randomized" and rule.energy is not None:
        raise UserError("--energy needs every singular value: use it with --svd exact")
    if options.budget == "global" and rule.keep is None:
        raise UserError("--budget global spends the parameters --keep would keep: use it with --keep")


def _check_explicit_rank(layers: list[LinearLayer], rule: RankRule) -> None:
    if not isinstance(rule.rank, int):
        return
    too_big = [layer for layer in layers if rule.rank > min(layer.k, layer.n)]
    if too_big:
        layer = too_big[0]
        raise UserError(f"--rank {rule.rank} is above min(K, N) = {min(layer.k, layer.n)} for {layer.name} "
                        f"({layer.k}x{layer.n}){f' and {len(too_big) - 1} more layers' if len(too_big) > 1 else ''}; "
                        "use a smaller rank, --rank full, or --keep")


def _release(layer: LinearLayer) -> None:
    """Unmap the weight's external data: its pages count towards RSS while mapped."""
    tensor = layer.weight.tensor
    if isinstance(tensor, ir.ExternalTensor):
        tensor.release()


def _outcome(layer: LinearLayer, status: str, reason: str = "", **values) -> LayerOutcome:
    return LayerOutcome(name=layer.name, module_path=layer.module_path, role=layer.role, group=layer.group,
                        k=layer.k, n=layer.n, dtype=layer.dtype.name.lower(), status=status, reason=reason,
                        parameters_before=layer.parameters if status != "skipped" else 0,
                        **values)
