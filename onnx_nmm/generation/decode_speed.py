"""End-to-end speed of causal LMs on onnxruntime CPU, several models side by side in one process.

For each model: time to first token (the prefill) at each prompt length, and the time of each decode step
at each context length (a cache of that many tokens, then one new token per step).

A speed-up is measured round by round. A round is two passes: every model in an order drawn afresh, then in
the reverse order, so whatever going first, last or after itself does to a model it does to each alike, and
a machine that slows down or speeds up part-way slows them alike. The round's speed-up of a model is the
geometric mean of its two passes' ratios (the first model's time over its own: a median step, or a
prefill). Over the rounds, the reported speed-up is the median, with a distribution-free confidence
interval from the rounds' order statistics (a sign test: nothing is assumed about the noise's shape).
Rounds go on past the minimum until every interval is within ±precision of its median or the time budget
is spent. Every round loads the models afresh and warms them up untimed: two loads of one model differ in
speed for as long as they live, so the rounds must sample loads too.

The ideal decode speed-up of a model over the first is the ratio of the bytes a decode step must read:
the weights every step multiplies by (an embedding table only gathered from is not read whole) and the
KV cache at that context.

A model's peak RSS is measured in a process of its own that loads only that model and decodes after its
longest context: in the benchmark's process the allocator's reuse of what an earlier model freed, and
pages the models share, would make the figure depend on which model came first.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.errors import OptionError
from onnx_nmm.generation.decoding import Decoder, DecoderState
from onnx_nmm.model_source import ModelSource
from onnx_nmm.progress import Phase, Progress
from onnx_nmm.runtime.backend_runner import Model
from onnx_nmm.runtime.host import describe_machine, peak_resident_bytes


@dataclass(frozen=True)
class BenchOptions:
    prompt_lengths: tuple[int, ...] = (128, 512)
    contexts: tuple[int, ...] = (128, 512, 2048)
    steps: int = 16  # decode steps timed at each context, every pass
    rounds: int = 6  # at least this many timed rounds (two passes each: the models in a drawn order, reversed)
    time_budget_s: float = 120.0  # more rounds until every interval is within ±precision or this much time passed
    precision: float = 0.02
    confidence: float = 0.95  # of every speed-up's interval
    threads: int | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("prompt_lengths", "contexts"):
            values = getattr(self, name)
            if not values or any(value < 1 for value in values):
                raise OptionError(f"{{{name}}} must be positive token counts", **{name: name})
        if self.steps < 1 or self.rounds < 1:
            raise OptionError("{steps} and {rounds} must be at least 1", steps="steps", rounds="rounds")
        if self.time_budget_s < 0:
            raise OptionError(f"{{time_budget_s}} must be 0 or more seconds, got {self.time_budget_s}",
                              time_budget_s="time_budget_s")
        if not 0 < self.precision < 1:
            raise OptionError(f"{{precision}} must be in (0, 1) (a fraction of the speed-up), got {self.precision}",
                              precision="precision")
        if not 0.5 <= self.confidence < 1:
            raise OptionError(f"{{confidence}} must be in [0.5, 1), got {self.confidence}", confidence="confidence")


@dataclass(frozen=True)
class Speedup:
    """A speed-up measured round by round: the median of the rounds' speed-ups and the interval that holds the
    true median with the confidence asked for (None: too few rounds for one)."""

    median: float
    interval: tuple[float, float] | None
    rounds: int

    @classmethod
    def of_rounds(cls, speedups: Sequence[float], confidence: float) -> Speedup:
        """The median of `speedups` and the order statistics around it that a sign test gives."""
        ordered = sorted(speedups)
        rank = median_interval_rank(len(ordered), confidence)
        interval = None if rank is None else (ordered[rank - 1], ordered[len(ordered) - rank])
        return cls(statistics.median(ordered), interval, len(ordered))

    @property
    def within_noise(self) -> bool:
        """Whether the measurement cannot tell this model from the first: the interval holds 1.0, or there is none."""
        return self.interval is None or self.interval[0] <= 1.0 <= self.interval[1]

    def within(self, precision: float) -> bool:
        """Whether the interval lies within ±`precision` (a fraction) of the median."""
        return (self.interval is not None and self.interval[0] >= self.median * (1 - precision)
                and self.interval[1] <= self.median * (1 + precision))

    def verdict(self, ideal: float | None = None) -> str:
        """What the measurement says: "within noise" when the interval holds 1.0, and a speed-up beyond the
        `ideal` (what the bytes read explain) flagged."""
        if self.interval is None:
            return "too few rounds for an interval"
        if self.within_noise:
            return "within noise"
        if ideal is not None and self.interval[0] > ideal:
            return f"faster than its bytes explain (ideal {ideal:.2f}×): check"
        return "faster" if self.interval[0] > 1 else "slower"

    def to_dict(self, ideal: float | None = None) -> dict:
        return {"median": self.median, "interval": list(self.interval) if self.interval else None,
                "rounds": self.rounds, "verdict": self.verdict(ideal)}


def median_interval_rank(samples: int, confidence: float) -> int | None:
    """The largest k for which the k-th smallest and k-th largest of `samples` values bracket their
    distribution's median with at least `confidence`, whatever the distribution (None: not even the smallest
    and largest do). Each value falls below the median with probability ½, so the bracket misses it when k-1
    or fewer of them do, or k-1 or fewer lie above: 2·P(Binomial(samples, ½) ≤ k-1)."""
    rank, below = 0, 0.0
    while rank < (samples + 1) // 2:
        below += math.comb(samples, rank) / 2**samples  # P(at most `rank` values below the median)
        if 2 * below > 1 - confidence:
            break
        rank += 1
    return rank or None


def speedup_of_passes(reference_s: Sequence[float], model_s: Sequence[float], confidence: float) -> Speedup:
    """The speed-up of a model over the reference from their times pass by pass, a round being two passes in
    opposite orders: each round's is the geometric mean of its passes' reference time over model time."""
    ratios = [reference / model for reference, model in zip(reference_s, model_s)]
    return Speedup.of_rounds([math.sqrt(a * b) for a, b in zip(ratios[0::2], ratios[1::2])], confidence)


@dataclass
class ModelSpeed:
    label: str
    weight_bytes: int  # every initializer
    step_weight_bytes: int  # the weights a decode step reads
    cache_bytes_per_token: int  # the KV cache one token adds (0: no cache)
    peak_rss_bytes: int | None  # the peak of a process of its own that loads only this model and decodes after its
    #                             longest context, Python, onnx-nmm and onnxruntime included (None: not measured)
    first_token_s: dict[int, list[float]] = field(default_factory=dict)  # prompt length → one time per pass
    step_s: dict[int, list[list[float]]] = field(default_factory=dict)  # context → per pass, every timed step

    def time_to_first_token(self, length: int) -> float:
        return statistics.median(self.first_token_s[length])

    def prefill_tokens_per_s(self, length: int) -> float:
        return length / self.time_to_first_token(length)

    def step_latency(self, context: int, quantile: float = 0.5) -> float:
        return float(np.quantile(np.concatenate(self.step_s[context]), quantile))

    def decode_tokens_per_s(self, context: int) -> float:
        return 1 / self.step_latency(context)

    def median_step_of_passes(self, context: int) -> list[float]:
        """The median decode step at `context` of each pass."""
        return [statistics.median(steps) for steps in self.step_s[context]]

    def step_bytes(self, context: int) -> int:
        return self.step_weight_bytes + context * self.cache_bytes_per_token

    def to_dict(self, options: BenchOptions) -> dict:
        return {
            "model": self.label, "weight_bytes": self.weight_bytes, "step_weight_bytes": self.step_weight_bytes,
            "cache_bytes_per_token": self.cache_bytes_per_token, "peak_rss_bytes": self.peak_rss_bytes,
            "prefill": [{"prompt_tokens": length, "time_to_first_token_s": self.time_to_first_token(length),
                         "tokens_per_s": self.prefill_tokens_per_s(length), "passes_s": self.first_token_s[length]}
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
    rounds: int  # timed rounds run
    timing_s: float  # wall time of every round, loads and warm-ups included

    def decode_speedup(self, model: ModelSpeed, context: int) -> Speedup:
        """Measured: `model`'s decode speed over the first model's, from their median steps pass by pass."""
        first = self.models[0]
        return speedup_of_passes(first.median_step_of_passes(context), model.median_step_of_passes(context),
                                 self.options.confidence)

    def prefill_speedup(self, model: ModelSpeed, length: int) -> Speedup:
        """Measured: `model`'s time to first token over the first model's, pass by pass."""
        return speedup_of_passes(self.models[0].first_token_s[length], model.first_token_s[length],
                                 self.options.confidence)

    def ideal_decode_speedup(self, model: ModelSpeed, context: int) -> float:
        """The ratio of bytes a decode step reads, the first model's over `model`'s: what a step bound by memory
        traffic would gain."""
        return self.models[0].step_bytes(context) / model.step_bytes(context)

    def speedups(self) -> list[Speedup]:
        """Every measured speed-up of every model but the first."""
        options = self.options
        return [speedup for model in self.models[1:]
                for speedup in ([self.prefill_speedup(model, length) for length in options.prompt_lengths]
                                + [self.decode_speedup(model, context) for context in options.contexts])]

    @property
    def precise(self) -> bool:
        """Whether every interval came within ±precision before the time budget ran out."""
        return all(speedup.within(self.options.precision) for speedup in self.speedups())

    def to_dict(self) -> dict:
        options = self.options
        return {"machine": self.machine, "threads": options.threads, "rounds": self.rounds, "steps": options.steps,
                "timing_s": self.timing_s, "confidence": options.confidence, "precision": options.precision,
                "precise": self.precise,
                "models": [{**model.to_dict(options),
                            "prefill_speedup_interval": {str(length): self.prefill_speedup(model, length).to_dict()
                                                         for length in options.prompt_lengths},
                            "decode_speedup": {str(c): self.decode_speedup(model, c).median for c in options.contexts},
                            "decode_speedup_interval": {
                                str(c): self.decode_speedup(model, c).to_dict(self.ideal_decode_speedup(model, c))
                                for c in options.contexts},
                            "ideal_decode_speedup": {str(c): self.ideal_decode_speedup(model, c)
                                                     for c in options.contexts}}
                           for model in self.models]}


def bench(models: Sequence[Model], options: BenchOptions = BenchOptions(), progress: Progress | None = None
          ) -> Benchmark:
    """Measure every model in `models` side by side; speed-ups are against the first."""
    progress = progress or Progress()
    with progress.phase("peak memory, each model alone", total=len(models)) as phase:
        peaks = []
        for model in models:
            peaks.append(peak_rss_alone(model, options))
            phase.advance()
    runs = []
    with progress.phase("loading the models", total=len(models)) as phase:
        for model, peak in zip(models, peaks):
            runs.append(_Run(model, options, peak))
            phase.advance(detail=runs[-1].speed.label)
    with progress.phase("timing rounds", total=options.rounds) as phase:
        return _timed_rounds(runs, options, phase)


def _timed_rounds(runs: list[_Run], options: BenchOptions, phase: Phase) -> Benchmark:
    """Rounds until there are `options.rounds` and every interval is within ±precision, or the time budget is
    spent; the benchmark they make."""
    speeds, machine = [run.speed for run in runs], describe_machine()
    order = np.random.default_rng(options.seed)
    start = time.perf_counter()
    result = Benchmark(speeds, options, machine, 0, 0.0)
    while result.rounds < options.rounds or not (result.precise or result.timing_s >= options.time_budget_s):
        _time_round(runs, options, order, reload=result.rounds > 0)
        result = Benchmark(speeds, options, machine, result.rounds + 1, time.perf_counter() - start)
        phase.set_total(max(result.rounds, options.rounds))
        phase.advance()
    return result


def _time_round(runs: list[_Run], options: BenchOptions, order: np.random.Generator, reload: bool) -> None:
    """One round: every model loaded afresh (if `reload`) and warmed up, then timed in an order drawn afresh and
    in the reverse of that order.

    Afresh, because two loads of one model in one process ran at speeds up to 10 % apart for as long as they
    lived (SmolLM2-135M, decode; where their memory landed), which rounds on the same loads never average
    out. Drawn, not fixed: whichever model a fixed order put after itself ran faster on a small model (its
    caches still warm), and the one put last before the check between rounds slower."""
    shuffled = [runs[index] for index in order.permutation(len(runs))]
    for run in shuffled:
        if reload:
            run.reload(options)
        run.warm_up(options)
    for run in [*shuffled, *reversed(shuffled)]:
        run.time_pass(options)


def peak_rss_alone(model: Model, options: BenchOptions) -> int | None:
    """The peak RSS of a fresh Python process that loads only `model` (a path) and decodes `options.steps`
    tokens after its longest context; None for an in-memory model, or where the process cannot tell."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    longest = max(*options.prompt_lengths, *options.contexts)
    program = ("import sys; from onnx_nmm.generation.decode_speed import decode_alone; "
               "print(decode_alone(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "
               "None if sys.argv[4] == 'None' else int(sys.argv[4]), int(sys.argv[5])))")
    child = subprocess.run([sys.executable, "-c", program, str(model), str(longest), str(options.steps),
                            str(options.threads), str(options.seed)], capture_output=True, text=True)
    last_line = child.stdout.strip().splitlines()[-1:] if child.returncode == 0 else []
    return int(last_line[0]) if last_line and last_line[0].isdigit() else None


