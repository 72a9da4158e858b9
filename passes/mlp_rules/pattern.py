"""The small pattern language the MLP rules are written in, and its matcher.

A pattern is a tree of values read backwards from an anchor, an MLP's output projection:

    Projection(name, input)   the output of a linear projection, its input matching `input`
    Input(name)               any value; every Input of one name is the same value
    Selected(projection)      columns selected from a projection's output (SELECTIONS nodes)
    ElementWise(*operands)    a value computed from the operands by element-wise nodes and RESHAPES alone

which a rule writes as the MLP reads, e.g. `Projection("down", ElementWise(Projection("gate", x),
Projection("up", x)))`: an output projection reading an ElementWise of projections (or of selections from
one) that read Inputs. What counts as a projection the caller says (a linear layer, a factorized one). The
matcher binds each named projection, and the nodes between the operands and the output projection: the region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import onnx_ir as ir

from onnx_nmm.passes.mlp_rules.mlp import Projection as Layer
from onnx_nmm.passes.mlp_rules.mlp import Projections
from onnx_nmm.passes.rules import Mismatch

# The nodes that change a value's shape but not its elements, which an MLP's values may pass through between its
# projections (an Identity is element-wise): the one list narrowing, fusion and the Trainium shapes all go by.
RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
# The nodes that may carry a projection's values themselves to part of its columns: they select or reshape
# (column_selection reads which columns).
SELECTIONS = ("Slice", "Split", "Gather", "Identity", *RESHAPES)
# Element-wise ops an activation is made of (as exporters spell SiLU, GELU, ReLU and their approximations).
ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Pow", "Neg", "Tanh", "Exp", "Sqrt", "Reciprocal", "Erf", "Sigmoid",
               "Softplus", "Relu", "Gelu", "Cast", "Identity", "HardSigmoid", "Elu", "Selu", "LeakyRelu")
# How far back from the output projection an element-wise region goes before the walk gives up.
MAX_REGION = 32

L = TypeVar("L", bound=Layer)


@dataclass(frozen=True)
class Input:
    name: str


@dataclass(frozen=True)
class Projection:
    name: str
    input: Input | ElementWise


@dataclass(frozen=True)
class Selected:
    projection: Projection


@dataclass(frozen=True)
class ElementWise:
    operands: tuple[Projection | Selected, ...]

    def __init__(self, *operands: Projection | Selected):
        object.__setattr__(self, "operands", operands)


@dataclass
class Found(Generic[L]):
    """What a pattern bound: each named projection, each Input's value, the values the element-wise region
    starts from (in the order the walk met them) and its nodes."""

    projections: dict[str, L] = field(default_factory=dict)
    inputs: dict[str, ir.Value] = field(default_factory=dict)
    operands: list[ir.Value] = field(default_factory=list)
    region: list[ir.Node] = field(default_factory=list)


def match(pattern: Projection, anchor: L, projections: Projections[L]) -> Found[L] | Mismatch:
    """`pattern` matched at `anchor`, the projection its root names; `projections`: the projection computing a
    value, or None."""
    found: Found[L] = Found(projections={pattern.name: anchor})
    region = pattern.input
    if not isinstance(region, ElementWise):
        raise TypeError("an MLP pattern's output projection reads an ElementWise")
    selects = any(isinstance(operand, Selected) for operand in region.operands)
    walked = _walk_back(anchor.x, projections, selects)
    if isinstance(walked, Mismatch):
        return walked
    found.operands, found.region = walked
    different = Mismatch(f"its input comes from {len(found.operands)} projections of different inputs, not from "
                         "gate and up", 1)
    if len(found.operands) != len(region.operands):
        return different
    for operand, value in zip(region.operands, found.operands):
        projection = operand.projection if isinstance(operand, Selected) else operand
        if not isinstance(projection.input, Input):
            raise TypeError("an MLP pattern's input projections read Inputs")
        source = _selected_from(value) if isinstance(operand, Selected) else value
        layer = projections(source) if source is not None else None
        if layer is None or (isinstance(operand, Selected) and source is value):  # a selection: one node at least
            return Mismatch("its input is not selected from one projection's output", 1)
        if found.projections.setdefault(projection.name, layer) is not layer:
            return Mismatch(f"its {projection.name} is two projections", 1)
        if found.inputs.setdefault(projection.input.name, layer.x) is not layer.x:
            return different
    return found


def _walk_back(value: ir.Value, projections: Projections, selects: bool
               ) -> tuple[list[ir.Value], list[ir.Node]] | Mismatch:
    """The values the nodes upstream of `value` start from (projection outputs, or with `selects` values selected
    from one) and those nodes; or why the walk met something an MLP does not hold."""
    operands: list[ir.Value] = []
    region: list[ir.Node] = []
    pending: list[ir.Value | None] = [value]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        value = current
        seen.add(id(value))
        source = _selected_from(value) if selects else value
        if source is not None and projections(source) is not None:
            operands.append(value)
            continue
        if value.const_value is not None:
            continue
        node = value.producer()
        if node is None:
            return Mismatch("its input is computed from a graph input, not from projections")
        if node.op_type == "Constant":
            continue
        if node.domain not in ("", "ai.onnx") or node.op_type not in ELEMENTWISE + RESHAPES:
            return Mismatch(f"a {node.op_type} node sits between it and the projections feeding it")
        if len(region) == MAX_REGION:
            return Mismatch(f"more than {MAX_REGION} nodes between it and the projections feeding it")
        region.append(node)
        pending.extend(node.inputs[:1] if node.op_type in RESHAPES else node.inputs)
    return operands, region


def _selected_from(value: ir.Value) -> ir.Value | None:
    """The value `value` is selected from through selection and reshape nodes (itself, through none)."""
    return _upstream(value, SELECTIONS)[0]


def through_reshapes(value: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """The value upstream of `value` past RESHAPES, and those nodes."""
    upstream, passed = _upstream(value, RESHAPES)
    return upstream or value, passed


def _upstream(value: ir.Value, op_types: tuple[str, ...]) -> tuple[ir.Value | None, list[ir.Node]]:
    """The value upstream of `value` past nodes of `op_types` (None past one without a data input), and those."""
    passed = []
    current: ir.Value | None = value
    while current is not None and (node := current.producer()) is not None and node.op_type in op_types:
        passed.append(node)
        current = node.inputs[0]
    return current, passed


def reshaped_forms(value: ir.Value) -> list[tuple[ir.Value, list[ir.Node]]]:
    """`value` and each value reshaped from it alone, with the RESHAPES on the way."""
    forms: list[tuple[ir.Value, list[ir.Node]]] = []
    pending: list[tuple[ir.Value, list[ir.Node]]] = [(value, [])]
    while pending:
        current, passed = pending.pop()
        forms.append((current, passed))
        pending.extend((use.node.outputs[0], [*passed, use.node]) for use in current.uses()
                       if use.node.op_type in RESHAPES and use.idx == 0)
    return forms
