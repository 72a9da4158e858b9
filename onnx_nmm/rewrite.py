"""The rewrite: find linear layers, choose ranks, factorize, swap in SvdMatMul ops.

    model ─ find_linear_layers ─ select_layers ─┬─ per layer: rank rule → SVD → factors
                                                └─ SvdFactorizationPass(factors) ─ model'

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

from onnx_nmm import lowrank
from onnx_nmm.errors import UserError
from onnx_nmm.passes import FactorizedLayer, LinearLayer, Selection, SvdFactorizationPass, find_linear_layers, select_layers

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
    seconds: float = 0.0


@dataclass
class RewriteReport:
    rule: str
    selection: str
    svd: str
    layers: list[LayerOutcome] = field(default_factory=list)

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
        return {"rule": self.rule, "selection": self.selection, "svd": self.svd, "totals": self.totals(),
                "layers": [asdict(layer) for layer in self.layers]}


@dataclass(frozen=True)
class SvdOptions:
    method: str = "exact"  # lowrank.SVD_METHODS
    power_iterations: int = 2
    oversample: int = 64
    seed: int = 0

    def describe(self) -> str:
        if self.method == "randomized":
            return f"randomized(power_iterations={self.power_iterations}, oversample={self.oversample})"
        return self.method


def rewrite_model(model: ir.Model, rule: RankRule, selection: Selection = Selection(), svd: SvdOptions = SvdOptions(),
                  on_layer: Callable[[LayerOutcome], None] | None = None,
                  on_start: Callable[[int], None] | None = None) -> RewriteReport:
    """Factorize the selected linear layers of `model` in place; return what was done to each.

    `on_start(n)` is told how many layers will be factorized, `on_layer` hears about each one as it
    finishes (for progress bars). Raises UserError when nothing can be targeted.
    """
    if svd.method == "randomized" and rule.energy is not None:
        raise UserError("--energy needs every singular value: use it with --svd exact")
    layers = find_linear_layers(model)
    if not layers:
        raise UserError("no linear layer found: looked for MatMul/Gemm nodes whose second input is a constant weight "
                        "(an initializer or a Constant, possibly behind Identity/Transpose/Cast)")
    chosen, skipped = select_layers(layers, selection)
    if not chosen:
        raise UserError(f"none of the {len(layers)} linear layers matches {selection.describe()}; "
                        "see `onnx-nmm inspect` for their names and roles")
    _check_explicit_rank(chosen, rule)
    report = RewriteReport(rule=rule.describe(), selection=selection.describe(), svd=svd.describe())
    if on_start is not None:
        on_start(len(chosen))
    factorized: list[FactorizedLayer] = []
    chosen_set = {id(layer) for layer in chosen}
    for layer in layers:
        if id(layer) not in chosen_set:
            report.layers.append(_outcome(layer, "skipped", skipped[layer.name]))
            continue
        outcome, factors = _factorize(layer, rule, svd)
        report.layers.append(outcome)
        if factors is not None:
            factorized.append(factors)
        if on_layer is not None:
            on_layer(outcome)
    SvdFactorizationPass(factorized)(model)
    return report


def _factorize(layer: LinearLayer, rule: RankRule, svd: SvdOptions) -> tuple[LayerOutcome, FactorizedLayer | None]:
    start = time.perf_counter()
    rank, reason = rule.rank_before_svd(layer.k, layer.n)
    if rank is None and reason is not None:
        return _outcome(layer, "dense", reason, parameters_after=layer.parameters), None
    weight = layer.weight_matrix()
    _release(layer)
    decomposition = lowrank.decompose(weight, svd.method, rank_hint=rank, oversample=svd.oversample,
                                      power_iterations=svd.power_iterations, seed=svd.seed)
    del weight
    if rank is None:
        rank, reason = rule.rank_from_spectrum(layer.k, layer.n, decomposition.singular_values)
        if rank is None:
            return _outcome(layer, "dense", reason, parameters_after=layer.parameters), None
    u, v = decomposition.factors(rank, dtype=np.float64)
    outcome = _outcome(layer, "factorized", rank=rank, parameters_after=rank * (layer.k + layer.n),
                       relative_error=decomposition.relative_error(rank), seconds=time.perf_counter() - start)
    if rank >= lowrank.break_even_rank(layer.k, layer.n):
        outcome.reason = "explicit rank saves nothing"
    return outcome, FactorizedLayer(layer=layer, u=u, v=v, align=rule.align, method=svd.method)


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
