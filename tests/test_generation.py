"""`generate` and `bench`: text from every KV-cache format the project reads, and speeds side by side."""

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import onnx_nmm
from onnx_nmm.cli import main

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
TOKENIZER = FORMATS / "genai-fp32"  # a 300-token BPE, below every test model's vocabulary
PROMPT = "the quick brown fox jumps over the lazy dog"


def _model(name: str, export) -> Path:
    if name in ("dynamo", "torchscript", "dynamo-no-cache"):
        return export("llama", name.removesuffix("-no-cache"), cache=not name.endswith("no-cache"))
    return FORMATS / name / "model.onnx"


def _greedy(options=None, **changes):
    return onnx_nmm.GenerateOptions(**{"max_new_tokens": 10, "chat": False, **(options or {}), **changes})


def test_greedy_generation_gives_the_tokens_of_a_loop_written_by_hand_in_onnxruntime(export):
    model = _model("dynamo", export)
    result = onnx_nmm.generate(model, PROMPT, TOKENIZER, _greedy())
    prompt = onnx_nmm.load_tokenizer(TOKENIZER)(PROMPT)["input_ids"]

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
            for i in session.get_inputs() if i.name.startswith("past_key_values")}
    outputs = [o.name for o in session.get_outputs()]
    ids, tokens = np.array([prompt]), []
    while len(tokens) < 10:
        done = next(iter(past.values())).shape[2]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, done + ids.shape[1]), np.int64),
                 "position_ids": np.arange(done, done + ids.shape[1])[None], **past}
        results = dict(zip(outputs, session.run(None, feeds)))
        tokens.append(int(results["logits"][0, -1].argmax()))
        past = {name: results[name.replace("past_key_values", "present")] for name in past}
        ids = np.array([[tokens[-1]]])
    eos = onnx_nmm.load_tokenizer(TOKENIZER).eos_token_id
    expected = tokens[: tokens.index(eos)] if eos in tokens else tokens
    assert result.tokens == expected and result.prompt_tokens == len(prompt)
    assert result.stopped_by == ("eos" if eos in tokens else "max_new_tokens")


@pytest.mark.parametrize("name", ["dynamo", "torchscript", "dynamo-no-cache", "optimum-past", "optimum-merged",
                                  "genai-fp32", "genai-int4"])
def test_every_format_generates_what_rereading_the_whole_sequence_gives(export, name):
    model = _model(name, export)
    result = onnx_nmm.generate(model, PROMPT, TOKENIZER, _greedy())
    runner = onnx_nmm.ModelRunner(model)
    ids = np.array([onnx_nmm.load_tokenizer(TOKENIZER)(PROMPT)["input_ids"]])
    for token in result.tokens:
        assert int(runner.logits(ids)[0, -1].argmax()) == token
        ids = np.concatenate([ids, [[token]]], axis=1)
    assert len(result.tokens) == 10 or result.stopped_by == "eos"


def test_a_genai_folder_generates_with_the_tokenizer_beside_it():
    model = FORMATS / "genai-int4" / "model.onnx"
    assert onnx_nmm.generate(model, PROMPT, options=_greedy()).tokens == \
        onnx_nmm.generate(model, PROMPT, TOKENIZER, _greedy()).tokens


def test_the_torch_backend_generates_the_tokens_onnxruntime_does(export, tmp_path):
    rewritten = tmp_path / "full.onnx"
    onnx_nmm.rewrite(_model("dynamo", export), onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(rank="full"))
                     ).save(rewritten)
    on_ort = onnx_nmm.generate(rewritten, PROMPT, TOKENIZER, _greedy())
    on_torch = onnx_nmm.generate(rewritten, PROMPT, TOKENIZER, _greedy(backend="torch"))
    assert on_torch.tokens == on_ort.tokens and len(on_ort.tokens) > 0


def test_sampling_is_seeded_and_a_tiny_nucleus_is_greedy(export):
    model = _model("dynamo", export)
    sample = _greedy(temperature=1.5, max_new_tokens=12)
    first, again = (onnx_nmm.generate(model, PROMPT, TOKENIZER, sample) for _ in range(2))
    other = onnx_nmm.generate(model, PROMPT, TOKENIZER, _greedy(temperature=1.5, max_new_tokens=12, seed=1))
    greedy = onnx_nmm.generate(model, PROMPT, TOKENIZER, _greedy(max_new_tokens=12))
    nucleus = onnx_nmm.generate(model, PROMPT, TOKENIZER, _greedy(temperature=1.5, top_p=1e-9, max_new_tokens=12))
    assert first.tokens == again.tokens and first.tokens != other.tokens
    assert nucleus.tokens == greedy.tokens and first.tokens != greedy.tokens


