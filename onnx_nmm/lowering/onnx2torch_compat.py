"""onnx2torch, made to convert what today's exporters write.

Why onnx2torch: it converts an ONNX graph into a torch.fx module with one converter per (domain, op,
version), and `add_converter` is an extension point for custom domains — exactly what the
`ai.onnx_nmm` ops need. onnx2pytorch converts the Llama exports too, but has no extension point and
fails on GPT-2's Gemm. onnx2torch 1.5.15 (its latest release, 2024) is stale in two ways, fixed here:

1. It imports torchvision at start-up for two converters (NMS, RoIAlign) no LLM uses, and there is
   no CPU build of torchvision for the pinned torch (pip's one fails to load its operators). When
   torchvision cannot be imported, a placeholder stands in; those two converters then fail if used.
2. It knows ONNX ops only up to the versions of 2024, while exporters write any opset from 17 to the
   newest. Coverage is by construction (`extend_to_newer_versions`, run once every converter is
   registered): a version whose inputs, outputs and attributes are those of the version before it — a
   change of element types only, as ONNX's Changelog.md records — gets the previous converter; a version
   that changed its signature does not, unless it is listed in COMPATIBLE_VERSIONS with the reason the
   old converter still computes it. The versions that changed semantics get converters of their own
   below, and the ops onnx2torch lacks (Gelu, RMSNormalization, Attention, ...) are in standard_ops.py.
3. Two of its converters are wrong for what exporters write, and are replaced: Reshape refuses
   `allowzero=1` (the dynamo exporter's default), and Flatten fails on a 1-D input.
4. It names modules `domain/node`, and torch refuses dots in module names: custom-domain ops are
   converted under a dot-free alias of their domain (`lowering_domain`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch
from torch import nn


@contextlib.contextmanager
def _torchvision_if_missing():
    """While onnx2torch imports, a placeholder torchvision if the real one cannot be imported; removed
    afterwards, so nothing else (transformers probes for torchvision) ever sees it."""
    try:
        importlib.import_module("torchvision.ops")
        yield
        return
    except Exception:  # not installed, or a build that cannot load its operators
        for name in [name for name in sys.modules if name == "torchvision" or name.startswith("torchvision.")]:
            del sys.modules[name]

    def unavailable(*_args, **_kwargs):
        raise RuntimeError("this ONNX op needs torchvision, which is not installed")

    package, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")
    ops.nms = ops.roi_align = ops.box_convert = unavailable
    package.ops = ops
    sys.modules.update({"torchvision": package, "torchvision.ops": ops})
    try:
        yield
    finally:
        del sys.modules["torchvision"], sys.modules["torchvision.ops"]


with _torchvision_if_missing():
    import onnx2torch  # noqa: E402
from onnx2torch.node_converters.reduce import OnnxReduceStaticAxes  # noqa: E402
from onnx2torch.node_converters.registry import _CONVERTER_REGISTRY, OperationDescription, add_converter  # noqa: E402
from onnx2torch.onnx_graph import OnnxGraph  # noqa: E402
from onnx2torch.onnx_node import OnnxNode  # noqa: E402
from onnx2torch.utils.common import (  # noqa: E402
    OnnxMapping,
    OnnxToTorchModule,
    OperationConverterResult,
    get_const_value,
    onnx_mapping_from_node,
)

# Versions whose signature changed in a way the previous converter still computes, with the reason.
COMPATIBLE_VERSIONS = {
    ("Cast", 19): "saturate only clips float8 results, types no converter produces",
    ("CastLike", 19): "saturate only clips float8 results, types no converter produces",
    ("Cast", 24): "round_mode only rounds float8 and float4 results, types no converter produces",
    ("CastLike", 24): "round_mode only rounds float8 and float4 results, types no converter produces",
    ("Range", 27): "stash_type sets the precision of float ranges; exporters' ranges are integers",
    ("Split", 18): "num_outputs splits evenly into the declared outputs, as the Split-13 converter does",
}
# Reductions whose `axes` moved from an attribute to an input in opset 18 (ReduceSum did in 13).
AXES_INPUT_REDUCTIONS = ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                         "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")


def _signature(schema) -> tuple:
    return ([(p.name, p.option) for p in schema.inputs], [(p.name, p.option) for p in schema.outputs],
            sorted(schema.attributes))


def extend_to_newer_versions() -> None:
    """Register each ONNX-domain converter for the op's later versions that kept its signature (or are
    COMPATIBLE_VERSIONS), up to the first that did not."""
    from onnx import defs

    history: dict[str, list] = {}
    for schema in defs.get_all_schemas_with_history():
        if schema.domain == "":
            history.setdefault(schema.name, []).append(schema)
    registered: dict[str, list[int]] = {}
    for description in _CONVERTER_REGISTRY:
        if description.domain == "":
            registered.setdefault(description.operation_type, []).append(description.version)
    for op, versions in registered.items():
        schemas = sorted(history.get(op, []), key=lambda schema: schema.since_version)
        latest = max(versions)
        previous = next((schema for schema in schemas if schema.since_version == latest), None)
        if previous is None:  # not an ONNX op (onnxruntime's, registered under every opset)
            continue
        for schema in (schema for schema in schemas if schema.since_version > latest):
            if _signature(schema) != _signature(previous) and (op, schema.since_version) not in COMPATIBLE_VERSIONS:
                break
            converter = _CONVERTER_REGISTRY[OperationDescription("", op, latest)]
            _CONVERTER_REGISTRY[OperationDescription("", op, schema.since_version)] = converter
            previous = schema


def register(domain: str, op: str, versions, converter) -> None:
    """`converter` for `op` of `domain` at each of `versions`, replacing onnx2torch's if it has one."""
    for version in versions:
        _CONVERTER_REGISTRY[OperationDescription(lowering_domain(domain), op, version)] = converter


