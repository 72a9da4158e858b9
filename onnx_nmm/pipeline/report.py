"""What a rewrite did: one row per linear layer, the totals, and the rewritten model with it."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx_ir as ir

from onnx_nmm.model_io import (
    PROTOBUF_LIMIT,
    carry_genai_config,
    check_model_file,
    check_output_path,
    save_model,
    weight_bytes,
)
from onnx_nmm.passes import LinearLayer


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


@dataclass
class RewriteReport:
    rule: str
    selection: str
    method: str
    calibration: str = ""
    calibration_windows: list[str] = field(default_factory=list)  # ids of the windows the statistics came from
    layers: list[LayerOutcome] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase
    fused_mlps: list[str] = field(default_factory=list)  # SvdGatedMLP/SvdMLP nodes made by fuse_mlp
    unfused_mlps: dict[str, str] = field(default_factory=dict)  # with fuse_mlp: MLP left alone → why
    quality_budget: dict = field(default_factory=dict)  # how the sensitivity pass chose the ranks
    answers: dict = field(default_factory=dict)  # the check prompts' greedy answers, dense and rewritten (answers.py)
    weight_bytes_before: int = 0  # of every initializer of the model, before and after the rewrite
    weight_bytes_after: int = 0

    @property
    def budget_summary(self) -> str:
        """What a quality budget measured on its held-out windows, in a line; "" without a quality budget."""
        from onnx_nmm.ranks.sensitivity import describe_measurement

        return describe_measurement(self.quality_budget) if self.quality_budget else ""

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
            "weight_bytes_before": self.weight_bytes_before,
            "weight_bytes_after": self.weight_bytes_after,
        }

    def to_dict(self) -> dict:
        return {"rule": self.rule, "selection": self.selection, "method": self.method,
                "calibration": self.calibration, "calibration_windows": self.calibration_windows,
                "totals": self.totals(), "seconds": self.seconds,
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
        start = time.perf_counter()
        if self.source_path is not None:
            check_output_path(self.source_path, path, overwrite_input)
        if external_data is None:
            external_data = self.source_used_external_data
        external_data = external_data or weight_bytes(self.model) > PROTOBUF_LIMIT
        written = save_model(self.model, path, external_data=external_data,
                             validate=functools.partial(check_model_file, source=self.source_path))
        if self.source_path is not None:
            carry_genai_config(self.source_path, written)
        self.report.seconds["writing"] = time.perf_counter() - start
        return written
