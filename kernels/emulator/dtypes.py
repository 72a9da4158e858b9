"""NKI data types as NumPy dtypes: bfloat16 and float8 come from ml_dtypes, which rounds to nearest even.

Real NKI names dtypes with strings (`nl.bfloat16 == "bfloat16"`); a NumPy dtype compares equal to its name,
so kernels that compare `x.dtype == nl.float32` read the same on both.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

float32 = np.dtype(np.float32)
tfloat32 = float32  # stored as float32; only TensorE treats it differently
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
bool_ = np.dtype(np.bool_)

FLOATS = (float32, bfloat16, float16, float8_e4m3, float8_e5m2)
SUPPORTED = FLOATS + (int8, int16, int32, uint8, uint16, uint32, bool_)
# TensorE input types (nki.isa.nc_matmul): fp8, bf16, fp16, tf32, fp32.
MATMUL_INPUTS = (float32, bfloat16, float16, float8_e4m3, float8_e5m2)


def as_dtype(dtype) -> np.dtype:
    """A NumPy dtype from a NumPy dtype, a NumPy scalar type or an NKI dtype name."""
    if isinstance(dtype, str):
        return np.dtype(getattr(ml_dtypes, dtype, dtype))
    return np.dtype(dtype)


def is_float(dtype) -> bool:
    return as_dtype(dtype) in FLOATS


def sentinel(dtype):
    """What fresh memory holds: NaN for floats, 4 for integers (the official simulator's sentinels)."""
    return np.nan if is_float(dtype) else 4
