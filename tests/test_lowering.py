"""Lowering rewritten graphs to PyTorch, running them on the kernels, and compiling them for Trainium."""

import json

import graphs
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from rewriting import assert_logits_close

from onnx_nmm import ModelError
from onnx_nmm.cli import main
from onnx_nmm.lowering import lower
from onnx_nmm.passes import svd_ops
from onnx_nmm.runtime.backend_runner import ModelRunner
from onnx_nmm.trainium import neuron

pytestmark = pytest.mark.xdist_group("lowering")


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _rewritten(capsys, source, folder, fuse=True, keep="0.5"):
    out = folder / "rewritten.onnx"
    code, _, err = _cli(capsys, "rewrite", source, "-o", out, "--keep", keep, "--align", "32", "--quiet",
                        *(["--fuse-mlp"] if fuse else []))
    assert code == 0, err
    return out


def _feeds(batch=2, seq_len=9, seed=0):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 1000, (batch, seq_len)), "attention_mask": np.ones((batch, seq_len), np.int64)}


@pytest.mark.parametrize("exporter", ["dynamo", "dynamo-noopt", "torchscript"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gpt2"])
def test_lowered_module_matches_onnxruntime(capsys, export, tmp_path, architecture, exporter):
    rewritten = _rewritten(capsys, export(architecture, exporter), tmp_path)
    ops = {node.op_type for node in onnx.load(rewritten).graph.node if node.domain == svd_ops.DOMAIN}
    # TorchScript's GPT-2 reads the shape of its activation outside the MLP, so that one stays unfused
    fused = {svd_ops.SVD_MATMUL} if exporter == "torchscript" else {svd_ops.SVD_MLP}
    assert ops == (fused if architecture == "gpt2" else {svd_ops.SVD_GATED_MLP})
    reference, lowered = ModelRunner(rewritten), ModelRunner(rewritten, "torch")
    for batch, seq_len in [(2, 9), (1, 1)]:
        feeds = _feeds(batch, seq_len)
        assert_logits_close(reference(feeds)["logits"], lowered(feeds)["logits"])


@pytest.mark.parametrize(("architecture", "exporter", "op"), [
    ("llama", "dynamo", svd_ops.SVD_GATED_MLP), ("qwen3", "dynamo", svd_ops.SVD_GATED_MLP),
    ("mistral", "dynamo", svd_ops.SVD_GATED_MLP),
    ("phi3", "dynamo", svd_ops.SVD_GATED_MLP),  # gate_up split by a Split node
    ("phi3", "torchscript", svd_ops.SVD_GATED_MLP),  # ... by Slices whose bounds come from the output's Shape
    ("gpt2", "dynamo", svd_ops.SVD_MLP), ("phi", "torchscript", svd_ops.SVD_MLP)])
def test_fusing_mlps_changes_no_output(capsys, export, tmp_path, architecture, exporter, op):
    source = export(architecture, exporter)
    unfused = _rewritten(capsys, source, tmp_path / "a", fuse=False)
    fused = _rewritten(capsys, source, tmp_path / "b", fuse=True)
    model = onnx.load(fused)
    nodes = [node for node in model.graph.node if node.domain == svd_ops.DOMAIN]
    assert [node.op_type for node in nodes] == [op] * 2
    assert nodes[0].name.endswith(("layers.0.mlp", "h.0.mlp"))
    read = {name for node in model.graph.node for name in node.input}
    assert {tensor.name for tensor in model.graph.initializer} <= read  # a gate_up's V went with its two halves
    feeds = _feeds()
    np.testing.assert_allclose(ModelRunner(fused)(feeds)["logits"], ModelRunner(unfused)(feeds)["logits"], atol=1e-6)


def test_emulator_backend_runs_the_fused_kernels_in_bf16(capsys, export, tmp_path):
    rewritten = _rewritten(capsys, export("llama", "dynamo"), tmp_path)
    feeds = _feeds(batch=1, seq_len=12)
    expected = ModelRunner(rewritten)(feeds)["logits"]
    emulated = ModelRunner(rewritten, "emulator")
    actual = emulated(feeds)["logits"]
    assert [call.kernel for call in emulated.kernel_calls] == ["fused_svd_mlp"] * 2
    assert emulated.kernel_calls[0].shapes[0] == (12, 256)  # tokens × hidden, leading dims flattened
    scale = np.abs(expected).max()
    assert np.abs(actual - expected).max() < 0.05 * scale  # bf16 activations and factors, fp32 accumulation
    assert not np.allclose(actual, expected, atol=1e-6)  # it really ran in bf16
    np.testing.assert_array_equal(actual[0, -1].argmax(), expected[0, -1].argmax())
    assert np.mean(actual.argmax(-1) == expected.argmax(-1)) >= 0.9


def test_run_and_diff_on_a_backend(capsys, export, tmp_path):
    source = export("gpt2", "dynamo")
    rewritten = _rewritten(capsys, source, tmp_path)
    code, out, _ = _cli(capsys, "run", rewritten, "--backend", "torch", "--json", "--seq-len", "5")
    assert code == 0 and json.loads(out)["outputs"]["logits"]["shape"] == [1, 5, 1000]
    code, out, _ = _cli(capsys, "diff", rewritten, rewritten, "--backend", "torch", "--atol", "1e-4", "--json")
    assert code == 0 and json.loads(out)["outputs"][0]["max_abs"] < 1e-4
    code, out, _ = _cli(capsys, "diff", source, rewritten, "--backend", "emulator", "--json", "--seq-len", "6")
    result = json.loads(out)
    assert code == 0 and result["backend"] == "emulator" and 0.5 < result["outputs"][0]["cosine"] < 1


def test_compile_dry_run_writes_a_manifest(capsys, export, tmp_path):
    rewritten = _rewritten(capsys, export("llama", "dynamo"), tmp_path, fuse=False)
    target = tmp_path / "compiled"
    code, out, err = _cli(capsys, "compile", rewritten, "--target", "trn1", "--batch", "2", "--seq-len", "8",
                          "-o", target, "--dry-run")
    assert code == 0, err
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["inputs"][0] == {"name": "input_ids", "shape": [2, 8], "dtype": "int64"}
    assert manifest["lowering_check"]["max_abs"] < 1e-3 and len(manifest["fused_mlps"]) == 2
    (first, second) = manifest["kernels"]
    assert first["kernel"] == "fused_svd_mlp" and first["tokens"] == 16 and first["dims"]["H"] == 256
    assert 0 < first["modelled_us"] < first["modelled_dense_us"]  # modelled: rank 128 of 256×512 matrices
    assert "modelled on trn1" in out and sorted(p.name for p in target.iterdir()) == ["manifest.json"]


def test_compile_a_model_with_external_data(capsys, export, tmp_path):
    rewritten = _rewritten(capsys, export("llama", "dynamo", external_data=True), tmp_path)
    assert (tmp_path / "rewritten.onnx.data").exists()
    code, _, err = _cli(capsys, "compile", rewritten, "--seq-len", "4", "-o", tmp_path / "compiled", "--dry-run")
    assert code == 0, err
    assert json.loads((tmp_path / "compiled" / "manifest.json").read_text())["lowering_check"]["max_abs"] < 1e-3


def test_compile_without_the_neuron_sdk_stops_before_the_trace(capsys, export, tmp_path):
    if not neuron.missing_neuron_packages():
        pytest.skip("the Neuron SDK is installed here: compile traces for real")
    rewritten = _rewritten(capsys, export("llama", "dynamo"), tmp_path)
    code, _, err = _cli(capsys, "compile", rewritten, "-o", tmp_path / "compiled")
    assert code == 3  # the README's exit code for a missing Neuron SDK
    assert "torch-neuronx" in err and neuron.NEURON_INDEX in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "compiled").exists()


def test_compile_refuses_to_replace_a_folder(capsys, export, tmp_path):
    rewritten = _rewritten(capsys, export("llama", "dynamo"), tmp_path)
    (tmp_path / "compiled").mkdir()
    (tmp_path / "compiled" / "keep.txt").write_text("mine")
    code, _, err = _cli(capsys, "compile", rewritten, "-o", tmp_path / "compiled", "--dry-run")
    assert code == 2 and "not empty" in err and (tmp_path / "compiled" / "keep.txt").read_text() == "mine"


def test_compile_force_replaces_only_a_folder_compile_wrote(capsys, export, tmp_path):
    """--force replaces a folder compile wrote; a file compile did not write is never deleted, --force or not."""
    rewritten, folder = _rewritten(capsys, export("llama", "dynamo"), tmp_path), tmp_path / "compiled"
    folder.mkdir()
    (folder / "important.txt").write_text("mine")
    code, _, err = _cli(capsys, "compile", rewritten, "--trace-tokens", "4", "-o", folder, "--dry-run", "--force")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "compile did not write important.txt" in err and "--force replaces only a folder compile wrote" in err
    assert (folder / "important.txt").read_text() == "mine"
    (folder / "important.txt").unlink()
    assert _cli(capsys, "compile", rewritten, "--trace-tokens", "4", "-o", folder, "--dry-run")[0] == 0
    code, _, err = _cli(capsys, "compile", rewritten, "--trace-tokens", "8", "-o", folder, "--dry-run")
    assert code == 2 and "set --force to replace it" in err
    assert _cli(capsys, "compile", rewritten, "--trace-tokens", "8", "-o", folder, "--dry-run", "--force")[0] == 0
    assert json.loads((folder / "manifest.json").read_text())["seq_len"] == 8
    (folder / "important.txt").write_text("mine")
    code, _, err = _cli(capsys, "compile", rewritten, "--trace-tokens", "4", "-o", folder, "--dry-run", "--force")
    assert code == 2 and (folder / "important.txt").read_text() == "mine"
    assert json.loads((folder / "manifest.json").read_text())["seq_len"] == 8


def test_an_op_the_lowering_does_not_cover_is_named(tmp_path):
    nodes = [helper.make_node("Frobnicate", ["X"], ["Y"], domain="com.example", name="the_strange_node")]
    model = graphs.model(nodes, {})
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(ModelError, match=r"node 'the_strange_node' \(com\.example::Frobnicate, opset 1\)"):
        lower(model)


def test_a_shape_the_target_cannot_take_names_the_limit():
    """A rank too large for any strip to fit SBUF: compile names the node and the limit."""
    def factor(name, dims):  # shapes only: the kernel planner never reads the numbers
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT)
        tensor.dims.extend(dims)
        return tensor

    node = helper.make_node(svd_ops.SVD_MATMUL, ["X", "U", "V"], ["Y"], domain=svd_ops.DOMAIN, name="huge", rank=262144)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 128])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 128])],
                              [factor("U", [128, 262144]), factor("V", [262144, 128])])
    with pytest.raises(ModelError, match=r"node 'huge' cannot run on trn1 at 512 tokens: .*fits SBUF"):
        neuron.plan_kernels(helper.make_model(graph), tokens=512, target="trn1", model_costs=False)


