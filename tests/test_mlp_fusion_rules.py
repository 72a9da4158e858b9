"""The MLP rules (passes/mlp_rules) as the fusion of factorized MLPs asks them, one by one on real exports: each
matches its own pattern at the MLP's output projection and no other, and an MLP no rule matches, or whose
projections are not all factorized, is left alone with the reason."""

import warnings

import onnx_ir as ir
import pytest

from onnx_nmm import RankOptions, RewriteOptions, Selection, rewrite
from onnx_nmm.passes import FuseMlpPass, svd_ops
from onnx_nmm.passes.mlp_fusion import factorized_projections, fused_form, output_projections
from onnx_nmm.passes.mlp_rules.rule_set import RULES
from onnx_nmm.passes.rules import Mismatch


def _factorized(export, architecture, exporter, exclude=None) -> ir.Model:
    options = RewriteOptions(ranks=RankOptions(keep=0.5, align=32), selection=Selection(exclude=exclude))
    return rewrite(export(architecture, exporter), options).model


def _downs(model: ir.Model) -> list[ir.Node]:
    return [node for node in output_projections(model) if node.op_type == svd_ops.SVD_MATMUL]


@pytest.mark.parametrize(("architecture", "exporter", "form", "op"), [
    ("llama", "dynamo", "gated", svd_ops.SVD_GATED_MLP),
    ("gemma", "torchscript", "gated", svd_ops.SVD_GATED_MLP),
    ("phi3", "dynamo", "split_gate_up", svd_ops.SVD_GATED_MLP),
    ("gpt2", "dynamo", "ungated", svd_ops.SVD_MLP),
    ("phi", "torchscript", "ungated", svd_ops.SVD_MLP),
])
def test_each_rule_matches_its_own_pattern_and_no_other(export, architecture, exporter, form, op):
    model = _factorized(export, architecture, exporter)
    projections = factorized_projections(model)
    downs = _downs(model)
    assert len(downs) == 2  # one per decoder layer
    for down in downs:
        for rule in RULES:
            found = rule.match(projections(down.outputs[0]), projections)
            if rule.form == form:
                assert not isinstance(found, Mismatch) and found.form == form
            else:
                assert isinstance(found, Mismatch) and found.reason
        assert fused_form(projections(down.outputs[0]), projections, model).op_type == op


@pytest.mark.parametrize(("architecture", "exporter", "exclude", "reason"), [
    ("llama", "dynamo", "gate_proj", "its gate, up or down projection is not factorized (or has a bias)"),
    ("phi3", "dynamo", "gate_up", "its gate_up or down projection is not factorized (or has a bias)"),
    ("gpt2", "dynamo", "c_fc", "its input projection is not factorized"),
    ("gpt2", "torchscript", None, "reshapes between its projections, and no shapes in the graph to show they keep "
                                  "the rows"),
])
def test_an_mlp_no_rule_matches_is_left_with_the_closest_rule_s_reason(export, architecture, exporter, exclude,
                                                                       reason):
    model = _factorized(export, architecture, exporter, exclude)
    projections = factorized_projections(model)
    for down in _downs(model):
        found = fused_form(projections(down.outputs[0]), projections, model)
        assert isinstance(found, Mismatch) and found.reason == reason
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fusion = FuseMlpPass()(model)
    assert fusion.fused == [] and set(fusion.unfused.values()) == {reason}
