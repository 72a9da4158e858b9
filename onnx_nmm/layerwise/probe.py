"""The held-out windows on their way through the layers, along several paths at once: the dense model, and
a path for each change to one layer (or, for a plan, every change). Each layer's weights are read once per
sweep, whatever the number of paths; what a path holds is its residual stream on a few windows.

At the head, each path's logits give its damage against the dense path's: the mean log-loss increase
("ppl") or the mean KL to the dense next-token distributions ("kl"), per window as sensitivity measures it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from onnx_nmm.layerwise.segments import LayerSegments
from onnx_nmm.ranks.sensitivity import log_loss_and_kl_by_positions, next_token_nll_by_positions

DENSE = (-1, 0)  # the key of the dense path; a change is (layer, width)

Key = tuple[int, int]


@dataclass
class Paths:
    """Token ids [W, S] of the held-out windows and, for each path, each window's carried values."""

    tokens: np.ndarray
    states: dict[Key, list[dict[str, np.ndarray]]]

    @classmethod
    def start(cls, tokens: np.ndarray) -> Paths:
        return cls(tokens, {DENSE: [{} for _ in tokens]})

    def dense_feeds(self, segments: LayerSegments, layer: int) -> Iterator[dict[str, np.ndarray]]:
        segment = segments.cut.segments[layer]
        for window, carried in enumerate(self.states[DENSE]):
            yield segments.feeds(segment, self.tokens[window:window + 1], carried)

    def through(self, segments: LayerSegments, layer: int, session, branches: dict[Key, object],
                sessions: dict[Key, object] | None = None) -> Paths:
        """Every path through layer `layer`: by `session`, or the path's own (`sessions`); and a new path for each
        of `branches`, the dense path's windows through that session."""
        sessions = sessions or {}
        moved = {key: self._run(segments, layer, sessions.get(key, session), windows)
                 for key, windows in self.states.items()}
        for key, branch in branches.items():
            moved[key] = self._run(segments, layer, branch, self.states[DENSE])
        unread = set(segments.unread_after(layer))
        return Paths(self.tokens, {key: [{name: value for name, value in carried.items() if name not in unread}
                                         for carried in windows] for key, windows in moved.items()})

    def _run(self, segments: LayerSegments, layer: int, session, windows: list[dict[str, np.ndarray]]
             ) -> list[dict[str, np.ndarray]]:
        segment = segments.cut.segments[layer]
        moved = []
        for window, carried in enumerate(windows):
            outputs = session.run(segment.outputs, segments.feeds(segment, self.tokens[window:window + 1], carried))
            moved.append(carried | dict(zip(segment.outputs, outputs)))
        return moved

    def save(self) -> dict[str, np.ndarray]:
        """As arrays named "layer:width|window|value", for np.savez."""
        arrays = {"tokens": self.tokens}
        for (layer, width), windows in self.states.items():
            for window, carried in enumerate(windows):
                for name, value in carried.items():
                    arrays[f"{layer}:{width}|{window}|{name}"] = value
        return arrays

    @classmethod
    def load(cls, arrays) -> Paths:
        tokens = arrays["tokens"]
        states: dict[Key, list[dict[str, np.ndarray]]] = {}
        for entry in arrays.files:
            if entry == "tokens":
                continue
            key, window, name = entry.split("|", 2)
            layer, width = (int(part) for part in key.split(":"))
            windows = states.setdefault((layer, width), [{} for _ in tokens])
            windows[int(window)][name] = arrays[entry]
        return cls(tokens, states or {DENSE: [{} for _ in tokens]})


def damage_of_paths(segments: LayerSegments, paths: Paths, metric: str) -> dict[Key, np.ndarray]:
    """Each path's damage on each window (log-loss increase, or KL), the dense path's zero; through the head.
    The log-loss increase needs no reference distribution: each path's log-loss is taken alone."""
    head = segments.cut.head
    session = segments.session(head)

    def logits(key: Key, window: int) -> np.ndarray:
        feeds = segments.feeds(head, paths.tokens[window:window + 1], paths.states[key][window])
        return session.run(head.outputs[:1], feeds)[0]

    windows = range(len(paths.tokens))
    if metric == "ppl":
        nll = {key: np.array([next_token_nll_by_positions(logits(key, window), paths.tokens[window:window + 1])[0]
                              for window in windows]) for key in paths.states}
        return {key: nll[key] - nll[DENSE] for key in paths.states}
    kl = {key: np.zeros(len(windows)) for key in paths.states}
    for window in windows:
        reference = logits(DENSE, window)
        for key in paths.states.keys() - {DENSE}:
            _, window_kl = log_loss_and_kl_by_positions(logits(key, window), paths.tokens[window:window + 1],
                                                        reference)
            kl[key][window] = window_kl[0]
        del reference
    return kl
