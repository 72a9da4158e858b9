"""passes/mlp_rules/split_gate_up.py: y = down(f(select(gate_up(x)), select(gate_up(x)))), Phi-3's one gate_up
projection; the selections read as two column sets, the gate's and the up's."""

import numpy as np

from onnx_nmm.model_io import load_model
from onnx_nmm.passes import find_linear_layers
from onnx_nmm.passes.mlp_rules.rule_set import SPLIT_GATE_UP_MLP, by_output
from onnx_nmm.passes.rules import Mismatch


def test_gate_and_up_are_the_two_halves_of_one_projection(export):
    model = load_model(export("phi3", "dynamo"))
    layers = find_linear_layers(model)
    downs = [layer for layer in layers if layer.role == "down"]
    assert len(downs) == 2
    for down in downs:
        mlp = SPLIT_GATE_UP_MLP.match(down, by_output(layers))
        assert not isinstance(mlp, Mismatch) and mlp.gated and len(mlp.projections) == 1
        gate_up = mlp.projections[0]
        assert gate_up.n == 2 * down.k
        found = SPLIT_GATE_UP_MLP.activation(mlp, model.opset_imports[""])
        assert found.name == "silu"
        gate, up = found.columns
        np.testing.assert_array_equal(gate, np.arange(down.k))  # Phi-3: gate first, then up
        np.testing.assert_array_equal(up, np.arange(down.k, 2 * down.k))


def test_separate_gate_and_up_are_not_a_split(export):
    layers = find_linear_layers(load_model(export("llama", "dynamo")))
    down = next(layer for layer in layers if layer.role == "down")
    assert isinstance(SPLIT_GATE_UP_MLP.match(down, by_output(layers)), Mismatch)
