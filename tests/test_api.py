"""The Python API: the README's example, every command's work done through the API alone, in-memory models,
typed errors in the API's terms, progress."""

import contextlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import onnx_nmm
from onnx_nmm.cli import main
from onnx_nmm.passes import svd_ops

README = Path(__file__).resolve().parent.parent / "README.md"
pytestmark = pytest.mark.xdist_group("lowering")  # finetune and compile lower to PyTorch, as test_lowering does


def _cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _token_ids(path, samples=4, seq_len=32, seed=0):
    np.savez(path, input_ids=np.random.default_rng(seed).integers(0, 1000, (samples, seq_len), dtype=np.int64))
    return path


def _initializers(path):
    return {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in onnx.load(path).graph.initializer}


def _assert_same_model(a, b):
    ours, theirs = _initializers(a), _initializers(b)
    assert ours.keys() == theirs.keys()
    for name, array in ours.items():
        np.testing.assert_array_equal(array, theirs[name], err_msg=name)
    assert [n.op_type for n in onnx.load(a).graph.node] == [n.op_type for n in onnx.load(b).graph.node]


def test_the_readme_python_example_runs(export, tmp_path, monkeypatch, capsys):
    example = re.search(r"## Python API.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    shutil.copy(export("llama", "dynamo"), tmp_path / "llama.onnx")
    _token_ids(tmp_path / "calibration.npz", samples=16, seq_len=64)  # 8 to calibrate on, 8 held out
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "gate 256x512" in printed and "top-1 agreement" in printed
    assert "ranks.keep must be in (0, 1] (the fraction of parameters kept), got 1.5" in printed
    narrowed, factorized = onnx.load(tmp_path / "llama.nmm.onnx"), onnx.load(tmp_path / "llama.svd.onnx")
    assert not any(node.domain == svd_ops.DOMAIN for node in narrowed.graph.node)  # plain, narrower MatMuls
    assert "perplexity increase measured on 8 calibration windows held out" in printed
    assert sum(node.domain == svd_ops.DOMAIN for node in factorized.graph.node) == 6


def test_rewrite_on_the_command_line_is_the_api(capsys, export, tmp_path):
    source, calib = export("qwen3", "dynamo"), _token_ids(tmp_path / "calib.npz")
    _cli(capsys, "rewrite", source, "-o", tmp_path / "cli.onnx", "--keep", "0.5", "--align", "32", "--calib", calib,
         "--method", "whiten", "--budget", "global", "--fuse-mlp", "--report", tmp_path / "cli.json", "--quiet")
    options = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.5, align=32, budget="global"),
                                      factorization=onnx_nmm.FactorizationOptions(method="whiten"),
                                      calibration=onnx_nmm.CalibrationOptions(calib), fuse_mlp=True)
    result = onnx_nmm.rewrite(source, options)
    result.save(tmp_path / "api.onnx")
    _assert_same_model(tmp_path / "cli.onnx", tmp_path / "api.onnx")
    report = json.loads((tmp_path / "cli.json").read_text())

    def rows(layers):
        return [(layer["name"], layer["status"], layer["rank"], layer["whitened_loss"]) for layer in layers]

    assert rows(report["layers"]) == rows(json.loads(json.dumps(result.report.to_dict()))["layers"])
    assert report["fused_mlps"] == result.report.fused_mlps and len(result.report.fused_mlps) == 2


