"""What the MLP rules share besides the pattern language: what an activation recognized is, and the checks
every rule makes the same way."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.passes.mlp_rules.mlp import Projection
from onnx_nmm.passes.rules import Mismatch


@dataclass
class Activation:
    """The activation an MLP computes: its name (activation_match.ACTIVATIONS), the nodes computing it, and the
    input projections as the fused op takes them (gate, up; or fc1)."""

    name: str
    nodes: list[ir.Node]
    inputs: list
    columns: list[np.ndarray] = field(default_factory=list)  # a split gate_up: the gate's and the up's columns


def unknown_activation(activated: ir.Value) -> Mismatch:
    producer = activated.producer()
    return Mismatch(f"gated by {producer.op_type if producer is not None else 'a graph input'}, an activation "
                    "onnx-nmm does not fuse (it fuses SiLU and GELU, erf or tanh)", 2)


def widths_mismatch(inputs: list[Projection], down: Projection) -> Mismatch | None:
    """Why the input projections do not make the width the output projection reads, or None when they do."""
    widths = {layer.n for layer in inputs}
    if widths == {down.k}:
        return None
    return Mismatch(f"its input projections write {sorted(widths)} columns and it reads {down.k}: a split or "
                    "concatenation between them (a fused gate_up projection) is not narrowed", 1)


def keeps_rows(mlp) -> bool:
    """Whether an op computing the MLP on its first projection's input X gives the rows its output projection
    gives: with reshapes between the projections, only when the graph's shapes say so."""
    if not mlp.reshapes:
        return True
    x, y = mlp.projections[0].x.shape, mlp.down.output.shape
    return x is not None and y is not None and tuple(x)[:-1] == tuple(y)[:-1]


ROWS_UNKNOWN = Mismatch("reshapes between its projections, and no shapes in the graph to show they keep the rows", 3)
