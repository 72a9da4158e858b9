"""Which linear layers a rewrite targets: a group (mlp, attention, all), regexes, and the lm_head."""

from __future__ import annotations

import re
from typing import Protocol

from onnx_nmm.passes import roles
from onnx_nmm.passes.linear_layers import LinearLayer

TARGETS = ("mlp", "attention", "all")


class LayerFilter(Protocol):
    """`targets` picks groups; `include`/`exclude` are regexes searched in node names and module paths
    (exclude wins); the lm_head is only taken when `lm_head` is set (the paper leaves it alone)."""

    targets: str
    include: str | None
    exclude: str | None
    lm_head: bool


def select_layers(layers: list[LinearLayer], selection: LayerFilter) -> tuple[list[LinearLayer], dict[str, str]]:
    """The layers to rewrite, and for every other layer the reason it is left alone."""
    if selection.targets not in TARGETS:
        raise ValueError(f"targets must be one of {', '.join(TARGETS)}, got {selection.targets!r}")
    include = re.compile(selection.include) if selection.include else None
    exclude = re.compile(selection.exclude) if selection.exclude else None
    chosen, reasons = [], {}
    for layer in layers:
        reason = _reason_to_skip(layer, selection, include, exclude)
        if reason is None:
            chosen.append(layer)
        else:
            reasons[layer.name] = reason
    return chosen, reasons


def _reason_to_skip(layer: LinearLayer, selection: LayerFilter, include, exclude) -> str | None:
    names = (layer.name, layer.module_path)
    if exclude is not None and any(exclude.search(name) for name in names):
        return f"excluded by {exclude.pattern!r}"
    if include is not None and not any(include.search(name) for name in names):
        return f"not matched by {include.pattern!r}"
    if layer.group == roles.LM_HEAD:
        return None if selection.lm_head else "lm_head, targeted only on request"
    if selection.targets == "all" or layer.group == selection.targets:
        return None
    return f"{layer.group} layer, targets are {selection.targets}"