def test_inspect_diff_eval_and_run_on_the_command_line_are_the_api(capsys, export, tmp_path):
    source = export("llama", "dynamo")
    rewritten = onnx_nmm.rewrite(source, onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.5, align=32)))
    rewritten.save(tmp_path / "r.onnx")
    candidate, tokens = tmp_path / "r.onnx", _token_ids(tmp_path / "text.npz", samples=2, seq_len=40)

    inspected = json.loads(_cli(capsys, "inspect", source, "--keep", "0.5", "--align", "32", "--json"))
    api = onnx_nmm.inspect(source, onnx_nmm.RankOptions(keep=0.5, align=32))
    assert inspected == json.loads(json.dumps(api.to_dict()))
    untargeted = [layer for layer in api.layers if not layer.targeted]  # attention and lm_head alike: one rule
    assert untargeted and all(layer.rank is None and layer.rank_note == "not targeted" for layer in untargeted)

    compared = json.loads(_cli(capsys, "diff", source, candidate, "--seq-len", "9", "--json"))
    assert compared == json.loads(json.dumps(onnx_nmm.diff(source, candidate,
                                                           onnx_nmm.DiffOptions(seq_len=9)).to_dict()))

    text = onnx_nmm.TextOptions(tokens, window=16)
    scored = json.loads(_cli(capsys, "eval", candidate, "--text", tokens, "--window", "16", "--json"))
    assert scored == json.loads(json.dumps(onnx_nmm.evaluate(candidate, text).to_dict()))
    on_text = json.loads(_cli(capsys, "diff", source, candidate, "--text", tokens, "--window", "16", "--json"))
    assert on_text == json.loads(json.dumps(onnx_nmm.diff_on_text(source, candidate, text).to_dict()))

    _cli(capsys, "run", candidate, "--seq-len", "5", "-o", tmp_path / "outputs.npz", "--json")
    with np.load(tmp_path / "outputs.npz") as saved:
        np.testing.assert_array_equal(saved["logits"], onnx_nmm.run_model(candidate, seq_len=5).outputs["logits"])


def test_compile_and_finetune_on_the_command_line_are_the_api(capsys, export, tmp_path):
    import torch

    source = export("llama", "dynamo")
    onnx_nmm.rewrite(source, onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.5, align=32))).save(
        tmp_path / "r.onnx")
    rewritten = tmp_path / "r.onnx"
    _cli(capsys, "compile", rewritten, "--seq-len", "16", "--dry-run", "-o", tmp_path / "cli.neuron")
    api = onnx_nmm.compile(rewritten, tmp_path / "api.neuron", onnx_nmm.CompileOptions(seq_len=16, dry_run=True))
    assert json.loads((tmp_path / "cli.neuron" / "manifest.json").read_text()) == json.loads(json.dumps(api.manifest))

    train = _token_ids(tmp_path / "train.npz", samples=4, seq_len=16)
    threads = torch.get_num_threads()
    try:
        _cli(capsys, "finetune", rewritten, "--text", train, "--steps", "3", "--threads", "1", "-o",
             tmp_path / "cli.tuned.onnx", "--quiet")
        options = onnx_nmm.FinetuneOptions(onnx_nmm.TrainingOptions(steps=3), threads=1)
        onnx_nmm.finetune(rewritten, onnx_nmm.TrainingData(train), options).save(tmp_path / "api.tuned.onnx")
    finally:
        torch.set_num_threads(threads)
    _assert_same_model(tmp_path / "cli.tuned.onnx", tmp_path / "api.tuned.onnx")


def test_an_in_memory_model_calibrates_like_its_file(export, tmp_path):
    """Calibration runs the original model in onnxruntime: from memory, its external weights stay where
    they are, and the caller's model is not changed."""
    source, calib = export("llama", "dynamo", external_data=True), _token_ids(tmp_path / "calib.npz")
    options = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.5, align=32),
                                      calibration=onnx_nmm.CalibrationOptions(calib))
    model = ir.load(source)
    from_memory = onnx_nmm.rewrite(model, options)
    from_file = onnx_nmm.rewrite(source, options)
    assert not any(node.domain == svd_ops.DOMAIN for node in model.graph)
    for name, value in from_file.model.graph.initializers.items():
        if ".svd_" in name:
            np.testing.assert_array_equal(from_memory.model.graph.initializers[name].const_value.numpy(),
                                          value.const_value.numpy(), err_msg=name)
    assert from_memory.report.calibration == from_file.report.calibration


def test_errors_name_options_by_their_path_in_the_api_and_by_their_flag_in_the_cli(capsys, export, tmp_path):
    with pytest.raises(onnx_nmm.OptionError, match=r"^calibration.samples must be a positive integer, got 0$"):
        onnx_nmm.CalibrationOptions("calib.npz", samples=0)
    with pytest.raises(onnx_nmm.OptionError, match="give ranks.keep, not ranks.rank"):
        onnx_nmm.RankOptions(rank=32, budget="global")
    code = main(["rewrite", str(export("llama", "dynamo")), "-o", str(tmp_path / "o.onnx"), "--calib", "x.npz",
                 "--calib-samples", "0"])
    assert code == 2 and capsys.readouterr().err.strip() == (
        "onnx-nmm rewrite: error: --calib-samples must be a positive integer, got 0")