def test_lowering_keeps_the_module_on_cpu_in_float32(capsys, export, tmp_path):
    module = lower(_rewritten(capsys, export("qwen3", "torchscript"), tmp_path))
    buffers = list(module.buffers())
    assert buffers and all(b.device.type == "cpu" for b in buffers)
    assert {b.dtype for b in buffers if b.is_floating_point()} == {torch.float32}


def _narrowed(capsys, source, folder, fuse=False):
    out = folder / "narrowed.onnx"
    code, _, err = _cli(capsys, "rewrite", source, "-o", out, "--method", "nystrom", "--calib", "random",
                        "--calib-samples", "4", "--seq-len", "16", "--keep", "0.5", "--align", "32", "--quiet",
                        *(["--fuse-mlp"] if fuse else []))
    assert code == 0, err
    return out


@pytest.mark.parametrize(("architecture", "exporter", "op"), [
    ("llama", "dynamo", svd_ops.GATED_MLP), ("gemma", "torchscript", svd_ops.GATED_MLP),
    ("gpt2", "dynamo", svd_ops.MLP), ("phi", "dynamo", svd_ops.MLP)])
def test_a_narrowed_mlp_fuses_into_one_dense_mlp_op_that_changes_no_output(capsys, export, tmp_path, architecture,
                                                                          exporter, op):
    source = export(architecture, exporter)
    unfused = _narrowed(capsys, source, tmp_path / "a")
    fused = _narrowed(capsys, source, tmp_path / "b", fuse=True)
    nodes = [node for node in onnx.load(fused).graph.node if node.domain == svd_ops.DOMAIN]
    assert [node.op_type for node in nodes] == [op] * 2
    feeds = _feeds()
    for runner in (ModelRunner(fused), ModelRunner(fused, "torch")):
        np.testing.assert_allclose(runner(feeds)["logits"], ModelRunner(unfused)(feeds)["logits"], atol=2e-5)


