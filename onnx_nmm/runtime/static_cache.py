"""A causal LM as the static-shape graphs Neuron runs: a prefill per prompt-length bucket and one decode step,
over a KV cache of `max_context` positions that stays where it is (passes/static_cache.py makes the graphs).

    prompt ─ padded to the smallest bucket that holds it ─ prefill[bucket] ─ cache, logits of its last token
    token  ─ decode(cache, cache_position) ─ cache, logits ─ token ─ ...           up to max_context positions

A merged decoder (optimum's) is made from its with-past branch; an onnxruntime-genai export's attention writes its
cache itself, at the end of the mask, and takes no cache_position. `StaticDecoder` runs the graphs on the CPU,
with onnxruntime or lowered to PyTorch as the Neuron trace takes them (`backend` "torch": the custom ops as
torch math; "emulator": on the NKI kernels), and must give the exported model's own tokens; `compile` writes
them to a folder (runtime/compiled_folder.py) that generate reads back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnx_nmm.errors import DataError, ModelError, OptionError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes.static_cache import (
    CACHE_POSITION,
    CacheLayout,
    attention_writes_cache,
    static_decode_graph,
    static_prefill_graph,
)
from onnx_nmm.runtime.backend_runner import Model, ModelRunner
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.graph_probe import with_past_step
from onnx_nmm.runtime.rank_programs import RankPrograms, RankProgramsRunner

if TYPE_CHECKING:
    from onnx_nmm.runtime.device_ranks import DeviceRankRunner, DeviceRanks

USUAL_BUCKETS = (128, 512, 2048)  # prompt lengths a prefill is compiled for, capped at max_context
STATE_PREFIX = "cache."  # a decode trace's cache parameters (trainium/cache_state.CacheState.cache)


def default_buckets(max_context: int) -> tuple[int, ...]:
    """128, 512 and 2048 below `max_context`, then `max_context` itself: a prompt of any length that fits."""
    return (*(bucket for bucket in USUAL_BUCKETS if bucket < max_context), max_context)


@dataclass
class StaticCache:
    """The prefill graphs (by bucket) and the decode graph of one model, and the layout of their cache. A graph
    is an onnx-ir model, or the path of one (a compiled folder's), or the rank programs of one split over
    NeuronCores (`compile --tp`: then each cache tensor is the ranks' caches stacked, [tp, batch, ...])."""

    label: str
    layout: CacheLayout
    cache_shapes: dict[str, tuple[int, ...]]  # per past input: [batch, heads, max_context, head_dim]
    max_context: int
    prefill: dict[int, Model | RankPrograms]
    decode: Model | RankPrograms
    traced: dict[str, Path] = field(default_factory=dict)  # graph name → its Neuron trace (a compiled folder's)
    # graph name → how its trace holds the cache as state (trainium/cache_state.py): {"step_inputs", "aliased"}
    state: dict[str, dict] = field(default_factory=dict)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.prefill))

    @property
    def batch(self) -> int:
        return next(iter(self.cache_shapes.values()))[-4]

    def graphs(self) -> list[tuple[str, Model | RankPrograms, int]]:
        """(name, graph, tokens per sequence) of every graph: each prefill bucket, then the decode step."""
        return [*((f"prefill_{bucket}", self.prefill[bucket], bucket) for bucket in self.buckets),
                ("decode", self.decode, 1)]

    def bucket_for(self, prompt_tokens: int) -> int:
        """The smallest bucket that holds the prompt; DataError when none does."""
        fitting = [bucket for bucket in self.buckets if bucket >= prompt_tokens]
        if not fitting:
            raise DataError(f"a prompt of {prompt_tokens} tokens is longer than the largest prefill bucket, "
                            f"{self.buckets[-1]}: compile with a larger {{max_context}} or {{buckets}}",
                            max_context="max_context", buckets="buckets")
        return fitting[0]

    def check_fits(self, prompt_tokens: int, new_tokens: int) -> None:
        """DataError unless a prompt and its continuation fit a bucket and the cache."""
        self.bucket_for(prompt_tokens)
        if prompt_tokens + new_tokens > self.max_context:
            raise DataError(f"{prompt_tokens} prompt tokens and {new_tokens} new ones do not fit the cache of "
                            f"{self.max_context} positions: ask for fewer, or compile with a larger {{max_context}}",
                            max_context="max_context")

    def prefill_feeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """A prefill's feeds for token ids [batch, n]: padded to the bucket, over an empty cache."""
        bucket = self.bucket_for(ids.shape[1])
        layout = self.layout
        feeds = {layout.tokens: _padded(ids, bucket), layout.mask: _padded(np.ones_like(ids), bucket),
                 **{name: np.zeros(shape, np.float32) for name, shape in self.cache_shapes.items()}}
        if layout.positions is not None:
            feeds[layout.positions] = np.tile(np.arange(bucket, dtype=np.int64), (ids.shape[0], 1))
        return feeds

    def decode_feeds(self, tokens: np.ndarray, position: int, cache: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A decode step's feeds: one token per sequence [batch, 1] written at `position` of `cache`."""
        layout = self.layout
        mask = np.zeros((tokens.shape[0], self.max_context), np.int64)
        mask[:, :position + 1] = 1
        feeds = {layout.tokens: tokens, layout.mask: mask, **cache}
        if layout.write_position is not None:  # else the attention writes where the mask ends
            feeds[layout.write_position] = np.array([position], np.int64)
        if layout.positions is not None:
            feeds[layout.positions] = np.full((tokens.shape[0], 1), position, np.int64)
        return feeds

    def example_feeds(self, graph: str) -> dict[str, np.ndarray]:
        """Feeds for one graph by name, as a check or a trace takes them: random tokens over an empty cache
        (a prefill), or one token half way through a cache written that far, random before it and zero after (the
        decode step; onnxruntime leaves what an attention that writes its cache does not write as zeros)."""
        rng = np.random.default_rng(0)
        if graph != "decode":
            return self.prefill_feeds(rng.integers(0, 100, (self.batch, int(graph.removeprefix("prefill_")))))
        position = self.max_context // 2
        cache = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in self.cache_shapes.items()}
        for values in cache.values():
            values[..., position:, :] = 0
        return self.decode_feeds(rng.integers(0, 100, (self.batch, 1)), position, cache)

    def generate_greedy(self, ids: np.ndarray, new_tokens: int, backend: str = "ort") -> list[int]:
        """The greedy continuation of one prompt (token ids [1, n]) on these graphs, run by `backend` ("ort",
        "torch" or "emulator": onnx_nmm.runtime.backend_runner)."""
        self.check_fits(ids.shape[1], new_tokens)
        decoder = StaticDecoder(self, backend)
        tokens = [int(decoder.prefill(ids).argmax(-1)[0])]
        while len(tokens) < new_tokens:
            tokens.append(int(decoder.step(np.array([[tokens[-1]]])).argmax(-1)[0]))
        return tokens


