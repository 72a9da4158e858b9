"""Converters for the ONNX-domain ops of transformer exports that onnx2torch 1.5.15 does not know: the
fused ops of opset 20+ (Gelu-20, RMSNormalization-23, RotaryEmbedding-23, Attention-23/24, Swish-24,
SwiGLU), Trilu, and the two normalizations onnxruntime registers in the ONNX domain for its optimizer
(LayerNormalization below opset 17, SimplifiedLayerNormalization), and ScatterElements (what a static KV cache
writes its new keys and values with). Semantics follow ONNX's Operators.md
and its reference implementation; tests/test_lowering_ops.py checks each against onnxruntime.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx import defs
from torch import nn

from onnx_nmm.lowering.onnx2torch_compat import OnnxGraph, OnnxNode, converted, register
from onnx_nmm.lowering.onnx2torch_compat import OnnxToTorchModule as _Onnx
from onnx_nmm.lowering.transformer_math import additive, attended, band_bias, length_bias, normalized, rotated_heads

NEWEST_OPSET = defs.onnx_opset_version()


class Gelu(nn.Module, _Onnx):
    def __init__(self, approximate: str):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.gelu(x if bias is None else x + bias, approximate=self.approximate)


class Swish(nn.Module, _Onnx):
    """x · sigmoid(alpha · x); SwiGLU multiplies it by a second input."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        swish = x * torch.sigmoid(self.alpha * x)
        return swish if up is None else swish * up


