"""Two layers (GPT-2, Phi, BERT): one projection, an activation, the output projection; reshapes between them
allowed.

    h = f(fc1(x));  y = down(h)                  fused when f is act, SiLU or GELU
"""

from __future__ import annotations

from onnx_nmm.passes import activation_match
from onnx_nmm.passes.mlp_rules.mlp import UNGATED, Mlp, P, Projections
from onnx_nmm.passes.mlp_rules.pattern import (
    RESHAPES,
    ElementWise,
    Found,
    Input,
    Projection,
    match,
    reshaped_forms,
    through_reshapes,
)
from onnx_nmm.passes.mlp_rules.shared import Activation, widths_mismatch
from onnx_nmm.passes.rules import Mismatch


def pattern() -> Projection:
    x = Input("x")
    return Projection("down", ElementWise(Projection("fc1", x)))


class UngatedMlp:
    form = UNGATED

    def match(self, down: P, projections: Projections[P]) -> Mlp[P] | Mismatch:
        found: Found[P] | Mismatch = match(pattern(), down, projections)
        if isinstance(found, Mismatch):
            return found
        inputs = [found.projections["fc1"]]
        return widths_mismatch(inputs, down) or Mlp(UNGATED, inputs, down, found.region,
                                                    [node for node in found.region if node.op_type in RESHAPES],
                                                    found.operands)

    def activation(self, mlp: Mlp) -> Activation | Mismatch:
        """act(fc1), on fc1's output or a reshaped form of it."""
        activated = through_reshapes(mlp.down.x)[0]
        fc1 = mlp.projections[0]
        for g, _ in reshaped_forms(fc1.output):
            recognized = activation_match.recognize(g, activated)
            if recognized is not None:
                return Activation(recognized[1], recognized[0], [fc1])
        producer = activated.producer()
        return Mismatch(f"its activation ({producer.op_type if producer is not None else 'a graph input'} ...) is "
                        "not one onnx-nmm fuses (SiLU, GELU erf or tanh)", 2)
