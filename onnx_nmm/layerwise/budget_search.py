"""The longest greedy prefix within the budget, in few measurements: each one is a narrowing sweep.

The in-memory rewrite bisects the greedy moves, a measurement each step (a forward pass). Layer by layer a
measurement reads every layer again, so the search starts where the predicted damages say the budget is
met, and each next probe is where the measurements so far say it is (the damages of several narrowed layers
add up to more than their sum when measured together). The bracket

    low   the longest prefix measured within the budget (0, nothing narrowed, is within by definition)
    high  the shortest measured over it

only narrows. A probe is the longest prefix inside it whose damage, interpolated between low's and high's
measurements over the predicted damage (before high is measured: the prediction scaled by low's ratio), is
AIM of the budget, or the move after low if none is; after two misses on the same side, the bracket's
middle, so that it is never slower than bisection for long. The search ends when low and high are adjacent, when
low's damage is within CLOSE of the budget, or after `sweeps` probes: whatever it ends with, the plan it
returns was measured within the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CLOSE = 0.9  # a measured damage this share of the budget or more is near enough: no more probes
AIM = (1 + CLOSE) / 2  # a probe aims at the middle of that band
MAX_SWEEPS = 5  # probes at most (Qwen2.5-0.5B's default budget took all five, a minute each)


def longest_prefix_within(predicted: Sequence[float], budget: float, measure: Callable[[int], float],
                          sweeps: int) -> tuple[int, dict[int, float]]:
    """The longest prefix found with measure(prefix) ≤ budget, and every damage measured (prefix → damage).
    `predicted[p]` is the predicted damage of the first p moves (non-decreasing, predicted[0] = 0)."""
    end = len(predicted) - 1
    measured = {0: 0.0}
    low, high = 0, end + 1  # high: the shortest prefix measured over the budget (end + 1 until one is)
    within: list[bool] = []  # each probe's side
    for _ in range(sweeps):
        if high - low <= 1 or measured[low] >= CLOSE * budget:
            break
        if len(within) >= 2 and within[-1] == within[-2]:  # the interpolation missed twice on one side
            probe = (low + high) // 2
        else:
            probe = _longest_predicted_within(predicted, _aim(predicted, measured, low, high, AIM * budget), low, high)
        measured[probe] = measure(probe)
        within.append(measured[probe] <= budget)
        low, high = (probe, high) if within[-1] else (low, probe)
    return low, measured


def _aim(predicted: Sequence[float], measured: dict[int, float], low: int, high: int, goal: float) -> float:
    """The predicted damage at which the measured one should be `goal`: interpolated between low and high when
    both are measured; else the prediction scaled by low's measured-to-predicted ratio (1 before any)."""
    if high in measured:
        (x0, y0), (x1, y1) = (predicted[low], measured[low]), (predicted[high], measured[high])
        return x0 + (goal - y0) * (x1 - x0) / (y1 - y0)
    scale = measured[low] / predicted[low] if low > 0 and predicted[low] > 0 and measured[low] > 0 else 1.0
    return goal / scale


def _longest_predicted_within(predicted: Sequence[float], allowed: float, low: int, high: int) -> int:
    """The longest prefix strictly between low and high predicted within `allowed`; if none is, low + 1."""
    within = [prefix for prefix in range(low + 1, high) if predicted[prefix] <= allowed]
    return within[-1] if within else low + 1
