"""onnxruntime on an in-memory graph whatever its weights weigh: a static-cache graph of Qwen2.5-0.5B holds 2.5 GB
of float weights, and protobuf serializes 2 GB at most.

    the graph                      a proto whose weights of WEIGHT_BYTES or more are external data named after
                                   themselves, no bytes in it (`weightless_proto`)
    those weights                  handed to onnxruntime as OrtValues over their own arrays
                                   (SessionOptions.add_external_initializers): nothing is copied or written
"""

from __future__ import annotations

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
