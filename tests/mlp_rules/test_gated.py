"""passes/mlp_rules/gated.py: y = down(f(gate(x), up(x))), on real exports as narrowing asks it (their linear
layers); act(gate) · up names the activation."""

import onnx_ir as ir
import pytest

from onnx_nmm.model_io import load_model
from onnx_nmm.passes import find_linear_layers
from onnx_nmm.passes.mlp_rules.rule_set import GATED_MLP, by_output
from onnx_nmm.passes.rules import Mismatch


def _downs(model: ir.Model):
    layers = find_linear_layers(model)
    return [layer for layer in layers if layer.role in ("down", "fc2")], by_output(layers)


@pytest.mark.parametrize(("architecture", "exporter", "activation"), [
    ("llama", "dynamo", "silu"), ("llama", "torchscript", "silu"), ("gemma", "torchscript", "gelu_tanh")])
def test_a_gated_mlp_is_gate_up_and_down_of_one_input(export, architecture, exporter, activation):
    downs, projections = _downs(load_model(export(architecture, exporter)))
    assert len(downs) == 2  # one per decoder layer
    for down in downs:
        mlp = GATED_MLP.match(down, projections)
        assert not isinstance(mlp, Mismatch)
        assert [layer.role for layer in mlp.layers] == ["gate", "up", "down"] and mlp.gated
        assert mlp.projections[0].x is mlp.projections[1].x and mlp.width == down.k == mlp.projections[0].n
        assert "Mul" in {node.op_type for node in mlp.region} and not mlp.reshapes
        found = GATED_MLP.activation(mlp)
        assert found.name == activation and [layer.role for layer in found.inputs] == ["gate", "up"]
        assert set(map(id, found.nodes)) < set(map(id, mlp.region))  # the activation, without the product


@pytest.mark.parametrize(("architecture", "reason"), [
    ("gpt2", "its input comes from 1 projections of different inputs, not from gate and up"),
    ("phi3", "a Split node sits between it and the projections feeding it")])
def test_an_mlp_of_another_form_is_not_gated(export, architecture, reason):
    downs, projections = _downs(load_model(export(architecture, "dynamo")))
    assert {GATED_MLP.match(down, projections).reason for down in downs} == {reason}


def test_a_gate_the_kernels_have_no_activation_for_is_an_mlp_all_the_same(export):
    model = load_model(export("llama", "dynamo"))
    sigmoid = next(node for node in model.graph if node.op_type == "Sigmoid")
    sigmoid.op_type = "Relu"  # Mul(g, Relu(g)): narrowing narrows it, fusion cannot name it
    downs, projections = _downs(model)
    mlp = GATED_MLP.match(downs[0], projections)
    assert not isinstance(mlp, Mismatch)
    assert GATED_MLP.activation(mlp).reason == ("gated by Mul, an activation onnx-nmm does not fuse (it fuses SiLU "
                                                "and GELU, erf or tanh)")
