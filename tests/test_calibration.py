"""Calibration statistics gathered in onnxruntime, and the calibrated rewrite end to end."""

import json

import graphs
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from onnx_nmm import ExecutionError, Selection
from onnx_nmm.calibration import calibration_data
from onnx_nmm.calibration.activation_stats import GramStatistics, collect_gram_matrices
from onnx_nmm.calibration.calibration_data import observed_inputs
from onnx_nmm.cli import main
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes import find_linear_layers, select_layers


def _float_feeds(x):
    return {"X": x}


@pytest.mark.parametrize("hidden, intermediate", [(32, 64), (700, 1300)])  # one block; several blocks
def test_grams_equal_numpy_on_the_layer_inputs(tmp_path, hidden, intermediate):
    """The MLP's first layers read X itself, the down projection reads silu(X·Wg)·(X·Wu)."""
    path = tmp_path / "mlp.onnx"
    onnx.save(graphs.swiglu_mlp(hidden=hidden, intermediate=intermediate), path)
    targets, _ = select_layers(find_linear_layers(ir.load(path)), Selection())
    inputs = observed_inputs(targets)
    assert inputs == {"X": hidden, "act": intermediate}  # gate and up share one entry
    batches = [np.random.default_rng(seed).standard_normal((2, 7, hidden)).astype(np.float32) for seed in range(3)]
    stats = collect_gram_matrices(ModelSource(path), inputs, batches, make_feeds=_float_feeds)
    x = np.concatenate([batch.reshape(-1, hidden) for batch in batches]).astype(np.float64)
    np.testing.assert_allclose(stats.grams["X"], x.T @ x, rtol=1e-4, atol=1e-4 * hidden)
    wg = graphs.weight(hidden, intermediate, 1).astype(np.float64)
    wu = graphs.weight(hidden, intermediate, 2).astype(np.float64)
    gate = x @ wg
    act = gate / (1 + np.exp(-gate)) * (x @ wu)
    np.testing.assert_allclose(stats.grams["act"], act.T @ act, rtol=1e-4, atol=1e-4 * intermediate)
    assert stats.tokens == 42


def test_non_finite_activations_are_an_error(tmp_path):
    """sqrt of negative inputs makes NaN before the layer: refused, naming the value."""
    nodes = [helper.make_node("Sqrt", ["X"], ["root"]), helper.make_node("MatMul", ["root", "W"], ["Y"], name="mm")]
    path = tmp_path / "nan.onnx"
    onnx.save(graphs.model(nodes, {"W": graphs.weight(16, 24)}), path)
    batches = [-np.ones((1, 3, 16), np.float32)]
    with pytest.raises(ExecutionError, match="non-finite activations at 'root'"):
        collect_gram_matrices(ModelSource(path), {"root": 16}, batches, make_feeds=_float_feeds)


def test_statistics_round_trip(tmp_path):
    stats = GramStatistics({"a": np.eye(3), "b": np.ones((2, 2))}, tokens=17, description="test")
    stats.save(tmp_path / "sub" / "stats.npz")
    assert GramStatistics.is_statistics_file(tmp_path / "sub" / "stats.npz")
    loaded = GramStatistics.load(tmp_path / "sub" / "stats.npz")
    assert loaded.tokens == 17 and loaded.description == "test"
    np.testing.assert_array_equal(loaded.grams["b"], np.ones((2, 2)))
    np.savez(tmp_path / "inputs.npz", input_ids=np.zeros((2, 3)))
    assert not GramStatistics.is_statistics_file(tmp_path / "inputs.npz")


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, *capsys.readouterr()


def test_calibrated_full_rank_rewrite_is_exact(capsys, export, tmp_path):
    from rewriting import assert_logits_close, run_both

    source = export("llama", "dynamo")
    out = tmp_path / "whitened.onnx"
    with pytest.warns(UserWarning, match="random token ids"):
        code, _, _ = _run(capsys, "rewrite", source, "-o", out, "--rank", "full", "--targets", "all",
                          "--calib", "random", "--calib-samples", "4", "--seq-len", "32", "--quiet")
    assert code == 0
    expected, actual = run_both(source, out, batch=2, seq_len=9, seed=3)
    assert_logits_close(expected, actual)


