"""A small rule form for the graph patterns exports spell too many ways for a fixed pattern graph.

A rule matches from an anchor (a node, an MLP's output projection) in a context (the model, the projections
found in it) and returns either what it found, for the pass to replace, or a `Mismatch` saying why the graph is
not its pattern. The MLP rules write their patterns as code (mlp_rules/pattern.py). A mismatch also says how far
into the pattern the rule got, so that when every rule fails, the reason given is the one of the rule that came
closest: "gated by Relu" says more than "not a two-layer MLP".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

Anchor = TypeVar("Anchor", contravariant=True)
Context = TypeVar("Context", contravariant=True)
Found = TypeVar("Found", covariant=True)


@dataclass(frozen=True)
class Mismatch:
    """Why a rule does not match; `depth`: how many steps of its pattern matched before this one failed."""

    reason: str
    depth: int = 0


class Rule(Protocol, Generic[Anchor, Context, Found]):
    """A pattern anchored at one node: `match` returns what it found, or a Mismatch."""

    def match(self, anchor: Anchor, context: Context) -> Found | Mismatch: ...


def first_match(rules: Sequence[Rule[Anchor, Context, Found]], anchor: Anchor, context: Context) -> Found | Mismatch:
    """What the first rule that matches at `anchor` found, else the mismatch of the rule that got furthest (the
    earlier rule on a tie)."""
    misses = []
    for rule in rules:
        found = rule.match(anchor, context)
        if not isinstance(found, Mismatch):
            return found
        misses.append(found)
    return max(misses, key=lambda miss: miss.depth)

