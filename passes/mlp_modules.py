"""Find each MLP as a module: the projections that widen X to the intermediate activation h, and the one
that reads h back. The rule, for a down (or fc2) projection D:

    pattern   h = f(P₁(X), …, Pₘ(X))          f element-wise (and reshapes keeping the last axis), m = 1 or 2
              Y = D(h)                         gated: m = 2 (gate, up: act(g)·u); two-layer: m = 1 (act(fc1))
    check     every Pᵢ reads the same X and writes as many columns as D reads rows (the width I); nothing
              outside the MLP but a Shape reads a value between them; every constant f reads is a scalar, so that it
              broadcasts over any width; a reshape between them names the width as a constant
    result    Mlp(projections, down, region, reshapes): what narrowing (mlp_narrowing) changes

A down projection that does not match gets the reason, in the graph's terms. A gate and an up projection
computed by one gate_up projection split in two (Phi-3) do not match: the split would have to move too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.passes.linear_layers import LinearLayer

# Element-wise ops an activation is made of (as exporters spell SiLU, GELU, ReLU and their approximations).
ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Pow", "Neg", "Tanh", "Exp", "Sqrt", "Reciprocal", "Erf", "Sigmoid",
               "Softplus", "Relu", "Gelu", "Cast", "Identity", "HardSigmoid", "Elu", "Selu", "LeakyRelu")
RESHAPES = ("Reshape",)
OUTPUT_PROJECTIONS = ("down", "fc2")
# How far back from D the walk goes before it gives up: activations are a handful of nodes.
_MAX_REGION = 32


@dataclass
class Mlp:
    """One MLP: its input projections (gate and up, or fc1), its output projection, and the nodes between."""

    projections: list[LinearLayer]
    down: LinearLayer
    region: list[ir.Node] = field(default_factory=list)  # element-wise nodes and reshapes from the Pᵢ to D
    reshapes: list[ir.Node] = field(default_factory=list)  # the reshapes among them, whose shape names the width

    @property
    def name(self) -> str:
        """The module path of the MLP ("model.layers.0.mlp"), from its output projection's."""
        path = self.down.module_path
        return path.rsplit(".", 1)[0] if "." in path else f"{self.down.name}.mlp"

    @property
    def width(self) -> int:
        """I: the intermediate activation's width."""
        return self.down.k

    @property
    def gated(self) -> bool:
        return len(self.projections) == 2

    @property
    def layers(self) -> list[LinearLayer]:
        return [*self.projections, self.down]

    @property
    def parameters_per_neuron(self) -> int:
        """What one intermediate neuron costs: a column of every input projection, a row of the output one."""
        return sum(layer.k for layer in self.projections) + self.down.n

    def parameters(self, width: int | None = None) -> int:
        return (self.width if width is None else width) * self.parameters_per_neuron


def find_mlps(layers: list[LinearLayer]) -> tuple[list[Mlp], dict[str, str]]:
    """Every MLP among `layers` (each site of one in several subgraphs), and for each output projection that
    heads none, why."""
    by_output = {id(layer.output): layer for layer in layers}
    mlps, unmatched = [], {}
    for down in layers:
        if down.role not in OUTPUT_PROJECTIONS:
            continue
        found = match_mlp(down, by_output)
        if isinstance(found, Mlp):
            mlps.append(found)
        else:
            unmatched[down.name] = found
    return mlps, unmatched


def match_mlp(down: LinearLayer, by_output: dict[int, LinearLayer]) -> Mlp | str:
    """The MLP `down` reads from, or why there is none (`by_output`: every linear layer by its output)."""
    projections, region, reason = _walk_back(down, by_output)
    if reason:
        return reason
    widths = {layer.n for layer in projections}
    if len(projections) not in (1, 2) or len({id(layer.x) for layer in projections}) != 1:
        return f"its input comes from {len(projections)} projections of different inputs, not from gate and up"
    if widths != {down.k}:
        return (f"its input projections write {sorted(widths)} columns and it reads {down.k}: a split or "
                "concatenation between them (a fused gate_up projection) is not narrowed")
    mlp = Mlp(_gate_first(projections), down, region, [node for node in region if node.op_type in RESHAPES])
    return _outside_reader(mlp) or _unscalable(mlp) or mlp


