"""How quantized formats store a linear layer's weight, and how to read it back as a float matrix W [K, N].

    MatMulNBits (com.microsoft)   codes [N, blocks, blob] uint8: `bits`-bit codes of Wᵀ's rows packed along K,
                                  low bits first; scales [N·blocks] or [N, blocks]; zero points packed
                                  [N, ⌈blocks·bits/8⌉] uint8, or [N, blocks] in the scales' dtype, or absent
                                  (2^(bits−1)):  W[k, n] = (q[n, k] − zp[n, k // block]) · scale[n, k // block]
    DequantizeLinear → MatMul     W = (q − zp) · scale, per tensor, per channel along `axis`, or in blocks of
                                  `block_size` along it (opset 21)
    MatMulInteger                 onnxruntime's dynamic quantization: X → DynamicQuantizeLinear → (Xq, sx, zx);
                                  Y = float(MatMulInteger(Xq, Wq, zx, zw)) · (sx · sw), W = (Wq − zw) · sw

A form these do not cover (MatMulNBits with g_idx or a 2-bit code, QLinearMatMul, DynamicQuantizeMatMul)
is listed by `unsupported_quantized`, so that inspect and rewrite name the op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

NBITS = "MatMulNBits"
DEQUANTIZE = "DequantizeLinear"
INTEGER = "MatMulInteger"
MICROSOFT = "com.microsoft"
# Quantized products of activations and weights that no rewrite reads: named, never mistaken for dense.
_QUANTIZED_PRODUCTS = ("QLinearMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm", "MatMulFpQ4",
                       "MatMulBnb4")


@dataclass
class QuantizedWeight:
    """A weight kept quantized: its format, the constants that hold it, and the format's parameters."""

    format: str  # NBITS or DEQUANTIZE
    codes: ir.Value
    scales: ir.Value
    zero_points: ir.Value | None = None
    bits: int = 8
    block_size: int = 0  # 0: per tensor or per channel (DequantizeLinear without blocks)
    axis: int = 1  # DequantizeLinear: the axis scales run along
    node: ir.Node | None = None  # the DequantizeLinear node (DEQUANTIZE)
    attributes: dict = field(default_factory=dict)  # MatMulNBits: K, N, and the rest to write the factors back

    @property
    def float_dtype(self) -> ir.DataType:
        return _const(self.scales).dtype

    def dequantize(self, k: int, n: int) -> np.ndarray:
        """W [K, N] float32 (stored orientation for DEQUANTIZE: the caller transposes)."""
        zero_points = _const(self.zero_points).numpy() if self.zero_points is not None else None
        return dequantized(self.format, _const(self.codes).numpy(), _const(self.scales).numpy(), zero_points,
                           self.bits, self.block_size, self.axis, k, n)

    @property
    def stored_bytes(self) -> int:
        return sum(_const(value).nbytes for value in (self.codes, self.scales, self.zero_points) if value is not None)


def dequantized(format: str, codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int,
                block_size: int, axis: int, k: int, n: int) -> np.ndarray:
    """The float32 matrix quantized arrays stand for: W [K, N] for MatMulNBits, the codes' shape otherwise."""
    if format == NBITS:
        return _nbits_weight(codes, scales, zero_points, bits, block_size, k, n)
    return _dequantize_linear(codes, scales, zero_points, block_size, axis)


def nbits_layer_parts(node: ir.Node) -> tuple[QuantizedWeight, int, int, ir.Value | None] | None:
    """(weight, K, N, bias) of a MatMulNBits this rewrite can read, else None."""
    if node.op_type != NBITS or node.domain != MICROSOFT:
        return None
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    _, codes, scales, zero_points, g_idx, bias = inputs[:6]
    constants = (codes, scales, zero_points, bias)
    if codes is None or scales is None or g_idx is not None or any(
            value is not None and _const(value) is None for value in constants):
        return None
    attributes = {name: attribute.value for name, attribute in node.attributes.items()}
    if attributes.get("bits", 4) not in (4, 8):
        return None
    weight = QuantizedWeight(NBITS, codes, scales, zero_points, bits=attributes.get("bits", 4),
                             block_size=attributes["block_size"], attributes=attributes)
    return weight, attributes["K"], attributes["N"], bias


def dequantize_linear_parts(node: ir.Node) -> QuantizedWeight | None:
    """The weight a DequantizeLinear of constants reconstructs, else None."""
    if node.op_type != DEQUANTIZE or node.domain not in ("", "ai.onnx"):
        return None
    codes, scales = node.inputs[0], node.inputs[1]
    zero_points = node.inputs[2] if len(node.inputs) > 2 else None
    if codes is None or scales is None or any(value is not None and _const(value) is None
                                              for value in (codes, scales, zero_points)):
        return None
    axis, block_size = node.attributes.get("axis"), node.attributes.get("block_size")
    return QuantizedWeight(DEQUANTIZE, codes, scales, zero_points, bits=_const(codes).dtype.itemsize * 8,
                           block_size=block_size.as_int() if block_size is not None else 0,
                           axis=axis.as_int() if axis is not None else 1, node=node)


