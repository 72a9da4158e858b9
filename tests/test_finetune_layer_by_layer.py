"""`finetune --layer-by-layer`: each decoder layer of a rewritten model tuned in turn to the dense layer's outputs
on the residual stream of the layers tuned before it, one layer in memory at a time; the path `finetune` takes
by itself when the whole model would not fit in memory twice."""

import contextlib
import json

import numpy as np
import pytest
import torch
from exported_models import exported_model

import onnx_nmm
from onnx_nmm.cli import main
from onnx_nmm.layerwise import memory
from onnx_nmm.model_io import load_model
from onnx_nmm.model_source import ModelSource
from onnx_nmm.runtime.backend_runner import ModelRunner
from onnx_nmm.training import layer_by_layer
from onnx_nmm.training.layer_pairs import LayerPairs

pytestmark = pytest.mark.xdist_group("lowering")

VOCAB = 1000
WORDS = 16  # token ids drawn below this: held-out windows hold the training windows' tokens in other orders, and a
# random-weight model's layers then have something to generalise
TRAINING = onnx_nmm.TrainingOptions(steps=30, learning_rate=1e-3, batch=4)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny models' matrices are so small that a second thread costs more than the maths."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def narrowed_llama(tmp_path_factory):
    """The tiny two-layer Llama, its MLPs narrowed by nystrom to half their width (the rewrite records it)."""
    output = tmp_path_factory.mktemp("narrowed") / "narrowed.onnx"
    assert main(["rewrite", str(exported_model("llama", "dynamo")), "-o", str(output), "--method", "nystrom",
                 "--calib", "random", "--calib-samples", "4", "--calib-window", "32", "--keep", "0.5", "--align",
                 "32", "--quiet"]) == 0
    return output


def _tokens(samples, seq_len, seed):
    return np.random.default_rng(seed).integers(0, WORDS, (samples, seq_len), dtype=np.int64)


def _initializers(model):
    return {name: value.const_value.numpy() for name, value in model.graph.initializers.items()}


class _Details(onnx_nmm.Progress):
    """What each phase was told as it advanced."""

    def __init__(self):
        self.details = {}

    @contextlib.contextmanager
    def phase(self, description, total=None):
        details = self.details.setdefault(description, [])

        class Phase(onnx_nmm.Phase):
            def advance(self, amount=1, detail=None):
                details.append(detail)

        yield Phase()


def _mean_log_loss(model, tokens):
    """−mean log q(x_{t+1} | x_≤t) of `model` (onnxruntime) over the windows of 16 tokens that `tokens` [1, 64]
    is cut into."""
    windows = tokens.reshape(-1, 16)
    logits = ModelRunner(model).logits(windows).astype(np.float64)[:, :-1]
    log_q = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    return -np.mean(np.take_along_axis(log_q, windows[:, 1:, None], axis=-1))


def _layer_errors(dense, compressed, tuned, tokens):
    """For each layer i, on the residual stream of `tuned`'s layers before it: ‖f(X̃ᵢ) − dense layer i(X̃ᵢ)‖² of
    the `compressed` layer and of the `tuned` one."""
    before, after = LayerPairs.of(ModelSource(dense), ModelSource(compressed)), \
        LayerPairs.of(ModelSource(dense), ModelSource(tuned))
    carried, errors = {}, []
    for layer in range(after.layers):
        outputs = {}
        for name, pairs, cut in (("dense", after, after.dense), ("compressed", before, before.compressed),
                                 ("tuned", after, after.compressed)):
            segment = cut.segments[layer]
            source = pairs.dense_source if cut is pairs.dense else pairs.compressed_source
            outputs[name] = source.session_of(segment.model).run(segment.outputs,
                                                                 pairs.feeds(segment, tokens, carried))
        errors.append(tuple(float(np.sum((outputs[name][0] - outputs["dense"][0]) ** 2))
                            for name in ("compressed", "tuned")))
        carried |= dict(zip(after.compressed.segments[layer].outputs, outputs["tuned"]))
    return errors


def test_each_tuned_layer_is_closer_to_the_dense_layer_on_held_out_windows(narrowed_llama, tmp_path):
    options = onnx_nmm.FinetuneOptions(TRAINING, layer_by_layer=True)
    result = onnx_nmm.finetune(narrowed_llama, onnx_nmm.TrainingData(_tokens(32, 32, seed=0)), options)
    work = result.work.folder
    tuned = result.save(tmp_path / "tuned.onnx")

    assert not work.exists()  # the tuned weights' files went once the model was written
    assert result.loss == layer_by_layer.LAYER_LOSS and result.teacher == str(exported_model("llama", "dynamo"))
    assert [layer.layer for layer in result.layers] == [0, 1] and result.training.records[-1].step == 60
    assert all(layer.error_after < layer.error_before for layer in result.layers)  # on the training windows
    held_out = _tokens(4, 32, seed=9)
    errors = _layer_errors(exported_model("llama", "dynamo"), narrowed_llama, tuned, held_out)
    assert all(after < 0.75 * before for before, after in errors), errors
    before, after = _initializers(load_model(narrowed_llama)), _initializers(load_model(tuned))
    narrowed = {name for name in before if name.endswith(".narrowed")}
    assert len(narrowed) == 6 and all(not np.array_equal(before[name], after[name]) for name in narrowed)
    assert all(np.array_equal(before[name], after[name]) for name in set(before) - narrowed)
    assert ModelRunner(tuned).logits(held_out).shape == (4, 32, VOCAB)


