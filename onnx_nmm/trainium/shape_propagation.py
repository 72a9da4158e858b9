"""The shapes of one rank's values, from the whole model's: what a graph computes on 1/tp of the heads.

A rank program is the model's graph with its linear layers split (graph_sharding.py). Between a split layer and
the one that joins its output, every value holds the rank's share: q [B, S, H/tp·D], the scores [B, H/tp, S, P],
a KV cache [B, K/tp, P, D]. Most ops compute that share as they are (elementwise ops, Transpose, Softmax, MatMul,
Concat, the cache's ScatterElements). Those that spell a shape do not: a Reshape or Expand whose target holds
the head count (torch.onnx writes `Concat(batch, 2, 2, P, 64)` for repeat_kv's Expand). So:

    the model's graph run once on onnxruntime (`probe`)     every value's shape, and the values of small integer
                                                            tensors (shapes, axes, positions)
    each op reading a value the split changed, in order     run on zeros of the rank's shapes (onnx's reference
                                                            ops), giving the rank's shapes and small values
    Reshape                                                 the rank's share of each group of axes it merges or
                                                            splits goes to the group's outermost axis (heads are
                                                            outer of the head size)
    Expand                                                  an axis from the input keeps the input's share; a
                                                            broadcast axis takes the share of a target computed
                                                            from a split value's Shape; repeat_kv's (K heads, then
                                                            H/K copies) takes H/tp ÷ the rank's KV heads copies

Each Reshape and Expand whose output changed gets the rank's shape as a constant target (the graphs have
static shapes). Anything these rules get wrong computes other logits: compile's check against the model as given
(generation_check.py) refuses the folder then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import onnx
import onnx_ir as ir

from onnx_nmm.errors import ModelError
from onnx_nmm.runtime import ort_runner
from onnx_nmm.runtime.graph_probe import value_types
from onnx_nmm.trainium.graph_session import session_of, weightless_proto

_SMALL = 64  # integer tensors up to this size are shapes, axes or positions: their values are kept


@dataclass
class Probe:
    """Every value's shape and dtype in the whole model's graph, and the values of its small integer tensors."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]
    values: dict[str, np.ndarray]

    def copy(self) -> Probe:
        """A copy a rank program's split may add its new values to."""
        return Probe(dict(self.shapes), dict(self.dtypes), dict(self.values))


def probe(model: ir.Model, feeds: dict[str, np.ndarray]) -> Probe:
    """Run `model` once on onnxruntime with every value of its graph as an output."""
    proto, weights = weightless_proto(model)  # a static graph of a 0.5B model passes protobuf's 2 GB
    types = value_types(proto)
    present = {output.name for output in proto.graph.output}
    for node in proto.graph.node:
        for name in node.output:
            if name and name not in present and name in types:
                proto.graph.output.append(onnx.helper.make_tensor_value_info(name, types[name], None))
                present.add(name)
    outputs = ort_runner.run(session_of(proto, weights, "the graph to split"), feeds)
    known = {**feeds, **outputs}
    return Probe({name: tuple(array.shape) for name, array in known.items()},
                 {name: array.dtype for name, array in known.items()},
                 {name: array for name, array in known.items() if array.dtype.kind in "iub" and array.size <= _SMALL})


@dataclass(frozen=True)
class RepeatKv:
    """repeat_kv on a rank: each of the model's `kv_heads` KV heads is read by `copies` query heads; the rank's
    KV head by `local_copies`."""

    kv_heads: int
    copies: int
    local_copies: int


