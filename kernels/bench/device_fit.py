"""Re-estimate a few cost-model parameters from a device report (device.bench_on_device's JSON).

Each parameter is fitted as a factor on its value in hardware.py: TensorE clock, DMA bandwidth per engine,
DMA fixed latency, the DMA queue's issue interval and the per-descriptor overhead (the two the tutorial
measurements fitted, the least certain), ScalarE and VectorE clocks. The fit minimises

    sum over launches of log(measured p50 / modelled(factors))^2

over the log-factors, each within [log 1/4, log 4], by Levenberg-Marquardt with a finite-difference Jacobian
(the parameters are correlated, DMA bandwidth with latency, TensorE with DMA on the same launch, so a
coordinate search zig-zags for hundreds of evaluations where this takes a few tens). Each launch is traced
once (trace-only emulation) and re-modelled for every try. A parameter the launches do not exercise stays
at 1, so the fit is only as good as the grid it saw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from onnx_nmm.kernels.bench.device import KERNELS, launch_of, scaled_core
from onnx_nmm.kernels.bench.runner import trace
from onnx_nmm.kernels.pricing.cost_model import model_traces
from onnx_nmm.kernels.pricing.hardware import neuron_core

PARAMETERS = ("pe_hz", "dma_engine_bytes_per_s", "dma_fixed_latency_s", "dma_issue_interval_s",
              "dma_descriptor_overhead_s", "act_hz", "dve_hz")
FACTOR_RANGE = (0.25, 4.0)
ITERATIONS = 50
DIFFERENCE_STEP = 1e-3  # of a log-factor (0.1 %), for the Jacobian's finite differences


@dataclass
class Fit:
    """The fitted factors and what they do to each launch's measured/modelled ratio."""

    factors: dict[str, float]
    documented: dict[str, dict[str, float]]  # per target, each parameter's documented value
    launches: list[dict]  # the report's entries that were fitted
    before: list[float]  # measured / modelled, documented parameters
    after: list[float]  # measured / modelled, fitted parameters

    def to_json(self) -> dict:
        return {
            "note": "factors on the documented cost-model parameters that best explain the measured times "
                    f"(least squares in log time over {len(self.launches)} launches); the fit is only as good as "
                    "the grid it saw: a parameter the launches barely exercise stays near 1",
            "parameters": {
                name: {"documented": {target: values[name] for target, values in self.documented.items()},
                       "fitted": {target: values[name] * self.factors[name]
                                  for target, values in self.documented.items()},
                       "factor": self.factors[name]}
                for name in PARAMETERS
            },
            "median_abs_log_residual": {"before": median_abs_log(self.before), "after": median_abs_log(self.after)},
            "launches": [
                {"kernel": entry["kernel"], "shapes": entry["shapes"], "target": entry["target"],
                 "measured_over_modelled": {"before": before, "after": after}}
                for entry, before, after in zip(self.launches, self.before, self.after)
            ],
        }


def fit_report(report: dict) -> Fit:
    """Fit the factors to the report's launches whose results were right (ok)."""
    entries = [entry for entry in report["launches"] if entry["ok"]]
    if not entries:
        raise ValueError("the report has no launch with a correct result to fit to")
    traces = [_trace(entry) for entry in entries]
    measured = np.array([entry["measured_us"]["p50"] * 1e-6 for entry in entries])

    def modelled(log_factors: np.ndarray) -> np.ndarray:
        factors = dict(zip(PARAMETERS, np.exp(log_factors)))
        return np.array([model_traces(t, scaled_core(e["target"], factors)).total_s for t, e in zip(traces, entries)])

    best = least_squares(lambda log_factors: np.log(measured / modelled(log_factors)), len(PARAMETERS),
                         tuple(np.log(FACTOR_RANGE)))
    targets = sorted({entry["target"] for entry in entries})
    return Fit(
        factors=dict(zip(PARAMETERS, np.exp(best).tolist())),
        documented={t: {name: getattr(neuron_core(t), name) for name in PARAMETERS} for t in targets},
        launches=entries,
        before=(measured / modelled(np.zeros(len(PARAMETERS)))).tolist(),
        after=(measured / modelled(best)).tolist(),
    )


def _trace(entry: dict):
    launch = launch_of(entry)
    return trace(KERNELS[launch.kernel], *launch.shapes, dtype=launch.dtype, target=launch.target)


def least_squares(residuals: Callable[[np.ndarray], np.ndarray], dimensions: int, bounds: tuple[float, float],
                  iterations: int = ITERATIONS) -> np.ndarray:
    """The point within `bounds` (on every coordinate) where sum(residuals(point)^2) is least, from the origin.

    Levenberg-Marquardt: each step solves (JᵀJ + λ·diag(JᵀJ)) δ = -Jᵀr, λ shrinking after a step that lowers
    the loss and growing until one does. A coordinate the residuals do not depend on has a zero column in J,
    so its step is 0 and it stays at the origin.
    """
    point = np.zeros(dimensions)
    current = residuals(point)
    damping = 1e-2
    for _ in range(iterations):
        jacobian = np.column_stack([(residuals(point + DIFFERENCE_STEP * axis) - current) / DIFFERENCE_STEP
                                    for axis in np.eye(dimensions)])
        normal, gradient = jacobian.T @ jacobian, jacobian.T @ current
        while damping < 1e8:
            step = np.linalg.solve(normal + damping * (np.diag(np.diag(normal)) + 1e-12 * np.eye(dimensions)),
                                   -gradient)
            candidate = np.clip(point + step, *bounds)
            tried = residuals(candidate)
            if tried @ tried < current @ current:
                point, current, damping = candidate, tried, damping / 3
                break
            damping *= 4
        else:
            break  # no step lowers the loss: a minimum
        if np.max(np.abs(step)) < 1e-6:
            break
    return point


def median_abs_log(ratios: list[float]) -> float:
    """The median of |log(measured/modelled)|: 0.1 is about 10 % off."""
    return float(np.median(np.abs(np.log(ratios))))
