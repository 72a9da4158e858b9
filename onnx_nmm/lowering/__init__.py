"""Lower a (rewritten) ONNX graph to a PyTorch module: onnx2torch for the standard ops, converters of
our own for the `ai.onnx_nmm` ops, which call a kernel backend (kernel_backends.BACKENDS).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import numpy as np
import onnx

from onnx_nmm.errors import MissingDependencyError, ModelError

# Weights above this size are detached while shapes are inferred; smaller ones (shape tensors, which
# inference reads) stay.
_DETACH_BYTES = 4096

if importlib.util.find_spec("onnx2torch") is None or importlib.util.find_spec("torch") is None:
    raise MissingDependencyError("lowering to PyTorch needs torch and onnx2torch: pip install torch && "
                    "pip install --no-deps onnx2torch==1.5.15 (its torchvision dependency is not needed)")

# Each registers its converters on import.
from onnx_nmm.lowering import collective_converters, microsoft_ops, quantized_converters, standard_ops  # noqa: F401
from onnx_nmm.lowering.kernel_backends import (
    BACKENDS,
    EmulatorKernels,
    KernelCall,
    NeuronKernels,
    TorchMath,
    backend_named,
)
from onnx_nmm.lowering.onnx2torch_compat import convert, extend_to_newer_versions, lowering_domain, modules_by_output
from onnx_nmm.lowering.svd_converters import (
    factor_parameters,
    reset_shared_parameters,
    set_backend,
    svd_ops_of,
    weights_as_parameters,
)

extend_to_newer_versions()


def lower(model: onnx.ModelProto | str | os.PathLike, backend=None, *, consume: bool = False):
    """The model as a torch.fx module (inputs and outputs as in the ONNX graph), its custom ops on `backend`.

    `consume=True` lets the lowering rewrite a proto made for the call in place instead of converting a copy
    (one copy of every weight less at the peak; the proto is of no use afterwards).
    Raises ModelError naming every node whose op the lowering does not cover.
    """
    proto = _load_with_shapes(model)
    owned = consume or not isinstance(model, onnx.ModelProto)
    unsupported = unsupported_nodes(proto)
    if unsupported:
        shown = "; ".join(unsupported[:3]) + (f"; and {len(unsupported) - 3} more" if len(unsupported) > 3 else "")
        raise ModelError(f"the lowering to PyTorch, which fisher, finetune, the quality budgets, compile and the "
                         f"torch/emulator backends run the model through, does not cover: {shown}")
    reset_shared_parameters()
    try:
        module = convert(_with_lowering_domains(proto if owned else _copy(proto)))
    except NotImplementedError as error:
        raise ModelError(f"the lowering to PyTorch failed: {error}") from None
    set_backend(module, backend or TorchMath())
    return module.eval()


class CausalLmInputs:
    """The lowered module's inputs for token ids [B, S], in the graph's input order: the causal LM's feeds
    after an empty cache. `model` is anything model_source.ModelSource takes; from a file, an onnxruntime-genai
    folder's config gives the head size its graph leaves free."""

    def __init__(self, model):
        from onnx_nmm.model_source import ModelSource
        from onnx_nmm.runtime.causal_lm import CausalLm

        source = ModelSource.of(model)
        self.order = [value.name for value in source.model.graph.inputs if not value.is_initializer()]
        self.model = CausalLm.of_source(source)
        self.model.feeds(np.zeros((1, 2), np.int64))  # refuse a graph that is no causal LM before any work

    def __call__(self, tokens: np.ndarray) -> tuple:
        import torch

        feeds = self.model.feeds(tokens)
        return tuple(torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in self.order)


def call_lowered(module, *inputs):
    """Run a lowered module on tensors, without gradients and without onnx2torch's internal warnings
    (deprecations in its converters' indexing code, which say nothing about the model)."""
    import torch

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module(*inputs)


