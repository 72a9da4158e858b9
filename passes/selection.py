"""Which linear layers a rewrite targets: a group (mlp, attention, all), regexes, and the lm_head."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol, TypeVar

from onnx_nmm.passes import roles

TARGETS = ("mlp", "attention", "all")


class Candidate(Protocol):
    """What selection looks at: a linear layer of a graph (passes.LinearLayer), or one of a model's shape."""

    @property
    def name(self) -> str: ...

    @property
    def module_path(self) -> str: ...

    @property
    def group(self) -> str: ...


Layer = TypeVar("Layer", bound=Candidate)


class LayerFilter(Protocol):
    """`targets` picks groups; `include`/`exclude` are regexes searched in node names and module paths
    (exclude wins); the lm_head is only taken when `lm_head` is set (the paper leaves it alone)."""

    targets: str
    include: str | None
    exclude: str | None
    lm_head: bool


def select_layers(layers: Sequence[Layer], selection: LayerFilter) -> tuple[list[Layer], dict[str, str]]:
    """The layers to rewrite, and for every other layer the reason it is left alone."""
    chosen, reasons = [], {}
    for layer in layers:
        reason = reason_to_skip(layer, selection)
        if reason is None:
            chosen.append(layer)
        else:
            reasons[layer.name] = reason
    return chosen, reasons


def reason_to_skip(layer: Candidate, selection: LayerFilter) -> str | None:
    """Why `selection` leaves the layer alone, or None when it is a target."""
    if selection.targets not in TARGETS:
        raise ValueError(f"targets must be one of {', '.join(TARGETS)}, got {selection.targets!r}")
    names = (layer.name, layer.module_path)
    if selection.exclude and any(re.search(selection.exclude, name) for name in names):
        return f"excluded by {selection.exclude!r}"
    if selection.include and not any(re.search(selection.include, name) for name in names):
        return f"not matched by {selection.include!r}"
    if layer.group == roles.LM_HEAD:
        return None if selection.lm_head else "lm_head, targeted only on request"
    if selection.targets == "all" or layer.group == selection.targets:
        return None
    return f"{layer.group} layer, targets are {selection.targets}"