def test_whitening_lowers_the_output_error_of_a_real_export(capsys, export, tmp_path):
    source = export("qwen3", "dynamo")
    stats = tmp_path / "stats.npz"
    reports = {}
    for method in ("svd", "whiten"):
        report = tmp_path / f"{method}.json"
        saved = ["--calib", stats] if stats.exists() else ["--calib", "random", "--save-calib-stats", stats]
        code, _, _ = _run(capsys, "rewrite", source, "-o", tmp_path / f"{method}.onnx",
                          "--keep", "0.5", "--align", "32",
                          "--method", method, *saved, "--calib-samples", "8", "--seq-len", "64", "--report", report,
                          "--quiet")
        assert code == 0
        reports[method] = json.loads(report.read_text())
    for plain, whitened in zip(reports["svd"]["layers"], reports["whiten"]["layers"]):
        if plain["status"] == "factorized":
            assert whitened["rank"] == plain["rank"]
            assert whitened["whitened_loss"] < plain["whitened_loss"]
            assert whitened["relative_error"] >= plain["relative_error"] - 1e-9  # plain SVD is optimal for W itself


def test_global_budget_spends_the_same_parameters(capsys, export, tmp_path):
    source = export("llama", "dynamo")
    totals = {}
    for budget in ("uniform", "global"):
        report = tmp_path / f"{budget}.json"
        code, _, _ = _run(capsys, "rewrite", source, "-o", tmp_path / f"{budget}.onnx",
                          "--keep", "0.5", "--align", "32",
                          "--calib", "random", "--calib-samples", "8", "--seq-len", "32", "--budget", budget,
                          "--report", report, "--quiet")
        assert code == 0
        totals[budget] = json.loads(report.read_text())
    assert totals["global"]["totals"]["parameters_after"] <= totals["uniform"]["totals"]["parameters_after"]
    ranks = {layer["rank"] for layer in totals["global"]["layers"] if layer["status"] == "factorized"}
    assert all(rank % 32 == 0 for rank in ranks)
    loss = {budget: sum(layer["whitened_loss"] ** 2 for layer in data["layers"] if layer["status"] == "factorized")
            for budget, data in totals.items()}
    assert loss["global"] <= loss["uniform"] + 1e-9


