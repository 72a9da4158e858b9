"""Weights as a rewrite stores them: new initializers (float, or quantized codes with their scales and zero
points), and the nodes that multiply an activation by one in the form its layer used.

    float          MatMul(X, W)                      W in the layer's dtype, behind a Cast when it computes in another
    MatMulNBits    MatMulNBits(X, codes, scales, zero points)
    QDQ            MatMul(X, DequantizeLinear(codes, scales, zero points))
    MatMulInteger  Cast(MatMulInteger(Xq, codes, zx, zw)) · (sx · scales)     Xq, sx, zx: X's DynamicQuantizeLinear

Both rewrites use them: the SVD factorization (each factor a product) and MLP narrowing (narrower weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_nmm.passes.linear_layers import LinearLayer
from onnx_nmm.passes.quantized_weights import INTEGER, MICROSOFT, NBITS, dequantized


@dataclass
class QuantizedFactor:
    """A matrix stored quantized (an SVD factor, or a narrowed weight): codes, scales, zero points (None:
    symmetric), and its node's attributes (MatMulNBits: K, N, bits, block_size; DequantizeLinear: axis)."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    attributes: dict

    def matrix(self, format: str, bits: int, block_size: int, k: int, n: int) -> np.ndarray:
        """The float32 factor [k, n] the stored arrays stand for."""
        return dequantized(format, self.codes, self.scales, self.zero_points, bits, block_size,
                           self.attributes.get("axis", 1), k, n)

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in (self.codes, self.scales, self.zero_points) if array is not None)


class NameAllocator:
    """Initializer names that do not clash with anything in the graph."""

    def __init__(self, graph: ir.Graph):
        self.taken = set(graph.initializers) | {v.name for v in graph.inputs} | {
            out.name for node in graph for out in node.outputs}

    def fresh(self, wanted: str) -> str:
        name, suffix = wanted, 1
        while name in self.taken:
            name, suffix = f"{wanted}.{suffix}", suffix + 1
        self.taken.add(name)
        return name


def initializer(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    stored = np.ascontiguousarray(array.astype(dtype.numpy()))
    value = ir.Value(name=name, shape=ir.Shape(stored.shape), type=ir.TensorType(dtype),
                     const_value=ir.tensor(stored, dtype=dtype, name=name))
    graph.register_initializer(value)
    return value


def quantized_initializers(graph: ir.Graph, name: str, factor: QuantizedFactor) -> list[ir.Value]:
    """[codes, scales(, zero points)] of a quantized matrix, registered as initializers (or found, if they are)."""
    arrays = [("", factor.codes), ("_scales", factor.scales), ("_zero_points", factor.zero_points)]
    values = []
    for suffix, array in arrays:
        if array is None:
            continue
        if name + suffix in graph.initializers:
            values.append(graph.initializers[name + suffix])
        else:
            values.append(initializer(graph, name + suffix, array, ir.DataType.from_numpy(array.dtype)))
    return values


def dequantize(codes: ir.Value, factor: QuantizedFactor, nodes: list[ir.Node]) -> ir.Value:
    """DequantizeLinear of stored codes (their scales and zero points found under the codes' name)."""
    graph, name = codes.graph, codes.name
    assert graph is not None and name is not None, "stored codes are a named initializer of a graph"
    inputs = [graph.initializers[name + suffix] for suffix in ("", "_scales", "_zero_points")
              if name + suffix in graph.initializers]
    node = ir.Node("", "DequantizeLinear", inputs, [ir.AttrInt64("axis", factor.attributes["axis"])], num_outputs=1,
                   name=f"{codes.name}.dequantize")
    node.outputs[0].name = f"{codes.name}.dequantized"
    nodes.append(node)
    return node.outputs[0]


def cast(value: ir.Value, to: ir.DataType, nodes: list[ir.Node]) -> ir.Value:
    node = ir.Node("", "Cast", [value], [ir.AttrInt64("to", to.value)], num_outputs=1, name=f"{value.name}.cast")
    node.outputs[0].name = f"{value.name}.cast"
    nodes.append(node)
    return node.outputs[0]


def bias_value(graph: ir.Graph, layer: LinearLayer, names: NameAllocator, suffix: str) -> ir.Value | None:
    """The layer's bias input: the original constant, or a new one (named `<layer>.<suffix>`) when Gemm's beta
    had to be applied."""
    if layer.bias is None or layer.beta == 1.0:
        return layer.bias
    bias = layer.bias_vector()
    tensor = ir.convenience.get_const_tensor(layer.bias)
    assert tensor is not None, "a layer's bias is a constant (linear_layers: _is_bias)"
    dtype = tensor.dtype
    return initializer(graph, names.fresh(f"{layer.name}.{suffix}"), bias, dtype)


def nbits_node(x: ir.Value, stored: list[ir.Value], factor: QuantizedFactor, name: str, metadata: dict) -> ir.Node:
    """MatMulNBits(X, codes, scales(, zero points)) with the stored matrix's attributes."""
    attributes = [ir.AttrInt64(key, value) for key, value in factor.attributes.items() if isinstance(value, int)]
    return ir.Node(MICROSOFT, NBITS, [x, *stored], attributes, num_outputs=1, name=name, metadata_props=metadata)


def integer_product(quantized_x: tuple[ir.Value, ir.Value, ir.Value], stored: list[ir.Value], dtype: ir.DataType,
                    name: str, nodes: list[ir.Node]) -> ir.Value:
    """X·W with X dynamically quantized (Xq, sx, zx) and W stored as int8 codes, scales, zero points, as
    onnxruntime's dynamic quantization computes it; the nodes are named `name`, `name_cast`, ..."""
    quantized, x_scale, x_zero_point = quantized_x
    codes, scales, zero_points = stored

    def node(op_type, inputs, label, **integers):
        nodes.append(ir.Node("", op_type, inputs, [ir.AttrInt64(key, value) for key, value in integers.items()],
                             num_outputs=1, name=f"{name}{label}"))
        return nodes[-1].outputs[0]

    product = node(INTEGER, [quantized, codes, x_zero_point, zero_points], "")
    widened = node("Cast", [product], "_cast", to=dtype.value)
    scale = node("Mul", [x_scale, scales], "_scales")
    return node("Mul", [widened, scale], "_rescaled")


def dynamic_quantization(value: ir.Value, name: str, nodes: list[ir.Node]) -> tuple[ir.Value, ir.Value, ir.Value]:
    """DynamicQuantizeLinear(value): its codes, scale and zero point."""
    nodes.append(ir.Node("", "DynamicQuantizeLinear", [value], num_outputs=3, name=name))
    codes, scale, zero_point = nodes[-1].outputs
    return codes, scale, zero_point


def drop_unread_weight_inputs(graph: ir.Graph, weights: list[ir.Value]) -> None:
    """A replaced weight that an older exporter also listed as a graph input would stay a required input once
    its initializer goes: drop both when nothing reads it any more."""
    for weight in weights:
        if weight in graph.inputs and not list(weight.uses()):
            graph.inputs.remove(weight)
            if weight.name is not None:
                graph.initializers.pop(weight.name, None)