class StaticDecoder:
    """generation.decoding.Decoder's prefill and step, on a StaticCache's graphs: the prompt padded to its
    bucket, then one decode step a token, the cache carried from each graph's present outputs to the next one's
    past inputs. A compiled batch above 1 runs the sequence in every row.

    `backend`: "ort", "torch" or "emulator" run the ONNX graphs on the CPU (backend_runner); "neuron" runs each
    graph's trace (`compile` without --dry-run, on a machine with the Neuron SDK), a graph split over NeuronCores
    by the one NxDModel every graph's trace is in (runtime/device_ranks.py)."""

    def __init__(self, graphs: StaticCache, backend: str = "ort", target: str = "trn2", threads: int | None = None):
        if backend == "neuron" and not graphs.traced:
            raise OptionError(f"{graphs.label} was not traced: the neuron {{backend}} runs what compile traced on a "
                              "machine with the Neuron SDK (without {dry_run})", backend="backend", dry_run="dry_run")
        self.graphs, self.backend, self.target, self.threads = graphs, backend, target, threads
        self.label = graphs.label
        self._runners: dict[str, ModelRunner | TracedRunner | RankProgramsRunner | DeviceRankRunner] = {}
        self._device_ranks: DeviceRanks | None = None
        self.vocabulary = self._runner("decode", graphs.decode).vocabulary
        self.position = 0
        self.cache: dict[str, np.ndarray] = {}

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Start a sequence with token ids [1, n]; the logits of its last position [1, vocabulary]."""
        return self.prompt_logits(tokens)[:, -1]

    def prompt_logits(self, tokens: np.ndarray) -> np.ndarray:
        """Start a sequence with token ids [1, n]; the logits of each of its positions [1, n, vocabulary]."""
        tokens = np.asarray(tokens, np.int64)
        bucket = self.graphs.bucket_for(tokens.shape[1])
        logits = self._run(f"prefill_{bucket}", self.graphs.prefill[bucket], self.graphs.prefill_feeds(
            np.repeat(tokens, self.graphs.batch, axis=0)))
        decode = self._runner("decode", self.graphs.decode)
        if isinstance(decode, StateRunner):  # the decode trace holds the cache as its state from here on
            decode.hold(self.cache)
        self.position = tokens.shape[1]
        return logits[:1, :self.position]

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Append one token [1, 1]; the logits of the new position [1, vocabulary]."""
        if self.position >= self.graphs.max_context:
            raise DataError(f"the cache holds {self.graphs.max_context} positions, all written: compile with a "
                            "larger {max_context} to generate further", max_context="max_context")
        tokens = np.repeat(np.asarray(tokens, np.int64).reshape(1, 1), self.graphs.batch, axis=0)
        logits = self._run("decode", self.graphs.decode, self.graphs.decode_feeds(tokens, self.position, self.cache))
        self.position += 1
        return logits[:1, -1]

    def _runner(self, name: str, graph: Model | RankPrograms
                ) -> ModelRunner | TracedRunner | RankProgramsRunner | DeviceRankRunner:
        if name not in self._runners:
            if isinstance(graph, RankPrograms) and self.backend == "neuron":  # its ranks on the NeuronCores
                self._runners[name] = self._on_neuroncores().runner(name)
            elif isinstance(graph, RankPrograms):  # a graph split over NeuronCores: its ranks in lock-step
                self._runners[name] = RankProgramsRunner(graph, dict(self.graphs.layout.cache), self.backend,
                                                         self.target)
            elif self.backend != "neuron":
                self._runners[name] = ModelRunner(graph, self.backend, self.target, self.threads)
            elif name in self.graphs.state:
                self._runners[name] = StateRunner(self.graphs.traced[name], ModelSource.of(graph), self.graphs.layout,
                                                  **self.graphs.state[name])
            else:
                self._runners[name] = TracedRunner(self.graphs.traced[name], ModelSource.of(graph))
        return self._runners[name]

    def _on_neuroncores(self) -> DeviceRanks:
        """The one NxDModel holding every graph's trace, loaded with every rank's weights (once)."""
        if self._device_ranks is None:
            from onnx_nmm.runtime.device_ranks import DeviceRanks

            graphs = {name: graph for name, graph, _ in self.graphs.graphs() if isinstance(graph, RankPrograms)}
            shapes = {past: shape[1:] for past, shape in self.graphs.cache_shapes.items()}  # one rank's
            self._device_ranks = DeviceRanks(self.graphs.traced["decode"], graphs, self.graphs.layout, shapes)
        return self._device_ranks

    def _run(self, name: str, graph: Model | RankPrograms, feeds: dict[str, np.ndarray]) -> np.ndarray:
        runner = self._runner(name, graph)
        outputs = runner(feeds)
        if not getattr(runner, "holds_cache", False):  # else the trace keeps the cache on the device
            self.cache = {past: outputs[present] for past, present in self.graphs.layout.cache}
        return outputs[runner.output_names[0]]


