"""Recognize the activation an exporter wrote between a gate projection and the gating product.

Exporters spell one activation many ways: SiLU as Mul(g, Sigmoid(g)); GELU as one Gelu-20 node, as
0.5·g·(1 + Erf(g/√2)) or with the tanh approximation, factors in any order, constants as initializers or
Constant nodes. Rather than one pattern per spelling, the region is found by structure — the element-wise
nodes between g and the product whose only non-constant input is g — and named by evaluating it on probe
values against each known activation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

PROBE = np.linspace(-6.0, 6.0, 97)
TOLERANCE = 1e-4  # float32 constants in the graph, float64 evaluation


def _gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
}

_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
    "Neg": np.negative, "Tanh": np.tanh, "Exp": np.exp, "Sqrt": np.sqrt, "Reciprocal": np.reciprocal,
    "Erf": np.vectorize(math.erf), "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "Softplus": lambda x: np.log1p(np.exp(x)), "Cast": lambda x: x, "Identity": lambda x: x,
}


def activation_region(g: ir.Value, output: ir.Value) -> list[ir.Node] | None:
    """The element-wise nodes computing `output` from `g` alone (and constants), in order; None if `output`
    is not such a function of g."""
    region: list[ir.Node] = []
    pending: list[ir.Value | None] = [output]
    while pending:
        value = pending.pop()
        if value is g or _constant(value) is not None:
            continue
        node = value.producer() if value is not None else None
        if node is None or node.domain != "" or (node.op_type not in _ELEMENTWISE and node.op_type != "Gelu"):
            return None
        if node not in region:
            region.append(node)
            pending.extend(node.inputs)
    return in_dependency_order(region) if any(g in node.inputs for node in region) else None


def identify(region: list[ir.Node], g: ir.Value, output: ir.Value) -> str | None:
    """The name in ACTIVATIONS of what `region` computes from g, or None."""
    values = {id(g): PROBE}
    try:
        for node in region:
            arguments = [values[id(value)] if id(value) in values else _constant(value) for value in node.inputs]
            values[id(node.outputs[0])] = _evaluate(node, arguments)
    except (KeyError, TypeError, ValueError, FloatingPointError):
        return None
    result = values.get(id(output))
    for name, function in ACTIVATIONS.items():
        if result is not None and np.allclose(result, function(PROBE), atol=TOLERANCE, rtol=TOLERANCE):
            return name
    return None


def recognize(g: ir.Value, output: ir.Value) -> tuple[list[ir.Node], str] | None:
    """The element-wise region computing `output` from g and the name of the activation it computes, or None."""
    region = activation_region(g, output)
    name = identify(region, g, output) if region is not None else None
    return (region, name) if region is not None and name is not None else None


def _evaluate(node: ir.Node, arguments: list) -> np.ndarray:
    if node.op_type == "Gelu":
        approximate = node.attributes.get("approximate")
        tanh = approximate is not None and approximate.as_string() == "tanh"
        return ACTIVATIONS["gelu_tanh" if tanh else "gelu"](arguments[0])
    if any(argument is None for argument in arguments):
        raise ValueError("an input is neither g nor a constant")
    with np.errstate(all="raise"):
        return np.asarray(_ELEMENTWISE[node.op_type](*arguments), np.float64)


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """A value fixed when the graph is built (an initializer or a Constant node's output) as float64."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy().astype(np.float64)
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor().numpy().astype(np.float64)
    return None


def in_dependency_order(region: list[ir.Node]) -> list[ir.Node]:
    """`region` with every node after the region nodes it reads."""
    produced_by = {id(value): node for node in region for value in node.outputs}
    ordered, placed = [], set()

    def place(node):
        if id(node) in placed:
            return
        placed.add(id(node))
        for value in node.inputs:
            if id(value) in produced_by:
                place(produced_by[id(value)])
        ordered.append(node)

    for node in region:
        place(node)
    return ordered
