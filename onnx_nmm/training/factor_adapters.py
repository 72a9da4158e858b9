"""Low-rank adapters on the SVD factors of a lowered model (LoRA on U and V), merged back after training.

Each factor F [m, n] (a U or a V) is read as

    F + A·B        A [m, a], B [a, n], a = the adapter rank

B starts at zero, so training starts from the rewritten model exactly; A starts random in ±1/√m (as
LoRA does) so that B gets a gradient. Only A and B train; F stays frozen. Merging writes F + A·B into F
and removes the adapters: the module is a plain lowered module again, with the same factor shapes.

A factor that several ops share (one initializer) gets one adapter.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from onnx_nmm.lowering import factor_parameters, svd_ops_of


class LowRankDelta(nn.Module):
    """F ↦ F + A·B, the parametrization torch applies whenever the op reads its factor."""

    def __init__(self, rows: int, cols: int, rank: int, generator: torch.Generator):
        super().__init__()
        bound = 1 / math.sqrt(rows)
        self.a = nn.Parameter(torch.empty(rows, rank).uniform_(-bound, bound, generator=generator))
        self.b = nn.Parameter(torch.zeros(rank, cols))

    def forward(self, factor: torch.Tensor) -> torch.Tensor:
        return factor + self.a @ self.b


def add_adapters(module: nn.Module, rank: int, seed: int = 0) -> dict[str, LowRankDelta]:
    """Put an adapter of `rank` on every factor of the lowered `module`; return them by initializer name."""
    generator = torch.Generator().manual_seed(seed)
    adapters: dict[str, LowRankDelta] = {}
    for op in svd_ops_of(module):
        for index, (name, factor) in enumerate(zip(op.factor_names, list(op.factors))):
            if name not in adapters:
                adapters[name] = LowRankDelta(factor.shape[0], factor.shape[1], rank, generator)
            parametrize.register_parametrization(op.factors, str(index), adapters[name])
    return adapters


def merge_adapters(module: nn.Module, adapters: dict[str, LowRankDelta]) -> None:
    """F ← F + A·B for every adapted factor, then remove the adapters from `module`."""
    with torch.no_grad():
        merged: dict[str, torch.Tensor] = {}
        for op in svd_ops_of(module):
            for index, name in enumerate(op.factor_names):
                merged.setdefault(name, adapters[name](op.factors.parametrizations[str(index)].original))
        for op in svd_ops_of(module):
            for index in range(len(op.factor_names)):
                parametrize.remove_parametrizations(op.factors, str(index), leave_parametrized=False)
        for name, factor in factor_parameters(module).items():
            factor.copy_(merged[name])
