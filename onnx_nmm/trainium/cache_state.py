"""The decode step with its KV cache kept on the NeuronCore: torch-neuronx's input/output aliasing.

A traced graph takes its inputs from the host and gives its outputs back on every call, and a cache of
max_context positions moved both ways on every token would cost more than the step itself. torch-neuronx keeps
a traced module's parameters on the device as its state, and `input_output_aliases` names, for each state
tensor, the output it is updated from, in place (torch_neuronx.trace's API reference; the pattern of AWS's T5
inference tutorial). So the decode graph is traced as `CacheState`: the lowered graph with its cache inputs held
as the module's parameters, called with the other inputs only. The prefill graphs keep the cache as plain inputs
and outputs; after a prefill, the runtime copies its cache into the decode trace's state, once a sequence:

    prefill[bucket](tokens, mask, cache = 0)  ─ present ─ copy ─▶ CacheState's cache (on the device)
    CacheState(tokens, mask, cache_position)  ─ logits;  present aliases CacheState's cache (updated in place)
"""

from __future__ import annotations

import torch
from torch import nn

from onnx_nmm.lowering import call_lowered
from onnx_nmm.passes.static_cache import CacheLayout


class CacheState(nn.Module):
    """`module` (a lowered graph) with the cache inputs of `layout` held as parameters of `shapes` (per past
    input); called with the graph's other inputs, in their order (`step_inputs`)."""

    def __init__(self, module: nn.Module, input_names: list[str], layout: CacheLayout,
                 shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        self.module = module
        self.input_names = input_names
        self.past = [past for past, _ in layout.cache]
        # named cache.0, cache.1, ... in the layout's order: what runtime/static_cache.StateRunner reads back
        self.cache = nn.ParameterList(nn.Parameter(torch.zeros(shapes[past]), requires_grad=False)
                                      for past in self.past)
        self.step_inputs = [name for name in input_names if name not in self.past]

    def forward(self, *step_inputs):
        given = dict(zip(self.step_inputs, step_inputs, strict=True))
        state = dict(zip(self.past, self.cache, strict=True))
        inputs = (given[name] if name in given else state[name] for name in self.input_names)
        return tuple(call_lowered(self.module, *inputs))  # the logits, then the presents, in the graph's order

    def aliases(self, output_names: list[str], layout: CacheLayout) -> dict[nn.Parameter, int]:
        """torch_neuronx.trace's input_output_aliases: each cache parameter and the index of the present output
        that updates it."""
        presents = dict(layout.cache)
        return {parameter: output_names.index(presents[past]) for past, parameter in zip(self.past, self.cache)}
