"""Graph passes: small, pure steps over an onnx-ir model. They know graphs, not files, flags or maths:
the factors a pass swaps in come computed."""

from onnx_nmm.passes import svd_ops
from onnx_nmm.passes.linear_layers import (
    LinearLayer,
    UnreadLayer,
    WeightSource,
    find_linear_layers,
    find_unread_layers,
    unmatched_products,
)
from onnx_nmm.passes.mlp_fusion import FuseMlpPass
from onnx_nmm.passes.selection import TARGETS, LayerFilter, reason_to_skip, select_layers
from onnx_nmm.passes.svd_factorization import FactorizedLayer, FactorsPlaced, SvdFactorizationPass

__all__ = [
    "TARGETS",
    "UnreadLayer",
    "find_unread_layers",
    "FactorizedLayer",
    "FactorsPlaced",
    "FuseMlpPass",
    "LayerFilter",
    "LinearLayer",
    "SvdFactorizationPass",
    "WeightSource",
    "find_linear_layers",
    "reason_to_skip",
    "select_layers",
    "svd_ops",
    "unmatched_products",
]
