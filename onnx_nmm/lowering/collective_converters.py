"""The PyTorch modules of the collectives that join the rank programs of a model split over NeuronCores
(`compile --tp`; runtime/collective_ops.py).

Each module calls the join it is bound to (`bind_collectives`). On the CPU the rank programs run in lock-step in
one process (runtime/rank_programs.py), and the join is their simulated group's, which hands every rank the joined
tensor once each has given its own. On NeuronCores (`compile --tp N` traced with neuronx-distributed,
trainium/rank_tracing.py) the join is `nxd_join`: NxD's collectives over NeuronLink, which the trace records.
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


def nxd_join(kind: str, tensor, axis: int):
    """The collective as neuronx-distributed's tensor-parallel mappings compute it across the tp group: the sum
    (`reduce_from_tensor_model_parallel_region`), or the ranks' parts concatenated in rank order
    (`gather_from_tensor_model_parallel_region`, which gathers along the last axis: another axis is moved last
    for the gather and back)."""
    from neuronx_distributed.parallel_layers import mappings

    if kind == ALL_REDUCE:
        return mappings.reduce_from_tensor_model_parallel_region(tensor)
    last = tensor.dim() - 1
    if axis % tensor.dim() == last:
        return mappings.gather_from_tensor_model_parallel_region(tensor)
    gathered = mappings.gather_from_tensor_model_parallel_region(tensor.movedim(axis, last).contiguous())
    return gathered.movedim(last, axis)


def _all_reduce(node: OnnxNode, graph: OnnxGraph):
    return converted(node, AllReduceModule(node.name))


def _all_gather(node: OnnxNode, graph: OnnxGraph):
    return converted(node, AllGatherModule(node.name, int(node.attributes.get("axis", -1))))


register(DOMAIN, ALL_REDUCE, (DOMAIN_VERSION,), _all_reduce)
register(DOMAIN, ALL_GATHER, (DOMAIN_VERSION,), _all_gather)
