"""End-to-end speed of causal LMs on onnxruntime CPU, several models side by side in one process.

For each model: time to first token (the prefill) at each prompt length, and the time of each decode step
at each context length (a cache of that many tokens, then one new token per step). The models take turns
within every round, so a machine that slows down or speeds up part-way does so for all of them alike, and
their ratios stay honest; the first round warms up and is not counted.

The ideal decode speed-up of a model over the first is the ratio of the bytes a decode step must read:
the weights every step multiplies by (an embedding table only gathered from is not read whole) and the
KV cache at that context.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.errors import OptionError
from onnx_nmm.generation.decoding import Decoder, DecoderState
from onnx_nmm.model_source import ModelSource
from onnx_nmm.progress import Progress
from onnx_nmm.runtime.backend_runner import Model
from onnx_nmm.runtime.host import describe_machine, peak_resident_bytes, reset_peak, resident_bytes


@dataclass(frozen=True)
class BenchOptions:
    prompt_lengths: tuple[int, ...] = (128, 512)
    contexts: tuple[int, ...] = (128, 512, 2048)
    steps: int = 16  # decode steps timed at each context, every round
    rounds: int = 5
    threads: int | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("prompt_lengths", "contexts"):
            values = getattr(self, name)
            if not values or any(value < 1 for value in values):
                raise OptionError(f"{{{name}}} must be positive token counts", **{name: name})
        if self.steps < 1 or self.rounds < 1:
            raise OptionError("{steps} and {rounds} must be at least 1", steps="steps", rounds="rounds")


@dataclass
class ModelSpeed:
    label: str
    weight_bytes: int  # every initializer
    step_weight_bytes: int  # the weights a decode step reads
    cache_bytes_per_token: int  # the KV cache one token adds (0: no cache)
    peak_rss_bytes: int | None  # the process's peak while loading the model and filling its longest cache, above
    #                             what the process held before it
    first_token_s: dict[int, list[float]] = field(default_factory=dict)  # prompt length → one time per round
    step_s: dict[int, list[float]] = field(default_factory=dict)  # context → every timed step, every round

    def time_to_first_token(self, length: int) -> float:
        return statistics.median(self.first_token_s[length])

    def prefill_tokens_per_s(self, length: int) -> float:
        return length / self.time_to_first_token(length)

    def step_latency(self, context: int, quantile: float = 0.5) -> float:
        return float(np.quantile(self.step_s[context], quantile))

    def decode_tokens_per_s(self, context: int) -> float:
        return 1 / self.step_latency(context)

    def step_bytes(self, context: int) -> int:
        return self.step_weight_bytes + context * self.cache_bytes_per_token

    def to_dict(self, options: BenchOptions) -> dict:
        return {
            "model": self.label, "weight_bytes": self.weight_bytes, "step_weight_bytes": self.step_weight_bytes,
            "cache_bytes_per_token": self.cache_bytes_per_token, "peak_rss_bytes": self.peak_rss_bytes,
            "prefill": [{"prompt_tokens": length, "time_to_first_token_s": self.time_to_first_token(length),
                         "tokens_per_s": self.prefill_tokens_per_s(length), "rounds_s": self.first_token_s[length]}
                        for length in options.prompt_lengths],
            "decode": [{"context": context, "tokens_per_s": self.decode_tokens_per_s(context),
                        "latency_median_s": self.step_latency(context),
                        "latency_p90_s": self.step_latency(context, 0.9),
                        "bytes_read_per_step": self.step_bytes(context)} for context in options.contexts],
        }


@dataclass
class Benchmark:
    models: list[ModelSpeed]
    options: BenchOptions
    machine: str

    def decode_speedup(self, model: ModelSpeed, context: int) -> float:
        """Measured: decode tokens/s of `model` over the first model's."""
        return model.decode_tokens_per_s(context) / self.models[0].decode_tokens_per_s(context)

    def ideal_decode_speedup(self, model: ModelSpeed, context: int) -> float:
        """The ratio of bytes a decode step reads, the first model's over `model`'s: what a step bound by memory
        traffic would gain."""
        return self.models[0].step_bytes(context) / model.step_bytes(context)

    def to_dict(self) -> dict:
        options = self.options
        return {"machine": self.machine, "threads": options.threads, "rounds": options.rounds, "steps": options.steps,
                "models": [{**model.to_dict(options),
                            "decode_speedup": {str(c): self.decode_speedup(model, c) for c in options.contexts},
                            "ideal_decode_speedup": {str(c): self.ideal_decode_speedup(model, c)
                                                     for c in options.contexts}}
                           for model in self.models]}


def bench(models: Sequence[Model], options: BenchOptions = BenchOptions(), progress: Progress | None = None
          ) -> Benchmark:
    """Measure every model in `models` side by side; ratios are against the first."""
    progress = progress or Progress()
    runs = []
    with progress.phase("loading the models", total=len(models)) as phase:
        for model in models:
            runs.append(_Run(model, options))
            phase.advance(detail=runs[-1].speed.label)
    with progress.phase("timing rounds", total=options.rounds) as phase:
        for round_ in range(options.rounds + 1):  # round 0 warms up
            for run in runs:
                run.measure(options, keep=round_ > 0)
            if round_:
                phase.advance()
    return Benchmark([run.speed for run in runs], options, describe_machine())


class _Run:
    """One model under measurement: its decoder, its prompt, and a filled cache per context."""

    def __init__(self, model: Model, options: BenchOptions):
        source = ModelSource.of(model)
        before = resident_bytes()
        peak_known = reset_peak()
        self.decoder = Decoder(source, options.threads)
        longest = max(*options.prompt_lengths, *options.contexts) + options.steps
        self.tokens = self.decoder.model.random_tokens(1, longest, options.seed)
        self.filled: dict[int, DecoderState] = {}
        for context in options.contexts:
            self.decoder.prefill(self.tokens[:, :context])
            self.filled[context] = self.decoder.state
        peak = peak_resident_bytes()
        self.speed = ModelSpeed(
            source.label, _weight_bytes(source.model), _step_weight_bytes(source.model),
            _cache_bytes_per_token(self.filled[min(options.contexts)], min(options.contexts)),
            peak - before if peak_known and peak is not None and before is not None else None)

    def measure(self, options: BenchOptions, keep: bool) -> None:
        for length in options.prompt_lengths:
            start = time.perf_counter()
            self.decoder.prefill(self.tokens[:, :length]).argmax(-1)
            elapsed = time.perf_counter() - start
            if keep:
                self.speed.first_token_s.setdefault(length, []).append(elapsed)
        for context in options.contexts:
            self.decoder.resume(self.filled[context])
            for step in range(options.steps):
                start = time.perf_counter()
                self.decoder.step(self.tokens[:, context + step]).argmax(-1)
                elapsed = time.perf_counter() - start
                if keep:
                    self.speed.step_s.setdefault(context, []).append(elapsed)


def _weight_bytes(model: ir.Model) -> int:
    return sum(_nbytes(value) for value in model.graph.initializers.values())


def _step_weight_bytes(model: ir.Model) -> int:
    """The weights a decode step reads: all but the tables it only gathers a row from (the embedding)."""
    return sum(_nbytes(value) for value in model.graph.initializers.values()
               if not value.uses() or any(node.op_type != "Gather" for node, _ in value.uses()))


def _cache_bytes_per_token(state: DecoderState, context: int) -> int:
    return 0 if state.cache is None else sum(array.nbytes for array in state.cache.values()) // context


def _nbytes(value: ir.Value) -> int:
    return value.const_value.nbytes if value.const_value is not None else 0