def test_a_killed_run_takes_up_after_the_last_finished_layer_and_writes_the_same_weights(narrowed_llama, tmp_path,
                                                                                         monkeypatch):
    data = onnx_nmm.TrainingData(_tokens(4, 16, seed=1))
    whole = onnx_nmm.finetune(narrowed_llama, data, onnx_nmm.FinetuneOptions(TRAINING, layer_by_layer=True))
    expected = _initializers(load_model(whole.save(tmp_path / "uninterrupted.onnx")))

    output = tmp_path / "tuned.onnx"
    options = onnx_nmm.FinetuneOptions(TRAINING, layer_by_layer=True, output=output)
    tune, tuned_layers = layer_by_layer._tune_layer, []

    def killed_at_layer_1(pairs, layer, *args):
        if layer == 1:
            raise KeyboardInterrupt
        return tune(pairs, layer, *args)

    monkeypatch.setattr(layer_by_layer, "_tune_layer", killed_at_layer_1)
    with pytest.raises(KeyboardInterrupt):
        onnx_nmm.finetune(narrowed_llama, data, options)
    assert (tmp_path / "tuned.onnx.partial" / "layer-0000.json").is_file()

    def counted(pairs, layer, *args):
        tuned_layers.append(layer)
        return tune(pairs, layer, *args)

    monkeypatch.setattr(layer_by_layer, "_tune_layer", counted)
    result = onnx_nmm.finetune(narrowed_llama, data, options)
    assert tuned_layers == [1] and [layer.layer for layer in result.layers] == [0, 1]
    written = _initializers(load_model(result.save(output)))
    assert all(np.array_equal(written[name], array) for name, array in expected.items())
    assert not (tmp_path / "tuned.onnx.partial").exists()


