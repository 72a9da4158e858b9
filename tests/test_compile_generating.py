"""`compile --max-context`: a folder of static-shape graphs (a prefill per bucket, a decode step over a fixed
cache) that `generate DIR` runs with the tokens of `generate MODEL` on onnxruntime."""

import json
import shlex
import shutil
from pathlib import Path

import onnx
import pytest
from exported_models import exported_model

import onnx_nmm
from onnx_nmm import CompileOptions, DataError, OptionError, RankOptions, RewriteOptions, compile, rewrite
from onnx_nmm.cli import main
from onnx_nmm.model_source import ModelSource
from onnx_nmm.runtime import compiled_folder
from onnx_nmm.trainium import neuron

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
TOKENIZER = FORMATS / "genai-fp32"  # a 300-token BPE, below every test model's vocabulary
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory) -> Path:
    """A KV-cache model rewritten at keep 0.9: SVD custom ops and fused MLPs to choose kernels for."""
    path = tmp_path_factory.mktemp("rewritten") / "model.onnx"
    options = RewriteOptions(ranks=RankOptions(keep=0.9, align=32))
    rewrite(exported_model("llama", "dynamo", cache=True), options).save(path)
    return path


@pytest.fixture(scope="module")
def compiled(rewritten, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("compiled") / "model.neuron"
    assert main(["compile", str(rewritten), "--target", "trn1", "--max-context", "96", "--buckets", "16,64",
                 "--dry-run", "-o", str(folder)]) == 0
    return folder


def _greedy(**changes):
    return onnx_nmm.GenerateOptions(**{"max_new_tokens": 12, "chat": False, **changes})


def test_the_manifest_lists_the_buckets_the_decode_step_and_the_cache_it_aliases(compiled):
    manifest = json.loads((compiled / "manifest.json").read_text())
    assert manifest["buckets"] == [16, 64] and manifest["max_context"] == 96 and manifest["target"] == "trn1"
    assert [(graph["name"], graph["kind"], graph["tokens"]) for graph in manifest["graphs"]] == [
        ("prefill_16", "prefill", 16), ("prefill_64", "prefill", 64), ("decode", "decode", 1)]
    tensors = manifest["cache"]["tensors"]
    assert len(tensors) == 4 and all(tensor["shape"] == [1, 2, 96, 64] for tensor in tensors)
    for graph in manifest["graphs"]:
        proto = onnx.load(compiled / graph["file"], load_external_data=False)
        inputs, outputs = {value.name for value in proto.graph.input}, {value.name for value in proto.graph.output}
        assert all(tensor["input"] in inputs and tensor["aliases_output"] in outputs for tensor in tensors)
        assert graph["lowering_check"]["max_abs"] < 1e-3
        assert graph["kernels"] and graph["modelled_us"] > 0  # the custom ops, priced at the graph's own shape
    assert not manifest["traced"] and manifest["dry_run"]


def test_each_graph_chooses_its_mlp_kernels_at_its_own_shape(compiled):
    """The fastest of the fused kernel, the projections one by one and (a factorized MLP) the dense MLP kernel on
    its factors multiplied back, at that graph's tokens: the choice compares the times, and takes the least."""
    manifest = json.loads((compiled / "manifest.json").read_text())
    for graph in manifest["graphs"]:
        assert graph["mlp_kernels"], graph["name"]
        for choice in graph["mlp_kernels"]:
            times = {"fused": choice["fused_us"], "separate": choice["separate_us"],
                     "dense": choice.get("dense_us", float("inf"))}
            way = "dense" if choice["densified"] else "fused" if choice["fused"] else "separate"
            assert times[way] == min(times.values()), (graph["name"], choice)
        assert len(graph["fused_mlps"]) == sum(choice["fused"] for choice in graph["mlp_kernels"])


def test_the_graphs_share_one_copy_of_the_weights(compiled, rewritten):
    weights = (compiled / compiled_folder.WEIGHTS).stat().st_size
    model_bytes = sum(tensor.ByteSize() for tensor in onnx.load(rewritten).graph.initializer)
    assert weights < 1.1 * model_bytes  # three graphs, each weight written once
    for path in compiled.glob("*.onnx"):  # the graphs hold no weight of their own beyond small constants
        inside = onnx.load(path, load_external_data=False).graph.initializer
        assert sum(len(tensor.raw_data) for tensor in inside) < 0.01 * weights


@pytest.mark.parametrize("backend", ["torch", "ort"])
def test_generate_on_the_compiled_folder_gives_the_tokens_of_the_model_on_onnxruntime(compiled, rewritten, backend):
    expected = onnx_nmm.generate(rewritten, PROMPT, TOKENIZER, _greedy())
    result = onnx_nmm.generate(compiled, PROMPT, TOKENIZER, _greedy(backend=backend))
    assert result.tokens == expected.tokens and result.text == expected.text


def test_generate_dir_from_the_command_line_prints_the_models_text(compiled, rewritten, capsys):
    assert main(["generate", str(rewritten), "--prompt", PROMPT, "--tokenizer", str(TOKENIZER), "--no-chat",
                 "--max-new-tokens", "12"]) == 0
    expected = capsys.readouterr().out
    assert main(["generate", str(compiled), "--prompt", PROMPT, "--tokenizer", str(TOKENIZER), "--no-chat",
                 "--max-new-tokens", "12", "--backend", "torch"]) == 0
    assert capsys.readouterr().out == expected


def test_the_neuron_backend_runs_the_trace_the_manifest_names_for_each_graph(compiled, rewritten, tmp_path):
    """On a device each graph's torch_neuronx trace runs; here a torch.jit trace of the same lowered program
    (what torch_neuronx.trace makes is one, the NEFF inside), written where compile writes the traces, the decode
    step as compile traces it: a CacheState holding the cache, filled from the prefill's and, with no aliasing on
    the CPU, from each step's present outputs. It also checks that every static-shape graph traces."""
    import torch

    from onnx_nmm.lowering import TorchMath, call_lowered, lower
    from onnx_nmm.trainium.cache_state import CacheState

    folder = tmp_path / "traced"
    shutil.copytree(compiled, folder)
    with pytest.raises(OptionError, match="was not traced"):
        onnx_nmm.generate(folder, PROMPT, TOKENIZER, _greedy(backend="neuron"))
    manifest = json.loads((folder / "manifest.json").read_text())
    graphs = compiled_folder.read(folder)[1]
    for graph in manifest["graphs"]:
        feeds = graphs.example_feeds(graph["name"])
        names = [value.name for value in onnx.load(folder / graph["file"], load_external_data=False).graph.input]
        module = lower(folder / graph["file"], TorchMath())
        if graph["name"] == "decode":
            module = CacheState(module, names, graphs.layout, graphs.cache_shapes)
            names = module.step_inputs
            graph["cache_state"] = {"step_inputs": names, "aliased": False}
        example = tuple(torch.from_numpy(feeds[name]) for name in names)
        traced = (torch.jit.trace(module, example, check_trace=False) if graph["name"] == "decode" else
                  torch.jit.trace(lambda *inputs, module=module: call_lowered(module, *inputs), example,
                                  check_trace=False))
        (folder / graph["name"]).mkdir()
        traced.save(str(folder / graph["name"] / "model.pt"))
        graph["torchscript"] = f"{graph['name']}/model.pt"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert "past_key_values.0.key" not in manifest["graphs"][-1]["cache_state"]["step_inputs"]
    expected = onnx_nmm.generate(rewritten, PROMPT, TOKENIZER, _greedy())
    assert onnx_nmm.generate(folder, PROMPT, TOKENIZER, _greedy(backend="neuron")).tokens == expected.tokens


def test_compile_traces_the_decode_step_with_its_cache_aliased_on_the_device(rewritten, tmp_path, monkeypatch):
    """With the Neuron SDK, compile hands torch_neuronx.trace the decode step as a CacheState: called with the
    step's other inputs only, each cache parameter aliased to the present output that updates it. The SDK is
    stood in for here: the call is recorded, and a scripted stand-in saved where the trace goes."""
    import torch

    calls = {}

    def trace_for_neuron(module, example_inputs, workdir, target, separate_weights=False, input_output_aliases=None):
        calls[workdir.parent.name] = (module, example_inputs, input_output_aliases)
        return torch.jit.script(torch.nn.Identity())

    monkeypatch.setattr(neuron, "missing_neuron_packages", lambda tp=1: [])
    monkeypatch.setattr(neuron, "trace_for_neuron", trace_for_neuron)
    folder = tmp_path / "model.neuron"
    compile(rewritten, folder, CompileOptions(target="trn1", max_context=32, buckets=(16,)))
    manifest = json.loads((folder / "manifest.json").read_text())
    decode = next(graph for graph in manifest["graphs"] if graph["name"] == "decode")
    assert decode["cache_state"] == {"step_inputs": ["input_ids", "attention_mask", "position_ids", "cache_position"],
                                     "aliased": True}
    state, example, aliases = calls["decode"]
    outputs = [value.name for value in onnx.load(folder / "decode.onnx", load_external_data=False).graph.output]
    assert len(example) == 4 and {outputs[index] for index in aliases.values()} == {
        f"present.{layer}.{kind}" for layer in range(2) for kind in ("key", "value")}
    assert set(map(id, aliases)) == set(map(id, state.cache))  # the aliased tensors are the trace's own state
    assert calls["prefill_16"][2] is None and len(calls["prefill_16"][1]) == 7  # the prefill: the cache as inputs


def test_a_prompt_or_a_generation_that_does_not_fit_is_a_one_line_error(compiled, capsys):
    long_prompt = " ".join([PROMPT] * 8)
    with pytest.raises(DataError, match="longer than the largest prefill bucket, 64"):
        onnx_nmm.generate(compiled, long_prompt, TOKENIZER, _greedy())
    with pytest.raises(DataError, match="do not fit the cache of 96 positions"):
        onnx_nmm.generate(compiled, PROMPT, TOKENIZER, _greedy(max_new_tokens=60))
    assert main(["generate", str(compiled), "--prompt", long_prompt, "--tokenizer", str(TOKENIZER),
                 "--no-chat"]) != 0
    error = capsys.readouterr().err.strip()
    assert "--max-context" in error and len(error.splitlines()) == 1


def test_without_the_neuron_sdk_compile_exits_3_before_any_work_and_writes_nothing(rewritten, tmp_path, capsys,
                                                                                     monkeypatch):
    """Not a result: said at once (the model is never loaded), and no folder is left; --dry-run is the way to
    the graphs without the SDK."""
    if not neuron.missing_neuron_packages():
        pytest.skip("the Neuron SDK is installed here: compile traces for real")

    def never(model):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ModelSource, "of", never)
    assert main(["compile", str(rewritten), "--max-context", "32", "--buckets", "16", "-o",
                 str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err.strip()
    assert "neuronx-cc" in err and "nothing was written" in err and "set --dry-run" in err
    assert len(err.splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_force_replaces_a_compiled_folder_but_nothing_compile_did_not_write(compiled, tmp_path):
    from onnx_nmm.trainium.compile_steps import refuse_to_replace

    folder = shutil.copytree(compiled, tmp_path / "model.neuron")
    refuse_to_replace(folder, overwrite=True)  # every file in it is one compile wrote
    with pytest.raises(onnx_nmm.OutputError, match="exists and is not empty; choose another"):
        refuse_to_replace(folder, overwrite=False)
    (folder / "important.txt").write_text("mine")
    with pytest.raises(onnx_nmm.OutputError, match="compile did not write important.txt"):
        refuse_to_replace(folder, overwrite=True)


class _Phases(onnx_nmm.Progress):
    """A listener that keeps the description of every phase, in the order they start."""

    def __init__(self):
        self.started = []

    def phase(self, description, total=None):
        self.started.append(description)
        return super().phase(description, total)


def test_compile_says_each_step_as_it_starts(rewritten, tmp_path):
    """No silent minutes before the table: every step of a compile is a phase the progress hears."""
    phases = _Phases()
    compile(rewritten, tmp_path / "out", CompileOptions(max_context=32, buckets=(16,), dry_run=True), progress=phases)
    assert phases.started == ["loading the model", "building the static graphs", "choosing MLP kernels",
                              "writing the folder", "checking the graphs against the model as given",
                              "lowering and checking each graph"]
    phases = _Phases()
    compile(rewritten, tmp_path / "one", CompileOptions(seq_len=8, dry_run=True), progress=phases)
    assert phases.started == ["loading the model", "choosing MLP kernels", "lowering and checking against onnxruntime"]


def test_the_closing_hint_runs_the_folder_as_typed(rewritten, tmp_path, capsys):
    """The hint names --tokenizer when the folder holds no tokenizer; when compile copied one from beside the
    model, the command printed runs as it is."""
    args = ["--max-context", "96", "--buckets", "16,64", "--dry-run"]
    assert main(["compile", str(rewritten), *args, "-o", str(tmp_path / "bare.neuron")]) == 0
    hint = " ".join(capsys.readouterr().out.split()).split("run it with: ")[1]
    assert hint.startswith(f"onnx-nmm generate {tmp_path / 'bare.neuron'} --tokenizer TOKENIZER --prompt")
    beside = tmp_path / "with-tokenizer"
    beside.mkdir()
    shutil.copy(rewritten, beside / "model.onnx")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, beside / name)
    assert main(["compile", str(beside / "model.onnx"), *args, "-o", str(tmp_path / "own.neuron")]) == 0
    command = capsys.readouterr().out.split("run it with: ")[1].strip()
    assert "--tokenizer" not in command
    assert main([*shlex.split(command)[1:], "--max-new-tokens", "4"]) == 0, capsys.readouterr().err


def test_buckets_without_a_max_context_are_refused():
    with pytest.raises(OptionError, match="max_context"):
        CompileOptions(buckets=(128,))


def test_a_model_without_a_kv_cache_cannot_be_compiled_to_generate(export, tmp_path):
    with pytest.raises(onnx_nmm.ModelError, match="has no KV cache"):
        compile(export("llama", "dynamo"), tmp_path / "out", CompileOptions(max_context=32, dry_run=True))
    assert not (tmp_path / "out").exists()


def test_bench_prices_a_compiled_folder_as_it_runs(compiled):
    """A prompt costs its bucket's prefill, and every decode step reads the whole cache, whatever the context."""
    options = onnx_nmm.TrainiumOptions("trn1", prompt_lengths=(5, 16, 17), contexts=(8, 64), generation=(10, 4))
    model = onnx_nmm.estimate_trainium([str(compiled)], options).models[0]
    prefill = {length: phase.seconds for length, phase in model.prefill.items()}
    assert prefill[5] == prefill[16] < prefill[17]  # buckets 16 and 64
    assert model.decode[8].seconds == model.decode[64].seconds
    assert model.generation_prefill_s == prefill[16] and model.generation_decode_s == 3 * model.decode[8].seconds
    with pytest.raises(OptionError, match="do not fit"):
        onnx_nmm.estimate_trainium([str(compiled)], onnx_nmm.TrainiumOptions("trn1", contexts=(128,)))


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_an_onnxruntime_genai_model_compiles_and_generates_its_own_tokens(tmp_path, precision):
    """onnxruntime-genai's export: GroupQueryAttention writes its one cache buffer in place, so the graphs take
    no write position, and the compiled folder still gives the rewritten model's tokens on onnxruntime. Its int4
    build's MatMulNBits quantize their activations on onnxruntime's CPU (accuracy_level 4); the lowering is
    checked against them computing in float, as the lowered program does."""
    rewritten = tmp_path / "model.onnx"
    options = RewriteOptions(ranks=RankOptions(keep=0.9, align=16))
    rewrite(FORMATS / f"genai-{precision}" / "model.onnx", options).save(rewritten)
    folder = tmp_path / "model.neuron"
    compile(rewritten, folder, CompileOptions(target="trn1", max_context=64, buckets=(48,), dry_run=True))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["cache"]["write_position"] is None
    assert all(tensor["shape"] == [1, 2, 64, 16] for tensor in manifest["cache"]["tensors"])
    expected = onnx_nmm.generate(rewritten, PROMPT, TOKENIZER, _greedy())
    assert onnx_nmm.generate(folder, PROMPT, TOKENIZER, _greedy(backend="torch")).tokens == expected.tokens


def test_compile_refuses_graphs_that_generate_other_text_than_the_model_and_leaves_no_folder(tmp_path, capsys,
                                                                                             monkeypatch):
    """The static pass made wrong on purpose (positions left where a full cache puts them): the lowering check
    compares each graph with itself and passes; the check against the model as given refuses, in one line."""
    from onnx_nmm.passes import static_cache as static_pass

    model = exported_model("llama", "dynamo", cache=True, positions=False)
    monkeypatch.setattr(static_pass, "derive_from_lengths", lambda graph, sources, position: 0)
    folder = tmp_path / "model.neuron"
    with pytest.raises(onnx_nmm.GenerationMismatch, match=r"at decode step \d \(position \d+\) .* differ by"):
        compile(model, folder, CompileOptions(target="trn1", max_context=32, buckets=(16,), dry_run=True))
    assert main(["compile", str(model), "--max-context", "32", "--buckets", "16", "--dry-run", "-o",
                 str(folder)]) == 1
    error = capsys.readouterr().err.strip()
    assert "generate other text" in error and len(error.splitlines()) == 1
    assert not folder.exists() and list(tmp_path.iterdir()) == []


def test_the_manifest_records_the_check_against_the_model_as_given(compiled):
    check = json.loads((compiled / "manifest.json").read_text())["generation_check"]
    assert check["prompt_tokens"] == 14 and check["steps"] == 4  # from 2 short of bucket 16 to 2 past it
    assert check["max_abs"] <= check["tolerance"] and check["tokens_agree"]


@pytest.mark.slow
@pytest.mark.xdist_group("gigabytes")
@pytest.mark.parametrize("rewritten", [False, True], ids=["dense", "rewritten"])
def test_smollm2_exported_without_positions_generates_onnxruntimes_text_once_compiled(tmp_path, capsys, rewritten):
    """SmolLM2 as torch.onnx.export(dynamo=True) writes it when called with a DynamicCache: no position input,
    positions and masks from the cache's length. Compiled over 256 positions, it writes onnxruntime's text."""
    import assets
    from filelock import FileLock

    assets.CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(assets.CACHE / "smollm2.lock")):
        model, tokenizer = assets.smollm2_kv_without_positions_onnx(), assets.smollm2_gguf()
    if rewritten:  # full rank: SvdMatMul ops on every projection, and still an answering model
        rewrite(model, RewriteOptions(ranks=RankOptions(rank="full"))).save(tmp_path / "model.onnx")
        model = tmp_path / "model.onnx"
    folder = tmp_path / "model.neuron"
    assert main(["compile", str(model), "--target", "trn1", "--max-context", "256", "--dry-run", "-o",
                 str(folder)]) == 0
    prompt = ["--prompt", "Write a short story about a dragon who learns to bake bread.", "--tokenizer",
              str(tokenizer), "--max-new-tokens", "24", "--json"]
    capsys.readouterr()
    texts = []
    for argv in ([str(model)], [str(folder), "--backend", "torch"]):
        assert main(["generate", *argv, *prompt]) == 0
        texts.append(json.loads(capsys.readouterr().out))
    assert texts[1]["tokens"] == texts[0]["tokens"] and len(texts[0]["tokens"]) == 24


def test_a_cache_that_cannot_be_made_static_is_refused_in_one_line_before_anything_is_written(export, tmp_path,
                                                                                               capsys):
    """Gemma 2's sliding-window layers keep a window of the cache, not an appended whole."""
    folder = tmp_path / "model.neuron"
    assert main(["compile", str(export("gemma2", "dynamo", cache=True)), "--max-context", "32", "--dry-run", "-o",
                 str(folder)]) == 2
    error = capsys.readouterr().err.strip()
    assert "neither appended to with a Concat" in error and len(error.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
