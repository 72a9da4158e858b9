"""passes/mlp_rules/ungated.py: y = down(f(fc1(x))), on real exports as narrowing asks it (their linear layers),
reshapes between the projections included; act(fc1) names the activation."""

import pytest

from onnx_nmm.model_io import load_model
from onnx_nmm.passes import find_linear_layers
from onnx_nmm.passes.mlp_rules.rule_set import UNGATED_MLP, by_output
from onnx_nmm.passes.rules import Mismatch


@pytest.mark.parametrize(("architecture", "exporter", "reshapes"), [
    ("gpt2", "dynamo", 2), ("gpt2", "torchscript", 2), ("phi", "torchscript", 0)])
def test_an_ungated_mlp_is_fc1_an_activation_and_fc2(export, architecture, exporter, reshapes):
    layers = find_linear_layers(load_model(export(architecture, exporter)))
    downs = [layer for layer in layers if layer.role == "fc2"]
    assert len(downs) == 2
    for down in downs:
        mlp = UNGATED_MLP.match(down, by_output(layers))
        assert not isinstance(mlp, Mismatch) and not mlp.gated
        assert [layer.role for layer in mlp.layers] == ["fc1", "fc2"] and mlp.width == mlp.projections[0].n
        assert [node.op_type for node in mlp.reshapes] == ["Reshape"] * reshapes
        assert UNGATED_MLP.activation(mlp).name == "gelu_tanh"


def test_a_gated_mlp_is_not_ungated(export):
    layers = find_linear_layers(load_model(export("llama", "dynamo")))
    down = next(layer for layer in layers if layer.role == "down")
    assert UNGATED_MLP.match(down, by_output(layers)) == Mismatch(
        "its input comes from 2 projections of different inputs, not from gate and up", 1)
