"""Each MLP's damage at the output from a local proxy, measured at a few calibration layers only.

Narrowing layer i's MLP to width w adds the refit's error to the residual stream after the layer. Relative to
that stream, on the calibration windows, it is

    proxy_i(w) = loss_i(w) · ‖h·W_d‖² / ‖x_{i+1}‖²

with loss_i(w) = E(S)/‖h·W_d‖² the refit's relative error, ‖h·W_d‖² = tr(W_dᵀ C W_d) what the MLP writes into
the stream and ‖x_{i+1}‖² the stream after the layer: all known once the layer's Gram is, at no model run.
How much of that perturbation reaches the logits depends on the layers after it, so the damage is measured
(the held-out windows carried to the logits, analysis.py) only at M calibration layers, evenly spaced over
the depth from the first layer to the last. At a calibration layer c, for each reference position p (the
middle and the lowest reference width, sensitivity.Candidate.reference_ranks)

    ratio_c,p = damage_c(w_p) / proxy_c(w_p)

and at any other layer i, between the nearest calibration layers a < i < b, t = (i − a)/(b − a):

    damage_i(w_p) = proxy_i(w_p) · exp((1 − t)·log ratio_a,p + t·log ratio_b,p)

the ratio interpolated linearly in log space over depth (from the first layers to the last it spans orders of
magnitude). A ratio that is not positive (a damage measured at or below zero, or a proxy of zero) says nothing
of the scale and is left out; at a position with none left, the proxy stands for the damage.

The carried paths then cost O(M·L) layer runs instead of O(L²). Exactness is not what the references are for:
they order the greedy moves (sensitivity.greedy_moves), and the budget's search measures real plans at the
output and corrects the scale by those measurements (budget_search.py). What matters is that the damages rank
the layers rightly against each other.
"""

from __future__ import annotations

import numpy as np


def calibration_layers(layers: int, count: int) -> list[int]:
    """The layers whose damage is measured: `count` of the `layers`, evenly spaced, the first and the last among
    them; every layer when `count` is 0 or at least `layers`."""
    if count == 0 or count >= layers:
        return list(range(layers))
    assert count >= 2, "the first and the last layer are both calibration layers"
    return [int(layer) for layer in np.round(np.linspace(0, layers - 1, count))]


def local_proxy(loss: float, mlp_energy: float, stream_energy: float) -> float:
    """loss · ‖h·W_d‖² / ‖x_{i+1}‖²: the refit's error relative to the residual stream it is added to."""
    return loss * mlp_energy / stream_energy if stream_energy > 0 else 0.0


def interpolated_ratios(ratios: dict[int, float], layers: int) -> np.ndarray:
    """The measured-to-proxy ratio at every layer, from those at the calibration layers (`ratios`, layer → ratio):
    linear in log space between the nearest two, the nearest one's beyond them. Ratios not positive are left
    out; with none left, 1 everywhere."""
    usable = sorted((layer, ratio) for layer, ratio in ratios.items() if ratio > 0 and np.isfinite(ratio))
    if not usable:
        return np.ones(layers)
    known, logs = zip(*((layer, np.log(ratio)) for layer, ratio in usable))
    return np.exp(np.interp(np.arange(layers), known, logs))


def reference_damages(proxies: list[list[float]], measured: dict[int, list[float]]) -> list[list[float]]:
    """Every layer's damage at each reference position: `measured[c][p]` at a calibration layer c, and elsewhere
    the layer's proxy (`proxies[i][p]`) times the ratio interpolated over depth at that position."""
    positions = range(len(proxies[0])) if proxies else range(0)
    scales = [interpolated_ratios({layer: _ratio(damages[p], proxies[layer][p]) for layer, damages in measured.items()},
                                  len(proxies)) for p in positions]
    return [measured[layer] if layer in measured else [proxy * scales[p][layer] for p, proxy in enumerate(row)]
            for layer, row in enumerate(proxies)]


def _ratio(damage: float, proxy: float) -> float:
    """Measured over proxied; 0 (left out) for a proxy of zero."""
    return damage / proxy if proxy > 0 else 0.0
