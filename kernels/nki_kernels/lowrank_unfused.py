"""Unfused low-rank product y = (x · U) · V: two dense kernel launches, the intermediate through HBM.

This is what a graph compiler does with the rewritten model when nothing fuses the pair: the first
launch writes z = x · U [M, r] to HBM, the second reads it back (and transposes it again on TensorE).
It is the reference the fused kernel is measured against.
"""

from onnx_nmm.kernels.nki_kernels.dense_matmul import dense_matmul


def lowrank_unfused(x, u, v):
    """y = (x · U) · V with x [M, K], U [K, r], V [r, N]; two launches of dense_matmul."""
    z = dense_matmul(x, u)
    return dense_matmul(z, v)
