"""NKI kernels for the factorized linear layers, a NumPy emulator of NKI, and a Trainium cost model.

Kernels (`@nki.jit`, HBM tensors in and out; x is row-major [tokens, features], weights in ONNX layout):
    dense_matmul(x [M,K], w [K,N]) -> y [M,N]
    dense_matmul_lhsT(lhsT [K,M], w [K,N]) -> y [M,N]           (the AWS tutorial's calling convention)
    fused_xuv(x [M,K], u [K,r], v [r,N]) -> y [M,N]
    fused_svd_mlp(x [M,H], ug, vg, uu, vu, ud, vd) -> y [M,H]
    fused_svd_ungated_mlp(x [M,H], u1, v1, b1, u2, v2) -> y [M,H]
    dense_gated_mlp(x [M,H], wg [H,I], wu [H,I], wd [I,H]) -> y [M,H]
    dense_ungated_mlp(x [M,H], w1 [H,I], b1 [I], w2 [I,H]) -> y [M,H]
    silu_mul(gate [M,I], up [M,I]) -> act [M,I]
    silu_mul_transposed(gate [M,I], up [M,I]) -> actᵀ [I,M]   (for dense_matmul_lhsT)
and lowrank_unfused(x, u, v), which launches dense_matmul twice.

On a CPU: `run(kernel, *arrays, target=...)` executes on the emulator; `estimate(kernel, *shapes,
dtype=..., target=...)` returns a modelled KernelCost without doing the arithmetic.
"""

from onnx_nmm.kernels.bench.runner import estimate, run, trace
from onnx_nmm.kernels.nki_kernels.dense_matmul import dense_matmul, dense_matmul_lhsT
from onnx_nmm.kernels.nki_kernels.dense_mlp import dense_gated_mlp, dense_ungated_mlp
from onnx_nmm.kernels.nki_kernels.fused_mlp import fused_svd_mlp, fused_svd_ungated_mlp
from onnx_nmm.kernels.nki_kernels.fused_xuv import fused_xuv
from onnx_nmm.kernels.nki_kernels.gated_activation import silu_mul, silu_mul_transposed
from onnx_nmm.kernels.nki_kernels.lowrank_unfused import lowrank_unfused
from onnx_nmm.kernels.nki_kernels.nki_api import USING_EMULATOR
from onnx_nmm.kernels.pricing.cost_model import KernelCost

__all__ = [
    "USING_EMULATOR",
    "KernelCost",
    "dense_gated_mlp",
    "dense_matmul",
    "dense_matmul_lhsT",
    "dense_ungated_mlp",
    "estimate",
    "fused_svd_mlp",
    "fused_svd_ungated_mlp",
    "fused_xuv",
    "lowrank_unfused",
    "run",
    "silu_mul",
    "silu_mul_transposed",
    "trace",
]
