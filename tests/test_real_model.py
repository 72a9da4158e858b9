"""SmolLM2-135M-Instruct, a real trained LLM: whitening must beat plain SVD on real text.

Slow (an export of ~100 s on first use, cached in .cache/assets): run in CI, skip locally with
`-m "not slow"`.
"""

import json

import assets
import pytest
from filelock import FileLock

from onnx_nmm import external_data_path
from onnx_nmm.cli import main

# one worker runs every test that writes GBs (here and test_large_model.py), so their files never add up
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gigabytes")]


@pytest.fixture(scope="module")
def smollm2():
    assets.CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(assets.CACHE / "smollm2.lock")):
        return assets.smollm2_onnx(), assets.smollm2_gguf()


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _perplexity(capsys, model, tokenizer, windows=4):
    out = _run(capsys, "eval", model, "--text", assets.kjv_text("evaluation"), "--tokenizer", tokenizer,
               "--window", "256", "--max-windows", windows, "--json")
    return json.loads(out)["perplexity"]


def _discard(model):
    """Remove a rewritten model once measured: these tests would otherwise hold GBs of them at once."""
    for path in (model, external_data_path(model)):
        path.unlink(missing_ok=True)


def test_whitened_svd_beats_plain_svd_on_smollm2(capsys, smollm2, tmp_path):
    model, tokenizer = smollm2
    dense = _perplexity(capsys, model, tokenizer)
    assert 3 < dense < 30  # a trained model on English text
    calibration = ["--calib", assets.kjv_text("calibration"), "--tokenizer", tokenizer, "--calib-samples", "16",
                   "--seq-len", "256"]
    perplexities = {}
    for method, extra in (("svd", []), ("whiten", calibration)):
        out = tmp_path / f"{method}.onnx"
        _run(capsys, "rewrite", model, "-o", out, "--keep", "0.8", "--align", "32", "--method", method, *extra,
             "--quiet")
        perplexities[method] = _perplexity(capsys, out, tokenizer)
        _discard(out)
    assert dense < perplexities["whiten"] < perplexities["svd"]
    assert perplexities["whiten"] < 0.01 * perplexities["svd"]  # plain SVD wrecks it; whitening does not


def test_full_rank_rewrite_of_smollm2_keeps_its_perplexity(capsys, smollm2, tmp_path):
    model, tokenizer = smollm2
    out = tmp_path / "full.onnx"
    _run(capsys, "rewrite", model, "-o", out, "--rank", "full", "--quiet")
    assert _perplexity(capsys, out, tokenizer, windows=2) == pytest.approx(_perplexity(capsys, model, tokenizer, 2),
                                                                           rel=1e-4)


def test_fisher_beats_whitening_at_the_same_parameter_count_on_smollm2(capsys, smollm2, tmp_path):
    """Weighing each output direction by the loss's gradients beats weighing only the inputs, at the same ranks;
    spending the same parameters where the predicted KL is least beats both (docs/quality.md)."""
    model, tokenizer = smollm2
    stats = tmp_path / "stats.npz"
    _run(capsys, "rewrite", model, "-o", tmp_path / "calibrated.onnx", "--method", "fisher", "--calib",
         assets.kjv_text("calibration"), "--tokenizer", tokenizer, "--calib-samples", "16", "--seq-len", "256",
         "--save-calib-stats", stats, "--quiet")
    _discard(tmp_path / "calibrated.onnx")
    perplexities, kept = {}, {}
    for name, flags in (("whiten", ["--method", "whiten"]), ("fisher", ["--method", "fisher"]),
                        ("fisher-global", ["--method", "fisher", "--budget", "global"])):
        out, report = tmp_path / f"{name}.onnx", tmp_path / f"{name}.json"
        _run(capsys, "rewrite", model, "-o", out, "--calib", stats, "--keep", "0.9", "--align", "32", *flags,
             "--report", report, "--quiet")
        perplexities[name] = _perplexity(capsys, out, tokenizer)
        _discard(out)
        kept[name] = json.loads(report.read_text())["totals"]["parameters_after"]
    assert kept["fisher-global"] <= kept["fisher"] == kept["whiten"]
    assert _perplexity(capsys, model, tokenizer) < perplexities["fisher-global"] < perplexities["fisher"] \
        < perplexities["whiten"]


def test_smollm2_answers_a_simple_question_before_and_after_a_full_rank_rewrite(capsys, tmp_path):
    assets.CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(assets.CACHE / "smollm2.lock")):
        model, tokenizer = assets.smollm2_kv_onnx(), assets.smollm2_gguf()
    out = tmp_path / "full.onnx"
    _run(capsys, "rewrite", model, "-o", out, "--rank", "full", "--quiet")
    answers = [_run(capsys, "generate", path, "--tokenizer", tokenizer, "--prompt", "What is the capital of France?",
                    "--max-new-tokens", "24") for path in (model, out)]
    _discard(out)
    assert "Paris" in answers[0] and answers[1] == answers[0]
