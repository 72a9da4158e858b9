"""The maths of the transformer ops that ONNX (opset 23+) and onnxruntime's contrib domain fuse: one
function per computation, shared by the converters of both domains.

Shapes: `x` of a rotation is [batch, sequence, heads, head_size]; the attention's q is [batch, q_heads,
sequence, head_size] and k, v are [batch, kv_heads, total, head_size] (grouped-query attention repeats
each kv head for q_heads / kv_heads query heads).
"""

from __future__ import annotations

import torch


def normalized(x: torch.Tensor, axis: int, epsilon: float, center: bool) -> tuple[torch.Tensor, ...]:
    """(x − mean) / sqrt(var + ε) over the axes from `axis` to the last (RMS: mean taken as 0 when not
    `center`), in float32 (ONNX's stash_type 1), with the mean and the inverse standard deviation the ops
    may also output."""
    dims = tuple(range(axis % x.dim(), x.dim()))
    stash = x.float()
    mean = stash.mean(dims, keepdim=True) if center else torch.zeros_like(stash[..., :1])
    centered = stash - mean
    inverse_std = torch.rsqrt(centered.pow(2).mean(dims, keepdim=True) + epsilon)
    return (centered * inverse_std).to(x.dtype), mean, inverse_std


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
            rotary_dim: int = 0) -> torch.Tensor:
    """Rotary position embedding of x [B, S, H, D]: its first `rotary_dim` features (all if 0) taken as
    pairs — halves, or neighbours if `interleaved` — and turned by the angles whose cos and sin are
    [B, S, rotary_dim / 2]; the rest pass."""
    rotary_dim = rotary_dim or x.shape[-1]
    turning, passing = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleaved:
        first, second = turning[..., 0::2], turning[..., 1::2]
    else:
        first, second = turning.chunk(2, dim=-1)
    real, imaginary = first * cos - second * sin, first * sin + second * cos
    if interleaved:
        turned = torch.stack((real, imaginary), dim=-1).flatten(-2)
    else:
        turned = torch.cat((real, imaginary), dim=-1)
    return torch.cat((turned, passing), dim=-1)


def rotated_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rotary_dim: int,
                  heads: int) -> torch.Tensor:
    """`rotated` for x in either layout the rotary ops take: [B, heads, S, D], or [B, S, heads·D] split
    into `heads`; the result in x's layout."""
    if x.dim() == 4:
        return rotated(x.transpose(1, 2), cos, sin, interleaved, rotary_dim).transpose(1, 2)
    batch, sequence, hidden = x.shape
    split = x.reshape(batch, sequence, heads, hidden // heads)
    return rotated(split, cos, sin, interleaved, rotary_dim).reshape(x.shape)


def bias_of(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean mask (True = attend) as a bias to add to the scores: 0 where allowed, −inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))


def length_bias(keys: int, lengths: torch.Tensor) -> torch.Tensor:
    """[B, 1, 1, keys]: −inf for the keys at or past each batch row's length."""
    return bias_of(torch.arange(keys).reshape(1, 1, 1, -1) < lengths.reshape(-1, 1, 1, 1))


def band_bias(queries: int, keys: int, offset, left: int = -1, right: int = 0) -> torch.Tensor:
    """0 where query i may see key j, −inf elsewhere: with p = i + offset (offset the keys before the first
    query, an int or a [B] tensor — then the bias is [B, 1, queries, keys]), p − left ≤ j ≤ p + right, a
    negative bound leaving its side open. The default is bottom-right aligned causality."""
    position = torch.arange(queries).unsqueeze(1)
    if torch.is_tensor(offset):
        position = position + offset.reshape(-1, 1, 1, 1).long()
    else:
        position = position + offset
    j = torch.arange(keys).unsqueeze(0)
    allowed = torch.ones(torch.broadcast_shapes(position.shape, j.shape), dtype=torch.bool)
    if left >= 0:
        allowed = allowed & (j >= position - left)
    if right >= 0:
        allowed = allowed & (j <= position + right)
    return bias_of(allowed)


def additive(mask: torch.Tensor | None, keys: int, dtype: torch.dtype) -> torch.Tensor | None:
    """An attention mask as a bias to add to the scores: a boolean mask (True = attend) as 0 / −inf, a float
    one as it is; a mask shorter than `keys` padded with masked keys (ONNX Attention's rule)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = bias_of(mask, dtype)
    missing = keys - mask.shape[-1]
    if missing > 0:
        mask = torch.nn.functional.pad(mask, (0, missing), value=float("-inf"))
    return mask.to(dtype)


def attended(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float,
             softcap: float = 0.0, sink: bool = False) -> torch.Tensor:
    """softmax(softcap(scale · q kᵀ) + bias) v for q [B, Hq, S, D], k, v [B, Hkv, T, D]; `softcap` > 0 caps
    the scores at ±softcap by tanh, `sink` adds a zero logit every row also competes with (onnxruntime's
    smooth softmax). A row with every key masked gives 0."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if sink:
        scores = torch.cat((scores, torch.zeros_like(scores[..., :1])), dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if sink:
        weights = weights[..., :-1]
    return torch.matmul(weights, v.float()).to(q.dtype)
