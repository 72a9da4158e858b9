"""The MLP rules in the order they are tried, and the projections they are asked about."""

from __future__ import annotations

from onnx_nmm.passes.mlp_rules.gated import GatedMlp
from onnx_nmm.passes.mlp_rules.mlp import P, Projections
from onnx_nmm.passes.mlp_rules.split_gate_up import SplitGateUpMlp
from onnx_nmm.passes.mlp_rules.ungated import UngatedMlp

GATED_MLP, SPLIT_GATE_UP_MLP, UNGATED_MLP = GatedMlp(), SplitGateUpMlp(), UngatedMlp()
RULES = (GATED_MLP, SPLIT_GATE_UP_MLP, UNGATED_MLP)  # the first that matches is used
# The MLPs whose projections are their own, which narrowing narrows (a split gate_up's split would have to move).
OWN_PROJECTIONS = (GATED_MLP, UNGATED_MLP)
# The roles an MLP's output projection has: where the rules are anchored.
OUTPUT_PROJECTIONS = ("down", "fc2")


def by_output(projections: list[P]) -> Projections[P]:
    """The projection among `projections` that computes a value, or None."""
    computing = {id(projection.output): projection for projection in projections}
    return lambda value: computing.get(id(value))
