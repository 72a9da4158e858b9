"""The hardware rules the emulator enforces, each with a name that its error message starts with.

A kernel that breaks a rule gets `NkiValidationError("[rule-name] what the rule says: what broke it")`,
the same exception type real NKI raises for violated hardware constraints (nki.isa.NkiValidationError).
"""

from __future__ import annotations

RULES = {
    "partition-max": "an on-chip tensor spans at most 128 partitions (nl.tile_size.pmax)",
    "partition-start": "a compute-engine operand of P partitions starts at partition 0 (P > 64), "
    "0 or 64 (P > 32), or a multiple of 32",
    "partition-stride": "an on-chip view cannot step over partitions",
    "view": "an on-chip view keeps the partition dimension first and whole",
    "index": "an index or slice stays inside the tensor",
    "engine-memory": "compute engines read and write SBUF or PSUM only (GpSimd cannot access PSUM)",
    "elementwise-shape": "operands of an element-wise instruction have the same partitions and the same "
    "number of elements per partition",
    "matmul-operands-sbuf": "nc_matmul reads stationary and moving from SBUF",
    "matmul-dst-psum": "nc_matmul writes its result to PSUM",
    "matmul-contraction": "stationary and moving have the same contraction (partition) size, at most 128",
    "matmul-stationary-fmax": "the stationary free size is at most 128 (nl.tile_size.gemm_stationary_fmax)",
    "matmul-moving-fmax": "the moving free size is at most 512 (nl.tile_size.gemm_moving_fmax)",
    "matmul-dst-shape": "the result has shape (stationary free size, moving free size)",
    "matmul-dtype": "nc_matmul writes float32 and takes fp8/bf16/fp16/fp32 inputs, fp32 only with fp32",
    "psum-bank": "one matmul output fits in one 2 KiB PSUM bank per partition",
    "psum-accumulate": "accumulating onto PSUM needs a prior nc_matmul write there (otherwise undefined)",
    "psum-capacity": "PSUM holds 16 KiB per partition: 8 banks of 2 KiB",
    "sbuf-capacity": "SBUF holds 192 KiB per partition on trn1 and 224 KiB on trn2",
    "dma-no-psum": "dma_copy moves data between HBM and SBUF; it cannot access PSUM",
    "dma-element-count": "dma_copy source and destination hold the same number of elements",
    "transpose-size": "nc_transpose takes at most 128x128 on TensorE and 32x32 on VectorE",
    "transpose-buffers": "a TensorE transpose reads SBUF and writes PSUM",
    "transpose-dtype": "nc_transpose writes the data type it reads",
    "tensor-tensor-psum": "tensor_tensor cannot read both inputs from PSUM",
    "scalar-copy-gen2": "tensor_copy does not run on the Scalar engine of NeuronCore-v2 (trn1); use "
    "nisa.activation(op=nl.copy)",
    "activation-bias": "on NeuronCore-v2 (trn1) the activation bias is a [P, 1] tensor, not a scalar",
    "memset-value": "memset writes a value of the destination's kind (float for float, integer for integer)",
    "kernel-output": "a kernel returns tensors allocated in nl.shared_hbm",
    "kernel-input": "a kernel runs on NumPy arrays of an NKI data type (float32, bfloat16, ...), or on "
    "placeholders in trace-only mode",
}


class NkiValidationError(Exception):
    """A hardware constraint was violated; `rule` names it (a key of RULES)."""

    def __init__(self, rule: str, detail: str):
        super().__init__(f"[{rule}] {RULES[rule]}: {detail}")
        self.rule = rule


def require(condition: bool, rule: str, detail) -> None:
    """Raise NkiValidationError(rule) unless `condition`; `detail` may be a callable, built only on failure."""
    if not condition:
        raise NkiValidationError(rule, detail() if callable(detail) else detail)