@dataclass
class LocalShapes:
    """The rank's shapes and small values where they differ from the whole model's (`probe`)."""

    probe: Probe
    repeat: RepeatKv | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)

    def full(self, value: ir.Value) -> tuple[int, ...]:
        """The value's shape in the whole model."""
        name = value.name or ""
        if name not in self.probe.shapes and value.const_value is not None:
            return tuple(value.const_value.shape.numpy())
        return self.probe.shapes[name]

    def shape(self, value: ir.Value) -> tuple[int, ...]:
        """The value's shape on the rank."""
        return self.shapes.get(value.name or "", self.full(value))

    def rename(self, old: str, new: str) -> None:
        """What is known of the value `old` is now of `new`."""
        for known in (self.probe.shapes, self.probe.dtypes, self.probe.values, self.shapes, self.values):
            if old in known:
                known[new] = known.pop(old)  # type: ignore[index,assignment]

    def changed(self, value: ir.Value | None) -> bool:
        return value is not None and (value.name in self.shapes or value.name in self.values)

    def set(self, value: ir.Value, shape: tuple[int, ...]) -> None:
        """`value` holds `shape` on the rank (remembered only where it differs)."""
        if tuple(shape) != self.probe.shapes[value.name or ""]:
            self.shapes[value.name or ""] = tuple(shape)

    def follow(self, node: ir.Node) -> list[ir.Value]:
        """The rank's shapes of `node`'s outputs, when it reads a value the split changed (and of every Expand,
        whose repeat_kv copies change with the heads); the Reshape or Expand targets to make constant."""
        if node.op_type == "Expand" and node.domain == "":
            return self._expand(node)
        if not any(self.changed(value) for value in node.inputs):
            return []
        if node.op_type == "Reshape" and node.domain == "":
            return self._reshape(node)
        self._evaluate(node)
        return []

    def _reshape(self, node: ir.Node) -> list[ir.Value]:
        data, output = node.inputs[0], node.outputs[0]
        assert data is not None
        full_in, full_out = self.full(data), self.full(output)
        self.set(output, _reshaped(full_in, full_out, self.shape(data), node.name or ""))
        return [output] if self.changed(output) else []

    def _expand(self, node: ir.Node) -> list[ir.Value]:
        data, target, output = node.inputs[0], node.inputs[1], node.outputs[0]
        assert data is not None and target is not None
        full_out = self.full(output)
        rank = len(full_out)
        full_in = (1,) * (rank - len(self.full(data))) + self.full(data)
        local_in = (1,) * (rank - len(self.shape(data))) + self.shape(data)
        wanted = self.values.get(target.name or "")
        shape = []
        for axis in range(rank):
            if full_in[axis] != 1:
                shape.append(local_in[axis])
            elif wanted is not None:
                shape.append(int(wanted[axis]))
            elif self.repeat is not None and axis > 0 and full_in[axis - 1] == self.repeat.kv_heads and \
                    full_out[axis] == self.repeat.copies:
                shape.append(self.repeat.local_copies)
            else:
                shape.append(full_out[axis])
        self.set(output, tuple(shape))
        return [output] if self.changed(output) else []

    def _elementwise(self, node: ir.Node) -> bool:
        """An op of one input the reference ops do not know (Gelu) that keeps its input's shape: the output keeps
        the rank's."""
        data = node.inputs[0]
        if len(node.outputs) != 1 or data is None or self.full(node.outputs[0]) != self.full(data):
            return False
        self.set(node.outputs[0], self.shape(data))
        return True

    def _evaluate(self, node: ir.Node) -> None:
        """Run `node` on zeros of the rank's shapes (its small integer inputs with their values)."""
        from onnx.reference import ReferenceEvaluator

        arguments: list[np.ndarray | None] = []
        for value in node.inputs:
            if value is None:
                arguments.append(None)
                continue
            name = value.name or ""
            if name in self.values:
                arguments.append(self.values[name])
            elif name in self.probe.values:
                arguments.append(self.probe.values[name])
            elif value.const_value is not None and value.const_value.size <= _SMALL:
                arguments.append(value.const_value.numpy())
            else:
                arguments.append(np.zeros(self.shape(value), self.probe.dtypes.get(name, np.float32)))
        names = [f"in{index}" if value is not None else "" for index, value in enumerate(node.inputs)]
        proto = onnx.helper.make_node(node.op_type, names, [f"out{index}" for index in range(len(node.outputs))],
                                      domain=node.domain or None)
        proto.attribute.extend(ir.to_proto(attribute) for attribute in node.attributes.values())
        try:
            results = ReferenceEvaluator(proto).run(None, {name: array for name, array in zip(names, arguments)
                                                           if name})
        except Exception as error:
            if "No implementation" in str(error) and self._elementwise(node):
                return
            raise ModelError(f"cannot split {node.op_type} node '{node.name}' over the ranks: on the rank's share of "
                             f"its inputs ({', '.join(str(np.shape(a)) for a in arguments if a is not None)}) it "
                             f"fails ({str(error).splitlines()[0][:120]})") from None
        for output, result in zip(node.outputs, results):
            result = np.asarray(result)
            self.set(output, result.shape)
            name = output.name or ""
            if name in self.probe.values and (result.shape != self.probe.values[name].shape
                                              or not np.array_equal(result, self.probe.values[name])):
                self.values[name] = result


def _reshaped(full_in: tuple[int, ...], full_out: tuple[int, ...], local_in: tuple[int, ...],
              name: str) -> tuple[int, ...]:
    """A Reshape's output on the rank: each group of input axes whose product matches a group of output axes keeps
    the group's share, on the group's outermost output axis that can take it."""
    if local_in == full_in:
        return full_out
    out, i, j = list(full_out), 0, 0
    while i < len(full_in) and j < len(full_out):
        group_in, group_out = [i], [j]
        product_in, product_out = full_in[i], full_out[j]
        while product_in != product_out:
            if product_in < product_out:
                i += 1
                group_in.append(i)
                product_in *= full_in[i]
            else:
                j += 1
                group_out.append(j)
                product_out *= full_out[j]
        share = Fraction(int(np.prod([local_in[k] for k in group_in])), product_in)
        if share != 1:
            axis = next((k for k in group_out if (full_out[k] * share).denominator == 1 and full_out[k] > 1), None)
            if axis is None:
                raise ModelError(f"cannot split Reshape node '{name}' over the ranks: {full_in} → {full_out} with the "
                                 f"rank's input {local_in}")
            out[axis] = int(full_out[axis] * share)
        i, j = i + 1, j + 1
    return tuple(out)