def converted(node: OnnxNode, module: nn.Module) -> OperationConverterResult:
    """The conversion of `node` to `module`, called with the node's inputs in order."""
    return OperationConverterResult(torch_module=module, onnx_mapping=onnx_mapping_from_node(node))


def lowering_domain(domain: str) -> str:
    """The name a custom domain is converted under: onnx2torch puts it into torch module names."""
    return domain.replace(".", "_")


def _reduce_with_axes_input(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Reduce*-18: `axes` is an optional input, constant (read now) or computed (read at run time)."""
    keepdims = node.attributes.get("keepdims", 1)
    data_only = OnnxMapping(inputs=node.input_values[:1], outputs=node.output_values)
    if len(node.input_values) > 1 and node.input_values[1]:
        try:
            axes = [int(axis) for axis in get_const_value(node.input_values[1], graph).tolist()]
        except KeyError:
            return converted(node, _ReduceWithAxesInput(node.operation_type, keepdims))
    else:
        axes = None
    if not axes and node.attributes.get("noop_with_empty_axes", 0):
        return OperationConverterResult(torch_module=nn.Identity(), onnx_mapping=data_only)
    return OperationConverterResult(torch_module=OnnxReduceStaticAxes(node.operation_type, axes, keepdims),
                                    onnx_mapping=data_only)


class _ReduceWithAxesInput(nn.Module, OnnxToTorchModule):
    def __init__(self, operation_type: str, keepdims: int):
        super().__init__()
        self.operation_type, self.keepdims = operation_type, keepdims

    def forward(self, x: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
        return OnnxReduceStaticAxes(self.operation_type, [int(a) for a in axes.tolist()], self.keepdims)(x)


class _Reshape(nn.Module, OnnxToTorchModule):
    """ONNX Reshape: a 0 in `shape` copies the input's dimension unless allowzero=1 (then it means 0)."""

    def __init__(self, allowzero: bool):
        super().__init__()
        self.allowzero = allowzero

    def forward(self, x: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
        dims = [int(d) for d in shape.tolist()]
        if not self.allowzero:
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        return torch.reshape(x, dims)


class _Flatten(nn.Module, OnnxToTorchModule):
    """ONNX Flatten: [d0·…·d(axis-1), d(axis)·…·dn], for any rank (1-D included)."""

    def __init__(self, axis: int):
        super().__init__()
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axis = self.axis + x.dim() if self.axis < 0 else self.axis  # axis may equal the rank
        left = 1
        for size in x.shape[:axis]:
            left *= size
        right = 1
        for size in x.shape[axis:]:
            right *= size
        return torch.reshape(x, (left, right))


class _CastLike(nn.Module, OnnxToTorchModule):
    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x.to(like.dtype)


class _SplitToSequence(nn.Module, OnnxToTorchModule):
    def __init__(self, axis: int, keepdims: bool):
        super().__init__()
        self.axis, self.keepdims = axis, keepdims

    def forward(self, x: torch.Tensor, split: torch.Tensor | None = None) -> list[torch.Tensor]:
        if split is None:  # one element per slice along the axis
            parts = torch.split(x, 1, dim=self.axis)
            return [part if self.keepdims else part.squeeze(self.axis) for part in parts]
        sizes = int(split) if split.dim() == 0 else [int(size) for size in split]
        return list(torch.split(x, sizes, dim=self.axis))


class _SequenceAt(nn.Module, OnnxToTorchModule):
    def forward(self, sequence: list[torch.Tensor], position: torch.Tensor) -> torch.Tensor:
        return sequence[int(position)]


def _register_new_converters() -> None:
    for op in AXES_INPUT_REDUCTIONS:
        add_converter(op, 18)(_reduce_with_axes_input)
    for op in ("ReduceMax", "ReduceMin"):  # 20 added bool inputs only
        add_converter(op, 20)(_reduce_with_axes_input)

    def reshape(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        return converted(node, _Reshape(bool(node.attributes.get("allowzero", 0))))

    def flatten(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        return converted(node, _Flatten(node.attributes.get("axis", 1)))

    register("", "Reshape", (5, 13, 14), reshape)
    register("", "Flatten", (1, 9, 11, 13), flatten)

    pad_13 = _CONVERTER_REGISTRY[OperationDescription("", "Pad", 13)]

    def pad(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        """Pad-18 added an optional `axes` input (pads for some axes only); without it, it is Pad-13."""
        if len(node.input_values) > 3 and node.input_values[3]:
            raise NotImplementedError(f"Pad '{node.name}' pads only some axes (its axes input)")
        return pad_13(node, graph)

    register("", "Pad", (18,), pad)

    @add_converter("CastLike", 15)
    def _cast_like(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        return converted(node, _CastLike())

    @add_converter("SplitToSequence", 11)
    def _split_to_sequence(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        module = _SplitToSequence(node.attributes.get("axis", 0), bool(node.attributes.get("keepdims", 1)))
        return converted(node, module)

    @add_converter("SequenceAt", 11)
    def _sequence_at(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        return converted(node, _SequenceAt())


_register_new_converters()

def convert(proto):
    """onnx2torch.convert of a model whose shapes the caller has already inferred: onnx2torch would infer
    them again, and its size probe (`ModelProto.ByteSize`) fails on a model above protobuf's 2 GiB.
    Every node's module keeps its `onnx_mapping` (the ONNX values it reads and writes)."""
    from unittest import mock

    with mock.patch.object(onnx2torch.converter, "safe_shape_inference", lambda model: model):
        return onnx2torch.convert(proto, attach_onnx_mapping=True)


def modules_by_output(module: nn.Module) -> dict[str, nn.Module]:
    """The module of a lowered graph that computes each ONNX value, by value name."""
    return {output: child for child in module.modules() if hasattr(child, "onnx_mapping")
            for output in child.onnx_mapping.outputs}