def test_whiten_without_calibration_is_an_error(capsys, export, tmp_path):
    code, _, err = _run(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--method", "whiten")
    assert code == 2 and "--method whiten learns from calibration data: give --calib" in err
    assert list(tmp_path.iterdir()) == []


def _characters(text, add_special_tokens=False, verbose=True):
    """A tokenizer with one token per character, so that window i starts at character i * seq_len."""
    return {"input_ids": [ord(c) for c in text]}


def _tokenize_by_characters(monkeypatch) -> None:
    """Calibration reads every text with `_characters`, whatever --tokenizer names."""
    monkeypatch.setattr(calibration_data, "load_tokenizer", lambda spec: _characters)
    monkeypatch.setattr(calibration_data, "check_tokenizer", lambda spec: None)


def _ten_lettered_windows(folder):
    """A text of 10 windows of 4 characters, aaaa bbbb ... jjjj (with `_characters`)."""
    text = folder / "t.txt"
    text.write_text("".join(chr(ord("a") + i) * 4 for i in range(10)))
    return text


def test_calibration_windows_come_from_the_start_or_spread_over_the_text(tmp_path):
    text = _ten_lettered_windows(tmp_path)
    first = calibration_data.windows_from_text(text, _characters, 4, 4)
    spread = calibration_data.windows_from_text(text, _characters, 4, 4, spread=True)
    assert ["".join(map(chr, w)) for w in first.tokens] == ["aaaa", "bbbb", "cccc", "dddd"]
    assert ["".join(map(chr, w)) for w in spread.tokens] == ["aaaa", "dddd", "gggg", "jjjj"]
    everything = calibration_data.windows_from_text(text, _characters, 10, 4, spread=True)
    np.testing.assert_array_equal(everything.tokens,
                                  calibration_data.windows_from_text(text, _characters, None, 4).tokens)


def test_spreading_windows_needs_a_text(capsys, export, tmp_path):
    code, _, err = _run(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", "random",
                        "--calib-spread")
    assert code == 2 and "--calib-spread chooses windows of a text" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o.onnx").exists()


def _record_windows(monkeypatch):
    """Record the windows (as strings of their token ids) the statistics and the budget's probe run on."""
    from onnx_nmm.ranks import sensitivity
    seen = {"statistics": [], "budget": []}
    gather = calibration_data.collect_gram_matrices

    def recording_gather(source, inputs, batches, *args, **kwargs):
        batches = list(batches)
        seen["statistics"].extend(" ".join(map(str, window)) for batch in batches for window in batch)
        return gather(source, inputs, batches, *args, **kwargs)

    class RecordingProbe(sensitivity.DamageProbe):
        def __init__(self, module, factor_names, decompositions, tokens, metric, source, narrowings=None):
            seen["budget"].extend(" ".join(map(str, window)) for window in tokens)
            super().__init__(module, factor_names, decompositions, tokens, metric, source, narrowings)

    monkeypatch.setattr(calibration_data, "collect_gram_matrices", recording_gather)
    monkeypatch.setattr(sensitivity, "DamageProbe", RecordingProbe)
    return seen


def test_a_budget_is_never_measured_on_a_calibration_window(capsys, export, tmp_path, monkeypatch):
    """The statistics and the budget's windows are disjoint, by their token ids and by the report's window
    ids, and the held-out windows are spread over the text as the calibration's are."""
    text = _ten_lettered_windows(tmp_path)
    _tokenize_by_characters(monkeypatch)
    seen = _record_windows(monkeypatch)
    report = tmp_path / "r.json"
    code, out, err = _run(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", text,
                          "--tokenizer", text, "--seq-len", "4", "--calib-samples", "6", "--calib-spread",
                          "--max-ppl-increase", "0.5", "--sensitivity-windows", "2", "--report", report,
                          "--calib-mix", "0",  # the text's windows alone: the character tokenizer cannot generate
                          "--no-answer-check")  # and has no chat to answer in
    assert code == 0, err
    as_text = {kind: ["".join(chr(int(t)) for t in window.split()) for window in windows]
               for kind, windows in seen.items()}
    assert len(as_text["statistics"]) == 6 and len(as_text["budget"]) == 2
    assert not set(as_text["statistics"]) & set(as_text["budget"])
    assert as_text["budget"] == ["bbbb", "jjjj"]  # spread: from both ends of the text, not the first two
    written = json.loads(report.read_text())
    held_out = written["quality_budget"]["spread"]["windows"]
    assert held_out == ["t.txt#1", "t.txt#9"] and not set(held_out) & set(written["calibration_windows"])
    assert len(written["quality_budget"]["spread"]["per_window"]) == 2
    assert "held out of the statistics" in out and "per window" in out


def test_a_budget_on_loaded_statistics_refuses_windows_they_came_from(capsys, export, tmp_path, monkeypatch):
    """Statistics saved from 6 windows, loaded by a budget rewrite that calibrates on 4: its held-out windows
    would be windows 5 and 6, which the statistics saw: a one-line error, and no output."""
    text = _ten_lettered_windows(tmp_path)
    _tokenize_by_characters(monkeypatch)
    model, stats, out = export("llama", "dynamo"), tmp_path / "s.npz", tmp_path / "o.onnx"
    common = ["--calib", text, "--tokenizer", text, "--seq-len", "4", "--quiet", "--no-answer-check", "--calib-mix",
              "0", "--sensitivity-windows", "2"]
    code, _, err = _run(capsys, "rewrite", model, "-o", tmp_path / "first.onnx", *common, "--calib-samples", "6",
                        "--keep", "0.5", "--save-calib-stats", stats)
    assert code == 0, err
    assert calibration_data.GramStatistics.load(stats).windows == tuple(f"t.txt#{i}" for i in range(6))
    budget = ["--max-ppl-increase", "0.5", "--calib-stats", stats]
    code, _, err = _run(capsys, "rewrite", model, "-o", out, *common, "--calib-samples", "4", *budget)
    assert code != 0 and not out.exists()
    assert "came from 2 of the windows the quality budget is measured on (t.txt#4, t.txt#5)" in err
    assert "--calib-samples" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(capsys, "rewrite", model, "-o", out, *common, "--calib-samples", "6", *budget)
    assert code == 0, err


@pytest.mark.slow
def test_mixed_and_generated_calibration_hold_windows_out_of_each_source(tmp_path, monkeypatch):
    """A text mixed with windows the model generates: each source gives its windows, the budget windows are
    held out of both and are none of them; the generated windows are the same for the same seed."""
    from exported_models import exported_model

    import onnx_nmm

    text = _ten_lettered_windows(tmp_path)
    _tokenize_by_characters(monkeypatch)
    monkeypatch.setenv("ONNX_NMM_CACHE", str(tmp_path / "cache"))
    seen = _record_windows(monkeypatch)
    generated = onnx_nmm.GeneratedText(samples=3, batch=2, start_token=1, seed=5)
    options = onnx_nmm.RewriteOptions(
        ranks=onnx_nmm.RankOptions(max_ppl_increase=0.5, sensitivity_windows=2),
        calibration=onnx_nmm.CalibrationOptions([str(text), generated], text, samples=4, seq_len=4),
        check_answers=False)  # the character tokenizer has no chat template to ask questions with
    result = onnx_nmm.rewrite(exported_model("llama", "dynamo"), options)
    statistics, budget = seen["statistics"], seen["budget"]
    assert len(statistics) == 4 + 3 and len(budget) == 2 and not set(statistics) & set(budget)
    ids = result.report.to_dict()["calibration_windows"]
    assert ids == [f"t.txt#{i}" for i in range(4)] + [f"generated#{i}" for i in range(3)]
    assert result.report.quality_budget["spread"]["windows"] == ["t.txt#4", "generated#3"]
    monkeypatch.setenv("ONNX_NMM_CACHE", "off")  # sampled again, not read back
    again = onnx_nmm.calibration.generated_text.generated_windows(generated, exported_model("llama", "dynamo"), 4,
                                                                  samples=4)
    assert [" ".join(map(str, w)) for w in again.tokens] == statistics[4:] + [budget[1]]
    assert all(window.split()[0] == "1" for window in statistics[4:])  # each starts with the start token


def test_text_calibration_needs_a_tokenizer(capsys, export, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some words")
    code, _, err = _run(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", text)
    assert code == 2 and "--tokenizer" in err and not (tmp_path / "o.onnx").exists()


def test_calibration_sources_parse_generated_and_mix(tmp_path):
    import onnx_nmm
    from onnx_nmm.cli._common import calibration_sources

    options = onnx_nmm.CalibrationOptions(["a.txt", "generated:8", "generated"])
    assert options.source == ("a.txt", onnx_nmm.GeneratedText(samples=8), onnx_nmm.GeneratedText())
    assert onnx_nmm.CalibrationOptions("generated:5").source == onnx_nmm.GeneratedText(samples=5)
    with pytest.raises(onnx_nmm.OptionError, match="generated:N with N the number of windows"):
        onnx_nmm.CalibrationOptions("generated:many")
    assert calibration_sources(["a.txt"], None) == "a.txt"
    assert calibration_sources(["a.txt", "generated:4"], "kv.onnx") == [
        "a.txt", onnx_nmm.GeneratedText(samples=4, generator="kv.onnx")]


def test_nucleus_sampling_keeps_to_the_nucleus_and_repeats_with_its_seed():
    from onnx_nmm.calibration.generated_text import sample_nucleus

    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    picks = sample_nucleus(logits, 1.0, 0.75, np.random.default_rng(0))
    assert set(picks) == {0, 1}  # 0.5 + 0.3 crosses 0.75: the rest is cut
    assert abs(np.mean(picks == 0) - 0.5 / 0.8) < 0.05
    np.testing.assert_array_equal(picks, sample_nucleus(logits, 1.0, 0.75, np.random.default_rng(0)))
    assert set(sample_nucleus(logits, 1.0, 0.4, np.random.default_rng(1))) == {0}


def test_a_generator_without_generated_windows_is_refused_in_one_line(tmp_path, capsys):
    from onnx_nmm.cli import main

    text = tmp_path / "a.txt"
    text.write_text("some words " * 200)
    for command in (["rewrite", "m.onnx", "-o", str(tmp_path / "o.onnx"), "--calib", str(text),
                     "--calib-generator", "kv.onnx"],
                    ["finetune", "m.onnx", "-o", str(tmp_path / "o.onnx"), "--text", str(text),
                     "--generator", "kv.onnx"]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "generated:N" in err, err
        assert not (tmp_path / "o.onnx").exists()


def test_sampling_from_a_model_without_a_cache_says_how_long_first(tmp_path, monkeypatch):
    """Every step of a cache-free model re-reads the sequence: hours on a real model. Before the first batch,
    a warning says about how long, and what to give to go faster; a model with a cache samples without one."""
    import re
    import warnings

    from exported_models import exported_model

    import onnx_nmm
    from onnx_nmm.calibration.generated_text import generated_windows

    monkeypatch.setenv("ONNX_NMM_CACHE", "off")
    generated = onnx_nmm.GeneratedText(samples=4, batch=2, start_token=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        heard_before = []
        windows = generated_windows(generated, exported_model("llama", "dynamo"), 8,
                                    on_batch=lambda: heard_before.append(len(said)))
    assert windows.tokens.shape == (4, 8) and heard_before == [1, 1]
    message = str(said[0].message)
    assert "has no KV cache, so sampling 4 windows of 8 tokens re-reads the whole sequence" in message
    assert re.search(r"about \d+ (s|min|h)", message) and "--generator" in message
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        generated_windows(generated, exported_model("llama", "dynamo", cache=True), 8)
    assert not any("KV cache" in str(warning.message) for warning in said)


def test_sampling_generated_windows_is_a_phase_the_progress_hears(tmp_path, monkeypatch):
    """Generating calibration text takes minutes on a real model: it is said, batch by batch, not done in silence."""
    import contextlib

    from exported_models import exported_model

    import onnx_nmm

    monkeypatch.setenv("ONNX_NMM_CACHE", str(tmp_path / "cache"))
    heard = []

    class Recorder(onnx_nmm.Progress):
        @contextlib.contextmanager
        def phase(self, description, total=None):
            done = [0]

            class Counting(onnx_nmm.Phase):
                def advance(self, amount=1, detail=None):
                    done[0] += amount

            yield Counting()
            heard.append((description.split(" (")[0], total, done[0]))

    model = ModelSource(exported_model("llama", "dynamo"))
    options = onnx_nmm.CalibrationOptions(onnx_nmm.GeneratedText(samples=3, batch=2, start_token=1), seq_len=4)
    windows = calibration_data.CalibrationData(options, model.model.graph, model, progress=Recorder()).windows()
    assert len(windows.tokens) == 3 and heard == [("sampling calibration text", 2, 2)]


def test_what_a_calibration_source_is_is_decided_once_as_a_typed_value(tmp_path):
    """calibration.sources.calibration_source: the options hold the typed sources, and every consumer asks them."""
    from onnx_nmm import CalibrationOptions, GeneratedText
    from onnx_nmm.calibration.sources import (
        RandomTokens,
        StatisticsFile,
        TextFile,
        TokenArray,
        TokenIdsFile,
        calibration_source,
    )

    np.savez(tmp_path / "ids.npz", input_ids=np.zeros((2, 8), np.int64))
    GramStatistics({"x": np.eye(2)}, 8, "test").save(tmp_path / "stats.npz")
    kinds = {"a.txt": TextFile, str(tmp_path / "ids.npz"): TokenIdsFile, str(tmp_path / "stats.npz"): StatisticsFile,
             "random": RandomTokens, "generated:8": GeneratedText}
    for raw, kind in kinds.items():
        assert isinstance(calibration_source(raw), kind), raw
    assert isinstance(calibration_source(np.zeros((2, 8), np.int64)), TokenArray)
    options = CalibrationOptions(["a.txt", "generated:8"])
    assert [type(source) for source in options.sources] == [TextFile, GeneratedText] and not options.is_one_text
    assert CalibrationOptions("a.txt").is_one_text and not CalibrationOptions(str(tmp_path / "stats.npz")).has_tokens


def test_nucleus_sampling_over_a_large_vocabulary_picks_what_sorting_all_of_it_picks():
    from onnx_nmm.calibration.generated_text import sample_nucleus

    def sorting_everything(logits, top_p, rng):
        probabilities = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probabilities /= probabilities.sum(axis=-1, keepdims=True)
        order = np.argsort(-probabilities, axis=-1)
        sorted_p = np.take_along_axis(probabilities, order, axis=-1)
        sorted_p = np.where(np.cumsum(sorted_p, axis=-1) - sorted_p < top_p, sorted_p, 0.0)
        sorted_p /= sorted_p.sum(axis=-1, keepdims=True)
        picks = (sorted_p.cumsum(axis=-1) < rng.random((len(logits), 1))).sum(axis=-1)
        return order[np.arange(len(logits)), picks]

    rng = np.random.default_rng(0)
    peaked = rng.standard_normal((8, 50_000)) * 4  # the nucleus among the 1024 most likely
    flat = rng.standard_normal((8, 50_000)) * 0.1  # it is not: every token is sorted
    for logits in (peaked, flat):
        for seed in range(5):
            np.testing.assert_array_equal(sample_nucleus(logits.astype(np.float32), 1.0, 0.95,
                                                         np.random.default_rng(seed)),
                                          sorting_everything(logits.astype(np.float32).astype(np.float64), 0.95,
                                                             np.random.default_rng(seed)))
