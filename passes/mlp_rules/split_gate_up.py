"""Gate and up as two column selections of one projection's output (Phi-3's gate_up_proj).

    gu = gate_up(x);  h = f(select(gu), select(gu));  y = down(h)
                                  fused when f is act(gate) · up, the selections two column sets of one size
"""

from __future__ import annotations

from onnx_nmm.passes import activation_match, column_selection
from onnx_nmm.passes.mlp_rules.mlp import SPLIT_GATE_UP, Mlp, P, Projections
from onnx_nmm.passes.mlp_rules.pattern import (
    RESHAPES,
    ElementWise,
    Found,
    Input,
    Projection,
    Selected,
    match,
    through_reshapes,
)
from onnx_nmm.passes.mlp_rules.shared import Activation, unknown_activation
from onnx_nmm.passes.rules import Mismatch

NOT_ACT_GATE_TIMES_UP = Mismatch("the output projection's input is not act(gate) · up", 2)


def pattern() -> Projection:
    x = Input("x")
    gate_up = Projection("gate_up", x)
    return Projection("down", ElementWise(Selected(gate_up), Selected(gate_up)))


class SplitGateUpMlp:
    form = SPLIT_GATE_UP

    def match(self, down: P, projections: Projections[P]) -> Mlp[P] | Mismatch:
        found: Found[P] | Mismatch = match(pattern(), down, projections)
        if isinstance(found, Mismatch):
            return found
        return Mlp(SPLIT_GATE_UP, [found.projections["gate_up"]], down, found.region,
                   [node for node in found.region if node.op_type in RESHAPES], found.operands)

    def activation(self, mlp: Mlp, opset: int) -> Activation | Mismatch:
        """act(gate) · up, gate and up two column sets of gate_up's output: act's name and nodes with the
        selections', and the columns each holds."""
        product = through_reshapes(mlp.down.x)[0].producer()
        if product is None or product.op_type != "Mul" or product.domain != "":
            return NOT_ACT_GATE_TIMES_UP
        gate_up = mlp.projections[0]
        for activated, up_value in (product.inputs, product.inputs[::-1]):
            if up_value not in mlp.operands:
                continue
            g = next(value for value in mlp.operands if value is not up_value)
            recognized = activation_match.recognize(g, activated)
            if recognized is None:
                return unknown_activation(activated)
            selection = column_selection.selection_region(gate_up.output, [g, up_value])
            columns = selection and column_selection.selected_columns(gate_up.output, [g, up_value], selection,
                                                                       gate_up.n, opset)
            if not columns or len(columns[0]) != len(columns[1]) or len(columns[0]) != mlp.down.k:
                return Mismatch("gate and up come from one projection split in a way onnx-nmm cannot read as two "
                                "column sets", 3)
            return Activation(recognized[1], [*selection, *recognized[0]], [gate_up], columns)
        return NOT_ACT_GATE_TIMES_UP