def _load_with_shapes(model: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    """The model, weights loaded, with inferred value shapes (some converters read them)."""
    return _with_inferred_shapes(model if isinstance(model, onnx.ModelProto) else onnx.load(str(model)))


def _with_inferred_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` (its value_info changed in place) with the value shapes that shape inference finds, inferred on a
    copy without its large weights' data: a protobuf's memory is freed only with the whole message, so clearing
    and restoring the weights in place would hold them twice."""
    light = onnx.ModelProto(ir_version=proto.ir_version)
    light.opset_import.extend(proto.opset_import)
    light.functions.extend(proto.functions)
    for name in ("node", "input", "output", "value_info"):
        getattr(light.graph, name).extend(getattr(proto.graph, name))
    for tensor in proto.graph.initializer:
        if tensor.ByteSize() > _DETACH_BYTES:
            light.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
        else:
            light.graph.initializer.append(tensor)
    inferred = onnx.shape_inference.infer_shapes(light)
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(inferred.graph.value_info)
    return proto


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    copied = onnx.ModelProto()
    copied.CopyFrom(proto)
    return copied


def _with_lowering_domains(renamed: onnx.ModelProto) -> onnx.ModelProto:
    """`renamed` (changed in place) in the form onnx2torch converts: custom domains without dots (it puts them
    in module names), nodes in topological order, every output named (it reads an empty input name as the value
    of the last node that left an output out), each graph output written by a one-output node (it returns a
    multi-output node's whole tuple for any of its outputs)."""
    sorted_nodes = _topologically_sorted(renamed.graph)
    del renamed.graph.node[:]
    renamed.graph.node.extend(sorted_nodes)
    _give_graph_outputs_a_node_of_their_own(renamed.graph)
    unused = 0
    for node in renamed.graph.node:
        node.domain = lowering_domain(node.domain)
        for index, name in enumerate(node.output):
            if not name:  # an output left out: onnx2torch would take the empty name for a value
                node.output[index], unused = f"onnx_nmm_unused_{unused}", unused + 1
    for entry in renamed.opset_import:
        entry.domain = lowering_domain(entry.domain)
    return renamed


def _give_graph_outputs_a_node_of_their_own(graph: onnx.GraphProto) -> None:
    """Each graph output that a node with several outputs writes is renamed there and copied out by an
    Identity node."""
    from onnx import helper

    outputs = {value.name for value in graph.output}
    copies = []
    for node in graph.node:
        if len(node.output) > 1:
            for index, name in enumerate(node.output):
                if name in outputs:
                    node.output[index] = f"{name}_onnx_nmm_before_output"
                    copies.append(helper.make_node("Identity", [node.output[index]], [name]))
    graph.node.extend(copies)


def _topologically_sorted(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes, each after the nodes whose outputs it reads, otherwise in their order."""
    import heapq

    producer = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
    consumers: dict[int, list[int]] = {}
    waiting = []
    for index, node in enumerate(graph.node):
        needed = {producer[name] for name in node.input if name in producer}
        waiting.append(len(needed))
        for dependency in needed:
            consumers.setdefault(dependency, []).append(index)
    ready = [index for index, count in enumerate(waiting) if count == 0]
    ordered = []
    while ready:
        index = heapq.heappop(ready)
        ordered.append(graph.node[index])
        for consumer in consumers.get(index, []):
            waiting[consumer] -= 1
            if waiting[consumer] == 0:
                heapq.heappush(ready, consumer)
    if len(ordered) < len(graph.node):
        raise ModelError("the graph has a cycle: its nodes cannot be put in an order where each reads only "
                         "values computed before it")
    return ordered


def unsupported_nodes(proto: onnx.ModelProto) -> list[str]:
    """'node (domain::Op version v)' for every node no converter is registered for."""
    from onnx2torch.node_converters.registry import get_converter

    opsets = {entry.domain: entry.version for entry in proto.opset_import}
    missing = []
    for node in proto.graph.node:
        version = opsets.get(node.domain, 1)
        try:
            get_converter(operation_type=node.op_type, version=version, domain=lowering_domain(node.domain))
        except NotImplementedError:
            op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
            missing.append(f"node '{node.name or node.output[0]}' ({op}, opset {version})")
    return missing


__all__ = ["BACKENDS", "CausalLmInputs", "EmulatorKernels", "KernelCall", "NeuronKernels", "TorchMath", "backend_named",
           "call_lowered",
           "factor_parameters", "lower", "modules_by_output", "set_backend", "svd_ops_of", "unsupported_nodes",
           "weights_as_parameters"]
