"""`compile --max-context --tp N`: a folder of N rank programs per graph, joined by collectives the manifest names;
`generate DIR --backend torch` runs them in lock-step with the collectives simulated and prints onnxruntime's
greedy tokens; `diff MODEL DIR` compares their logits; refusals are one line and leave no folder."""

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from exported_models import exported_model

import onnx_nmm
from onnx_nmm import CompileOptions, OptionError, compile
from onnx_nmm.cli import main
from onnx_nmm.model_source import ModelSource
from onnx_nmm.runtime import compiled_folder
from onnx_nmm.runtime.collective_ops import ALL_GATHER, ALL_REDUCE
from onnx_nmm.runtime.rank_programs import SimulatedGroup
from onnx_nmm.trainium import neuron

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
TOKENIZER = FORMATS / "genai-fp32"  # a 300-token BPE, below every test model's vocabulary
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model() -> Path:
    return exported_model("llama", "dynamo", cache=True)  # 4 query heads, 2 KV heads


@pytest.fixture(scope="module")
def compiled(model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tp") / "model.neuron"
    assert main(["compile", str(model), "--target", "trn1", "--max-context", "96", "--buckets", "16,64", "--tp", "4",
                 "--dry-run", "-o", str(folder)]) == 0
    return folder


def _greedy(**changes):
    return onnx_nmm.GenerateOptions(**{"max_new_tokens": 12, "chat": False, **changes})


def test_the_folder_holds_the_rank_programs_and_the_manifest_the_collectives_joining_them(compiled):
    manifest = json.loads((compiled / "manifest.json").read_text())
    assert manifest["tp"] == 4 and manifest["sharding"]["kv_heads_replicated"]
    assert manifest["sharding"]["kv_heads_of_rank"] == [[0], [0], [1], [1]]
    assert manifest["collective_ops"]["domain"] == "com.onnx_nmm"
    assert all(tensor["shape"] == [1, 1, 96, 64] for tensor in manifest["cache"]["tensors"])  # one rank's KV head
    for graph in manifest["graphs"]:
        assert graph["ranks"] == [f"{graph['name']}.rank{rank}.onnx" for rank in range(4)]
        assert all((compiled / file).is_file() for file in graph["ranks"])
        assert [join["op"] for join in graph["collectives"]] == [ALL_GATHER] + [ALL_REDUCE] * 4 + [ALL_GATHER]
        assert graph["collectives"][1] == {"op": ALL_REDUCE, "after": "model.layers.0.self_attn.o_proj",
                                           "width_per_token": 256, "node": "model.layers.0.self_attn.o_proj.AllReduce"}
        assert graph["lowering_check"]["max_abs"] < 1e-4
    assert manifest["generation_check"]["tokens_agree"]
    assert not list(compiled.glob("prefill_16.onnx"))  # the rank programs, not the whole graph


@pytest.mark.parametrize("backend", ["torch", "emulator"])
def test_generate_on_the_rank_programs_gives_the_tokens_of_the_model_on_onnxruntime(compiled, model, backend):
    expected = onnx_nmm.generate(model, PROMPT, TOKENIZER, _greedy())
    result = onnx_nmm.generate(compiled, PROMPT, TOKENIZER, _greedy(backend=backend, max_new_tokens=6 if
                                                                    backend == "emulator" else 12))
    assert result.tokens == expected.tokens[:len(result.tokens)]


def test_generate_dir_from_the_command_line_prints_the_models_text(compiled, model, capsys):
    assert main(["generate", str(model), "--prompt", PROMPT, "--tokenizer", str(TOKENIZER), "--no-chat",
                 "--max-new-tokens", "12", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert main(["generate", str(compiled), "--prompt", PROMPT, "--tokenizer", str(TOKENIZER), "--no-chat",
                 "--max-new-tokens", "12", "--backend", "torch", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected["text"]


def test_diff_compares_the_rank_programs_logits_with_onnxruntimes(compiled, model, capsys):
    assert main(["diff", str(model), str(compiled), "--backend", "torch", "--tokens", "12", "--json",
                 "--atol", "1e-4"]) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    assert [output["name"] for output in outputs] == ["logits (prompt of 12)", "logits (4 decode steps)"]
    assert all(output["top1_agreement"] == 1.0 and output["max_abs"] < 1e-4 for output in outputs)


def test_onnxruntime_cannot_run_the_rank_programs_said_in_one_line(compiled, capsys):
    assert main(["generate", str(compiled), "--prompt", PROMPT, "--tokenizer", str(TOKENIZER), "--no-chat",
                 "--backend", "ort"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "runs its 4 rank programs lowered to PyTorch" in error


def test_a_tp_that_does_not_divide_the_query_heads_is_refused_in_one_line_and_writes_nothing(model, tmp_path, capsys):
    folder = tmp_path / "tp3.neuron"
    assert main(["compile", str(model), "--max-context", "96", "--buckets", "16", "--tp", "3", "--dry-run",
                 "-o", str(folder)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "--tp 3 does not divide the model's 4 query heads" in error
    assert not folder.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("options, refusal", [
    (dict(tp=2, dry_run=True), "tp splits a model that generates: give max_context too"),
    (dict(tp=33, target="trn1", max_context=96, dry_run=True),
     "tp must be from 1 to 32, the NeuronCores of a trn1.32xlarge"),
])
def test_a_tp_without_a_cache_or_beyond_the_instance_is_refused(options, refusal):
    with pytest.raises(OptionError, match=refusal):
        CompileOptions(**options)


def test_without_neuronx_distributed_compile_tp_names_it_and_writes_nothing(model, tmp_path, capsys, monkeypatch):
    """Tracing the rank programs takes neuronx-distributed besides the rest of the SDK: said at once, before the
    model is loaded, in one line, and no folder is left (tests/test_tensor_parallel_trace.py traces them with a
    stand-in of it)."""
    assert "neuronx-distributed" in neuron.missing_neuron_packages(2)
    assert "neuronx-distributed" not in neuron.missing_neuron_packages(1)

    def never(model):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ModelSource, "of", never)
    assert main(["compile", str(model), "--max-context", "96", "--tp", "2", "-o", str(tmp_path / "out")]) == 3
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "neuronx-distributed" in error and "nothing was written" in error
    assert list(tmp_path.iterdir()) == []



def test_a_rewritten_model_splits_and_generates_its_own_tokens(tmp_path):
    rewritten = tmp_path / "rewritten.onnx"
    onnx_nmm.rewrite(exported_model("qwen2", "dynamo", cache=True),  # q/k/v with biases
                     onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.9, align=32))).save(rewritten)
    folder = tmp_path / "rewritten.neuron"
    compilation = compile(rewritten, folder, CompileOptions(target="trn1", max_context=96, buckets=(64,), tp=2,
                                                            dry_run=True))
    splits = compilation.manifest["graphs"][-1]["splits"]
    assert any(how.startswith("U ") for how in splits.values())  # factorized layers split their own way
    expected = onnx_nmm.generate(rewritten, PROMPT, TOKENIZER, _greedy())
    assert onnx_nmm.generate(folder, PROMPT, TOKENIZER, _greedy(backend="torch")).tokens == expected.tokens


def test_simulated_collectives_give_every_rank_the_same_sum_and_the_gathered_parts_in_rank_order():
    group, results = SimulatedGroup(3), {}
    parts = [torch.full((2, 2), float(rank + 1)) / 3 for rank in range(3)]

    def rank(index):
        join = group.join_for(index)
        results[index] = (join(ALL_REDUCE, parts[index], -1), join(ALL_GATHER, parts[index], -1))

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected_sum = (parts[0] + parts[1]) + parts[2]
    for summed, gathered in results.values():
        assert torch.equal(summed, expected_sum)  # bit for bit, on every rank
        assert gathered.shape == (2, 6) and torch.equal(gathered[:, 2:4], parts[1])


def test_a_rank_that_fails_releases_the_others_and_its_error_is_the_one_said(compiled):
    from onnx_nmm.runtime.rank_programs import RankProgramsRunner

    _, graphs = compiled_folder.read(compiled)
    runner = RankProgramsRunner(graphs.decode, dict(graphs.layout.cache))
    feeds = graphs.example_feeds("decode")

    def failing(*inputs):
        raise RuntimeError("rank 1 failed")

    working = runner.modules[1]
    runner.modules[1] = failing
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        runner(feeds)  # the other ranks, waiting at its first collective, are released
    runner.modules[1] = working
    assert runner(feeds)["logits"].shape[-1] == 1000


@pytest.mark.slow
@pytest.mark.parametrize("rewritten", [False, True])
def test_smollm2_over_three_neuroncores_generates_onnxruntimes_tokens(tmp_path, rewritten):
    """The done-when: SmolLM2's KV export (9 query heads, 3 KV heads), and its rewrite, compiled with --tp 3
    --max-context 256 --dry-run: three rank programs per graph; generate DIR --backend torch prints onnxruntime's
    greedy tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import assets

    model, gguf = assets.smollm2_kv_onnx(), assets.smollm2_gguf()
    if rewritten:
        path = tmp_path / "keep0.9.onnx"
        onnx_nmm.rewrite(model, onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.9))).save(path)
        model = path
    folder = tmp_path / "smollm2.neuron"
    assert main(["compile", str(model), "--target", "trn1", "--max-context", "256", "--tp", "3", "--dry-run",
                 "-o", str(folder)]) == 0
    manifest = json.loads((folder / "manifest.json").read_text())
    assert all(len(graph["ranks"]) == 3 for graph in manifest["graphs"])
    assert manifest["sharding"]["query_heads_per_rank"] == 3 and manifest["sharding"]["kv_heads_per_rank"] == 1
    options = dict(max_new_tokens=24)
    expected = onnx_nmm.generate(model, "What is the capital of France?", gguf, onnx_nmm.GenerateOptions(**options))
    result = onnx_nmm.generate(folder, "What is the capital of France?", gguf,
                               onnx_nmm.GenerateOptions(backend="torch", **options))
    assert result.tokens == expected.tokens
    assert np.isfinite(manifest["generation_check"]["max_abs"])
