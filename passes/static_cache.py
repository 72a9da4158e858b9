"""A KV cache of fixed length, as Neuron's static shapes need it: the graphs a compiled model generates with.

An exported decoder reads its cache as past inputs of any length and appends the new keys and values with a
Concat on the length axis; its present outputs are longer by the new tokens. Here the cache holds
`max_context` positions, and what the step computes is written in place, at the positions given:

    decode:   K = Concat(past [B,H,n,D], k [B,H,1,D])   →   K = ScatterElements(cache [B,H,max,D], at
                                                                  cache_position, k, axis=2)
    prefill:  K = Concat(past, k [B,H,S,D])             →   K = Concat(cache[:, :, :0], k);
                                                             present = ScatterElements(cache, at 0..S-1, K)

Both graphs take the cache as their `past` inputs, [B, H, max, D], and give it back updated as their
`present` outputs of the same shape: the pairs a runtime aliases (one buffer for both). The rest of the
exported graph still sizes its attention from the past's shape (the key count, the causal mask): it reads the
cache's first max-1 positions in a decode step, so that with the new token it counts max keys, and none in a
prefill, which then attends to its own tokens causally. Which of the max keys a decode step reads is the
attention_mask's part: 1 on the positions written so far and on the new one. A merged decoder appends inside
the with-past branch of its If, which the caller takes out first.

onnxruntime-genai's exports need no rewrite: their GroupQueryAttention already takes the cache as one buffer as
long as the context (onnxruntime-genai's past_present_share_buffer) and writes a step's keys and values into it
at the positions the mask gives (seqlens_k, the mask's count less one). Their graphs only get static shapes:
the mask [B, bucket] in a prefill, [B, max] in a decode step; there is no position input. Any other way of
extending a cache is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_nmm.passes.cache_length import (
    SHAPE_ALIASES,
    LengthSource,
    append_node,
    derive_from_lengths,
    int64_constant,
)

CACHE_POSITION = "cache_position"  # the decode graph's new input: where its token's keys and values go
LENGTH_AXIS = 2  # the cache's [batch, heads, length, head_dim]
_WRITING_ATTENTION = ("com.microsoft", "GroupQueryAttention", (3, 4))  # reads the cache as inputs 3 and 4


@dataclass(frozen=True)
class CacheLayout:
    """The graph's token, mask and position inputs, and its cache: (past input, present output) per tensor.
    `write_position`: the decode step's input that says where it writes (CACHE_POSITION), or None where the
    graph's attention writes the cache itself at the mask's count (attention_writes_cache)."""

    tokens: str
    mask: str
    positions: str | None
    cache: tuple[tuple[str, str], ...]
    write_position: str | None = CACHE_POSITION


def attention_writes_cache(graph: ir.Graph, past_name: str) -> bool:
    """Whether the cache input `past_name` is read by an attention that writes the step into it in place
    (onnxruntime-genai's GroupQueryAttention)."""
    domain, op_type, slots = _WRITING_ATTENTION
    past = next(value for value in graph.inputs if value.name == past_name)
    return any(use.node.domain == domain and use.node.op_type == op_type and use.idx in slots
               for use in past.uses())


def static_decode_graph(model: ir.Model, layout: CacheLayout, max_context: int) -> ir.Model:
    """`model` (changed in place, and returned) as one decode step over a cache of `max_context` positions."""
    if layout.write_position is None:
        return _with_static_shapes(model, layout, new_tokens=1, mask_length=max_context, max_context=max_context)
    graph = model.graph
    inputs = _inputs_by_name(graph)
    position = ir.Value(name=CACHE_POSITION, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(position)
    batch = _set_batch_shapes(inputs, layout, new_tokens=1, mask_length=max_context)
    where_shape = int64_constant(graph, "cache.where_shape", np.array([1, 1, 1, 1], np.int64))
    where = append_node(graph, "Reshape", [position, where_shape], "cache.where")  # one position, every cache tensor's
    lengths = [LengthSource(inputs[layout.mask], axis=1, beyond=1)]  # the mask covers the step's token too
    for past_name, present_name in layout.cache:
        past = inputs[past_name]
        concat = _cache_concat(past)
        _static(past, batch, max_context)
        seen = _seen_as(graph, past, max_context - 1)  # so that the keys the step reads number max_context
        lengths.append(LengthSource(seen, LENGTH_AXIS))
        shape = append_node(graph, "Shape", [concat.inputs[1]], f"{past_name}.new_shape")
        indices = append_node(graph, "Expand", [where, shape], f"{past_name}.indices")
        _write_in_place(graph, concat, past, indices, concat.inputs[1], present_name)
    derive_from_lengths(graph, lengths, position)  # positions and masks where the step writes, not at max - 1
    graph.sort()
    model.metadata_props["onnx_nmm.cache_aliases"] = _aliases(layout)
    return model


def static_prefill_graph(model: ir.Model, layout: CacheLayout, tokens: int, max_context: int) -> ir.Model:
    """`model` (changed in place, and returned) as a prefill of `tokens` positions (a prompt padded to its
    bucket) into a cache of `max_context` positions, written from position 0."""
    if tokens > max_context:
        raise ValueError(f"a prefill of {tokens} tokens does not fit a cache of {max_context} positions")
    if layout.write_position is None:
        return _with_static_shapes(model, layout, new_tokens=tokens, mask_length=tokens, max_context=max_context)
    graph = model.graph
    inputs = _inputs_by_name(graph)
    batch = _set_batch_shapes(inputs, layout, new_tokens=tokens, mask_length=tokens)
    where = int64_constant(graph, "cache.prefill_positions",
                      np.arange(tokens, dtype=np.int64).reshape(1, 1, tokens, 1))
    for past_name, present_name in layout.cache:
        past = inputs[past_name]
        concat = _cache_concat(past)
        _static(past, batch, max_context)
        _seen_as(graph, past, 0)  # the step attends to its own tokens, causally
        shape = append_node(graph, "Shape", [concat.outputs[0]], f"{past_name}.new_shape")
        indices = append_node(graph, "Expand", [where, shape], f"{past_name}.indices")
        _write_in_place(graph, concat, past, indices, None, present_name)
    graph.sort()
    model.metadata_props["onnx_nmm.cache_aliases"] = _aliases(layout)
    return model


def _with_static_shapes(model: ir.Model, layout: CacheLayout, new_tokens: int, mask_length: int,
                        max_context: int) -> ir.Model:
    """A graph whose attention writes its cache (attention_writes_cache) as a static step: only its shapes are
    fixed, the cache in and out [B, H, max_context, D]."""
    graph = model.graph
    inputs = _inputs_by_name(graph)
    outputs = {value.name: value for value in graph.outputs}
    batch = _set_batch_shapes(inputs, layout, new_tokens, mask_length)
    for past_name, present_name in layout.cache:
        if not attention_writes_cache(graph, past_name):
            raise ValueError(f"the cache input '{past_name}' is not read by the GroupQueryAttention that writes the "
                             "other cache inputs in place: a static cache needs one way of writing them all")
        _static(inputs[past_name], batch, max_context)
        outputs[present_name].shape = inputs[past_name].shape
    model.metadata_props["onnx_nmm.cache_aliases"] = _aliases(layout)
    return model


def _seen_as(graph: ir.Graph, past: ir.Value, length: int) -> ir.Value:
    """Every reader of the cache input reads its first `length` positions instead (returned): the past the
    exported graph computes its key count and causal mask from (the write in place reads the whole cache)."""
    readers = list(past.uses())
    bounds = [int64_constant(graph, f"{past.name}.seen_{name}", np.array([value], np.int64))
              for name, value in (("start", 0), ("end", length), ("axis", LENGTH_AXIS))]
    seen = append_node(graph, "Slice", [past, *bounds], f"{past.name}.seen")
    for reader, index in readers:
        reader.replace_input_with(index, seen)
    return seen


def _cache_concat(past: ir.Value) -> ir.Node:
    """The Concat that appends the step's keys or values to `past` on the length axis."""
    pending = [past]
    while pending:
        value = pending.pop()
        for use in value.uses():
            node = use.node
            if node.op_type == "Concat" and len(node.inputs) == 2 and use.idx == 0 \
                    and node.attributes["axis"].as_int() in (LENGTH_AXIS, LENGTH_AXIS - 4):
                if node.graph is not past.graph:
                    raise ValueError(f"the cache input '{past.name}' is appended to inside a subgraph (a merged "
                                     "decoder's branch): take the with-past branch out of its If first")
                return node
            if node.op_type in SHAPE_ALIASES and len(node.inputs) == 1:
                pending.extend(node.outputs)
    raise ValueError(f"the cache input '{past.name}' is neither appended to with a Concat on its length axis nor "
                     "written in place by a GroupQueryAttention, the two forms a static cache is made from")


def _write_in_place(graph: ir.Graph, concat: ir.Node, cache: ir.Value, indices: ir.Value, new: ir.Value | None,
                    present_name: str) -> None:
    """The present output becomes the cache with the step's keys or values scattered in. Decode (`new` given):
    everything that read the Concat reads the written cache instead. Prefill: the scattered values are the
    Concat's output, which the attention keeps reading."""
    appended = concat.outputs[0]
    scatter = ir.Node("", "ScatterElements", [cache, indices, new if new is not None else appended],
                      [ir.AttrInt64("axis", LENGTH_AXIS)], num_outputs=1, name=f"{present_name}.write")
    graph.append(scatter)
    written = scatter.outputs[0]
    written.type, written.shape = cache.type, cache.shape
    index, present = next((i, value) for i, value in enumerate(graph.outputs) if value.name == present_name)
    if new is None or present is appended:
        graph.outputs[index] = written
    if new is not None:
        ir.convenience.replace_all_uses_with(appended, written)
        graph.remove(concat, safe=False)
    if graph.outputs[index] is written:
        present.name = f"{present_name}.appended"
        written.name = present_name


def _inputs_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    """The graph's inputs by name (every input of an ONNX graph has one)."""
    return {value.name: value for value in graph.inputs if value.name is not None}


def _set_batch_shapes(inputs: dict[str, ir.Value], layout: CacheLayout, new_tokens: int,
                      mask_length: int) -> ir.SymbolicDim | int:
    """The static sequence dims of the token, position and mask inputs; the batch dim kept as it was."""
    tokens = inputs[layout.tokens]
    batch = tokens.shape[0] if tokens.shape is not None else ir.SymbolicDim("batch")
    tokens.shape = ir.Shape([batch, new_tokens])
    if layout.positions is not None:
        inputs[layout.positions].shape = ir.Shape([batch, new_tokens])
    inputs[layout.mask].shape = ir.Shape([batch, mask_length])
    return batch


def _static(past: ir.Value, batch, max_context: int) -> None:
    dims = list(past.shape) if past.shape is not None else [batch, None, None, None]
    dims[0], dims[LENGTH_AXIS] = batch, max_context
    past.shape = ir.Shape(dims)


def _aliases(layout: CacheLayout) -> str:
    """Which output holds which input's buffer: "present.0.key=past_key_values.0.key,...\""""
    return ",".join(f"{present}={past}" for past, present in layout.cache)
