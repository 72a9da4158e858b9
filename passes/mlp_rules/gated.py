"""Gate and up separate (Llama, Qwen, Gemma, Mistral): two projections of one input, combined element-wise.

    h = f(gate(x), up(x));  y = down(h)          fused when f is act(gate) · up, act SiLU or GELU
"""

from __future__ import annotations

from onnx_nmm.passes import activation_match
from onnx_nmm.passes.mlp_rules.mlp import GATED, Mlp, P, Projections
from onnx_nmm.passes.mlp_rules.pattern import RESHAPES, ElementWise, Found, Input, Projection, match, through_reshapes
from onnx_nmm.passes.mlp_rules.shared import Activation, unknown_activation, widths_mismatch
from onnx_nmm.passes.rules import Mismatch


def pattern() -> Projection:
    x = Input("x")
    return Projection("down", ElementWise(Projection("gate", x), Projection("up", x)))


class GatedMlp:
    form = GATED

    def match(self, down: P, projections: Projections[P]) -> Mlp[P] | Mismatch:
        found: Found[P] | Mismatch = match(pattern(), down, projections)
        if isinstance(found, Mismatch):
            return found
        inputs = sorted((found.projections["gate"], found.projections["up"]), key=lambda layer: layer.role != "gate")
        return widths_mismatch(inputs, down) or Mlp(GATED, inputs, down, found.region,
                                                    [node for node in found.region if node.op_type in RESHAPES],
                                                    found.operands)

    def activation(self, mlp: Mlp) -> Activation | Mismatch:
        """act(gate) · up: act's name and nodes, with gate and up as the product reads them."""
        product = through_reshapes(mlp.down.x)[0].producer()
        if product is None or product.op_type != "Mul" or product.domain != "":
            return Mismatch("the output projection's input is not act(gate) · up", 2)
        for activated, up_value in (product.inputs, product.inputs[::-1]):
            up = next((layer for layer in mlp.projections if layer.output is up_value), None)
            gate = next((layer for layer in mlp.projections if layer is not up), None)
            if up is None or gate is None:
                continue
            recognized = activation_match.recognize(gate.output, activated)
            if recognized is None:
                return unknown_activation(activated)
            return Activation(recognized[1], recognized[0], [gate, up])
        return Mismatch("the output projection's input is not act(gate) · up", 2)

