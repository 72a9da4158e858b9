"""Fine-tuning the SVD factors in PyTorch and writing them back into the ONNX model."""

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from exported_models import exported_model
from rewriting import assert_logits_close

from onnx_nmm import TrainingDiverged, TrainingOptions
from onnx_nmm.cli import main
from onnx_nmm.lowering import CausalLmInputs, call_lowered, factor_parameters, lower
from onnx_nmm.model_io import check_model_file, load_model, save_model
from onnx_nmm.runtime.backend_runner import ModelRunner
from onnx_nmm.training.factor_training import next_token_loss, replace_factors, train_factors

pytestmark = pytest.mark.xdist_group("lowering")

VOCAB = 1000


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny models' matrices are so small that handing work to a second thread costs more than the
    maths (50× slower steps on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _rewrite(source, output, fuse=True):
    code = main(["rewrite", str(source), "-o", str(output), "--keep", "0.5", "--align", "32", "--quiet",
                 *(["--fuse-mlp"] if fuse else [])])
    assert code == 0
    return output


@pytest.fixture(scope="module")
def rewritten_llama(tmp_path_factory):
    """A tiny Llama whose MLPs are SvdGatedMLP ops at keep 0.5."""
    return _rewrite(exported_model("llama", "dynamo"), tmp_path_factory.mktemp("llama") / "rewritten.onnx")


def _token_ids(samples, seq_len, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (samples, seq_len), dtype=np.int64)


def _factor_arrays(path):
    model = load_model(path)
    return {name: value.const_value.numpy() for name, value in model.graph.initializers.items()}


def test_finetuning_lowers_the_loss_and_changes_only_the_factors(rewritten_llama):
    module = lower(rewritten_llama)
    inputs = CausalLmInputs(rewritten_llama)
    windows = _token_ids(4, 32)
    frozen = {name: buffer.clone() for name, buffer in module.named_buffers()}
    factors = {name: factor.clone() for name, factor in factor_parameters(module).items()}
    loss_before = next_token_loss(call_lowered(module, *inputs(windows)), torch.from_numpy(windows)).item()

    result = train_factors(module, windows, inputs,
                           TrainingOptions(steps=30, learning_rate=1e-3, batch=4, loss="next-token"))

    loss_after = next_token_loss(call_lowered(module, *inputs(windows)), torch.from_numpy(windows)).item()
    assert len(result.records) == 30 and result.stopped_by == "steps"
    assert result.records[-1].tokens == 30 * 4 * 32
    assert result.records[0].loss == pytest.approx(loss_before, rel=1e-4)  # every step sees all 4 windows
    assert loss_after < 0.8 * loss_before  # random-weight model, 4 windows: fitting them is easy
    assert result.mean_loss(first=False) < result.mean_loss(first=True)
    assert result.trainable_parameters == sum(factor.numel() for factor in factors.values())
    assert all(torch.equal(buffer, frozen[name]) for name, buffer in module.named_buffers())
    tuned = factor_parameters(module)
    assert all(not torch.equal(tuned[name], factor) for name, factor in factors.items())
    assert not any(factor.requires_grad for factor in tuned.values())


def test_written_model_runs_in_onnxruntime_with_the_tuned_factors(tmp_path):
    """GPT-2: SvdMatMul ops with a bias, the factors written back, the graph otherwise the same."""
    rewritten = _rewrite(exported_model("gpt2", "dynamo"), tmp_path / "rewritten.onnx", fuse=False)
    model = load_model(rewritten)
    module = lower(rewritten)
    inputs = CausalLmInputs(model)
    train_factors(module, _token_ids(4, 16), inputs, TrainingOptions(steps=5, learning_rate=1e-3, loss="next-token"))
    replace_factors(model, factor_parameters(module))
    tuned = save_model(model, tmp_path / "tuned.onnx", external_data=False, validate=check_model_file)

    check = _token_ids(2, 12, seed=7)
    assert_logits_close(call_lowered(module, *inputs(check)).numpy(), ModelRunner(tuned).logits(check))
    before, after = _factor_arrays(rewritten), _factor_arrays(tuned)
    factor_names = set(factor_parameters(module))
    assert factor_names and factor_names <= set(after)
    assert all(not np.array_equal(before[name], after[name]) for name in factor_names)
    assert all(np.array_equal(before[name], after[name]) for name in set(before) - factor_names)
    def nodes(path):
        graph = onnx.load(str(path), load_external_data=False).graph
        return [(node.op_type, node.name, list(node.input)) for node in graph.node]

    assert nodes(rewritten) == nodes(tuned)


def test_cli_distills_into_adapters_and_reports_perplexity(capsys, tmp_path):
    """External data in, external data out; adapters of rank 4 on every factor, merged back."""
    source = exported_model("llama", "dynamo", external_data=True)
    rewritten = _rewrite(source, tmp_path / "rewritten.onnx")
    np.savez(tmp_path / "train.npz", input_ids=_token_ids(6, 24))
    np.savez(tmp_path / "held-out.npz", input_ids=_token_ids(2, 48, seed=1))
    output, report, plot = tmp_path / "tuned.onnx", tmp_path / "report.json", tmp_path / "loss.png"
    code, out, err = _cli(capsys, "finetune", rewritten, "--text", tmp_path / "train.npz", "--teacher", source,
                          "--adapters", "4", "--lr", "1e-2", "--steps", "25", "--eval-text", tmp_path / "held-out.npz",
                          "--eval-window", "24", "-o", output, "--report", report, "--plot", plot)
    assert code == 0, err

    result = json.loads(report.read_text())
    losses = [record["loss"] for record in result["records"]]
    assert result["loss"] == "distill" and result["steps"] == 25 and losses[0] > 0
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])  # the KL to the dense teacher shrinks
    factors = {name: array for name, array in _factor_arrays(rewritten).items() if ".svd_" in name}
    assert result["trainable_parameters"] == sum(4 * sum(array.shape) for array in factors.values())
    tuned = _factor_arrays(output)
    assert all(not np.array_equal(tuned[name], array) for name, array in factors.items())
    assert (tmp_path / "tuned.onnx.data").is_file()
    assert {"perplexity_before", "perplexity_after"} <= set(result)
    assert result["perplexity_after"]["tokens_scored"] == 4 * 23  # 96 held-out tokens, windows of 24
    assert "perplexity" in out and f"wrote {output}" in " ".join(out.split())
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_a_rising_loss_is_warned_about(capsys, rewritten_llama, tmp_path):
    np.savez(tmp_path / "train.npz", input_ids=_token_ids(4, 16))
    common = ("finetune", rewritten_llama, "--text", tmp_path / "train.npz", "--loss", "distill", "--teacher",
              exported_model("llama", "dynamo"), "--steps", "8", "--batch", "1", "-o", tmp_path / "tuned.onnx",
              "--quiet", "--force")
    code, _, err = _cli(capsys, *common, "--lr", "0.3")  # far too high: the KL to the teacher grows
    said = " ".join(err.split())  # rich wraps stderr at the terminal width
    assert code == 0 and "loss rose during training" in said and "try a lower --lr" in said
    code, _, err = _cli(capsys, *common, "--lr", "1e-3")
    assert code == 0 and "loss rose" not in err