class TracedRunner:
    """A graph's trace (TorchScript: torch_neuronx's runs on the NeuronCore), called as ModelRunner is: with
    {input name: array}, in the graph's input order; giving {output name: array}."""

    def __init__(self, trace: Path, graph: ModelSource):
        import importlib.util

        import torch

        if importlib.util.find_spec("torch_neuronx") is not None:
            import torch_neuronx  # noqa: F401  (registers the Neuron ops a Neuron trace calls)
        self.module = torch.jit.load(str(trace))
        self.vocabulary = CausalLm.of_source(graph).vocabulary
        self.input_names = [value.name or "" for value in graph.model.graph.inputs if not value.is_initializer()]
        self.output_names = [value.name or "" for value in graph.model.graph.outputs]

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        outputs = self.module(*(torch.from_numpy(np.ascontiguousarray(inputs[name])) for name in self.input_names))
        return {name: output.numpy() for name, output in zip(self.output_names, outputs)}


class StateRunner(TracedRunner):
    """A decode trace that holds the cache as its state (trainium/cache_state.CacheState), called with the step's
    other inputs only. `hold` puts a prefill's cache in; with `aliased` (torch-neuronx's input/output aliasing)
    each call updates it in place on the device, and without (a trace for the CPU) the runner copies the
    present outputs back in."""

    holds_cache = True

    def __init__(self, trace: Path, graph: ModelSource, layout: CacheLayout, step_inputs: list[str], aliased: bool):
        super().__init__(trace, graph)
        self.input_names = step_inputs
        named = dict(self.module.named_parameters())  # CacheState's cache.0, cache.1, ... in the layout's order
        self.state = [named[f"{STATE_PREFIX}{index}"] for index in range(len(layout.cache))]
        self.presents = [present for _, present in layout.cache]
        self.layout, self.aliased = layout, aliased

    def hold(self, cache: dict[str, np.ndarray]) -> None:
        import torch

        self._hold([torch.from_numpy(np.ascontiguousarray(cache[past])) for past, _ in self.layout.cache])

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The step's first output (the logits); the cache stays in the trace."""
        import torch

        outputs = dict(zip(self.output_names, self.module(
            *(torch.from_numpy(np.ascontiguousarray(inputs[name])) for name in self.input_names))))
        if not self.aliased:
            self._hold([outputs[present] for present in self.presents])
        return {self.output_names[0]: outputs[self.output_names[0]].numpy()}

    def _hold(self, tensors) -> None:
        import torch

        with torch.no_grad():
            for parameter, tensor in zip(self.state, tensors, strict=True):
                parameter.copy_(tensor)


def static_cache(model: Model | ModelSource, max_context: int, buckets: tuple[int, ...] | None = None,
                 batch: int = 1) -> StaticCache:
    """The static-cache graphs of a causal LM with a KV cache (any exporter's input names), for `batch`
    sequences at a time."""
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
    # Read once (a merged decoder: its later-step branch, which reads the cache); each graph is a fresh onnx-ir
    # model over the same weight tensors, which the passes do not change.
    proto = with_past_step(source.full_proto())
    in_place = attention_writes_cache(ir.from_proto(proto).graph, lm.cache[0].input.name)
    layout = CacheLayout(lm.tokens.name, lm.mask.name, lm.positions.name if lm.positions is not None else None,
                         tuple((entry.input.name, entry.present) for entry in lm.cache if entry.present),
                         write_position=None if in_place else CACHE_POSITION)
    cache_shapes: dict[str, tuple[int, ...]] = {
        entry.input.name: (batch, _fixed(entry.input.shape[1], source.label), max_context,
                           _fixed(entry.input.shape[3], source.label, lm.head_size))
        for entry in lm.cache}
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