class Normalization(nn.Module, _Onnx):
    """LayerNormalization (centered) or RMS normalization over the axes from `axis` on, then · scale + bias;
    returns as many of (Y, mean, inverse std) as the node declares outputs."""

    def __init__(self, axis: int, epsilon: float, center: bool, outputs: int):
        super().__init__()
        self.axis, self.epsilon, self.center, self.outputs = axis, epsilon, center, outputs

    def forward(self, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        y, mean, inverse_std = normalized(x, self.axis, self.epsilon, self.center)
        y = y * scale if bias is None else y * scale + bias
        return y if self.outputs == 1 else (y, mean, inverse_std)[:self.outputs]


class RotaryEmbedding(nn.Module, _Onnx):
    """RotaryEmbedding-23: x [B, S, heads·D] (then `num_heads` says how to split it) or [B, heads, S, D];
    the caches indexed by position_ids [B, S] when given, else already [B, S, rotary_dim / 2]."""

    def __init__(self, interleaved: bool, num_heads: int, rotary_dim: int):
        super().__init__()
        self.interleaved, self.num_heads, self.rotary_dim = interleaved, num_heads, rotary_dim

    def forward(self, x: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is not None:
            cos_cache, sin_cache = cos_cache[position_ids.long()], sin_cache[position_ids.long()]
        return rotated_heads(x, cos_cache, sin_cache, self.interleaved, self.rotary_dim, self.num_heads)


class Attention(nn.Module, _Onnx):
    """Attention-23/24/25: Q, K, V as [B, heads, S, D] or [B, S, heads·D] (with q_num_heads/kv_num_heads),
    the cache appended to K and V, a boolean or additive mask, causality and the sliding window (25)
    aligned to the cache's end, GQA; returns (Y, present_key, present_value) as the node declares them."""

    def __init__(self, q_heads: int, kv_heads: int, scale: float, causal: bool, softcap: float,
                 window: tuple[int, int], outputs: int):
        super().__init__()
        self.q_heads, self.kv_heads, self.scale = q_heads, kv_heads, scale
        self.causal, self.softcap, self.outputs = causal, softcap, outputs
        left, right = window
        self.band = (left, 0 if causal else right) if causal or max(window) >= 0 else None

    def forward(self, q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):
        flat = q.dim() == 3
        if flat:
            q, k, v = self._heads(q, self.q_heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        if past_key is not None:
            k, v = torch.cat((past_key, k), dim=2), torch.cat((past_value, v), dim=2)
        queries, keys = q.shape[2], k.shape[2]
        bias = additive(attn_mask, keys, torch.float32)
        if self.band:
            offset = keys - queries if nonpad_kv_seqlen is None else nonpad_kv_seqlen - queries
            band = band_bias(queries, keys, offset, *self.band)
            bias = band if bias is None else bias + band
        if nonpad_kv_seqlen is not None:
            padding = length_bias(keys, nonpad_kv_seqlen)
            bias = padding if bias is None else bias + padding
        y = attended(q, k, v, bias, self.scale or q.shape[-1] ** -0.5, self.softcap)
        if flat:
            y = y.transpose(1, 2).flatten(2)
        return y if self.outputs == 1 else (y, k, v)[:self.outputs]

    @staticmethod
    def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
        batch, sequence, hidden = x.shape
        return x.reshape(batch, sequence, heads, hidden // heads).transpose(1, 2)


class Trilu(nn.Module, _Onnx):
    def __init__(self, upper: bool):
        super().__init__()
        self.upper = upper

    def forward(self, x: torch.Tensor, k: torch.Tensor | None = None) -> torch.Tensor:
        diagonal = 0 if k is None else int(k)
        return torch.triu(x, diagonal) if self.upper else torch.tril(x, diagonal)


def _attention(node: OnnxNode, graph: OnnxGraph):
    a = node.attributes
    if a.get("qk_matmul_output_mode", 0) and len(node.output_values) > 3:
        raise NotImplementedError(f"Attention '{node.name}' outputs its scores (qk_matmul_output_mode)")
    return converted(node, Attention(a.get("q_num_heads", 0), a.get("kv_num_heads", 0), a.get("scale", 0.0),
                                     bool(a.get("is_causal", 0)), a.get("softcap", 0.0),
                                     (a.get("left_window_size", -1), a.get("right_window_size", -1)),
                                     len(node.output_values)))


def _gelu(node: OnnxNode, graph: OnnxGraph):
    approximate = node.attributes.get("approximate", "none")
    return converted(node, Gelu(approximate.decode() if isinstance(approximate, bytes) else approximate))


def _normalization(center: bool):
    def convert(node: OnnxNode, graph: OnnxGraph):
        a = node.attributes
        if a.get("stash_type", 1) != 1:
            raise NotImplementedError(f"'{node.name}' normalizes in a precision other than float32 (stash_type)")
        return converted(node, Normalization(a.get("axis", -1), a.get("epsilon", 1e-5), center,
                                             len(node.output_values)))
    return convert


def _rotary_embedding(node: OnnxNode, graph: OnnxGraph):
    a = node.attributes
    return converted(node, RotaryEmbedding(bool(a.get("interleaved", 0)), a.get("num_heads", 0),
                                           a.get("rotary_embedding_dim", 0)))


def _swish(node: OnnxNode, graph: OnnxGraph):
    return converted(node, Swish(node.attributes.get("alpha", 1.0)))


class ScatterElements(nn.Module, _Onnx):
    """data with `updates` written at `indices` along `axis` (no reduction): a new tensor, as in ONNX."""

    def __init__(self, axis: int):
        super().__init__()
        self.axis = axis

    def forward(self, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        indices = torch.where(indices < 0, indices + data.shape[self.axis], indices)
        return torch.scatter(data, self.axis, indices.long(), updates)


def _scatter_elements(node: OnnxNode, graph: OnnxGraph):
    if node.attributes.get("reduction", "none") != "none":
        raise NotImplementedError(f"ScatterElements with reduction {node.attributes['reduction']!r}")
    return converted(node, ScatterElements(node.attributes.get("axis", 0)))


def _trilu(node: OnnxNode, graph: OnnxGraph):
    return converted(node, Trilu(bool(node.attributes.get("upper", 1))))


register("", "Gelu", (20,), _gelu)
register("", "RMSNormalization", (23,), _normalization(center=False))
register("", "RotaryEmbedding", (23,), _rotary_embedding)
register("", "Attention", (23, 24, 25), _attention)
register("", "Swish", (24,), _swish)
register("", "SwiGLU", (28,), _swish)
register("", "Trilu", (14,), _trilu)
register("", "ScatterElements", (11, 13, 16, 18), _scatter_elements)
# onnxruntime's own ops in the ONNX domain, which no ONNX schema versions: onnx2torch looks them up under
# the model's opset, so they are registered under every one.
register("", "SimplifiedLayerNormalization", range(1, NEWEST_OPSET + 1), _normalization(center=False))
register("", "LayerNormalization", range(1, 17), _normalization(center=True))