def test_time_budget_ends_training(rewritten_llama):
    module = lower(rewritten_llama)
    inputs = CausalLmInputs(rewritten_llama)
    result = train_factors(module, _token_ids(2, 16), inputs,
                           TrainingOptions(steps=100_000, time_budget=0.5, batch=1, loss="next-token"))
    last = result.records[-1]
    assert result.stopped_by == "time" and 1 < last.step < 100_000
    assert last.seconds <= 0.5 + 2 * last.seconds / last.step  # at most about one step over


def test_write_back_keeps_the_dtype_and_refuses_non_finite_factors(rewritten_llama):
    model = load_model(rewritten_llama)
    names = [name for name in model.graph.initializers if ".svd_" in name][:2]
    for name in names:
        array = model.graph.initializers[name].const_value.numpy().astype(np.float16)
        model.graph.initializers[name].const_value = ir.tensor(array, dtype=ir.DataType.FLOAT16, name=name)
    tuned = {name: torch.full(model.graph.initializers[name].const_value.shape.numpy(), 0.5) for name in names}
    replace_factors(model, tuned)
    for name in names:
        value = model.graph.initializers[name].const_value
        assert value.dtype == ir.DataType.FLOAT16 and np.all(value.numpy() == 0.5)

    tuned[names[1]][0, 0] = float("nan")
    tuned[names[0]] = torch.full_like(tuned[names[0]], 0.25)
    with pytest.raises(TrainingDiverged, match="NaN or Inf"):
        replace_factors(model, tuned)
    assert np.all(model.graph.initializers[names[0]].const_value.numpy() == 0.5)  # nothing half-written


