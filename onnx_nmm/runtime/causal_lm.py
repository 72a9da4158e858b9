"""What onnx-nmm reads off a causal LM's graph — which input is what, its KV cache, its vocabulary — and the
feeds that run it on token ids: a prefill over an empty cache, or a step after a filled one.

Inputs are recognised by what they mean, not by the names of their dimensions alone:

    token ids        input_ids (or the one integer input that is nothing else)
    attention mask   covering past + new tokens, all ones
    positions        past … past + new − 1 (position_ids, or cache_position: one row)
    KV cache         past inputs (past_key_values.N.key, past.N.v, ...): [batch, heads, length, head_dim]
                     with heads and head_dim fixed by the graph (or head_dim by onnxruntime-genai's
                     genai_config.json beside the file); each is paired with the present output of the same
                     layer and kind, which the next step reads back
    cache branch     a merged decoder's use_cache_branch: whether the cache holds anything
    token types      zeros

An input that is none of these has no meaning onnx-nmm can give it: feeds are refused, naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_nmm.errors import DataError
from onnx_nmm.model_io import GENAI_CONFIG


@dataclass(frozen=True)
class TensorSpec:
    """A graph input: its name, its shape (an int per fixed dimension, a name or None per free one), dtype."""

    name: str
    shape: tuple
    dtype: Any  # a NumPy scalar type (object when the graph does not say)


@dataclass(frozen=True)
class CacheEntry:
    """One past input of the KV cache, and the present output that holds it after a step."""

    input: TensorSpec
    present: str | None
    length_axis: int


class CausalLm:
    """The inputs of a causal LM graph by their meaning; see the module docstring."""

    def __init__(self, inputs: list[TensorSpec], outputs: list[str], label: str = "the model",
                 vocabulary: int | None = None, head_size: int | None = None):
        self.label, self.vocabulary, self.head_size = label, vocabulary, head_size
        self.tokens: TensorSpec | None = None
        self.mask: TensorSpec | None = None
        self.positions: TensorSpec | None = None
        self.branch: TensorSpec | None = None
        self.token_types: list[TensorSpec] = []
        self.cache: list[CacheEntry] = []
        self.unknown: list[TensorSpec] = []
        for spec in inputs:
            self._classify(spec, outputs)
        if self.tokens is None:
            integers = [spec for spec in self.unknown if np.issubdtype(spec.dtype, np.integer)]
            if len(integers) == 1:
                self.tokens = integers[0]
                self.unknown.remove(self.tokens)

    @classmethod
    def of_source(cls, source) -> CausalLm:
        """The causal LM of a model_source.ModelSource: its graph, and the folder that describes it."""
        head_size = genai_head_size(source.folder) if source.folder is not None else None
        return cls.of_graph(source.model.graph, source.label, head_size)

    @classmethod
    def of_graph(cls, graph: ir.Graph, label: str = "the model", head_size: int | None = None) -> CausalLm:
        inputs = []
        for value in graph.inputs:
            if value.is_initializer():
                continue
            shape = tuple(dim if isinstance(dim, int) else (dim.value if dim is not None else None)
                          for dim in value.shape) if value.shape is not None else ()
            dtype = value.dtype.numpy() if value.dtype is not None else object
            inputs.append(TensorSpec(value.name or "", shape, dtype))
        return cls(inputs, [value.name or "" for value in graph.outputs], label, vocabulary_size(graph), head_size)

    @property
    def has_cache(self) -> bool:
        return bool(self.cache)

    def feeds(self, tokens: np.ndarray, cache: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The feeds for token ids [B, S] after `cache` (past input name → array; None: an empty cache)."""
        if self.unknown or self.tokens is None:
            missing = ", ".join(spec.name for spec in self.unknown) or "token ids"
            raise DataError(f"{self.label} takes {missing}, which onnx-nmm cannot make from token ids: it runs "
                            "causal LMs (token ids in, logits out)")
        batch, new = tokens.shape
        cache = cache if cache is not None else self.empty_cache(batch)
        past = self.cache_length(cache)
        feeds = {self.tokens.name: tokens.astype(self.tokens.dtype).reshape(_shaped(self.tokens, batch, new))}
        if self.mask is not None:
            feeds[self.mask.name] = np.ones(_shaped(self.mask, batch, past + new), self.mask.dtype)
        if self.positions is not None:
            row = np.arange(past, past + new, dtype=self.positions.dtype)
            feeds[self.positions.name] = (row if len(self.positions.shape) == 1
                                          else np.broadcast_to(row, (batch, new)).copy())
        for spec in self.token_types:
            feeds[spec.name] = np.zeros((batch, new), spec.dtype)
        if self.branch is not None:
            feeds[self.branch.name] = np.array([past > 0], dtype=self.branch.dtype).reshape(
                [1] * max(len(self.branch.shape), 1))
        feeds.update(cache)
        return feeds

    def random_feeds(self, batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
        """The feeds for random token ids [batch, length] below the vocabulary, after an empty cache."""
        if self.unknown or self.tokens is None:
            missing = ", ".join(spec.name for spec in self.unknown) or "no token ids"
            raise DataError(f"{self.label} takes {missing}: random token ids cannot feed it; give the {{inputs}}",
                            inputs="inputs")
        return self.feeds(self.random_tokens(batch, length, seed))

    def random_tokens(self, batch: int, length: int, seed: int) -> np.ndarray:
        if self.vocabulary is None:
            raise DataError(f"cannot tell the vocabulary size of {self.label} to draw token ids from; give the "
                            "{inputs}", inputs="inputs")
        return np.random.default_rng(seed).integers(0, self.vocabulary, size=(batch, length), dtype=np.int64)

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        """A cache holding nothing: every past input with length 0."""
        return {entry.input.name: np.zeros(self._cache_shape(entry, batch, 0), entry.input.dtype)
                for entry in self.cache}

    def cache_length(self, cache: dict[str, np.ndarray]) -> int:
        lengths = {cache[entry.input.name].shape[entry.length_axis] for entry in self.cache}
        if len(lengths) > 1:
            raise DataError(f"the cache given to {self.label} holds entries of different lengths {sorted(lengths)}")
        return lengths.pop() if lengths else 0

    def cache_after(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The cache a step left: its present outputs, as the next step's past inputs."""
        missing = [entry.input.name for entry in self.cache if entry.present not in outputs]
        if missing:
            raise DataError(f"{self.label} has no present output for its cache input(s) {', '.join(missing)}")
        return {entry.input.name: outputs[entry.present] for entry in self.cache if entry.present is not None}

    def _cache_shape(self, entry: CacheEntry, batch: int, length: int) -> list[int]:
        shape = []
        for axis, dim in enumerate(entry.input.shape):
            if axis == entry.length_axis:
                shape.append(length)
            elif isinstance(dim, int):
                shape.append(dim)
            elif axis == 0:
                shape.append(batch)
            elif axis == len(entry.input.shape) - 1 and self.head_size is not None:
                shape.append(self.head_size)
            else:
                raise DataError(f"the cache input '{entry.input.name}' of {self.label} has a free dimension '{dim}' "
                                "besides its batch and length; give the {inputs}", inputs="inputs")
        return shape

    def _classify(self, spec: TensorSpec, outputs: list[str]) -> None:
        name = spec.name.lower()
        if "past" in name and len(spec.shape) == 4 and np.issubdtype(spec.dtype, np.floating):
            self.cache.append(CacheEntry(spec, _present_of(spec.name, outputs), _length_axis(spec)))
        elif name == "use_cache_branch" or (spec.dtype is np.bool_ and "cache" in name):
            self.branch = spec
        elif "mask" in name and self.mask is None:
            self.mask = spec
        elif "position" in name and self.positions is None:
            self.positions = spec
        elif "type" in name and np.issubdtype(spec.dtype, np.integer):
            self.token_types.append(spec)
        elif name in ("input_ids", "tokens", "ids") or name.endswith("input_ids"):
            self.tokens = spec
        else:
            self.unknown.append(spec)


def _shaped(spec: TensorSpec, batch: int, length: int) -> tuple[int, ...]:
    return (length,) if len(spec.shape) == 1 else (batch, length)


def _length_axis(spec: TensorSpec) -> int:
    """The cache's length axis: the free dimension named like a length, else the free one that is not the
    batch, else axis 2 ([batch, heads, length, head_dim])."""
    free = [axis for axis, dim in enumerate(spec.shape) if not isinstance(dim, int) and axis != 0]
    named = [axis for axis in free if re.search(r"past|seq|len|total", str(spec.shape[axis]), re.IGNORECASE)]
    return (named or free or [2])[0]


def _layer_and_kind(name: str) -> tuple[int | None, str | None]:
    """(layer, "key" or "value") of a cache tensor's name: the first number, and the word after it
    (past_key_values.0.value, present.0.key, past.3.v)."""
    numbers = re.findall(r"\d+", name)
    after = re.split(r"\d+", name.lower(), maxsplit=1)[-1]
    words = [word for word in re.split(r"[^a-z]+", after) if word]
    word = words[-1] if words else ""
    kind = "key" if word in ("key", "k", "keys") else "value" if word in ("value", "v", "values") else None
    return (int(numbers[0]) if numbers else None), kind


def _present_of(past: str, outputs: list[str]) -> str | None:
    """The output holding `past` after a step: 'present' and the same layer and kind (key or value)."""
    wanted = _layer_and_kind(past)
    for output in outputs:
        if "present" in output.lower() and _layer_and_kind(output) == wanted:
            return output
    return None


def genai_head_size(folder: Path) -> int | None:
    """The head size an onnxruntime-genai folder's genai_config.json gives (its models leave it free)."""
    try:
        return int(json.loads((folder / GENAI_CONFIG).read_text())["model"]["decoder"]["head_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def vocabulary_size(graph: ir.Graph) -> int | None:
    """The token vocabulary: the logits' (the first output's) last dimension when it is static, else the rows
    of the embedding table (a Gather on a graph input reading a 2-D constant, in any subgraph too); None when
    neither says."""
    logits = graph.outputs[0] if graph.outputs else None
    if logits is not None and logits.shape is not None and len(logits.shape) and isinstance(logits.shape[-1], int) \
            and logits.shape[-1] > 1:
        return logits.shape[-1]
    inputs = set(graph.inputs)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type == "Gather" and len(node.inputs) == 2 and node.inputs[1] in inputs:
            table = node.inputs[0]
            if table is not None and table.const_value is not None and len(table.const_value.shape) == 2:
                return table.const_value.shape.numpy()[0]
    return None
