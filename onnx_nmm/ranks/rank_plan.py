"""Ranks: the rules that pick them, and the plan every way of choosing them returns.

    RankPlan = {target layer's name: rank | Dense(reason) | Narrowed(width)}

Every target has an entry, which the factorization consumes; Dense says why a target keeps its weight;
Narrowed says that the target is a projection of an MLP that keeps `width` of its intermediate neurons
(onnx_nmm.decomposition.nystrom), every projection of the MLP alike.
The simple rules are here — the block-aligned keep rule (docs/design.md §2), one explicit rank, an energy
threshold, the ranks of an earlier report; the global budget is in rank_allocation, the quality budgets
in sensitivity.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnx_nmm.errors import OptionError
from onnx_nmm.passes import LinearLayer


@dataclass(frozen=True)
class Dense:
    """A target that keeps its dense weight, and why."""

    reason: str


@dataclass(frozen=True, order=True)
class Narrowed:
    """A projection of an MLP narrowed to `width` of its `of` intermediate neurons."""

    width: int
    of: int


RankPlan = dict[str, "int | Dense | Narrowed"]
RankOrWidth = int | Narrowed  # a choice that compresses: a matrix's rank, or its MLP's kept width


def break_even_rank(k: int, n: int) -> float:
    """Factorizing K×N pays off only for r below K·N/(K+N): then r·(K+N) < K·N parameters."""
    return k * n / (k + n)


def aligned_ranks(k: int, n: int, align: int) -> list[int]:
    """The multiples of `align` that save parameters on a K×N matrix, largest first."""
    top = align * math.floor((break_even_rank(k, n) - 1e-9) / align)
    return list(range(top, 0, -align))


def block_aligned_rank(k: int, n: int, keep: float, align: int) -> int:
    """The rank that keeps a fraction `keep` of W's parameters, rounded to a multiple of `align`.

    r = align · round(keep · K·N / ((K + N) · align))   (NeuronMM §4.1; docs/design.md §2)
    """
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    return align * round(keep * k * n / ((k + n) * align))


def energy_rank(singular_values: np.ndarray, energy: float, align: int) -> int:
    """The smallest multiple of `align` whose leading singular values hold `energy` of Σσ²."""
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    captured = np.cumsum(np.asarray(singular_values, dtype=np.float64) ** 2)
    needed = int(np.searchsorted(captured, energy * captured[-1] * (1 - 1e-12))) + 1
    return min(align * math.ceil(needed / align), len(singular_values))


def parameters(k: int, n: int, choice: int | Dense | Narrowed) -> int:
    """Parameters of a K×N layer at a rank, dense, or narrowed (an input projection loses columns, the output
    projection rows)."""
    if isinstance(choice, Narrowed):
        return k * choice.width if n == choice.of else choice.width * n
    return k * n if isinstance(choice, Dense) else choice * (k + n)


def aligned_widths(width: int, align: int) -> list[int]:
    """The multiples of `align` below an MLP's `width`: the widths narrowing it may keep, largest first."""
    return list(range(align * ((width - 1) // align), 0, -align))


def keep_width(width: int, keep: float, align: int) -> Narrowed | Dense:
    """The `align`-ed width keeping the fraction `keep` of an MLP's neurons (and so of its parameters)."""
    kept = align * round(keep * width / align)
    if kept == 0:
        return Dense(f"width rounds to 0 at align {align} (a smaller align keeps some neurons)")
    if kept >= width:
        return Dense(f"width {kept} keeps every neuron of {width}")
    return Narrowed(kept, width)


def worth_factorizing(rank: int, k: int, n: int, align: int) -> int | Dense:
    """`rank`, or Dense when it rounds to nothing or saves no parameters."""
    if rank == 0:
        return Dense(f"rank rounds to 0 at align {align} (a smaller align keeps a rank)")
    if rank >= break_even_rank(k, n):
        return Dense(f"rank {rank} saves nothing (break-even {break_even_rank(k, n):.0f})")
    return rank


def keep_choice(layer: LinearLayer, keep: float, align: int) -> int | Dense:
    """The block-aligned rank keeping the fraction `keep` of the layer's parameters."""
    return worth_factorizing(block_aligned_rank(layer.k, layer.n, keep, align), layer.k, layer.n, align)


def energy_choice(layer: LinearLayer, singular_values: np.ndarray, energy: float, align: int) -> int | Dense:
    """The smallest aligned rank whose leading singular values hold `energy` of Σσ²."""
    return worth_factorizing(energy_rank(singular_values, energy, align), layer.k, layer.n, align)


def explicit_ranks(layers: list[LinearLayer], rank: int | str) -> RankPlan:
    """One rank for every layer ("full": min(K, N)); refused where it exceeds min(K, N)."""
    too_big = [layer for layer in layers if isinstance(rank, int) and rank > min(layer.k, layer.n)]
    if too_big:
        layer = too_big[0]
        more = f" and {len(too_big) - 1} more layers" if len(too_big) > 1 else ""
        raise OptionError(f"{{rank}} {rank} is above min(K, N) = {min(layer.k, layer.n)} for {layer.name} "
                          f"({layer.k}x{layer.n}){more}; use a smaller rank, full rank, or {{keep}}",
                          rank="ranks.rank", keep="ranks.keep")
    return {layer.name: min(layer.k, layer.n) if not isinstance(rank, int) else rank for layer in layers}


def check_report_files(ranks) -> None:
    """The reports that `ranks` (RankOptions) reads exist: checked before the model loads, so a typo costs no
    time."""
    for option in ("ranks_from", "sensitivity_from"):
        path = getattr(ranks, option)
        if isinstance(path, (str, os.PathLike)) and not Path(path).is_file():
            raise OptionError(f"{{{option}}} {path}: no such file; give the report an earlier rewrite wrote",
                              **{option: f"ranks.{option}"})


def plan_from_report(source: str | os.PathLike | Mapping[str, int | Narrowed | None], layers: list[LinearLayer],
                     all_layers: list[LinearLayer]) -> RankPlan:
    """The ranks (and widths) an earlier rewrite of this model chose: from its report, or from a mapping layer →
    rank or Narrowed (None: dense). Refused when it names layers this model does not have with that shape."""
    ranks: dict[str, int | Narrowed | None]
    shapes: dict[str, tuple[int, int]]
    if isinstance(source, Mapping):
        ranks, shapes, label = dict(source), {}, "the given plan"
    else:
        ranks, shapes = _report_ranks(source)
        label = str(source)
    ours = {layer.name: (layer.k, layer.n) for layer in all_layers}
    foreign = sorted(name for name in ranks if name not in ours or shapes.get(name, ours[name]) != ours[name])
    if foreign:
        raise OptionError(f"{{ranks_from}} {label} names {len(foreign)} layers this model does not have with that "
                          f"shape ({foreign[0]}, ...): it describes another model", ranks_from="ranks.ranks_from")
    kept_dense = Dense(f"kept dense in {label}")
    return {layer.name: ranks.get(layer.name) or kept_dense for layer in layers}


def _report_ranks(path: str | os.PathLike) -> tuple[dict[str, int | Narrowed | None], dict[str, tuple[int, int]]]:
    try:
        targeted = [layer for layer in json.loads(Path(path).read_text())["layers"] if layer["status"] != "skipped"]
        ranks = {layer["name"]: _reported_choice(layer) for layer in targeted}
        shapes = {layer["name"]: (layer["k"], layer["n"]) for layer in targeted}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise OptionError(f"{{ranks_from}} {path} is not a rewrite report ({error})",
                          ranks_from="ranks.ranks_from") from None
    return ranks, shapes


def _reported_choice(row: dict) -> int | Narrowed | None:
    """A report row's choice: its rank, its MLP's kept width (of the width its MLP had), or None (dense)."""
    if row["status"] == "narrowed":
        return Narrowed(row["width"], row["k"] if row["role"] in ("down", "fc2") else row["n"])
    return row["rank"] if row["status"] == "factorized" else None
