"""`bench`'s speed-ups: interleaved rounds, a distribution-free interval, and what it lets the output say."""

import math
import re

import numpy as np
import pytest

import onnx_nmm
from onnx_nmm.generation.decode_speed import ModelSpeed, Speedup, median_interval_rank, speedup_of_passes


@pytest.mark.parametrize("samples, confidence, rank", [
    (5, 0.95, None), (6, 0.95, 1), (10, 0.95, 2), (20, 0.95, 6), (7, 0.99, None), (8, 0.99, 1), (12, 0.999, 1),
])
def test_the_interval_takes_the_order_statistics_of_the_sign_test_tables(samples, confidence, rank):
    assert median_interval_rank(samples, confidence) == rank


def _passes(model_speedup: float, rounds: int, first_in_pass_slower: float = 1.0, noise: float = 0.0,
            seed: int = 0) -> tuple[list[float], list[float]]:
    """Times of a reference and a model, two passes a round (the reference first, then the model first), on a
    machine that slows down round by round, where going first in a pass costs `first_in_pass_slower`."""
    rng = np.random.default_rng(seed)
    reference, model = [], []
    for round_ in range(rounds):
        machine = 1 + 0.1 * round_
        for reference_first in (True, False):
            jitter = np.exp(rng.normal(0, noise, 2))
            reference.append(machine * jitter[0] * (first_in_pass_slower if reference_first else 1))
            model.append(machine * jitter[1] * (1 if reference_first else first_in_pass_slower) / model_speedup)
    return reference, model


def test_opposite_orders_cancel_what_going_first_does_and_a_machine_that_slows():
    speedup = speedup_of_passes(*_passes(1.0, rounds=8, first_in_pass_slower=1.3), confidence=0.95)
    assert speedup.rounds == 8 and speedup.interval is not None
    assert all(math.isclose(value, 1.0) for value in (speedup.median, *speedup.interval))
    assert speedup.within_noise and speedup.verdict(ideal=1.0) == "within noise"


def test_a_real_speedup_is_resolved_and_one_beyond_the_bytes_is_flagged():
    faster = speedup_of_passes(*_passes(1.25, rounds=12, first_in_pass_slower=1.1, noise=0.05), confidence=0.95)
    low, high = faster.interval
    assert 1 < low < 1.25 < high and not faster.within_noise
    assert faster.verdict(ideal=1.5) == "faster"
    assert faster.verdict(ideal=1.1).startswith("faster than its bytes explain (ideal 1.10×)")
    slower = speedup_of_passes(*_passes(0.8, rounds=12, noise=0.05), confidence=0.95)
    assert slower.verdict(ideal=1.0) == "slower"


def test_noise_alone_is_within_noise_and_too_few_rounds_give_no_interval():
    noisy = speedup_of_passes(*_passes(1.0, rounds=12, noise=0.2, seed=1), confidence=0.95)
    low, high = noisy.interval
    assert low < 1 < high and noisy.verdict() == "within noise"
    few = Speedup.of_rounds([1.3, 1.2, 1.25, 1.3, 1.2], confidence=0.95)
    assert few.interval is None and few.verdict() == "too few rounds for an interval" and few.median == 1.25
    assert not few.within(0.5)


def test_a_model_benched_against_itself_is_within_noise_and_weighs_the_same(export):
    model = export("llama", "dynamo", cache=True)
    options = onnx_nmm.BenchOptions(prompt_lengths=(8,), contexts=(8,), steps=4, rounds=12, time_budget_s=0,
                                    confidence=0.999, threads=1)
    result = onnx_nmm.bench([model, model], options)
    assert result.rounds == 12
    first, again = result.models
    for speedup in (result.prefill_speedup(again, 8), result.decode_speedup(again, 8)):
        low, high = speedup.interval
        assert low <= 1.0 <= high and speedup.verdict(result.ideal_decode_speedup(again, 8)) == "within noise"
    assert len(again.step_s[8]) == 2 * 12 and all(len(steps) == 4 for steps in again.step_s[8])
    # each measured in a process of its own: what the other model left in this one does not count
    assert first.peak_rss_bytes is not None and again.peak_rss_bytes is not None
    assert abs(first.peak_rss_bytes - again.peak_rss_bytes) < 0.1 * first.peak_rss_bytes


def test_rounds_go_on_until_the_intervals_are_tight_or_the_budget_is_spent(export):
    model = export("llama", "dynamo", cache=True)
    options = onnx_nmm.BenchOptions(prompt_lengths=(8,), contexts=(8,), steps=2, rounds=6, time_budget_s=1.0,
                                    precision=0.001, threads=1)
    result = onnx_nmm.bench([model, model], options)
    assert result.timing_s >= 1.0 and result.rounds > 6 and not result.precise
    alone = onnx_nmm.bench([model], onnx_nmm.BenchOptions(prompt_lengths=(8,), contexts=(8,), steps=2, rounds=6,
                                                          time_budget_s=60, precision=0.001, threads=1))
    assert alone.rounds == 6 and alone.precise  # no speed-up to resolve: the fewest rounds asked for


@pytest.mark.parametrize("changes, message", [
    ({"time_budget_s": -1}, "time_budget_s must be 0 or more seconds"),
    ({"precision": 0}, "precision must be in (0, 1)"),
    ({"confidence": 1}, "confidence must be in [0.5, 1)"),
])
def test_bench_options_are_checked(changes, message):
    with pytest.raises(onnx_nmm.OptionError, match=re.escape(message)):
        onnx_nmm.BenchOptions(**changes)


def _speed(label: str, step_s: float, rounds: int, weight_bytes: int) -> ModelSpeed:
    """A model's timings: every pass's prefill and steps take the same time."""
    return ModelSpeed(label, weight_bytes, weight_bytes, 1000, None, first_token_s={64: [10 * step_s] * 2 * rounds},
                      step_s={128: [[step_s] * 4] * 2 * rounds})


def test_the_demo_ends_with_what_it_measured_and_no_more():
    import demo

    rewrite = {"totals": {"parameters_before": 80_000_000, "parameters_after": 77_600_000,
                          "weight_bytes_before": 538_000_000, "weight_bytes_after": 528_400_000}}
    diff = {"reference": {"perplexity": 10.0, "tokens_scored": 2044}, "candidate": {"perplexity": 10.5}}
    options = onnx_nmm.BenchOptions(prompt_lengths=(64,), contexts=(128,))
    dense, narrowed = _speed("dense", 0.1, 6, 538_000_000), _speed("narrowed", 0.1, 6, 528_400_000)
    bench = onnx_nmm.Benchmark([dense, narrowed], options, "a machine", 6, 30.0).to_dict()
    assert demo.summary(rewrite, diff, bench) == [
        "parameters removed: 2.4 M of the MLPs' 80.0 M (3.0%); weights 538.0 MB → 528.4 MB",
        "perplexity on held-out text (2,044 tokens): 10.00 before, 10.50 after (+5.0%)",
        "decode speed after 128 tokens: 1.00× (95% interval 1.000–1.000×), within noise; the bytes a step reads "
        "allow 1.02×",
    ]
    faster = [_speed("dense", 0.1, 2, 538_000_000), _speed("narrowed", 0.05, 2, 528_400_000)]
    few = onnx_nmm.Benchmark(faster, options, "a machine", 2, 9.0).to_dict()
    assert demo.summary(rewrite, diff, few)[2] == ("decode speed after 128 tokens: 2.00× (no interval), too few rounds "
                                                   "for an interval; the bytes a step reads allow 1.02×")
