"""A causal LM as the static-shape graphs Neuron runs: a prefill per prompt-length bucket and one decode step,
over a KV cache of `max_context` positions that stays where it is (passes/static_cache.py makes the graphs).

    prompt ─ padded to the smallest bucket that holds it ─ prefill[bucket] ─ cache, logits of its last token
    token  ─ decode(cache, cache_position) ─ cache, logits ─ token ─ ...           up to max_context positions

A merged decoder (optimum's) is made from its with-past branch. `StaticCache.generate_greedy` runs the graphs
on the CPU, with onnxruntime or lowered to PyTorch as the Neuron trace takes them (`backend` "torch": the
custom ops as torch math; "emulator": on the NKI kernels), and must give the exported model's own tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.errors import DataError, ModelError, OptionError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes.static_cache import CACHE_POSITION, CacheLayout, static_decode_graph, static_prefill_graph
from onnx_nmm.runtime.backend_runner import ModelRunner
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.graph_probe import with_past_step

USUAL_BUCKETS = (128, 512, 2048)  # prompt lengths a prefill is compiled for, capped at max_context


def default_buckets(max_context: int) -> tuple[int, ...]:
    """128, 512 and 2048 below `max_context`, then `max_context` itself: a prompt of any length that fits."""
    return (*(bucket for bucket in USUAL_BUCKETS if bucket < max_context), max_context)


@dataclass
class StaticCache:
    """The prefill graphs (by bucket) and the decode graph of one model, and the layout of their cache."""

    label: str
    layout: CacheLayout
    cache_shapes: dict[str, tuple[int, ...]]  # per past input, for batch 1: [1, heads, max_context, head_dim]
    max_context: int
    prefill: dict[int, ir.Model]
    decode: ir.Model
    _runners: dict = field(default_factory=dict, repr=False)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.prefill))

    def bucket_for(self, prompt_tokens: int) -> int:
        """The smallest bucket that holds the prompt; DataError when none does."""
        fitting = [bucket for bucket in self.buckets if bucket >= prompt_tokens]
        if not fitting:
            raise DataError(f"a prompt of {prompt_tokens} tokens is longer than the largest prefill bucket, "
                            f"{self.buckets[-1]}: compile with a larger {{max_context}} or {{buckets}}",
                            max_context="max_context", buckets="buckets")
        return fitting[0]

    def generate_greedy(self, ids: np.ndarray, new_tokens: int, backend: str = "ort") -> list[int]:
        """The greedy continuation of one prompt (token ids [1, n]) on these graphs, run by `backend` ("ort",
        "torch" or "emulator": onnx_nmm.runtime.backend_runner)."""
        prompt = ids.shape[1]
        if prompt + new_tokens > self.max_context:
            raise DataError(f"{prompt} prompt tokens and {new_tokens} new ones do not fit the cache of "
                            f"{self.max_context} positions: ask for fewer, or compile with a larger {{max_context}}",
                            max_context="max_context")
        bucket = self.bucket_for(prompt)
        layout = self.layout
        cache = {name: np.zeros(shape, np.float32) for name, shape in self.cache_shapes.items()}
        feeds = {layout.tokens: _padded(ids, bucket), layout.mask: _padded(np.ones_like(ids), bucket), **cache}
        if layout.positions is not None:
            feeds[layout.positions] = np.arange(bucket, dtype=np.int64)[None]
        logits, cache = self._run(self.prefill[bucket], f"prefill {bucket}", backend, feeds)
        tokens, last = [], logits[:, prompt - 1]
        for step in range(new_tokens):
            token = int(last.argmax(-1)[0])
            tokens.append(token)
            if step == new_tokens - 1:
                break
            position = prompt + step
            mask = np.zeros((1, self.max_context), np.int64)
            mask[0, :position + 1] = 1
            feeds = {layout.tokens: np.array([[token]], np.int64), layout.mask: mask,
                     CACHE_POSITION: np.array([position], np.int64), **cache}
            if layout.positions is not None:
                feeds[layout.positions] = np.array([[position]], np.int64)
            logits, cache = self._run(self.decode, "decode", backend, feeds)
            last = logits[:, -1]
        return tokens

    def _run(self, model: ir.Model, graph: str, backend: str, feeds: dict) -> tuple[np.ndarray, dict]:
        if (graph, backend) not in self._runners:
            self._runners[graph, backend] = ModelRunner(model, backend)
        runner = self._runners[graph, backend]
        outputs = runner(feeds)
        return outputs[runner.output_names[0]], {past: outputs[present] for past, present in self.layout.cache}


def static_cache(model: str | os.PathLike | ir.Model, max_context: int,
                 buckets: tuple[int, ...] | None = None) -> StaticCache:
    """The static-cache graphs of a causal LM with a KV cache (any exporter's input names)."""
    if max_context < 2:
        raise OptionError(f"{{max_context}} must be at least 2, got {max_context}", max_context="max_context")
    buckets = tuple(sorted(set(buckets or default_buckets(max_context))))
    if buckets[0] < 1 or buckets[-1] > max_context:
        raise OptionError(f"{{buckets}} must be prompt lengths from 1 to {{max_context}} ({max_context}), got "
                          f"{', '.join(map(str, buckets))}", buckets="buckets", max_context="max_context")
    source = ModelSource.of(model)
    lm = CausalLm.of_source(source)
    if not lm.cache or lm.tokens is None or lm.mask is None or any(entry.present is None for entry in lm.cache):
        raise ModelError(f"{source.label} has no KV cache with an attention mask (past inputs, present outputs): "
                         "a static cache is made from one; export it with its cache")
    layout = CacheLayout(lm.tokens.name, lm.mask.name, lm.positions.name if lm.positions is not None else None,
                         tuple((entry.input.name, entry.present) for entry in lm.cache if entry.present))
    cache_shapes = {entry.input.name: (1, _fixed(entry.input.shape[1], source.label), max_context,
                                       _fixed(entry.input.shape[3], source.label, lm.head_size))
                    for entry in lm.cache}
    # Read once (a merged decoder: its later-step branch, which reads the cache); each graph is a fresh onnx-ir
    # model over the same weight tensors, which the passes do not change.
    proto = with_past_step(source.full_proto())
    try:
        prefill = {bucket: static_prefill_graph(ir.from_proto(proto), layout, bucket, max_context)
                   for bucket in buckets}
        decode = static_decode_graph(ir.from_proto(proto), layout, max_context)
    except ValueError as error:
        raise ModelError(f"{source.label}: {error}") from None
    return StaticCache(source.label, layout, cache_shapes, max_context, prefill, decode)


def _fixed(dim, label: str, known: int | None = None) -> int:
    """A cache dimension that must be fixed (heads, head size): the graph's, else what its folder says."""
    if isinstance(dim, int):
        return dim
    if known is not None:
        return known
    raise ModelError(f"{label}'s cache inputs leave their heads or head size free ('{dim}'): a static cache needs "
                     "them fixed")


def _padded(values: np.ndarray, length: int) -> np.ndarray:
    padded = np.zeros((values.shape[0], length), np.int64)
    padded[:, :values.shape[1]] = values
    return padded
