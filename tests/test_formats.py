"""The ONNX LLMs people deploy: a KV cache, a merged decoder. Fixtures made by optimum itself
(tools/format_fixtures.py), run by every command with no hand-made inputs."""

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnx_nmm
from onnx_nmm.cli import main
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes import svd_ops
from onnx_nmm.runtime.causal_lm import CausalLm

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
PAST, MERGED = FORMATS / "optimum-past" / "model.onnx", FORMATS / "optimum-merged" / "model.onnx"


def _kv_model(name: str, export) -> Path:
    """A KV-cache model: an optimum fixture, or onnx-nmm's own export with that exporter."""
    return FORMATS / name / "model.onnx" if name.startswith("optimum") else export("llama", name, cache=True)
VOCAB = 300


def _cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "ids.npz"
    np.savez(path, input_ids=np.random.default_rng(0).integers(0, VOCAB, (4, 32), dtype=np.int64))
    return path


def _prefill_then_step(path: Path, prefix: np.ndarray, step: np.ndarray) -> list[np.ndarray]:
    """Every output of a prefill, then of one decode step fed the prefill's cache, run by hand."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    model = CausalLm.of_source(ModelSource(path))
    names = [output.name for output in session.get_outputs()]
    first = dict(zip(names, session.run(None, model.feeds(prefix))))
    second = session.run(None, model.feeds(step, model.cache_after(first)))
    return list(first.values()) + second


@pytest.mark.parametrize("path", [PAST, MERGED], ids=["with-past", "merged"])
def test_the_inputs_are_read_off_the_graph(path):
    model = CausalLm.of_source(ModelSource(path))
    assert model.tokens.name == "input_ids" and model.mask.name == "attention_mask"
    assert model.positions.name == "position_ids" and not model.unknown
    assert [entry.present for entry in model.cache] == ["present.0.key", "present.0.value", "present.1.key",
                                                        "present.1.value"]
    feeds = model.feeds(np.zeros((2, 5), np.int64))
    assert feeds["past_key_values.0.key"].shape == (2, 2, 0, 16) and feeds["attention_mask"].shape == (2, 5)
    step = model.feeds(np.zeros((2, 1), np.int64), {name: np.zeros((2, 2, 5, 16), np.float32) for name in
                                                    (entry.input.name for entry in model.cache)})
    assert step["attention_mask"].shape == (2, 6) and step["position_ids"].tolist() == [[5], [5]]
    assert ("use_cache_branch" in feeds) == (path == MERGED) and step.get("use_cache_branch", [True])[0]


@pytest.mark.parametrize("name", ["optimum-past", "optimum-merged", "dynamo", "torchscript"])
def test_a_full_rank_rewrite_is_exact_on_the_prefill_and_on_a_decode_step(capsys, tmp_path, export, name):
    path, rewritten = _kv_model(name, export), tmp_path / "full.onnx"
    _cli(capsys, "rewrite", path, "-o", rewritten, "--rank", "full", "--targets", "all", "--lm-head", "--quiet")
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, 9), dtype=np.int64)
    for expected, actual in zip(_prefill_then_step(path, ids[:, :8], ids[:, 8:]),
                                _prefill_then_step(rewritten, ids[:, :8], ids[:, 8:])):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_a_merged_decoder_shares_each_targets_factors_between_its_branches(capsys, tmp_path, tokens):
    rewritten, report = tmp_path / "m.onnx", tmp_path / "r.json"
    _cli(capsys, "rewrite", MERGED, "-o", rewritten, "--calib", tokens, "--keep", "0.5", "--align", "16",
         "--method", "whiten", "--fuse-mlp", "--report", report, "--quiet")
    proto = onnx.load(rewritten)
    factors = [tensor.name for tensor in proto.graph.initializer if ".svd_" in tensor.name]
    data = json.loads(report.read_text())
    assert len(factors) == 2 * data["totals"]["layers_factorized"] == 12  # 6 MLP matrices, once each
    (branching,) = proto.graph.node
    for branch in branching.attribute:
        assert sum(node.op_type == svd_ops.SVD_GATED_MLP for node in branch.g.node) == 2
    assert data["fused_mlps"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert sum(layer["status"] != "skipped" for layer in data["layers"]) == 6  # one row per target


def test_a_merged_decoder_narrows_each_mlp_once_for_both_branches(capsys, tmp_path, tokens):
    narrowed, report = tmp_path / "n.onnx", tmp_path / "r.json"
    _cli(capsys, "rewrite", MERGED, "-o", narrowed, "--calib", tokens, "--keep", "0.5", "--align", "16",
         "--method", "nystrom", "--report", report, "--quiet")
    proto = onnx.load(narrowed)
    weights = [tensor.name for tensor in proto.graph.initializer if tensor.name.endswith(".narrowed")]
    assert len(weights) == 6  # 3 per MLP, read by both branches
    (branching,) = proto.graph.node
    for branch in branching.attribute:
        read = {name for node in branch.g.node for name in node.input}
        assert set(weights) <= read
    data = json.loads(report.read_text())
    assert [layer["width"] for layer in data["layers"] if layer["status"] == "narrowed"] == [64] * 6  # half of 128
    step = json.loads(_cli(capsys, "diff", MERGED, narrowed, "--past-len", "6", "--seq-len", "2", "--json"))
    assert step["outputs"][0]["cosine"] > 0.5


@pytest.mark.parametrize("name", ["optimum-past", "optimum-merged", "dynamo"])
def test_every_command_runs_on_a_cached_model_without_hand_made_inputs(capsys, tmp_path, tokens, export, name):
    path, whitened = _kv_model(name, export), tmp_path / "w.onnx"
    _cli(capsys, "rewrite", path, "-o", whitened, "--calib", tokens, "--keep", "0.5", "--align", "16", "--quiet")
    compared = json.loads(_cli(capsys, "diff", path, whitened, "--json"))
    assert [output["name"] for output in compared["outputs"]] == ["logits", "present.0.key", "present.0.value",
                                                                  "present.1.key", "present.1.value"]
    step = json.loads(_cli(capsys, "diff", path, whitened, "--past-len", "6", "--seq-len", "4", "--json"))
    (batch, _, past, _) = step["inputs"]["past_key_values.0.key"]
    assert (batch, past) == (1, 6) and step["outputs"][0]["cosine"] > 0.7  # keep 0.5 of random weights
    scored = json.loads(_cli(capsys, "eval", whitened, "--text", tokens, "--window", "16", "--json"))
    assert scored["tokens_scored"] == 120 and 1 < scored["perplexity"] < 10 * VOCAB
    for method in (["--method", "fisher"], ["--calib-mode", "sequential"], ["--max-ppl-increase", "0.2"]):
        _cli(capsys, "rewrite", path, "-o", tmp_path / "other.onnx", "--calib", tokens, "--align", "16", "--quiet",
             "--force", *method)
    _cli(capsys, "finetune", whitened, "--text", tokens, "--steps", "2", "-o", tmp_path / "tuned.onnx", "--quiet")
    emulated = json.loads(_cli(capsys, "diff", whitened, whitened, "--backend", "emulator", "--json"))
    assert emulated["outputs"][0]["top1_agreement"] > 0.8  # the kernels run in bf16


def _quantized(kind: str, path: Path) -> Path:
    """The optimum fixture quantized the way onnxruntime's own tools quantize LLMs."""
    model = onnx.load(PAST)
    if kind.startswith("nbits"):
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        bits, symmetric = {"nbits-4": (4, False), "nbits-4-symmetric": (4, True), "nbits-8": (8, False)}[kind]
        quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=symmetric, bits=bits)
        quantizer.process()
        onnx.save(quantizer.model.model, path)
    elif kind == "dynamic-int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(PAST, path, weight_type=QuantType.QInt8)
    else:  # QDQ, weights per channel
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

        feeds = [CausalLm.of_source(ModelSource(PAST)).feeds(np.full((1, 8), i, np.int64)) for i in range(4)]

        class Windows(CalibrationDataReader):
            def get_next(self):
                return feeds.pop() if feeds else None

        quantize_static(PAST, path, Windows(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                        per_channel=True, weight_type=QuantType.QInt8)
    return path


QUANTIZED = ["nbits-4", "nbits-4-symmetric", "nbits-8", "dynamic-int8", "qdq"]
# What onnxruntime computes differently from a float product of the dequantized weight: the dynamic and QDQ
# models quantize their activations too, so float factors of the same weight are close, not equal.
EXACT = {"nbits-4": 1e-4, "nbits-4-symmetric": 1e-4, "nbits-8": 1e-4, "dynamic-int8": 0.05, "qdq": 0.05}


@pytest.mark.parametrize("kind", QUANTIZED)
def test_a_quantized_model_is_read_and_rewritten_in_its_own_format(capsys, tmp_path, tokens, kind):
    quantized = _quantized(kind, tmp_path / "quantized.onnx")
    inspected = json.loads(_cli(capsys, "inspect", quantized, "--json"))
    assert inspected["totals"]["layers"] == 15 and not inspected["unread"]
    assert all(layer["storage"].startswith(("MatMulNBits", "MatMulInteger", "DequantizeLinear"))
               for layer in inspected["layers"] if layer["group"] == "mlp")
    full = tmp_path / "full.onnx"  # float factors of the dequantized weight: the quantized model, computed in float
    _cli(capsys, "rewrite", quantized, "-o", full, "--rank", "full", "--factor-dtype", "float32", "--quiet")
    logits = json.loads(_cli(capsys, "diff", quantized, full, "--json"))["outputs"][0]
    assert logits["max_rel"] < EXACT[kind]

    rewritten, report = tmp_path / "rewritten.onnx", tmp_path / "r.json"
    _cli(capsys, "rewrite", quantized, "-o", rewritten, "--keep", "0.5", "--align", "16", "--calib", tokens,
         "--method", "whiten", "--report", report, "--quiet")
    data = json.loads(report.read_text())
    assert data["totals"]["weight_bytes_after"] < data["totals"]["weight_bytes_before"]
    assert rewritten.stat().st_size < quantized.stat().st_size  # quantized factors: smaller than the input
    for layer in (layer for layer in data["layers"] if layer["status"] == "factorized"):
        assert layer["bytes_after"] < layer["bytes_before"] and layer["stored_error"] >= layer["relative_error"] - 1e-3
    step = json.loads(_cli(capsys, "diff", quantized, rewritten, "--past-len", "6", "--seq-len", "4", "--json"))
    assert step["outputs"][0]["cosine"] > 0.9
    if kind.startswith("nbits"):
        ops = [node.op_type for node in onnx.load(rewritten).graph.node]
        assert ops.count("MatMulNBits") == 15 + 6  # six MLP matrices became two each


def test_a_quantized_form_onnx_nmm_does_not_read_is_named(capsys, tmp_path):
    from onnx import TensorProto, helper

    node = helper.make_node("DynamicQuantizeMatMul", ["X", "Wq", "s"], ["Y"], domain="com.microsoft",
                            name="/model/layers.0/mlp/down_proj/MatMul")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4, 16])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4, 8])],
                              [helper.make_tensor("Wq", TensorProto.INT8, [16, 8], [1] * 128),
                               helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])])
    path = tmp_path / "q.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                      helper.make_opsetid("com.microsoft", 1)]), path)
    inspected = json.loads(_cli(capsys, "inspect", path, "--json"))
    assert inspected["unread"][0]["op"] == "DynamicQuantizeMatMul" and inspected["totals"]["layers"] == 0
    code = main(["rewrite", str(path), "-o", str(tmp_path / "o.onnx")])
    err = capsys.readouterr().err
    assert code == 2 and "quantized as DynamicQuantizeMatMul" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("kind", QUANTIZED)