@pytest.mark.parametrize("extra, message", [
    (["--steps", "0"], "steps must be a positive integer"),
    (["--batch", "9"], "batch of 9 windows"),
    (["--time-budget", "-1"], "--time-budget must be positive"),
    (["--minutes", "0"], "--minutes must be positive, got 0"),
])
def test_bad_options_are_one_line_errors(capsys, rewritten_llama, tmp_path, extra, message):
    np.savez(tmp_path / "train.npz", input_ids=_token_ids(8, 16))
    output = tmp_path / "tuned.onnx"
    code, _, err = _cli(capsys, "finetune", rewritten_llama, "--text", tmp_path / "train.npz", "-o", output, *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not output.exists()


def test_bad_models_and_data_are_one_line_errors(capsys, tmp_path, rewritten_llama):
    np.savez(tmp_path / "train.npz", input_ids=_token_ids(4, 16))
    np.savez(tmp_path / "foreign.npz", input_ids=np.full((4, 16), VOCAB + 5))
    (tmp_path / "train.txt").write_text("a text to train on")
    output = tmp_path / "tuned.onnx"
    cases = [
        (exported_model("llama", "dynamo"), "train.npz", "no ai.onnx_nmm SVD ops"),  # not rewritten
        (rewritten_llama, "foreign.npz", "vocabulary of 1000: tokenize with the model's own tokenizer"),
        (rewritten_llama, "missing.txt", "missing.txt: no such file"),
        (rewritten_llama, "train.txt", "give its --tokenizer"),
    ]
    for model, data, message in cases:
        code, _, err = _cli(capsys, "finetune", model, "--text", tmp_path / data, "-o", output)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (data, err)
        assert not output.exists()


def test_finetune_with_no_loss_option_distils_from_the_recorded_dense_model(capsys, rewritten_llama, tmp_path):
    """No --loss, no --teacher: the rewrite recorded its dense model, and finetune distils from it; the
    report and the summary say which loss, teacher and text."""
    np.savez(tmp_path / "train.npz", input_ids=_token_ids(4, 16))
    report = tmp_path / "report.json"
    code, out, err = _cli(capsys, "finetune", rewritten_llama, "--text", tmp_path / "train.npz", "--steps", "2",
                          "--batch", "1", "-o", tmp_path / "tuned.onnx", "--report", report)
    assert code == 0, err
    written = json.loads(report.read_text())
    dense = exported_model("llama", "dynamo").resolve()
    assert written["loss"] == "distill" and written["teacher"] == str(dense)
    assert "train.npz" in written["training_data"]
    said = " ".join(out.split())
    assert "distillation loss (KL to the dense" in said and "train.npz" in said


def test_default_training_text_is_generated_by_the_dense_model(rewritten_llama, tmp_path, monkeypatch):
    import onnx_nmm

    monkeypatch.setenv("ONNX_NMM_CACHE", str(tmp_path / "cache"))
    generated = onnx_nmm.GeneratedText(samples=2, batch=2, start_token=3)
    data = onnx_nmm.TrainingData(generated, seq_len=12)
    options = onnx_nmm.FinetuneOptions(TrainingOptions(steps=2, batch=1))
    result = onnx_nmm.finetune(rewritten_llama, data, options)
    assert result.loss == "distill" and result.teacher == str(exported_model("llama", "dynamo").resolve())
    assert result.data.startswith("generated: 2 windows of 12 tokens")
    assert onnx_nmm.TrainingData().text == "generated:32" and onnx_nmm.TrainingData().prompted == 32


def test_without_a_recorded_dense_model_finetune_asks_for_one(capsys, tmp_path):
    """A model rewritten in memory names no dense model: distillation (the default) needs --teacher, and
    next-token is there when asked for."""
    import onnx_nmm

    result = onnx_nmm.rewrite(load_model(exported_model("llama", "dynamo")), onnx_nmm.RewriteOptions())
    rewritten = save_model(result.model, tmp_path / "rewritten.onnx", external_data=False)
    np.savez(tmp_path / "train.npz", input_ids=_token_ids(4, 16))
    common = ("finetune", rewritten, "--text", tmp_path / "train.npz", "--steps", "1", "--batch", "1", "-o",
              tmp_path / "tuned.onnx", "--quiet")
    code, _, err = _cli(capsys, *common)
    assert code == 2 and "give the --teacher, or choose --loss next-token" in " ".join(err.split())
    code, _, err = _cli(capsys, *common, "--loss", "next-token")
    assert code == 0, err


def test_finetune_trains_a_narrowed_mlp(capsys, tmp_path):
    """A nystrom rewrite's MLPs are plain, narrower MatMuls: their weights are what finetune trains, written back
    into the same graph; nothing else changes."""
    source = exported_model("llama", "dynamo")
    narrowed = tmp_path / "narrowed.onnx"
    assert main(["rewrite", str(source), "-o", str(narrowed), "--method", "nystrom", "--calib", "random",
                 "--calib-samples", "4", "--seq-len", "32", "--keep", "0.5", "--align", "32", "--quiet"]) == 0
    np.savez(tmp_path / "train.npz", input_ids=_token_ids(4, 24))
    output, report = tmp_path / "tuned.onnx", tmp_path / "report.json"
    code, _, err = _cli(capsys, "finetune", narrowed, "--text", tmp_path / "train.npz", "--steps", "20", "--lr", "1e-2",
                        "--batch", "4", "-o", output, "--report", report)
    assert code == 0, err
    result = json.loads(report.read_text())
    before, after = _factor_arrays(narrowed), _factor_arrays(output)
    weights = {name for name in before if name.endswith(".narrowed")}
    assert len(weights) == 6 and {before[name].shape for name in weights} == {(256, 256)}  # 3 per MLP, 512 → 256
    assert result["loss"] == "distill" and result["trainable_parameters"] == sum(before[n].size for n in weights)
    assert all(not np.array_equal(before[name], after[name]) for name in weights)
    assert all(np.array_equal(before[name], after[name]) for name in set(before) - weights)
    losses = [record["loss"] for record in result["records"]]
    assert np.mean(losses[-4:]) < np.mean(losses[:4])
    tokens = _token_ids(2, 12, seed=3)
    assert ModelRunner(output).logits(tokens).shape == (2, 12, VOCAB)


def test_default_training_data_continues_passages_of_the_recorded_calibration_text(capsys, tmp_path, monkeypatch):
    """A rewrite calibrated on a text records it; finetune's generated data then also holds windows the dense
    model writes after passages of that text, each starting with its passage; --prompted 0 leaves them out."""
    import onnx_nmm
    from onnx_nmm.calibration.calibration_data import text_tokens
    from onnx_nmm.calibration.tokens import load_tokenizer
    from onnx_nmm.training.finetuning import PROMPT_TOKENS

    monkeypatch.setenv("ONNX_NMM_CACHE", "off")
    tokenizer = Path(__file__).resolve().parent / "data" / "formats" / "genai-fp32"
    text = tmp_path / "calibration.txt"
    text.write_text("the quick brown fox jumps over the lazy dog and runs far away into the forest " * 60)
    rewritten = tmp_path / "whitened.onnx"
    assert main(["rewrite", str(exported_model("llama", "dynamo")), "-o", str(rewritten), "--method", "whiten",
                 "--calib", str(text), "--tokenizer", str(tokenizer), "--calib-samples", "4", "--seq-len", "16",
                 "--keep", "0.5", "--align", "32", "--quiet", "--no-answer-check"]) == 0
    generated = onnx_nmm.GeneratedText(samples=2, batch=2, start_token=3)
    data = onnx_nmm.TrainingData(generated, tokenizer, seq_len=PROMPT_TOKENS + 8, prompted=2)
    result = onnx_nmm.finetune(rewritten, data, onnx_nmm.FinetuneOptions(TrainingOptions(steps=1, batch=1)))
    assert f"continuing prompts of {PROMPT_TOKENS} tokens of" in result.data and "calibration.txt" in result.data
    windows = onnx_nmm.TrainingData(generated, tokenizer, seq_len=PROMPT_TOKENS + 8, prompts=text,
                                    prompted=2).windows(exported_model("llama", "dynamo"))
    ids = text_tokens(text, load_tokenizer(tokenizer))
    assert windows.tokens.shape == (4, PROMPT_TOKENS + 8) and (windows.tokens[:2, 0] == 3).all()
    assert np.array_equal(windows.tokens[2, :PROMPT_TOKENS], ids[:PROMPT_TOKENS])  # spread: the first passage first
    assert any(window[:PROMPT_TOKENS].tolist() in [ids[i:i + PROMPT_TOKENS].tolist() for i in range(len(ids))]
               for window in windows.tokens[3:])
    off = onnx_nmm.finetune(rewritten, onnx_nmm.TrainingData(generated, tokenizer, seq_len=PROMPT_TOKENS + 8,
                                                             prompted=0),
                            onnx_nmm.FinetuneOptions(TrainingOptions(steps=1, batch=1)))
    assert "continuing prompts" not in off.data


def test_minutes_is_the_training_time_budget(capsys, rewritten_llama, tmp_path):
    np.savez(tmp_path / "train.npz", input_ids=_token_ids(4, 16))
    report = tmp_path / "report.json"
    code, _, err = _cli(capsys, "finetune", rewritten_llama, "--text", tmp_path / "train.npz", "--minutes", "0.0001",
                        "--steps", "1000", "--batch", "1", "-o", tmp_path / "tuned.onnx", "--report", report, "--quiet")
    assert code == 0, err
    written = json.loads(report.read_text())
    assert written["options"]["time_budget"] == pytest.approx(0.006) and written["stopped_by"] == "time"
    assert len(written["records"]) < 1000


def test_save_at_writes_the_model_trained_so_far_at_each_step(capsys, rewritten_llama, tmp_path):
    """--save-at 1,2 writes OUT.step1.onnx and OUT.step2.onnx during a 3-step run: each holds the factors trained
    that far (the last step's file is the written model itself)."""
    np.savez(tmp_path / "train.npz", input_ids=_token_ids(4, 16))
    output = tmp_path / "tuned.onnx"
    code, _, err = _cli(capsys, "finetune", rewritten_llama, "--text", tmp_path / "train.npz", "--steps", "3",
                        "--batch", "1", "--lr", "1e-2", "--save-at", "1,3", "-o", output, "--quiet")
    assert code == 0, err
    first, last, final = (_factor_arrays(tmp_path / name) for name in ("tuned.step1.onnx", "tuned.step3.onnx",
                                                                       "tuned.onnx"))
    before = _factor_arrays(rewritten_llama)
    trained = [name for name in before if ".svd_" in name]
    assert trained and all(np.array_equal(last[name], final[name]) for name in before)
    assert all(not np.array_equal(first[name], before[name]) and not np.array_equal(first[name], final[name])
               for name in trained)
    with pytest.raises(SystemExit):
        _cli(capsys, "finetune", rewritten_llama, "--save-at", "0", "-o", output)
    assert "--save-at: 0: steps are positive" in capsys.readouterr().err
