"""Fisher statistics (input and output-gradient Grams, by backpropagation) and the fisher rewrite end to end."""

import json

import numpy as np
import onnx
import pytest
from graphs import swiglu_mlp
from rewriting import assert_logits_close, run_both

from onnx_nmm import Selection
from onnx_nmm.calibration.activation_stats import GramStatistics, collect_gram_matrices
from onnx_nmm.calibration.calibration_data import observed_inputs
from onnx_nmm.cli import main
from onnx_nmm.decomposition.fisher import collect_fisher_statistics
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes import find_linear_layers, select_layers
from onnx_nmm.runtime.causal_lm import CausalLm


def _windows(samples=16, seq_len=64, vocab=1000, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (samples, seq_len), dtype=np.int64)


def _batches(windows, size=4):
    return [windows[start:start + size] for start in range(0, len(windows), size)]


def test_input_grams_equal_onnxruntimes(export):
    source = ModelSource(export("llama", "dynamo"))
    targets, _ = select_layers(find_linear_layers(source.model), Selection())
    windows = _windows(samples=4, seq_len=32)
    fisher = collect_fisher_statistics(source, targets, _batches(windows))
    reference = collect_gram_matrices(source, observed_inputs(targets), _batches(windows))
    assert fisher.grams.keys() == reference.grams.keys()  # gate and up share one input Gram
    for name, gram in reference.grams.items():
        np.testing.assert_allclose(fisher.grams[name], gram, rtol=1e-4, atol=1e-4 * np.abs(gram).max())
    assert fisher.tokens == reference.tokens == windows.size
    assert fisher.output_grams.keys() == {layer.name for layer in targets}
    # the output-gradient Grams, the bigger half, are kept in float32 (damped before use:
    # onnx_nmm.decomposition.whitening)
    assert {g.dtype for g in fisher.grams.values()} == {np.dtype(np.float64)}
    assert {g.dtype for g in fisher.output_grams.values()} == {np.dtype(np.float32)}


def test_the_lm_heads_output_gram_is_the_fisher_of_the_softmax(export):
    """The lm_head's output is the logits z, and ∂ℓ/∂z = softmax(z) − onehot(sampled), so in expectation
    over the sampled tokens G = Σ_t diag(p_t) − p_t p_tᵀ, which onnxruntime's logits give exactly."""
    source = ModelSource(export("llama", "dynamo"))
    head = [layer for layer in find_linear_layers(source.model) if layer.role == "lm_head"]
    windows = _windows(samples=32)
    statistics = collect_fisher_statistics(source, head, _batches(windows))
    session, model = source.session(), CausalLm.of_source(source)
    expected = 0.0
    for batch in _batches(windows):
        logits = session.run(None, model.feeds(batch))[0].reshape(-1, 1000).astype(np.float64)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        expected = expected + np.diag(p.sum(axis=0)) - p.T @ p
    sampled = statistics.output_gram(head[0].name)
    # 2,048 sampled tokens: quadratic forms agree to a few per cent (single entries are far noisier)
    for a in np.random.default_rng(1).standard_normal((8, 1000)):
        assert a @ sampled @ a == pytest.approx(a @ expected @ a, rel=0.15)
    assert np.trace(sampled) == pytest.approx(np.trace(expected), rel=0.05)
    ones = np.ones(1000)
    assert ones @ sampled @ ones < 1e-6 * np.trace(sampled)  # every gradient p − onehot sums to zero


@pytest.mark.parametrize("architecture, exporter", [("llama", "dynamo"), ("gpt2", "dynamo"), ("llama", "torchscript"),
                                                    ("qwen3", "dynamo-noopt")])
def test_a_full_rank_fisher_rewrite_reproduces_the_original(capsys, export, tmp_path, architecture, exporter):
    source, rewritten, tokens = export(architecture, exporter), tmp_path / "full.onnx", tmp_path / "tokens.npz"
    np.savez(tokens, input_ids=_windows(samples=4, seq_len=32))
    code = main([str(a) for a in ("rewrite", source, "-o", rewritten, "--method", "fisher", "--rank", "full",
                                  "--targets", "all", "--calib", tokens, "--quiet")])
    assert code == 0, capsys.readouterr().err
    for batch, seq_len, seed in [(1, 1, 0), (2, 7, 1)]:
        assert_logits_close(*run_both(source, rewritten, batch, seq_len, seed))