def test_a_quantized_model_lowers_to_pytorch_so_fisher_and_budgets_run_on_it(capsys, tmp_path, tokens, kind):
    quantized = _quantized(kind, tmp_path / "quantized.onnx")
    lowered = json.loads(_cli(capsys, "diff", quantized, quantized, "--backend", "torch", "--json"))["outputs"][0]
    assert lowered["max_rel"] < EXACT[kind]  # onnxruntime runs QDQ as fused integer kernels, the lowering as written
    for budget in (["--method", "fisher", "--keep", "0.5"], ["--max-ppl-increase", "0.2"]):
        _cli(capsys, "rewrite", quantized, "-o", tmp_path / "o.onnx", "--calib", tokens, "--align", "16", "--quiet",
             "--force", *budget)


def _generate(folder: Path, prompt: str = "In the beginning", length: int = 24) -> list[int]:
    """Greedy tokens from onnxruntime-genai's own generator, reading the folder's genai_config.json."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=length)
    generator = og.Generator(model, params)
    generator.append_tokens(og.Tokenizer(model).encode(prompt))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(token) for token in generator.get_sequence(0)]


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_an_onnxruntime_genai_model_rewrites_into_a_folder_its_generator_runs(capsys, tmp_path, tokens, precision):
    source = FORMATS / f"genai-{precision}" / "model.onnx"
    with pytest.warns(UserWarning, match="the input already fails onnx.checker"):  # the builder's own opset use
        _cli(capsys, "rewrite", source, "-o", tmp_path / "full" / "model.onnx", "--rank", "full", "--targets", "all",
             "--lm-head", "--factor-dtype", "float32", "--quiet")
        _cli(capsys, "rewrite", source, "-o", tmp_path / "whitened" / "rewritten.onnx", "--calib", tokens, "--keep",
             "0.5", "--align", "16", "--quiet")
    config = json.loads((tmp_path / "whitened" / "genai_config.json").read_text())
    assert (config["model"]["decoder"]["filename"] == "rewritten.onnx"
            and (tmp_path / "whitened" / "tokenizer.json").exists())
    assert not (source.parent / "rewritten.onnx").exists()  # the input's folder is left alone
    original = _generate(source.parent)
    if precision == "fp32":  # float factors of a float model at full rank: the same greedy text
        assert _generate(tmp_path / "full") == original
    compressed = _generate(tmp_path / "whitened")
    assert len(compressed) == len(original) and compressed[:5] == original[:5]  # the prompt, then its own tokens
    step = json.loads(_cli(capsys, "diff", source, tmp_path / "whitened" / "rewritten.onnx", "--past-len", "6",
                           "--seq-len", "2", "--json"))
    assert step["outputs"][0]["cosine"] > 0.9


def test_a_rewrite_beside_a_genai_model_leaves_its_config_and_says_so(capsys, tmp_path):
    folder = tmp_path / "genai"
    shutil.copytree(FORMATS / "genai-fp32", folder)
    before = (folder / "genai_config.json").read_text()
    with pytest.warns(UserWarning) as caught:
        _cli(capsys, "rewrite", folder / "model.onnx", "-o", folder / "small.onnx", "--keep", "0.5", "--quiet")
    assert any("still names model.onnx" in str(warning.message) for warning in caught)
    assert (folder / "genai_config.json").read_text() == before and (folder / "small.onnx").exists()


def test_what_needs_the_lowering_runs_on_a_genai_model(capsys, tmp_path, tokens):
    """GroupQueryAttention and the fused layer norms are lowered: fisher and the budgets run on the builder's
    graph, and the output still runs in onnxruntime."""
    source = FORMATS / "genai-fp32" / "model.onnx"
    for name, budget in (("fisher", ["--method", "fisher", "--keep", "0.5"]),
                         ("budget", ["--max-ppl-increase", "0.2"])):
        out = tmp_path / f"{name}.onnx"
        code = main(["rewrite", str(source), "-o", str(out), "--calib", str(tokens), "--calib-samples", "2",
                     "--quiet", *budget])
        assert code == 0, capsys.readouterr().err
        ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])


def test_compile_takes_a_merged_decoders_first_step_and_says_what_quantized_factors_miss(capsys, tmp_path, tokens):
    out = _cli(capsys, "compile", MERGED, "--dry-run", "--seq-len", "16", "-o", tmp_path / "merged.neuron")
    assert "first-step branch" in out and json.loads((tmp_path / "merged.neuron" / "manifest.json").read_text())[
        "first_step_only"]
    quantized, rewritten = _quantized("nbits-4", tmp_path / "q.onnx"), tmp_path / "r.onnx"
    _cli(capsys, "rewrite", quantized, "-o", rewritten, "--keep", "0.5", "--align", "16", "--quiet")
    assert "nothing for the NKI kernels" in " ".join(
        _cli(capsys, "compile", rewritten, "--dry-run", "--seq-len", "16", "-o", tmp_path / "q.neuron").split())
    code = main(["finetune", str(rewritten), "--text", str(tokens), "--steps", "1", "-o", str(tmp_path / "t.onnx")])
    assert code == 2 and "--factor-dtype float32" in capsys.readouterr().err


def test_initializers_also_listed_as_graph_inputs_are_still_weights(capsys, tmp_path, export):
    """What the TorchScript exporter writes with keep_initializers_as_inputs=True, as older exports did."""
    source = export("llama", "torchscript")
    proto = onnx.load(source)
    proto.graph.input.extend(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims)
                             for tensor in proto.graph.initializer)
    listed, rewritten = tmp_path / "listed.onnx", tmp_path / "full.onnx"
    onnx.save(proto, listed)
    layers = json.loads(_cli(capsys, "inspect", listed, "--json"))["layers"]
    assert layers == json.loads(_cli(capsys, "inspect", source, "--json"))["layers"] and len(layers) == 15
    _cli(capsys, "rewrite", listed, "-o", rewritten, "--rank", "full", "--targets", "all", "--quiet")
    assert json.loads(_cli(capsys, "diff", listed, rewritten, "--atol", "1e-4", "--json"))["passed"]


LLAMA_ROLES = {"q": 2, "k": 2, "v": 2, "o": 2, "gate": 2, "up": 2, "down": 2, "lm_head": 1}
GENAI_ROLES = {"qkv": 2, "o": 2, "gate": 2, "up": 2, "down": 2, "lm_head": 1}  # the builder fuses q, k and v


@pytest.mark.parametrize("name, roles", [("optimum-past", LLAMA_ROLES), ("optimum-merged", LLAMA_ROLES),
                                         ("dynamo", LLAMA_ROLES), ("torchscript", LLAMA_ROLES),
                                         ("genai-fp32", GENAI_ROLES), ("genai-int4", GENAI_ROLES)])
def test_inspect_finds_every_linear_layer_of_each_format(capsys, export, name, roles):
    path = FORMATS / name / "model.onnx" if name.startswith(("optimum", "genai")) else _kv_model(name, export)
    inspected = json.loads(_cli(capsys, "inspect", path, "--json"))
    found: dict[str, int] = {}
    for layer in inspected["layers"]:
        found[layer["role"]] = found.get(layer["role"], 0) + 1
    assert found == roles and not inspected["unread"]
    if name == "optimum-merged":  # each weight read in both branches, listed once
        assert all(layer["sites"] == 2 for layer in inspected["layers"] if layer["role"] != "lm_head")


def test_a_full_rank_rewrite_of_an_int8_model_adds_little_to_its_own_quantization_error(tmp_path):
    """MatMulInteger factors are int8 per column, and H is quantized again on its way to V: against the float
    model, the full-rank rewrite's error stays at the level of the input's own quantization."""
    quantized = _quantized("dynamic-int8", tmp_path / "quantized.onnx")
    rewritten = tmp_path / "full.onnx"
    onnx_nmm.rewrite(quantized, onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(rank="full"),
                                                        selection=onnx_nmm.Selection(targets="all"))).save(rewritten)
    options = onnx_nmm.DiffOptions(seq_len=16)
    own, after = (onnx_nmm.diff(PAST, model, options).outputs[0] for model in (quantized, rewritten))
    rms_ratio = np.sqrt((1 - after.cosine) / (1 - own.cosine))  # ‖a−b‖/‖a‖ ≈ √(2(1−cos)) when norms agree
    assert 1 - own.cosine > 1e-5 and rms_ratio < 1.5, rms_ratio
