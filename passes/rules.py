"""A small rule form for the graph patterns exports spell too many ways for a fixed pattern graph.

A rule matches from an anchor node (an MLP's output projection, say) and returns either what it found, for the
pass to replace, or a `Mismatch` saying why the graph is not its pattern. Each rule's docstring draws its
pattern. A mismatch also says how far into the pattern the rule got, so that when every rule fails, the reason
given is the one of the rule that came closest: "gated by Relu" says more than "not a two-layer MLP".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import onnx_ir as ir

Found = TypeVar("Found", covariant=True)


@dataclass(frozen=True)
class Mismatch:
    """Why a rule does not match; `depth`: how many steps of its pattern matched before this one failed."""

    reason: str
    depth: int = 0


class Rule(Protocol, Generic[Found]):
    """A pattern anchored at one node: `match` returns what it found, or a Mismatch."""

    def match(self, anchor: ir.Node, model: ir.Model) -> Found | Mismatch: ...


def first_match(rules: Sequence[Rule[Found]], anchor: ir.Node, model: ir.Model) -> Found | Mismatch:
    """What the first rule that matches at `anchor` found, else the mismatch of the rule that got furthest (the
    earlier rule on a tie)."""
    misses = []
    for rule in rules:
        found = rule.match(anchor, model)
        if not isinstance(found, Mismatch):
            return found
        misses.append(found)
    return max(misses, key=lambda miss: miss.depth)


def closest(misses: Sequence[Mismatch], otherwise: Mismatch) -> Mismatch:
    """The mismatch that got furthest among the tries of one rule (the earlier on a tie), or `otherwise`."""
    return max(misses, key=lambda miss: miss.depth) if misses else otherwise
