"""What an MLP rule finds: the MLP's projections, its output projection and the nodes between them.

A projection is whatever the caller finds MLPs among: the linear layers of a model (narrowing, the dense
fusion), or its factorized SvdMatMul nodes (the fusion of factorized MLPs). The rules ask each the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import onnx_ir as ir


class Projection(Protocol):
    """A linear projection Y = X·W (+ b), W of K×N."""

    @property
    def x(self) -> ir.Value: ...

    @property
    def output(self) -> ir.Value: ...

    @property
    def nodes(self) -> list[ir.Node]: ...

    @property
    def k(self) -> int: ...

    @property
    def n(self) -> int: ...

    @property
    def role(self) -> str: ...

    @property
    def module_path(self) -> str: ...

    @property
    def name(self) -> str: ...


P = TypeVar("P", bound=Projection)
# The projection that computes a value, or None.
Projections = Callable[[ir.Value], P | None]

GATED, SPLIT_GATE_UP, UNGATED = "gated", "split_gate_up", "ungated"
GRAPH_OUTPUT = "a graph output"


@dataclass
class Mlp(Generic[P]):
    """One MLP: its input projections (gate and up, gate first when the roles tell them apart; fc1; or the one
    gate_up), its output projection, and the nodes between them."""

    form: str  # GATED, SPLIT_GATE_UP or UNGATED: the rule that found it
    projections: list[P]
    down: P
    region: list[ir.Node] = field(default_factory=list)  # element-wise nodes, reshapes and selections between
    reshapes: list[ir.Node] = field(default_factory=list)  # the reshapes among them (pattern.RESHAPES)
    operands: list[ir.Value] = field(default_factory=list)  # the values the region starts from

    @property
    def name(self) -> str:
        """The module path of the MLP ("model.layers.0.mlp"), from its output projection's."""
        path = self.down.module_path
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        return parent or f"{self.down.name}.mlp"

    @property
    def width(self) -> int:
        """I: the intermediate activation's width."""
        return self.down.k

    @property
    def gated(self) -> bool:
        return self.form != UNGATED

    @property
    def layers(self) -> list[P]:
        return [*self.projections, self.down]

    @property
    def parameters_per_neuron(self) -> int:
        """What one intermediate neuron costs: a column of every input projection, a row of the output one."""
        return sum(layer.k for layer in self.projections) + self.down.n

    def parameters(self, width: int | None = None) -> int:
        return (self.width if width is None else width) * self.parameters_per_neuron


def outside_reader(values: Iterable[ir.Value], inside: set[int], graph: ir.Graph,
                   ignored: tuple[str, ...] = ()) -> str | None:
    """What outside the nodes `inside` (their ids) reads one of `values` — "a graph output" or the reading node
    as "a Relu node" — other than a node of an `ignored` op type; None when nothing does."""
    for value in values:
        if value in graph.outputs:
            return GRAPH_OUTPUT
        reader = next((use.node for use in value.uses()
                       if id(use.node) not in inside and use.node.op_type not in ignored), None)
        if reader is not None:
            return f"{'an' if reader.op_type[0] in 'AEIOU' else 'a'} {reader.op_type} node"
    return None
