"""Graph passes: small, pure steps over an onnx-ir model (no file I/O of their own)."""

from onnx_nmm.passes.gated_mlp_fusion import FuseGatedMlpPass
from onnx_nmm.passes.linear_layers import LinearLayer, WeightSource, find_linear_layers
from onnx_nmm.passes.selection import TARGETS, Selection, select_layers
from onnx_nmm.passes.svd_factorization import FactorizedLayer, SvdFactorizationPass

__all__ = [
    "TARGETS",
    "FactorizedLayer",
    "FuseGatedMlpPass",
    "LinearLayer",
    "Selection",
    "SvdFactorizationPass",
    "WeightSource",
    "find_linear_layers",
    "select_layers",
]
