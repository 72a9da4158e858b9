"""What a rewrite did: one row per linear layer, how many layers had each outcome, the layers treated alike
(one row each of the summary table), the totals, and the rewritten model with it."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx_ir as ir

from onnx_nmm.model_io import save_derived, weight_bytes
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes import LinearLayer
from onnx_nmm.runtime.host import peak_resident_bytes


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
    status: str  # "factorized", "narrowed" (its MLP keeps `width` neurons), "dense", or "skipped"
    reason: str = ""
    rank: int | None = None
    width: int | None = None  # narrowed: the intermediate neurons its MLP keeps
    parameters_before: int = 0
    parameters_after: int = 0
    relative_error: float | None = None  # ‖W − UV‖_F / ‖W‖_F
    # ‖X(W − UV)‖_F / ‖XW‖_F on the calibration set (fisher: ‖Sᵀ(W − UV)T‖ / ‖SᵀWT‖; a narrowed MLP's output
    # projection: ‖h·W_d − h_S·W_d'‖_F / ‖h·W_d‖_F)
    whitened_loss: float | None = None
    predicted_kl: float | None = None  # fisher: the mean KL per token this layer's truncation adds, to second order
    plain_svd_error: float | None = None  # ‖W − W_r‖_F / ‖W‖_F of plain SVD at the same rank (for comparison)
    conditioning: str = ""  # how XᵀX was factorized (cholesky, damped ε=…, eigendecomposition) and why
    stored_error: float | None = None  # ‖W − UV‖_F / ‖W‖_F with U, V as stored (quantized factors)
    bytes_before: int = 0  # of the weight as stored (codes, scales and zero points when quantized)
    bytes_after: int = 0  # of the factors as stored (the weight's again when it stays)
    seconds: float = 0.0

    @classmethod
    def of(cls, layer: LinearLayer, status: str, reason: str = "", **values) -> LayerOutcome:
        """A row; a layer left as it is keeps its bytes."""
        stored = layer.weight.quantized.stored_bytes if layer.weight.quantized else layer.weight.tensor.nbytes
        values.setdefault("bytes_after", stored if status != "skipped" else 0)
        return cls(name=layer.name, module_path=layer.module_path, role=layer.role, group=layer.group, k=layer.k,
                   n=layer.n, dtype=layer.dtype.name.lower(), status=status, reason=reason,
                   parameters_before=layer.parameters if status != "skipped" else 0,
                   bytes_before=stored if status != "skipped" else 0, **values)


# A layer's outcome in the report, in the order the summary counts them: "dense" is targeted but kept dense
# (its note says why), "skipped" not targeted.
OUTCOMES = ("factorized", "narrowed", "dense", "skipped")


@dataclass
class OutcomeGroup:
    """Targeted layers the rewrite treated alike: the same role, shape, outcome, note and measured errors (the
    dense layers a budget kept, the input projections of MLPs narrowed to one width). One row of the table."""

    layers: list[LayerOutcome]

    @property
    def first(self) -> LayerOutcome:
        return self.layers[0]

    @property
    def parameters_before(self) -> int:
        return sum(layer.parameters_before for layer in self.layers)

    @property
    def parameters_after(self) -> int:
        return sum(layer.parameters_after for layer in self.layers)

    def label(self, prefix: str = "") -> str:
        """The layers' module paths without `prefix`, folded where they differ in one number only
        ("layers.{0-3,5}.mlp.up_proj")."""
        return folded_names([layer.module_path.removeprefix(prefix) or layer.name for layer in self.layers])


def folded_names(names: list[str]) -> str:
    """Names that differ in one number only, as one name with the numbers in braces ("{0-3,5}.mlp.up_proj");
    any other names, listed."""
    if len(names) == 1:
        return names[0]
    pieces = [re.split(r"(\d+)", name) for name in names]  # text, number, text, number, ..., text
    skeletons = {tuple(piece if index % 2 == 0 else "" for index, piece in enumerate(split)) for split in pieces}
    if len(skeletons) == 1:
        varying = [index for index in range(1, len(pieces[0]), 2) if len({split[index] for split in pieces}) > 1]
        if len(varying) == 1:
            folded = list(pieces[0])
            folded[varying[0]] = "{" + number_ranges({int(split[varying[0]]) for split in pieces}) + "}"
            return "".join(folded)
    return ", ".join(names)


def number_ranges(numbers: set[int]) -> str:
    """{0, 1, 2, 3, 5, 7, 8} → "0-3,5,7,8"."""
    ranges: list[list[int]] = []
    for number in sorted(numbers):
        if ranges and number == ranges[-1][-1] + 1:
            ranges[-1].append(number)
        else:
            ranges.append([number])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in ranges)


def _alike(layer: LayerOutcome) -> tuple:
    """What the table shows of a layer besides its name: layers equal in all of it share a row."""
    return (layer.role, layer.k, layer.n, layer.dtype, layer.status, layer.reason, layer.rank, layer.width,
            layer.parameters_after, layer.relative_error, layer.whitened_loss, layer.predicted_kl,
            layer.conditioning)


@dataclass
class RewriteReport:
    rule: str
    selection: str
    method: str
    calibration: str = ""
    calibration_windows: list[str] = field(default_factory=list)  # ids of the windows the statistics came from
    layers: list[LayerOutcome] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)  # the process's high-water mark at each phase's end
    fused_mlps: list[str] = field(default_factory=list)  # SvdGatedMLP/SvdMLP nodes made by fuse_mlp
    unfused_mlps: dict[str, str] = field(default_factory=dict)  # with fuse_mlp: MLP left alone → why
    quality_budget: dict = field(default_factory=dict)  # how the sensitivity pass chose the ranks
    answers: dict = field(default_factory=dict)  # the check prompts' greedy answers, dense and rewritten (answers.py)
    weight_bytes_before: int = 0  # of every initializer of the model, before and after the rewrite
    weight_bytes_after: int = 0

    @classmethod
    def of(cls, options: RewriteOptions, model: ir.Model) -> RewriteReport:
        """The report of a rewrite of `model` under `options`, before any step: its rule, selection and method,
        and the bytes of the model's weights."""
        return cls(rule=options.ranks.describe(), selection=options.selection.describe(),
                   method=options.factorization.describe() + f", {options.ranks.budget} budget",
                   weight_bytes_before=weight_bytes(model))

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """The block's wall time in `seconds`, and the process's peak RSS so far at its end in `peak_rss_bytes`,
        under `phase` (the phase where the mark rises is the one that set it)."""
        start = time.perf_counter()
        yield
        self.seconds[phase] = time.perf_counter() - start
        peak = peak_resident_bytes()  # None where /proc does not say
        if peak is not None:
            self.peak_rss_bytes[phase] = peak

    @property
    def budget_summary(self) -> str:
        """What a quality budget measured on its held-out windows, in a line; "" without a quality budget."""
        from onnx_nmm.ranks.sensitivity import describe_measurement

        return describe_measurement(self.quality_budget) if self.quality_budget else ""

    @property
    def factorized(self) -> list[LayerOutcome]:
        return [layer for layer in self.layers if layer.status == "factorized"]

    def outcome_counts(self) -> dict[str, int]:
        """How many layers had each of OUTCOMES."""
        return {outcome: sum(1 for layer in self.layers if layer.status == outcome) for outcome in OUTCOMES}

    def groups(self) -> list[OutcomeGroup]:
        """The targeted layers, those treated alike together, in the order of each group's first layer."""
        groups: dict[tuple, OutcomeGroup] = {}
        for layer in self.layers:
            if layer.status != "skipped":
                groups.setdefault(_alike(layer), OutcomeGroup([])).layers.append(layer)
        return list(groups.values())

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
            "weight_bytes_before": self.weight_bytes_before,
            "weight_bytes_after": self.weight_bytes_after,
        }

    def to_dict(self) -> dict:
        return {"rule": self.rule, "selection": self.selection, "method": self.method,
                "calibration": self.calibration, "calibration_windows": self.calibration_windows,
                "totals": self.totals(), "seconds": self.seconds, "peak_rss_bytes": self.peak_rss_bytes,
                "fused_mlps": self.fused_mlps, "unfused_mlps": self.unfused_mlps, "quality_budget": self.quality_budget,
                "answers": self.answers,
                "layers": [asdict(layer) for layer in self.layers]}


@dataclass
class RewriteResult:
    """The rewritten model and the report of what was done to it."""

    model: ir.Model
    report: RewriteReport
    source_path: Path | None = None  # the input model's file, when it was given as one
    source_used_external_data: bool = False

    def save(self, path: str | os.PathLike, external_data: bool | None = None, overwrite_input: bool = False) -> Path:
        """Write the model atomically, checked by onnx.checker first. `external_data`: weights to `<name>.data`;
        None = as the input did, or when the weights pass protobuf's 2 GB. Refuses to write over the input
        unless `overwrite_input`."""
        with self.report.timed("writing"):
            return save_derived(self.model, path, self.source_path, self.source_used_external_data, external_data,
                                overwrite_input)
