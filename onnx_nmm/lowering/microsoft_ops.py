"""Converters for the com.microsoft ops that onnxruntime writes into LLM graphs: its session optimizer
(FusedMatMul, QuickGelu, FastGelu, BiasGelu, Gelu, SkipLayerNormalization), its transformers optimizer
(SkipSimplifiedLayerNormalization, RotaryEmbedding) and onnxruntime-genai's model builder
(GroupQueryAttention). Semantics follow onnxruntime's ContribOperators.md; tests/test_lowering_ops.py
checks each against onnxruntime.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from onnx_nmm.lowering.onnx2torch_compat import OnnxGraph, OnnxNode, converted, register
from onnx_nmm.lowering.onnx2torch_compat import OnnxToTorchModule as _Onnx
from onnx_nmm.lowering.standard_ops import Gelu, Swish
from onnx_nmm.lowering.transformer_math import attended, band_bias, length_bias, normalized, rotated, rotated_heads

MICROSOFT = "com.microsoft"


class FusedMatMul(nn.Module, _Onnx):
    """alpha · op(A) op(B), op transposing the last two axes where transA / transB say."""

    def __init__(self, alpha: float, transpose_a: bool, transpose_b: bool):
        super().__init__()
        self.alpha, self.transpose_a, self.transpose_b = alpha, transpose_a, transpose_b

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = a.transpose(-1, -2) if self.transpose_a else a
        b = b.transpose(-1, -2) if self.transpose_b else b
        product = torch.matmul(a, b)
        return product if self.alpha == 1.0 else product * self.alpha


class SkipNormalization(nn.Module, _Onnx):
    """Skip(Simplified)LayerNormalization: s = input + skip (+ bias), then s normalized (centered or RMS)
    · gamma (+ beta); returns (output, mean, inverse std, s) as the node declares them."""

    def __init__(self, epsilon: float, center: bool, outputs: int):
        super().__init__()
        self.epsilon, self.center, self.outputs = epsilon, center, outputs

    def forward(self, x, skip, gamma, beta=None, bias=None):
        total = x + skip if bias is None else x + skip + bias
        y, mean, inverse_std = normalized(total, -1, self.epsilon, self.center)
        y = y * gamma if beta is None else y * gamma + beta
        return y if self.outputs == 1 else (y, mean, inverse_std, total)[:self.outputs]


class SkipSimplifiedNormalization(SkipNormalization):
    """SkipSimplifiedLayerNormalization's inputs have no beta: (input, skip, gamma, bias)."""

    def forward(self, x, skip, gamma, bias=None):
        return super().forward(x, skip, gamma, None, bias)


class RotaryEmbedding(nn.Module, _Onnx):
    """com.microsoft RotaryEmbedding: x [B, S, heads·D] or [B, heads, S, D], position_ids [B, S] or a
    one-element start position, caches [max positions, rotary_dim / 2]."""

    def __init__(self, interleaved: bool, num_heads: int, rotary_dim: int):
        super().__init__()
        self.interleaved, self.num_heads, self.rotary_dim = interleaved, num_heads, rotary_dim

    def forward(self, x, position_ids, cos_cache, sin_cache):
        sequence = x.shape[2] if x.dim() == 4 else x.shape[1]
        if position_ids.numel() == 1:
            position_ids = position_ids.reshape(1, 1) + torch.arange(sequence).unsqueeze(0)
        cos, sin = cos_cache[position_ids.long()], sin_cache[position_ids.long()]
        heads = self.num_heads or x.shape[-1] // (2 * cos.shape[-1])  # unset: the head size is the caches' 2·width
        return rotated_heads(x, cos, sin, self.interleaved, self.rotary_dim, heads)