def test_the_cli_streams_the_text_and_says_how_fast(capsys, export):
    code = main(["generate", str(_model("dynamo", export)), "--prompt", PROMPT, "--tokenizer", str(TOKENIZER),
                 "--max-new-tokens", "6", "--no-chat"])
    out, err = capsys.readouterr()
    expected = onnx_nmm.generate(_model("dynamo", export), PROMPT, TOKENIZER, _greedy(max_new_tokens=6))
    assert code == 0 and out == expected.text + "\n"
    assert f"{len(expected.tokens)} new token" in err and "first token" in err


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or positive"),
    ([], "generating needs a --tokenizer"),
    (["--tokenizer", "missing"], "tokenizer missing: no such file or folder"),
])
def test_bad_generate_options_are_one_line_errors(capsys, export, argv, message):
    code = main(["generate", str(_model("dynamo", export)), "--prompt", PROMPT, *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_bench_measures_models_side_by_side(capsys, export, tmp_path):
    dense = _model("dynamo", export)
    rewritten = tmp_path / "keep-half.onnx"
    onnx_nmm.rewrite(dense, onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.5, align=8))).save(rewritten)
    plot = tmp_path / "speed.png"
    code = main(["bench", str(dense), str(rewritten), str(_model("dynamo-no-cache", export)), "--prompt-lengths",
                 "8,16", "--contexts", "8,32", "--steps", "3", "--rounds", "2", "--time-budget", "0", "--threads", "1",
                 "--json", "--plot", str(plot)])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    first, factorized, uncached = result["models"]
    assert [row["prompt_tokens"] for row in first["prefill"]] == [8, 16]
    assert [row["context"] for row in first["decode"]] == [8, 32]
    assert result["rounds"] == 2 and all(len(row["passes_s"]) == 4 for row in first["prefill"])  # 2 passes a round
    assert first["decode_speedup"] == {"8": 1.0, "32": 1.0} and first["ideal_decode_speedup"]["32"] == 1.0
    assert factorized["decode_speedup_interval"]["8"]["verdict"] == "too few rounds for an interval"
    assert factorized["step_weight_bytes"] < first["step_weight_bytes"] and factorized["ideal_decode_speedup"]["8"] > 1
    assert uncached["cache_bytes_per_token"] == 0 and first["cache_bytes_per_token"] > 0
    row = first["decode"][1]
    assert row["latency_p90_s"] >= row["latency_median_s"] > 0 and row["tokens_per_s"] == 1 / row["latency_median_s"]
    assert plot.stat().st_size > 0


def test_bench_tables_name_every_model(capsys, export):
    model = _model("dynamo", export)
    code = main(["bench", str(model), "--prompt-lengths", "4", "--contexts", "4", "--steps", "1", "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "Prefill" in out and "Decode" in out and out.count(model.name) >= 3
    assert "1 round in" in out and "peak RSS, alone" in out


def test_bench_says_when_its_rounds_cannot_resolve_a_speedup(capsys, export):
    model = _model("dynamo", export)
    code = main(["bench", str(model), str(model), "--prompt-lengths", "4", "--contexts", "4", "--steps", "1",
                 "--rounds", "2", "--time-budget", "0"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("the reference") == 2 and out.count("too few rounds for an interval") == 2
    assert "2 rounds in" in out and "stopped by the 0 s time budget before every interval was within ±2%" in out


def test_bench_options_are_checked(capsys, export):
    code = main(["bench", str(_model("dynamo", export)), "--contexts", "0"])
    assert code == 2 and "--contexts must be positive token counts" in capsys.readouterr().err


def test_the_emulator_backend_generates_on_the_fused_kernels(export, tmp_path):
    fused = tmp_path / "fused.onnx"
    options = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(rank="full"), fuse_mlp=True)
    onnx_nmm.rewrite(_model("dynamo", export), options).save(fused)
    on_ort = onnx_nmm.generate(fused, PROMPT, TOKENIZER, _greedy(max_new_tokens=4))
    on_emulator = onnx_nmm.generate(fused, PROMPT, TOKENIZER, _greedy(max_new_tokens=4, backend="emulator"))
    assert on_emulator.tokens == on_ort.tokens  # bf16 kernels, yet the same greedy choices on this model