@dataclass
class IntegerProduct:
    """A dynamically quantized product: the weight, the DynamicQuantizeLinear of X (which several layers may
    read), the nodes after MatMulInteger (Cast, the scales' Mul, the output Mul), and Y."""

    weight: QuantizedWeight
    quantizer: ir.Node
    chain: list[ir.Node]
    output: ir.Value


def integer_layer_parts(node: ir.Node) -> IntegerProduct | None:
    """The parts of onnxruntime's dynamically quantized MatMul around this MatMulInteger, else None."""
    if node.op_type != INTEGER or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    x, codes, zero_points = node.inputs[0], node.inputs[1], node.inputs[3] if len(node.inputs) > 3 else None
    quantizer = x.producer() if x is not None else None
    if quantizer is None or quantizer.op_type != "DynamicQuantizeLinear" or codes is None or _const(codes) is None:
        return None
    if zero_points is not None and _const(zero_points) is None:
        return None
    cast = _only_reader(node.outputs[0], "Cast")
    rescale = _only_reader(cast.outputs[0], "Mul") if cast is not None else None
    if cast is None or rescale is None:
        return None
    scales_product = next((value.producer() for value in rescale.inputs
                           if value is not None and value is not cast.outputs[0]), None)
    if scales_product is None or scales_product.op_type != "Mul" or quantizer.outputs[1] not in scales_product.inputs:
        return None
    scales = next(value for value in scales_product.inputs if value is not quantizer.outputs[1])
    if scales is None or _const(scales) is None:
        return None
    chain = [cast, *([scales_product] if len(list(scales_product.outputs[0].uses())) == 1 else []), rescale]
    weight = QuantizedWeight(INTEGER, codes, scales, zero_points, bits=8, axis=1)
    return IntegerProduct(weight, quantizer, chain, rescale.outputs[0])


def unsupported_quantized(node: ir.Node) -> str | None:
    """The op of a quantized product of an activation and a constant that no rewrite reads, else None."""
    if node.op_type in _QUANTIZED_PRODUCTS:
        return node.op_type
    if node.op_type == NBITS and nbits_layer_parts(node) is None:
        return f"{NBITS} (g_idx, a 2-bit code or a computed weight)"
    if node.op_type == INTEGER and integer_layer_parts(node) is None:
        return f"{INTEGER} (not onnxruntime's dynamic quantization pattern)"
    return None


def _only_reader(value: ir.Value, op_type: str) -> ir.Node | None:
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 and uses[0].node.op_type == op_type else None


def _nbits_weight(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int, block: int,
                  k: int, n: int) -> np.ndarray:
    blocks = -(-k // block)
    codes = codes.reshape(n, blocks, -1)
    if bits == 4:
        codes = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(n, blocks, -1)  # low nibble first
    q = codes.reshape(n, blocks, block).astype(np.float32)
    scales = scales.astype(np.float32).reshape(n, blocks)
    zero_points = _nbits_zero_points(zero_points, bits, n, blocks)
    rows = ((q - zero_points[..., None]) * scales[..., None]).reshape(n, blocks * block)[:, :k]
    return np.ascontiguousarray(rows.T)


def _nbits_zero_points(stored: np.ndarray | None, bits: int, n: int, blocks: int) -> np.ndarray:
    if stored is None:
        return np.full((n, blocks), 2.0 ** (bits - 1), np.float32)
    if stored.dtype != np.uint8:  # zero points in the scales' dtype, one per block
        return stored.astype(np.float32).reshape(n, blocks)
    stored = stored.reshape(n, -1)
    if bits == 4:
        stored = np.stack([stored & 0x0F, stored >> 4], axis=-1).reshape(n, -1)
    return stored[:, :blocks].astype(np.float32)


def _dequantize_linear(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, block_size: int,
                       axis: int) -> np.ndarray:
    codes = codes.astype(np.float32)
    scales = scales.astype(np.float32)
    zero_points = zero_points.astype(np.float32) if zero_points is not None else np.zeros_like(scales)
    if scales.ndim == 0 or scales.size == 1:
        return (codes - zero_points.reshape(())) * scales.reshape(())
    axis = axis % codes.ndim
    if block_size:  # scales hold one entry per block along `axis`
        scales = np.repeat(scales, block_size, axis=axis).take(range(codes.shape[axis]), axis=axis)
        zero_points = np.repeat(zero_points, block_size, axis=axis).take(range(codes.shape[axis]), axis=axis)
    else:
        shape = [1] * codes.ndim
        shape[axis] = -1
        scales, zero_points = scales.reshape(shape), zero_points.reshape(shape)
    return (codes - zero_points) * scales


def _const(value: ir.Value | None):
    return ir.convenience.get_const_tensor(value) if value is not None else None
