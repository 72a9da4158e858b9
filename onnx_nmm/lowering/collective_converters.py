"""The PyTorch modules of the collectives that join the rank programs of a model split over NeuronCores
(`compile --tp`; runtime/collective_ops.py).

On Trainium NxD runs these as collectives over NeuronLink. On the CPU the rank programs run in lock-step in one
process (runtime/rank_programs.py): each module is bound to the group it belongs to (`bind_collectives`), which
hands it the joined tensor once every rank has given its own.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from onnx_nmm.lowering.onnx2torch_compat import OnnxGraph, OnnxNode, OnnxToTorchModule, converted, register
from onnx_nmm.runtime.collective_ops import ALL_GATHER, ALL_REDUCE, DOMAIN, DOMAIN_VERSION


class Join(Protocol):
    """What a collective module calls: the joined tensor of every rank (`kind` ALL_REDUCE or ALL_GATHER)."""

    def __call__(self, kind: str, tensor, axis: int): ...


class _CollectiveModule(nn.Module, OnnxToTorchModule):
    kind = ""

    def __init__(self, node: str, axis: int = -1):
        super().__init__()
        self.node, self.axis = node, axis
        self.join: Join | None = None

    def forward(self, x):
        if self.join is None:
            raise RuntimeError(f"{self.node}: a {self.kind} joins the programs of a model split over NeuronCores; "
                               "run them together (runtime/rank_programs.RankPrograms)")
        return self.join(self.kind, x, self.axis)


class AllReduceModule(_CollectiveModule):
    kind = ALL_REDUCE


class AllGatherModule(_CollectiveModule):
    kind = ALL_GATHER


def bind_collectives(module: nn.Module, join: Join) -> int:
    """Every collective of the lowered `module` calls `join`; how many there are."""
    bound = 0
    for submodule in module.modules():
        if isinstance(submodule, _CollectiveModule):
            submodule.join, bound = join, bound + 1
    return bound


def _all_reduce(node: OnnxNode, graph: OnnxGraph):
    return converted(node, AllReduceModule(node.name))


def _all_gather(node: OnnxNode, graph: OnnxGraph):
    return converted(node, AllGatherModule(node.name, int(node.attributes.get("axis", -1))))


register(DOMAIN, ALL_REDUCE, (DOMAIN_VERSION,), _all_reduce)
register(DOMAIN, ALL_GATHER, (DOMAIN_VERSION,), _all_gather)
