"""onnx_nmm.kernel_table: each ai.onnx_nmm op's kernel, launched from the table, computes the op (the torch
backend's arithmetic, to bfloat16's precision), and compile plans it on the shapes the table names; an MLP runs
fused only where its fused kernel is modelled faster than its projections one by one."""

import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnx_nmm import CompileOptions, RankOptions, RewriteOptions, compile, rewrite
from onnx_nmm.kernel_table import KERNEL_TABLE, kernel_spec
from onnx_nmm.lowering import EmulatorKernels, TorchMath
from onnx_nmm.passes import svd_ops
from onnx_nmm.passes.dense_mlp_fusion import fuse_every_mlp
from onnx_nmm.trainium import neuron
from onnx_nmm.trainium.launch_costs import choose_mlp_kernel

TOKENS, H, I, R = 3, 128, 256, 64  # fewer tokens than a tile's 128 rows

# Every op's inputs after X at H, I and rank R, in the op's order.
INPUTS = {
    svd_ops.SVD_MATMUL: ((H, R), (R, I), (I,)),
    svd_ops.SVD_GATED_MLP: ((H, R), (R, I), (H, R), (R, I), (I, R), (R, H)),
    svd_ops.SVD_MLP: ((H, R), (R, I), (I,), (I, R), (R, H), (H,)),
    svd_ops.GATED_MLP: ((H, I), (H, I), (I, H)),
    svd_ops.MLP: ((H, I), (I,), (I, H), (H,)),
}


def _inputs(op):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) / shape[0] ** 0.5 for shape in INPUTS[op]]


@pytest.mark.parametrize("op", sorted(KERNEL_TABLE))
def test_the_kernel_the_table_names_computes_the_op(op):
    x = torch.randn(1, TOKENS, H, generator=torch.Generator().manual_seed(1))
    inputs = _inputs(op)
    emulator = EmulatorKernels(target="trn1")
    got = emulator.run("node", op, x, *inputs, activation="silu")
    want = TorchMath().run("node", op, x, *inputs, activation="silu")
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())
    spec = kernel_spec(op)
    (call,) = emulator.calls
    dims = spec.dims([tuple(t.shape) for t in inputs])
    assert call.kernel == spec.kernel and call.shapes == spec.shapes(TOKENS, dims)


@pytest.mark.parametrize("op", sorted(KERNEL_TABLE))
def test_compile_plans_each_op_on_the_table_s_shapes(op):
    names = [f"w{i}" for i in range(len(INPUTS[op]))]
    initializers = [numpy_helper.from_array(t.numpy(), name) for t, name in zip(_inputs(op), names)]
    node = helper.make_node(op, ["X", *names], ["Y"], domain=svd_ops.DOMAIN, name="layer")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, H])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializers)
    (entry,) = neuron.plan_kernels(helper.make_model(graph), tokens=128, target="trn1", model_costs=True).entries
    spec = kernel_spec(op)
    assert entry.kernel == spec.kernel and set(entry.dims) == set(spec.dim_names)
    assert entry.dims["H" if "H" in entry.dims else "K"] == H
    assert entry.modelled_us > 0 and entry.modelled_dense_us > 0
    # A factorized op at rank 64 of a 128 × 256 layer moves fewer bytes than the dense products it stands for.
    if op in (svd_ops.SVD_MATMUL, *svd_ops.MLP_OPS):
        assert entry.hbm_mb < entry.hbm_dense_mb


def test_an_op_the_table_does_not_know_is_named():
    with pytest.raises(KeyError, match="no kernel runs ai.onnx_nmm::Conv; the table knows SvdMatMul"):
        kernel_spec("Conv")


def test_a_vector_is_not_taken_for_a_matrix():
    spec = kernel_spec(svd_ops.MLP)
    assert spec.matrices([(H, I), (I,), (I, H), (H,)]) == [(H, I), (I, H)]
    assert spec.shapes(2, spec.dims([(H, I), (I,), (I, H)])) == ((2, H), (H, I), (I,), (I, H))


@pytest.mark.parametrize("op", [svd_ops.GATED_MLP, svd_ops.MLP])
def test_a_dense_mlp_s_projections_hand_the_down_projection_act_transposed_above_one_tile(op):
    """Launched one by one, a dense MLP's last projection takes act as it is up to 128 tokens (dense_matmul), and
    transposed above (dense_matmul_lhsT on [I, tokens]): its x^T transposes then cost it nothing."""
    spec = kernel_spec(op)
    dims = {"H": H, "I": I}
    *first, last = spec.separate_launches(128, dims)
    assert last == ("dense_matmul", ((128, I), (I, H))) and {kernel for kernel, _ in first} == {"dense_matmul"}
    *first, last = spec.separate_launches(129, dims)
    assert last == ("dense_matmul_lhsT", ((I, 129), (I, H))) and first[0] == ("dense_matmul", ((129, H), (H, I)))


