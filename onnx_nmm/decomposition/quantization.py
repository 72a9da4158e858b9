"""Quantize a layer's factors the way its weight was quantized, with onnxruntime's own quantizers.

    MatMulNBits        U [K, r] and V [r, N] each block-quantized along their input dimension with the
                       weight's bits and block size, symmetric when the weight had no zero points
                       (onnxruntime.quantization's DefaultWeightOnlyQuantizer: the C++ kernels behind
                       MatMulNBitsQuantizer)
    DequantizeLinear   U and V quantized per output channel to the weight's integer type (int8 symmetric,
                       uint8 with zero points: quant_utils.quantize_data)

The rewritten layer then runs on the same onnxruntime kernels as the input, in less memory.
"""

from __future__ import annotations

import logging

import numpy as np

from onnx_nmm.passes.quantized_weights import NBITS, QuantizedWeight
from onnx_nmm.passes.stored_weights import QuantizedFactor


def quantize_like(weight: QuantizedWeight, matrix: np.ndarray) -> QuantizedFactor:
    """`matrix` [K', N'] (a factor) stored as `weight` is: its codes, scales and zero points."""
    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    scales_dtype = weight.float_dtype.numpy()
    if weight.format == NBITS:
        return _nbits(weight, matrix, scales_dtype)
    return _per_channel(weight, matrix, scales_dtype)


def _nbits(weight: QuantizedWeight, matrix: np.ndarray, scales_dtype) -> QuantizedFactor:
    DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer = _nbits_quantizer()
    symmetric = weight.zero_points is None
    config = DefaultWeightOnlyQuantConfig(block_size=weight.block_size, is_symmetric=symmetric, bits=weight.bits)
    codes, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(matrix)
    k, n = matrix.shape
    attributes = {**weight.attributes, "K": k, "N": n}
    return QuantizedFactor(codes, scales.astype(scales_dtype), None if symmetric else zero_points, attributes)


def _nbits_quantizer():
    """onnxruntime's block quantizer; its module sets the root logger to INFO when imported, which would turn
    every library's info logs into output: the logging configuration is put back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    root.handlers[:], root.level = handlers, level
    return DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer


def _per_channel(weight: QuantizedWeight, matrix: np.ndarray, scales_dtype) -> QuantizedFactor:
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import quantize_data

    integer = np.dtype(weight.codes.const_value.dtype.numpy())
    symmetric = integer == np.int8
    kind = TensorProto.INT8 if symmetric else TensorProto.UINT8
    codes, scales, zero_points = np.empty(matrix.shape, integer), [], []
    for column in range(matrix.shape[1]):
        zero_point, scale, codes[:, column] = quantize_data(matrix[:, column], kind, symmetric)
        scales.append(scale)
        zero_points.append(zero_point)
    return QuantizedFactor(codes, np.asarray(scales, scales_dtype).reshape(-1),
                           np.asarray(zero_points, integer).reshape(-1),
                           {"axis": 1})


def kept_columns(weight: QuantizedWeight, n: int, kept: np.ndarray, columns: np.ndarray) -> QuantizedFactor:
    """The columns `kept` of a quantized weight W [K, N], stored as W is. MatMulNBits stores Wᵀ's rows, so its
    codes, scales and zero points are sliced: the kept columns stay exactly as they were. Other forms are
    quantized again from `columns`, W[:, kept] as float."""
    if weight.format != NBITS:
        return quantize_like(weight, columns)

    def rows(value, keep_shape: bool = True):
        array = value.const_value.numpy()
        sliced = array.reshape(n, -1)[kept]
        return sliced.reshape(len(kept), *array.shape[1:]) if keep_shape and array.ndim > 1 else sliced.reshape(-1)

    zero_points = rows(weight.zero_points) if weight.zero_points is not None else None
    return QuantizedFactor(rows(weight.codes), rows(weight.scales), zero_points,
                           {**weight.attributes, "N": len(kept)})