def test_defaults_are_the_documented_ones():
    options = onnx_nmm.RewriteOptions()
    assert options.ranks.keep == 0.8 and options.ranks.align == 128 and options.method == "svd"
    assert options.selection == onnx_nmm.Selection(targets="mlp")
    text = onnx_nmm.CalibrationOptions("text.txt")
    calibrated = onnx_nmm.RewriteOptions(calibration=text)
    assert calibrated.method == "nystrom" and calibrated.calibration.samples == 128
    assert calibrated.ranks.rule == "max_ppl_increase" and calibrated.ranks.max_ppl_increase == 0.02
    assert calibrated.calibration.source == ("text.txt", onnx_nmm.GeneratedText(samples=32))  # the default mix
    assert calibrated.given_calibration == text
    kept = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.8), calibration=text)
    assert kept.method == "nystrom" and kept.ranks.rule == "keep"  # a rule given is the rule used
    assert kept.calibration == calibrated.calibration  # and a text that narrows MLPs is mixed all the same
    alone = onnx_nmm.CalibrationOptions("text.txt", mix_generated=0)
    assert onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.8), calibration=alone).calibration == alone
    whitened = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.8), calibration=text,
                                       factorization=onnx_nmm.FactorizationOptions(method="whiten"))
    assert whitened.calibration == text  # SVD methods take the text as given
    ids = onnx_nmm.CalibrationOptions("ids.npz")
    assert onnx_nmm.RewriteOptions(calibration=ids).calibration == ids  # token ids have no BOS to start text with
    ranked = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(rank=8), calibration=text)
    assert ranked.method == "whiten"  # ranks only: the MLPs are factorized, not narrowed
    assert onnx_nmm.RankOptions(energy=0.9).keep is None  # the default applies only when no rule is given
    assert calibrated.streamable() == calibrated  # narrowing streams layer by layer, with every default kept
    whitened_by_default = onnx_nmm.RewriteOptions(calibration=text,
                                                  factorization=onnx_nmm.FactorizationOptions(method="whiten"))
    streamed = whitened_by_default.streamable()  # a factorization streams matrix by matrix: no measured budget
    assert streamed.method == "whiten" and streamed.ranks.rule == "keep" and streamed.ranks.keep == 0.8
    with pytest.raises(onnx_nmm.OptionError, match=r"calibration.mix_generated must be 0 \(the text alone\)"):
        onnx_nmm.CalibrationOptions("text.txt", mix_generated=-1)


def test_progress_hears_every_phase(export, tmp_path):
    class Recorder(onnx_nmm.Progress):
        def __init__(self):
            self.phases = {}

        @contextlib.contextmanager
        def phase(self, description, total=None):
            recorder, done = self, [0]

            class Counting(onnx_nmm.Phase):
                def advance(self, amount=1, detail=None):
                    done[0] += amount

            yield Counting()
            recorder.phases[description.split(" (")[0]] = (total, done[0])

    recorder = Recorder()
    options = onnx_nmm.RewriteOptions(calibration=onnx_nmm.CalibrationOptions(_token_ids(tmp_path / "c.npz",
                                                                                         samples=16)))
    result = onnx_nmm.rewrite(export("llama", "dynamo"), options, recorder)  # the default: nystrom within +2 %
    searched = recorder.phases.pop("choosing within the perplexity budget +2.0%")
    assert recorder.phases == {"calibrating": (8 * 32, 8 * 32), "held-out activations": (8 * 32, 8 * 32),
                               "measuring sensitivity": (2, 2), "narrowing MLPs": (2, 2), "factorizing": (6, 6)}
    assert searched[0] is None and searched[1] == len(result.report.quality_budget["evaluations"]) - 1  # 0 is free
    assert set(result.report.seconds) == {"calibration", "rank selection", "narrowing", "factorization"}