def _walk_back(down: LinearLayer, by_output: dict[int, LinearLayer]
               ) -> tuple[list[LinearLayer], list[ir.Node], str]:
    """The projections and nodes upstream of D's input down to the projections' outputs; or the reason the
    walk met something an MLP does not hold."""
    projections, region, pending, seen = [], [], [down.x], set()
    while pending:
        value = pending.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if id(value) in by_output:
            projections.append(by_output[id(value)])
            continue
        if value.const_value is not None:
            continue
        node = value.producer()
        if node is None:
            return [], [], "its input is computed from a graph input, not from projections"
        if node.op_type == "Constant":
            continue
        if node.domain not in ("", "ai.onnx") or node.op_type not in ELEMENTWISE + RESHAPES:
            return [], [], f"a {node.op_type} node sits between it and the projections feeding it"
        if len(region) == _MAX_REGION:
            return [], [], f"more than {_MAX_REGION} nodes between it and the projections feeding it"
        region.append(node)
        pending.extend(node.inputs[:1] if node.op_type in RESHAPES else node.inputs)
    return projections, region, ""


def _gate_first(projections: list[LinearLayer]) -> list[LinearLayer]:
    """Gate before up when the roles tell them apart (narrowing treats them alike)."""
    return sorted(projections, key=lambda layer: layer.role != "gate")


def _outside_reader(mlp: Mlp) -> str:
    """What outside the MLP reads a value inside it, or "" when nothing does."""
    inside = {id(node) for node in mlp.region} | {id(node) for node in mlp.down.nodes}
    if mlp.down.quantizer is not None:
        inside.add(id(mlp.down.quantizer))
    graph = mlp.down.node.graph
    values = [layer.output for layer in mlp.projections] + [value for node in mlp.region for value in node.outputs]
    for value in values:
        if value in graph.outputs:
            return "a value between its projections is a graph output"
        # A Shape reads only the dimensions, which narrowing keeps true.
        reader = next((use.node for use in value.uses() if id(use.node) not in inside and use.node.op_type != "Shape"),
                      None)
        if reader is not None:
            return f"a {reader.op_type} node outside the MLP reads a value between its projections"
    return ""


def _unscalable(mlp: Mlp) -> str:
    """Why narrowing could not keep the region's computation as it is: a constant the width would slice, or a
    reshape whose target width is computed; "" when it can."""
    for node in mlp.region:
        if node.op_type in RESHAPES:
            if width_constant(node, mlp.width, inside_values(mlp)) is None:
                return "a reshape between its projections computes its target shape"
            continue
        for value in node.inputs:
            constant = constant_array(value)
            if constant is not None and constant.size != 1:
                return (f"its activation reads a constant of shape {list(constant.shape)} (a {node.op_type}), which "
                        "narrowing would have to slice")
    return ""


def inside_values(mlp: Mlp) -> set[int]:
    """The ids of the values between the MLP's projections (the projections' outputs and the region's)."""
    return {id(layer.output) for layer in mlp.projections} | {id(value) for node in mlp.region
                                                               for value in node.outputs}


def width_constant(reshape: ir.Node, width: int, inside: set[int]) -> tuple[ir.Node, int, np.ndarray] | None:
    """Where a reshape's target shape names the width: (the node reading that constant, its input index, the
    constant) — the Reshape itself, or the Concat that builds the shape from a constant last part (which other
    reshapes may read too). A last part of -1, or one computed from the Shape of a value between the
    projections (`inside`: their ids), follows the narrowing by itself: its constant is given as [-1]. None
    when the shape is computed otherwise, or names another width."""
    reader, index = reshape, 1
    if constant_array(reshape.inputs[1]) is None:
        concat = reshape.inputs[1].producer()
        if concat is None or concat.op_type != "Concat" or not concat.inputs:
            return None
        reader, index = concat, len(concat.inputs) - 1
        if _measured_inside(concat.inputs[-1], inside):
            return reader, index, np.array([-1])
    array = constant_array(reader.inputs[index])
    if array is None or array.ndim != 1 or array.size < 1 or array[-1] not in (width, -1):
        return None
    return reader, index, array


def _measured_inside(value: ir.Value | None, inside: set[int], hops: int = 6) -> bool:
    """Whether `value` is computed from the Shape of a value between the projections (through Slice, Gather,
    Squeeze, Unsqueeze and the like)."""
    node = value.producer() if value is not None else None
    if node is None or hops == 0:
        return False
    if node.op_type == "Shape":
        return id(node.inputs[0]) in inside
    return any(_measured_inside(argument, inside, hops - 1) for argument in node.inputs[:1])


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The array a value holds when it is fixed at build time (an initializer or a Constant node's output)."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is None or producer.op_type != "Constant":
        return None
    attributes = producer.attributes
    if "value" in attributes:
        return attributes["value"].as_tensor().numpy()
    for name, dtype in (("value_ints", np.int64), ("value_int", np.int64), ("value_floats", np.float32),
                        ("value_float", np.float32)):
        if name in attributes:
            return np.asarray(attributes[name].value, dtype)
    return None