def test_the_global_budget_spends_parameters_by_predicted_kl(capsys, export, tmp_path):
    source = export("llama", "dynamo")
    reports = {}
    for budget in ("uniform", "global"):
        reports[budget] = tmp_path / f"{budget}.json"
        code = main([str(a) for a in ("rewrite", source, "-o", tmp_path / f"{budget}.onnx", "--method", "fisher",
                                      "--keep", "0.7", "--align", "16", "--budget", budget, "--calib", "random",
                                      "--calib-samples", "8", "--seq-len", "32", "--report", reports[budget],
                                      "--quiet")])
        assert code == 0, capsys.readouterr().err
    uniform, spent = (json.loads(reports[name].read_text()) for name in ("uniform", "global"))
    assert spent["totals"]["parameters_after"] <= uniform["totals"]["parameters_after"]
    factorized = [layer for layer in spent["layers"] if layer["status"] == "factorized"]
    assert factorized and all(layer["rank"] % 16 == 0 and layer["predicted_kl"] > 0 for layer in factorized)

    def predicted(report):
        return sum(layer["predicted_kl"] or 0.0 for layer in report["layers"])

    assert predicted(spent) < predicted(uniform)  # what it is for: less predicted damage for as many parameters


def test_saved_fisher_statistics_give_the_same_rewrite(capsys, export, tmp_path):
    source, stats = export("llama", "dynamo"), tmp_path / "stats.npz"
    common = ["--method", "fisher", "--keep", "0.6", "--align", "16", "--quiet"]
    assert main([str(a) for a in ("rewrite", source, "-o", tmp_path / "a.onnx", "--calib", "random",
                                  "--calib-samples", "4", "--seq-len", "32", "--save-calib-stats", stats,
                                  *common)]) == 0
    saved = GramStatistics.load(stats)
    assert saved.output_grams and saved.tokens == 4 * 32
    assert main([str(a) for a in ("rewrite", source, "-o", tmp_path / "b.onnx", "--calib", stats, *common)]) == 0
    expected, actual = run_both(tmp_path / "a.onnx", tmp_path / "b.onnx", 2, 9, 0)
    np.testing.assert_array_equal(expected, actual)


def test_fisher_with_statistics_that_lack_gradients_is_an_error(capsys, export, tmp_path):
    source, stats = export("llama", "dynamo"), tmp_path / "stats.npz"
    assert main([str(a) for a in ("rewrite", source, "-o", tmp_path / "a.onnx", "--calib", "random", "--calib-samples",
                                  "2", "--seq-len", "16", "--save-calib-stats", stats, "--quiet")]) == 0
    capsys.readouterr()
    code = main([str(a) for a in ("rewrite", source, "-o", tmp_path / "b.onnx", "--calib", stats,
                                  "--method", "fisher", "--quiet")])
    error = capsys.readouterr().err
    assert (code == 2 and "hold no output-gradient Grams, which --method fisher weighs by" in error
            and len(error.splitlines()) == 1)
    assert not (tmp_path / "b.onnx").exists()


def test_a_perplexity_budget_with_fisher_statistics_predicts_instead_of_measuring(capsys, export, tmp_path):
    report = tmp_path / "r.json"
    code = main([str(a) for a in ("rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--method", "fisher",
                                  "--calib", "random", "--calib-samples", "8", "--seq-len", "48", "--align", "32",
                                  "--max-ppl-increase", "0.02", "--report", report, "--quiet")])
    assert code == 0, capsys.readouterr().err
    budget = json.loads(report.read_text())["quality_budget"]
    assert budget["measured"] <= budget["budget"]
    # every aligned rank of every candidate has its predicted damage, increasing as the rank falls
    for predictions in budget["sensitivity"].values():
        ranks, damages = zip(*predictions)
        assert list(ranks) == sorted(ranks, reverse=True) and list(damages) == sorted(damages)


def test_fisher_on_a_model_that_is_not_a_causal_lm_is_a_one_line_error(capsys, tmp_path):
    source, ids = tmp_path / "mlp.onnx", tmp_path / "ids.npz"
    onnx.save(swiglu_mlp(), source)
    np.savez(ids, input_ids=np.zeros((2, 8), dtype=np.int64))
    code = main([str(a) for a in ("rewrite", source, "-o", tmp_path / "o.onnx", "--method", "fisher", "--calib", ids,
                                  "--quiet")])
    error = capsys.readouterr().err
    assert code == 2 and "cannot make from token ids: it runs causal LMs" in error and len(error.splitlines()) == 1
    assert not (tmp_path / "o.onnx").exists()
