"""The MLP fusion rules (passes/mlp_fusion.py), one by one on real exports: each matches its own pattern at the
MLP's output projection and no other, and an MLP no rule matches is left alone with the reason of the rule that
came closest."""

import warnings

import onnx_ir as ir
import pytest

from onnx_nmm import RankOptions, RewriteOptions, Selection, rewrite
from onnx_nmm.passes import FuseMlpPass, svd_ops
from onnx_nmm.passes.mlp_fusion import RULES, GatedMlp, SplitGateUpMlp, UngatedMlp, output_projections
from onnx_nmm.passes.rules import Mismatch, first_match


def _factorized(export, architecture, exporter, exclude=None) -> ir.Model:
    options = RewriteOptions(ranks=RankOptions(keep=0.5, align=32), selection=Selection(exclude=exclude))
    return rewrite(export(architecture, exporter), options).model


def _downs(model: ir.Model) -> list[ir.Node]:
    return [node for node in output_projections(model) if node.op_type == svd_ops.SVD_MATMUL]


@pytest.mark.parametrize(("architecture", "exporter", "rule", "op"), [
    ("llama", "dynamo", GatedMlp, svd_ops.SVD_GATED_MLP),
    ("gemma", "torchscript", GatedMlp, svd_ops.SVD_GATED_MLP),
    ("phi3", "dynamo", SplitGateUpMlp, svd_ops.SVD_GATED_MLP),
    ("gpt2", "dynamo", UngatedMlp, svd_ops.SVD_MLP),
    ("phi", "torchscript", UngatedMlp, svd_ops.SVD_MLP),
])
def test_each_rule_matches_its_own_pattern_and_no_other(export, architecture, exporter, rule, op):
    model = _factorized(export, architecture, exporter)
    downs = _downs(model)
    assert len(downs) == 2  # one per decoder layer
    for down in downs:
        for other in RULES:
            found = other.match(down, model)
            if isinstance(other, rule):
                assert not isinstance(found, Mismatch) and found.op_type == op
            else:
                assert isinstance(found, Mismatch) and found.reason


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
    for down in _downs(model):
        found = first_match(RULES, down, model)
        assert isinstance(found, Mismatch) and found.reason == reason
    fusion = FuseMlpPass()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fusion(model)
    assert fusion.fused == [] and set(fusion.unfused.values()) == {reason}