class GroupQueryAttention(nn.Module, _Onnx):
    """onnxruntime's GroupQueryAttention as onnxruntime-genai uses it: query [B, S, Hq·D] (or packed q|k|v
    when key is absent), the cache [B, Hkv, past, D] appended to, seqlens_k the index of each sequence's last
    token, rotary embedding inside when do_rotary, causal with an optional local window (a query sees its
    last local_window_size keys, itself included).

    Positions: a first prompt (empty cache, or S equal to total_sequence_length) is at 0..S−1 with keys past
    a sequence's length masked; a later step's tokens are at seqlens_k + 1 − S onwards. A cache shorter than
    total_sequence_length is appended to; one at least as long is the buffer present shares with past
    (onnxruntime-genai's past_present_share_buffer, a static cache): the step's keys and values are written
    into it at their positions, and the keys past each sequence's length are masked."""

    def __init__(self, q_heads: int, kv_heads: int, scale: float, softcap: float, window: int, rotary: bool,
                 interleaved: bool, sink: bool):
        super().__init__()
        self.q_heads, self.kv_heads, self.scale, self.softcap = q_heads, kv_heads, scale, softcap
        self.window, self.rotary, self.interleaved, self.sink = window, rotary, interleaved, sink

    def forward(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
                total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
                attention_bias=None):
        batch, sequence, _ = query.shape
        if key is None:  # packed q | k | v
            head_size = query.shape[-1] // (self.q_heads + 2 * self.kv_heads)
            query, key, value = query.split([self.q_heads * head_size, self.kv_heads * head_size,
                                             self.kv_heads * head_size], dim=-1)
        q, k, v = (x.reshape(batch, sequence, heads, -1) for x, heads in
                   ((query, self.q_heads), (key, self.kv_heads), (value, self.kv_heads)))
        cached = 0 if past_key is None else past_key.shape[2]
        total = int(total_sequence_length) if total_sequence_length is not None else cached + sequence
        in_place = cached >= total  # fixed for a traced graph: the shapes decide it
        lengths = seqlens_k.long() + 1
        first = not cached or (in_place and sequence == total)
        start = torch.zeros_like(lengths) if first else lengths - sequence
        if self.rotary:
            positions = position_ids.long() if position_ids is not None else start.unsqueeze(1) + torch.arange(sequence)
            cos, sin = cos_cache[positions], sin_cache[positions]
            q, k = rotated(q, cos, sin, self.interleaved), rotated(k, cos, sin, self.interleaved)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        left = self.window - 1 if self.window > 0 else -1
        if in_place:
            at = (start.unsqueeze(1) + torch.arange(sequence)).reshape(batch, 1, sequence, 1).expand(k.shape)
            k, v = past_key.scatter(2, at, k), past_value.scatter(2, at, v)
            bias = band_bias(sequence, cached, start, left=left) + length_bias(cached, lengths)
        else:
            if past_key is not None:
                k, v = torch.cat((past_key, k), dim=2), torch.cat((past_value, v), dim=2)
            bias = band_bias(sequence, k.shape[2], cached, left=left)
            if not cached:  # a padded first prompt: keys past each sequence's length
                bias = bias + length_bias(k.shape[2], lengths)
        if attention_bias is not None:
            bias = bias + attention_bias
        scale = self.scale or 1.0 / math.sqrt(q.shape[-1])
        y = attended(q.transpose(1, 2), k, v, bias, scale, self.softcap, self.sink)
        return y.transpose(1, 2).reshape(batch, sequence, -1), k, v


def _fused_matmul(node: OnnxNode, graph: OnnxGraph):
    a = node.attributes
    if a.get("transBatchA", 0) or a.get("transBatchB", 0):
        raise NotImplementedError(f"FusedMatMul '{node.name}' transposes batch axes (transBatchA/B)")
    return converted(node, FusedMatMul(a.get("alpha", 1.0), bool(a.get("transA", 0)), bool(a.get("transB", 0))))


def _gelu(approximate: str):
    def convert(node: OnnxNode, graph: OnnxGraph):
        return converted(node, Gelu(approximate))
    return convert


def _quick_gelu(node: OnnxNode, graph: OnnxGraph):
    return converted(node, Swish(node.attributes.get("alpha", 1.702)))


def _skip_normalization(center: bool):
    def convert(node: OnnxNode, graph: OnnxGraph):
        module = SkipNormalization if center else SkipSimplifiedNormalization
        return converted(node, module(node.attributes.get("epsilon", 1e-12), center, len(node.output_values)))
    return convert


def _rotary_embedding(node: OnnxNode, graph: OnnxGraph):
    a = node.attributes
    if a.get("is_packed_batching", 0):
        raise NotImplementedError(f"RotaryEmbedding '{node.name}' uses packed batching")
    return converted(node, RotaryEmbedding(bool(a.get("interleaved", 0)), a.get("num_heads", 0),
                                           a.get("rotary_embedding_dim", 0)))


def _group_query_attention(node: OnnxNode, graph: OnnxGraph):
    a = node.attributes
    if len(node.input_values) > 11 and node.input_values[11]:
        raise NotImplementedError(f"GroupQueryAttention '{node.name}' has a head sink input")
    return converted(node, GroupQueryAttention(
        a["num_heads"], a["kv_num_heads"], a.get("scale", 0.0), a.get("softcap", 0.0),
        a.get("local_window_size", -1), bool(a.get("do_rotary", 0)), bool(a.get("rotary_interleaved", 0)),
        bool(a.get("smooth_softmax", 0))))


register(MICROSOFT, "FusedMatMul", (1,), _fused_matmul)
register(MICROSOFT, "Gelu", (1,), _gelu("none"))
register(MICROSOFT, "BiasGelu", (1,), _gelu("none"))
register(MICROSOFT, "FastGelu", (1,), _gelu("tanh"))
register(MICROSOFT, "QuickGelu", (1,), _quick_gelu)
register(MICROSOFT, "SkipLayerNormalization", (1,), _skip_normalization(center=True))
register(MICROSOFT, "SkipSimplifiedLayerNormalization", (1,), _skip_normalization(center=False))
register(MICROSOFT, "RotaryEmbedding", (1,), _rotary_embedding)
register(MICROSOFT, "GroupQueryAttention", (1,), _group_query_attention)
