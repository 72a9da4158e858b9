"""onnxruntime on an in-memory graph whatever its weights weigh: a static-cache graph of Qwen2.5-0.5B holds 2.5 GB
of float weights, and protobuf serializes 2 GB at most.

    the graph                      a proto whose weights of WEIGHT_BYTES or more are external data named after
                                   themselves, no bytes in it (`weightless_proto`)
    those weights                  handed to onnxruntime as OrtValues over their own arrays
                                   (SessionOptions.add_external_initializers): nothing is serialized or
                                   written (onnxruntime 1.32 still copies them into the session it builds)

A graph read from a proto holds its tensors in it, and each read of one copies it out: `weights_as_arrays` gives
the graphs of one proto their tensors as arrays once, shared, so that neither this module nor a split copies them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeGuard

import numpy as np
import onnx
import onnx_ir as ir

from onnx_nmm.runtime import ort_runner

WEIGHT_BYTES = 1 << 20  # smaller weights stay in the proto: the graph stays one message, quick to build


def weightless_proto(model: ir.Model) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """`model` as a proto whose large weights are references by name, and those weights' arrays."""
    clone = model.clone()  # the tensors are shared; only the clone's values are pointed elsewhere
    weights: dict[str, np.ndarray] = {}
    for name, value in clone.graph.initializers.items():
        tensor = value.const_value
        if tensor is None or tensor.nbytes < WEIGHT_BYTES:
            continue
        weights[name] = np.ascontiguousarray(tensor.numpy())
        value.const_value = ir.ExternalTensor(name, 0, tensor.nbytes, tensor.dtype,
                                              shape=ir.Shape(tensor.shape.numpy()), name=name)
    return ir.to_proto(clone), weights


def session_of(proto: onnx.ModelProto, weights: dict[str, np.ndarray], label: str):
    """An onnxruntime CPU session of `proto` (from weightless_proto), its weights read from `weights`, which it
    keeps alive."""
    return ort_runner.create_session(proto.SerializeToString(), label=label, initializers=weights)


def graph_session(model: ir.Model, label: str):
    """An onnxruntime CPU session of the in-memory `model`."""
    return session_of(*weightless_proto(model), label)


def weights_as_arrays(models: Iterable[ir.Model]) -> None:
    """Every tensor of `models` read from a proto (initializers, node attributes; changed in place) as an array,
    one per proto tensor however many of the models read it. protobuf frees a message only whole, so the proto
    they were read from goes only once none of its tensors is held."""
    arrays: dict[int, tuple[onnx.TensorProto, ir.Tensor]] = {}  # by proto tensor; holding it keeps its id unique

    def as_array(tensor: ir.TensorProtoTensor) -> ir.Tensor:
        if id(tensor.raw) not in arrays:
            arrays[id(tensor.raw)] = (tensor.raw, ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name,
                                                            doc_string=tensor.doc_string))
        return arrays[id(tensor.raw)][1]

    for model in models:
        for value in model.graph.initializers.values():
            if _read_from_proto(value.const_value):
                value.const_value = as_array(value.const_value)
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            for name, attribute in node.attributes.items():
                if attribute.type == ir.AttributeType.TENSOR and _read_from_proto(attribute.value):
                    node.attributes[name] = ir.AttrTensor(name, as_array(attribute.value))


def _read_from_proto(tensor) -> TypeGuard[ir.TensorProtoTensor]:
    """A tensor whose bytes a proto holds (strings aside: they are no weights)."""
    return isinstance(tensor, ir.TensorProtoTensor) and tensor.dtype != ir.DataType.STRING