def test_compile_runs_a_narrowed_mlp_on_the_dense_mlp_kernel(capsys, export, tmp_path):
    """nystrom's MLPs are dense and narrower: compile fuses each into one GatedMLP, which the emulator runs on the
    dense_gated_mlp kernel and the manifest prices against its three projections launched one by one."""
    narrowed = _narrowed(capsys, export("llama", "dynamo"), tmp_path)
    target = tmp_path / "compiled"
    code, out, err = _cli(capsys, "compile", narrowed, "--target", "trn1", "--seq-len", "8", "-o", target, "--dry-run")
    assert code == 0, err
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["fused_mlps"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    kernels = manifest["kernels"]
    assert [k["kernel"] for k in kernels] == ["dense_gated_mlp"] * 2 and kernels[0]["dims"] == {"H": 256, "I": 256}
    # a narrowed MLP is dense: its best dense path is its own kernel, fused where faster than three launches
    assert 0 < kernels[0]["modelled_us"] == kernels[0]["modelled_dense_us"]
    fused = _narrowed(capsys, export("llama", "dynamo"), tmp_path / "fused", fuse=True)
    feeds = _feeds(batch=1, seq_len=12)
    emulated = ModelRunner(fused, "emulator")
    actual, expected = emulated(feeds)["logits"], ModelRunner(fused)(feeds)["logits"]
    assert [call.kernel for call in emulated.kernel_calls] == ["dense_gated_mlp"] * 2
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()  # bf16 weights and activations
