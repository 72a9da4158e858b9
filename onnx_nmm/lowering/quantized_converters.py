"""onnx2torch converters for the quantized forms an LLM ships in, so that a quantized model lowers too (fisher
statistics, the quality budgets' probe, fine-tuning run on it).

    MatMulNBits             x · W, W dequantized once at conversion (passes.quantized_weights)
    DequantizeLinear        (q − zp) · scale, per tensor, per channel, or in blocks
    QuantizeLinear          clamp(round(x / scale) + zp): the codes as floats, rounded in the forward pass and
                            passed straight through in the backward one (a rounding has no useful gradient)
    DynamicQuantizeLinear   the same, with the uint8 scale and zero point from x's range
    MatMulInteger           (a − a_zp) · (b − b_zp) on those float codes

Codes stay float tensors inside the module: what reads them (DequantizeLinear, MatMulInteger, a Cast) computes
on the values, not on an integer dtype.
"""

from __future__ import annotations

import torch
from onnx2torch.node_converters.registry import add_converter
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OnnxToTorchModule, OperationConverterResult
from torch import nn

from onnx_nmm.lowering.onnx2torch_compat import lowering_domain
from onnx_nmm.passes.quantized_weights import MICROSOFT, NBITS, dequantized

_INTEGER_RANGES = {torch.uint8: (0, 255), torch.int8: (-128, 127)}


class _DequantizedMatMul(nn.Module, OnnxToTorchModule):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x, bias=None):
        y = torch.matmul(x, self.weight.to(x.dtype))
        return y + bias if bias is not None else y


@add_converter(NBITS, 1, lowering_domain(MICROSOFT))
def _matmul_nbits(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    names = list(node.input_values) + [""] * (6 - len(node.input_values))
    x, codes, scales, zero_points, g_idx, bias = names[:6]
    if g_idx or any(name and name not in graph.initializers for name in (codes, scales, zero_points)):
        raise NotImplementedError(f"MatMulNBits '{node.name}' with g_idx or computed codes")
    arrays = [graph.initializers[name].to_torch().numpy() if name else None for name in (codes, scales, zero_points)]
    attributes = node.attributes
    weight = dequantized(NBITS, *arrays, attributes.get("bits", 4), attributes["block_size"], 1, attributes["K"],
                         attributes["N"])
    inputs = (x, bias) if bias else (x,)
    return OperationConverterResult(torch_module=_DequantizedMatMul(torch.from_numpy(weight)),
                                    onnx_mapping=OnnxMapping(inputs=inputs, outputs=node.output_values))


def _per_axis(value: torch.Tensor, like: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """A scale or zero point broadcast to `like`: a scalar as it is, else along `axis` (in blocks)."""
    if value.dim() == 0 or value.numel() == 1:
        return value.reshape(())
    axis %= like.dim()
    if block_size:
        return value.repeat_interleave(block_size, dim=axis).narrow(axis, 0, like.shape[axis])
    shape = [1] * like.dim()
    shape[axis] = -1
    return value.reshape(shape)


class _Dequantize(nn.Module, OnnxToTorchModule):
    def __init__(self, axis: int, block_size: int):
        super().__init__()
        self.axis, self.block_size = axis, block_size

    def forward(self, codes, scale, zero_point=None):
        shift = _per_axis(zero_point.float(), codes, self.axis, self.block_size) if zero_point is not None else 0.0
        return (codes.float() - shift) * _per_axis(scale, codes, self.axis, self.block_size)


def _rounded(value: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """round and clamp in the forward pass, the identity in the backward one."""
    return value + (torch.clamp(torch.round(value), low, high) - value).detach()


class _Quantize(nn.Module, OnnxToTorchModule):
    def __init__(self, axis: int, block_size: int):
        super().__init__()
        self.axis, self.block_size = axis, block_size

    def forward(self, x, scale, zero_point=None):
        low, high = _INTEGER_RANGES.get(zero_point.dtype if zero_point is not None else torch.uint8, (0, 255))
        shift = _per_axis(zero_point.float(), x, self.axis, self.block_size) if zero_point is not None else 0.0
        return _rounded(x / _per_axis(scale, x, self.axis, self.block_size) + shift, low, high)


class _DynamicQuantize(nn.Module, OnnxToTorchModule):
    def forward(self, x):
        low, high = torch.clamp(x.min().detach(), max=0.0), torch.clamp(x.max().detach(), min=0.0)
        scale = (high - low) / 255.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero_point = torch.clamp(torch.round(-low / scale), 0, 255)
        return _rounded(x / scale + zero_point, 0, 255), scale, zero_point


class _IntegerMatMul(nn.Module, OnnxToTorchModule):
    def forward(self, a, b, a_zero_point=None, b_zero_point=None):
        a = a.float() - (a_zero_point.float() if a_zero_point is not None else 0.0)
        b = b.float() - (b_zero_point.float() if b_zero_point is not None else 0.0)
        return torch.matmul(a, b)


def _quantize_like(module_class):
    def converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        module = module_class(node.attributes.get("axis", 1), node.attributes.get("block_size", 0))
        return OperationConverterResult(torch_module=module, onnx_mapping=OnnxMapping(inputs=node.input_values,
                                                                                       outputs=node.output_values))
    return converter


def _plain(module_class):
    def converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        return OperationConverterResult(torch_module=module_class(), onnx_mapping=OnnxMapping(
            inputs=node.input_values, outputs=node.output_values))
    return converter


for _version in (10, 13, 19, 21, 23):
    add_converter("DequantizeLinear", _version)(_quantize_like(_Dequantize))
    add_converter("QuantizeLinear", _version)(_quantize_like(_Quantize))
add_converter("DynamicQuantizeLinear", 11)(_plain(_DynamicQuantize))
add_converter("MatMulInteger", 10)(_plain(_IntegerMatMul))