def decode_alone(path: str, context: int, steps: int, threads: int | None, seed: int) -> int | None:
    """Run in a process of its own: prefill `context` tokens into the model at `path`, decode `steps` more, and
    return the process's peak RSS."""
    decoder = Decoder(path, threads)
    tokens = decoder.model.random_tokens(1, context + steps, seed)
    decoder.prefill(tokens[:, :context])
    for step in range(steps):
        decoder.step(tokens[:, context + step])
    return peak_resident_bytes()


class _Run:
    """One model under measurement: its decoder, its prompt, and a filled cache per context."""

    def __init__(self, model: Model, options: BenchOptions, peak_rss_bytes: int | None):
        self.source = ModelSource.of(model)
        self.decoder = Decoder(self.source, options.threads)
        longest = max(*options.prompt_lengths, *options.contexts) + options.steps
        self.tokens = self.decoder.model.random_tokens(1, longest, options.seed)
        self.filled: dict[int, DecoderState] = {}
        for context in options.contexts:
            self.decoder.prefill(self.tokens[:, :context])
            self.filled[context] = self.decoder.state
        self.speed = ModelSpeed(
            self.source.label, _weight_bytes(self.source.model), _step_weight_bytes(self.source.model),
            _cache_bytes_per_token(self.filled[min(options.contexts)], min(options.contexts)), peak_rss_bytes)

    def reload(self, options: BenchOptions) -> None:
        """A new session of the model, the old one let go first (its memory with it); the filled caches stay."""
        del self.decoder
        self.decoder = Decoder(self.source, options.threads)

    def warm_up(self, options: BenchOptions) -> None:
        """Run once, untimed, the shapes a pass times: a session's first run at a shape sets it up."""
        for length in options.prompt_lengths:
            self.decoder.prefill(self.tokens[:, :length])
        for context in options.contexts:
            self.decoder.resume(self.filled[context])
            self.decoder.step(self.tokens[:, context])

    def time_pass(self, options: BenchOptions) -> None:
        """Time a prefill at every prompt length and `steps` decode steps at every context. An untimed decode
        step comes first, so that whatever ran before (another model, or nothing) left this model's weights in
        the caches alike."""
        shortest = min(options.contexts)
        self.decoder.resume(self.filled[shortest])
        self.decoder.step(self.tokens[:, shortest]).argmax(-1)
        for length in options.prompt_lengths:
            start = time.perf_counter()
            self.decoder.prefill(self.tokens[:, :length]).argmax(-1)
            self.speed.first_token_s.setdefault(length, []).append(time.perf_counter() - start)
        for context in options.contexts:
            self.decoder.resume(self.filled[context])
            steps = []
            for step in range(options.steps):
                start = time.perf_counter()
                self.decoder.step(self.tokens[:, context + step]).argmax(-1)
                steps.append(time.perf_counter() - start)
            self.speed.step_s.setdefault(context, []).append(steps)


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