def test_an_mlp_runs_fused_only_where_the_fused_kernel_is_modelled_faster():
    """Llama-3-8B's MLP at keep 0.9 (ranks 2816): one fused_svd_mlp wins at one token, three fused_xuv launches
    win on a prompt of 512 (the fused kernel recomputes its strips there); both times are kept."""
    dims = {"H": 4096, "I": 14336, "rank_gate": 2816, "rank_up": 2816, "rank_down": 2816}
    decode = choose_mlp_kernel(svd_ops.SVD_GATED_MLP, dims, 1, "trn1")
    prefill = choose_mlp_kernel(svd_ops.SVD_GATED_MLP, dims, 512, "trn1")
    assert decode.fuse and decode.cost == decode.fused
    assert not prefill.fuse and prefill.cost == prefill.separate and prefill.separate[0] < prefill.fused[0]
    assert prefill.to_dict()["chose"] == "3 fused_xuv" and "(modelled)" in prefill.reason()


def test_compile_keeps_an_mlp_unfused_where_its_projections_are_faster(export, tmp_path):
    model = rewrite(export("llama", "dynamo"), RewriteOptions(ranks=RankOptions(keep=0.5, align=32))).model
    asked = []

    def refuse_the_first(name, op, shapes):
        asked.append((name, op, kernel_spec(op).dims(shapes)))
        return "faster as its projections" if len(asked) == 1 else None

    fused, unfused = fuse_every_mlp(model, refuse_the_first)
    assert [name for name, _, _ in asked] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert asked[0][2] == {"H": 256, "I": 512, "rank_gate": 96, "rank_up": 96, "rank_down": 96}  # 85 → 96
    assert fused == ["model.layers.1.mlp"] and unfused == {"model.layers.0.mlp.down_proj": "faster as its projections"}
    compiled = compile(export("llama", "dynamo"), tmp_path / "out", CompileOptions(target="trn1", seq_len=8,
                                                                                   dry_run=True))
    choices = compiled.manifest["mlp_kernels"]
    assert [c["op"] for c in choices] == [svd_ops.GATED_MLP] * 2 and all(c["separate_us"] > 0 for c in choices)
    assert compiled.manifest["fused_mlps"] == [c["mlp"] for c in choices if c["fused"]]


def test_a_factorized_mlp_takes_the_dense_path_where_the_dense_kernel_is_fastest():
    """A rank that keeps more parameters than the dense weights (1920 of 2048×8192) costs more than them: the
    choice multiplies the factors back (modelled); at rank 1280 the fused kernel reads fewer bytes and wins."""
    from onnx_nmm.trainium.launch_costs import choose_mlp_kernel

    dims = {"H": 2048, "I": 8192, "rank_gate": 1920, "rank_up": 1920, "rank_down": 1920}
    long_prefill = choose_mlp_kernel("SvdGatedMLP", dims, 2048, "trn1")
    assert long_prefill.way == "dense" and long_prefill.cost == long_prefill.dense
    assert long_prefill.dense[0] < min(long_prefill.fused[0], long_prefill.separate[0])
    lower = dims | {"rank_gate": 1280, "rank_up": 1280, "rank_down": 1280}
    assert choose_mlp_kernel("SvdGatedMLP", lower, 1, "trn1").way == "fused"
    assert choose_mlp_kernel("GatedMLP", {"H": 2048, "I": 8192}, 2048, "trn1").dense is None  # dense already


@pytest.mark.parametrize(("architecture", "fused_op", "dense_op"), [("llama", "SvdGatedMLP", "GatedMLP"),
                                                                     ("gpt2", "SvdMLP", "MLP")])
def test_densifying_a_fused_mlp_keeps_its_function(export, tmp_path, architecture, fused_op, dense_op):
    """passes/mlp_densify.py: each SvdGatedMLP (SvdMLP) becomes a GatedMLP (MLP) on U·V, and onnxruntime gives the
    same output."""
    import numpy as np
    import onnx_ir as ir

    from onnx_nmm import ModelRunner
    from onnx_nmm.passes.mlp_densify import DensifyMlpPass

    fused = tmp_path / "fused.onnx"
    options = RewriteOptions(ranks=RankOptions(keep=0.5, align=32), fuse_mlp=True)
    rewrite(export(architecture, "dynamo"), options).save(fused)
    model = ir.load(fused)
    names = {node.name for node in model.graph if node.op_type == fused_op}
    densify = DensifyMlpPass(names)
    densify(model)
    assert sorted(densify.densified) == sorted(names) and len(names) == 2
    assert {node.op_type for node in model.graph if node.domain == "ai.onnx_nmm"} == {dense_op}
    ir.save(model, tmp_path / "dense.onnx")
    runner = ModelRunner(fused)
    feeds = {name: np.arange(12)[None] % 100 if "ids" in name else np.ones((1, 12), np.int64)
             for name in runner.input_names}
    expected, actual = runner(feeds)["logits"], ModelRunner(tmp_path / "dense.onnx")(feeds)["logits"]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))
