"""Every decoder architecture transformers exports here, with each exporter at an old and a new opset:
`inspect` finds the roles, a full-rank rewrite reproduces the original, and the PyTorch lowering runs a
rewrite both on torch maths and on the emulated NKI kernels (docs/architectures.md has the table)."""

import onnx
import pytest

import onnx_nmm as nmm
from onnx_nmm import DiffOptions, RankOptions, RewriteOptions, Selection
from onnx_nmm.export import ARCHITECTURES
from onnx_nmm.passes import svd_ops

pytestmark = pytest.mark.slow

LAYERS = nmm.TinyShape().layers
# Linear layers per decoder layer: (attention, MLP). GPT-2 and Phi-3 project q|k|v (and Phi-3 gate|up) in one matrix.
PER_LAYER = {"gpt2": (2, 2), "phi3": (2, 2), "phi": (4, 2)}
# What each family's MLP fuses into, and its activation. Phi-3 computes gate and up in one projection; GPT-2
# and Phi are not gated.
FUSED_MLP = {**dict.fromkeys(("llama", "llama-tied", "qwen2", "qwen3", "mistral", "olmo", "olmo2", "granite", "phi3"),
                             (svd_ops.SVD_GATED_MLP, "silu")),
             **dict.fromkeys(("gemma", "gemma2", "gemma3"), (svd_ops.SVD_GATED_MLP, "gelu_tanh")),
             **dict.fromkeys(("gpt2", "phi"), (svd_ops.SVD_MLP, "gelu_tanh"))}
# TorchScript's GPT-2 reshapes between c_fc and c_proj with no shapes in the graph (and reads the activation's
# shape outside the MLP).
NOT_FUSED = {("gpt2", "torchscript")}
CELLS = [("torchscript", 18), ("dynamo", 18), ("dynamo", 23)]
EXACT = dict(atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("exporter, opset", CELLS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_architecture_end_to_end(export, tmp_path, architecture, exporter, opset):
    source = export(architecture, exporter, opset=opset)
    attention, mlp = PER_LAYER.get(architecture, (4, 3))
    assert nmm.inspect(source).totals()["by_group"] == {"attention": attention * LAYERS, "mlp": mlp * LAYERS,
                                                          "lm_head": 1}

    full = nmm.rewrite(source, RewriteOptions(ranks=RankOptions(rank="full"),
                                              selection=Selection(targets="all", lm_head=True)))
    assert len(full.report.factorized) == (attention + mlp) * LAYERS + 1
    full.save(tmp_path / "full.onnx")
    exact = nmm.diff(source, tmp_path / "full.onnx", DiffOptions(batch=2, seq_len=9, **EXACT))
    assert exact.passed, exact.to_dict()

    ranks = RankOptions(keep=0.5, align=32)
    nmm.rewrite(source, RewriteOptions(ranks=ranks, fuse_mlp=True)).save(tmp_path / "r.onnx")
    fused = [node for node in onnx.load(tmp_path / "r.onnx").graph.node if node.op_type in svd_ops.MLP_OPS]
    expected = [] if (architecture, exporter) in NOT_FUSED else [FUSED_MLP[architecture]] * LAYERS
    assert [(node.op_type, node.attribute[0].s.decode()) for node in fused] == expected
    if fused:  # the fused op's function body computes what the unfused graph did
        nmm.rewrite(source, RewriteOptions(ranks=ranks)).save(tmp_path / "unfused.onnx")
        same = nmm.diff(tmp_path / "unfused.onnx", tmp_path / "r.onnx", DiffOptions(batch=2, seq_len=9, **EXACT))
        assert same.passed, same.to_dict()
    lowered = nmm.diff(tmp_path / "r.onnx", tmp_path / "r.onnx", DiffOptions(batch=2, seq_len=9, backend="torch",
                                                                             **EXACT))
    assert lowered.passed, lowered.to_dict()
    emulated = nmm.diff(tmp_path / "r.onnx", tmp_path / "r.onnx", DiffOptions(batch=2, seq_len=9, backend="emulator"))
    logits = emulated.outputs[0]
    assert logits.cosine > 0.999 and logits.top1_agreement >= 0.9  # bf16 kernels, fp32 accumulation