def test_a_model_too_large_to_finetune_whole_is_tuned_layer_by_layer_and_says_so(capsys, tmp_path, monkeypatch):
    """The SVD-fused rewrite of the external-data export: external data in and out, a report per layer."""
    source = exported_model("llama", "dynamo", external_data=True)
    rewritten = tmp_path / "rewritten.onnx"
    assert main(["rewrite", str(source), "-o", str(rewritten), "--keep", "0.5", "--align", "32", "--quiet",
                 "--fuse-mlp"]) == 0
    np.savez(tmp_path / "train.npz", input_ids=_tokens(4, 16, seed=2))
    np.savez(tmp_path / "held-out.npz", input_ids=_tokens(1, 64, seed=5))
    monkeypatch.setattr(memory, "available_memory", lambda: 1 << 20)
    output, report = tmp_path / "tuned.onnx", tmp_path / "report.json"
    code = main([str(a) for a in ("finetune", rewritten, "--text", tmp_path / "train.npz", "--steps", 10, "--lr",
                                  "1e-3", "--eval-text", tmp_path / "held-out.npz", "-o", output, "--report", report)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "tuning it one layer at a time" in " ".join(err.split()) and "GB available" in err
    written = json.loads(report.read_text())
    assert written["loss"] == "layer-mse" and [layer["layer"] for layer in written["layers"]] == [0, 1]
    assert all(layer["relative_error_after"] < layer["relative_error_before"] for layer in written["layers"])
    assert "tuned 2 layers one at a time" in " ".join(out.split())
    after = written["perplexity_after"]["perplexity"]  # of the tuned weights (a random model's is no better)
    assert after == pytest.approx(float(np.exp(_mean_log_loss(output, _tokens(1, 64, seed=5)))), rel=1e-4)
    assert (tmp_path / "tuned.onnx.data").is_file() and not (tmp_path / "tuned.onnx.partial").exists()
    factors = [name for name in _initializers(load_model(rewritten)) if ".svd_" in name]
    before, after = _initializers(load_model(rewritten)), _initializers(load_model(output))
    assert factors and all(not np.array_equal(before[name], after[name]) for name in factors)

    code = main([str(a) for a in ("finetune", rewritten, "--text", tmp_path / "train.npz", "--steps", 1,
                                  "--whole-model", "-o", tmp_path / "whole.onnx", "--report", tmp_path / "w.json")])
    assert code == 0 and "one layer at a time" not in capsys.readouterr().err
    assert json.loads((tmp_path / "w.json").read_text())["loss"] == "distill"


@pytest.mark.parametrize("extra, message", [
    (["--loss", "next-token"], "--layer-by-layer tunes each layer to the dense layer's outputs: the next-token --loss"),
    (["--save-at", "1"], "--save-at are steps of one training, and --layer-by-layer trains each layer in turn"),
])
def test_what_layer_by_layer_cannot_do_is_a_one_line_error(capsys, narrowed_llama, tmp_path, extra, message):
    np.savez(tmp_path / "train.npz", input_ids=_tokens(4, 16, seed=3))
    output = tmp_path / "tuned.onnx"
    code = main([str(a) for a in ("finetune", narrowed_llama, "--text", tmp_path / "train.npz", "--layer-by-layer",
                                  "-o", output, *extra)])
    err = capsys.readouterr().err
    assert code == 2 and message in " ".join(err.split()) and len(err.strip().splitlines()) == 1, err
    assert not output.exists()


def test_a_layer_the_rewrite_kept_dense_is_passed_through_untrained(tmp_path):
    narrowed = tmp_path / "layer-1-narrowed.onnx"
    assert main(["rewrite", str(exported_model("llama", "dynamo")), "-o", str(narrowed), "--method", "nystrom",
                 "--calib", "random", "--calib-samples", "4", "--calib-window", "32", "--keep", "0.5", "--align",
                 "32", "--include", r"layers\.1\.", "--quiet"]) == 0
    progress = _Details()
    result = onnx_nmm.finetune(narrowed, onnx_nmm.TrainingData(_tokens(8, 16, seed=4)),
                               onnx_nmm.FinetuneOptions(TRAINING, layer_by_layer=True), progress)
    kept_dense, tuned = result.layers
    assert progress.details["layer by layer: each layer tuned to the dense layer's outputs"] == [
        "layer 1: kept dense", f"layer 2: relative error {tuned.error_before:.3g} → {tuned.error_after:.3g}"]
    assert kept_dense.steps == 0 and kept_dense.trainable_parameters == 0
    assert tuned.steps == 30 and tuned.error_after < tuned.error_before
    assert result.training.trainable_parameters == tuned.trainable_parameters and not result.loss_rose
    before, after = _initializers(load_model(narrowed)), _initializers(load_model(result.save(tmp_path / "t.onnx")))
    changed = {name for name in before if not np.array_equal(before[name], after[name])}
    assert len(changed) == 3 and all(name.endswith(".narrowed") for name in changed)


def test_a_time_budget_is_shared_by_the_layers(narrowed_llama):
    training = onnx_nmm.TrainingOptions(steps=100_000, time_budget=2.0, learning_rate=1e-4, batch=2)
    result = onnx_nmm.finetune(narrowed_llama, onnx_nmm.TrainingData(_tokens(4, 16, seed=6)),
                               onnx_nmm.FinetuneOptions(training, layer_by_layer=True))
    first, second = result.layers
    assert first.stopped_by == second.stopped_by == "time" and result.training.stopped_by == "time"
    assert first.steps > 1 and second.steps > 1
    assert first.seconds <= 1.0 + 2 * first.seconds / first.steps  # half the budget, about one step over at most
    assert first.seconds + second.seconds <= 2.0 + 2 * (first.seconds / first.steps + second.seconds / second.steps)
    result.work.remove()  # the temporary folder the tuned weights lie in, which saving would remove


def test_adapters_on_the_factors_are_trained_layer_by_layer_and_merged_back(tmp_path):
    rewritten = tmp_path / "svd.onnx"
    assert main(["rewrite", str(exported_model("llama", "dynamo")), "-o", str(rewritten), "--keep", "0.5", "--align",
                 "32", "--quiet", "--fuse-mlp"]) == 0
    training = onnx_nmm.TrainingOptions(steps=10, learning_rate=1e-3, batch=2, adapter_rank=4)
    result = onnx_nmm.finetune(rewritten, onnx_nmm.TrainingData(_tokens(4, 16, seed=7)),
                               onnx_nmm.FinetuneOptions(training, layer_by_layer=True))
    before = _initializers(load_model(rewritten))
    factors = {name: array for name, array in before.items() if ".svd_" in name}
    assert result.training.trainable_parameters == sum(4 * sum(array.shape) for array in factors.values())
    after = _initializers(load_model(result.save(tmp_path / "tuned.onnx")))
    assert all(after[name].shape == array.shape and not np.array_equal(after[name], array)
               for name, array in factors.items())
    assert all(np.array_equal(before[name], after[name]) for name in set(before) - set(factors))
