"""The commands as a user types them: outputs, exit codes, and one-line errors that leave no files."""

import json
import shutil
import subprocess
import sys

import graphs
import numpy as np
import onnx
import pytest

from onnx_nmm.cli import main
from onnx_nmm.passes import svd_ops


def _cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _assert_one_line_error(code, err, expected_code, fragment):
    assert code == expected_code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and fragment in lines[0], err


def test_inspect_lists_every_linear_layer(capsys, export):
    code, out, _ = _cli(capsys, "inspect", export("llama", "dynamo"), "--json")
    data = json.loads(out)
    assert code == 0 and data["totals"]["layers"] == 15 and data["totals"]["targeted_layers"] == 6
    assert {row["role"] for row in data["layers"] if row["targeted"]} == {"gate", "up", "down"}
    assert all(row["rank"] == 128 for row in data["layers"] if row["targeted"])
    code, out, _ = _cli(capsys, "inspect", export("gpt2", "torchscript"), "--keep", "0.5", "--align", "32")
    assert code == 0 and "mlp/fc1" in out and "attention/qkv" in out and "+bias" in out


def test_rewrite_then_diff(capsys, copied_export, tmp_path):
    source = copied_export("qwen3", "dynamo")
    report = tmp_path / "report.json"
    code, out, _ = _cli(capsys, "rewrite", source, "--keep", "0.5", "--align", "32", "--report", report)
    rewritten = source.with_name("model.nmm.onnx")
    assert code == 0 and rewritten.exists() and "6 layers factorized" in out
    data = json.loads(report.read_text())
    assert data["totals"]["layers_factorized"] == 6 and data["totals"]["kept_fraction"] == pytest.approx(0.5, abs=0.13)
    assert all(0 < layer["relative_error"] < 1 for layer in data["layers"] if layer["status"] == "factorized")
    code, out, _ = _cli(capsys, "diff", source, rewritten, "--json", "--seq-len", "12", "--batch", "2")
    (logits,) = json.loads(out)["outputs"]
    assert code == 0 and logits["shape"] == [2, 12, 1000]
    assert 0 < logits["mean_kl"] and 0 <= logits["top1_agreement"] <= 1 and logits["cosine"] < 1
    code, _, _ = _cli(capsys, "diff", source, rewritten, "--atol", "1e-6")
    assert code == 1  # low-rank logits are not within 1e-6
    code, _, _ = _cli(capsys, "diff", source, source, "--atol", "0")
    assert code == 0


def test_diff_reads_inputs_from_npz(capsys, export, tmp_path):
    source = export("gpt2", "dynamo")
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, input_ids=np.arange(10, dtype=np.int64).reshape(2, 5), attention_mask=np.ones((2, 5), np.int64))
    code, out, _ = _cli(capsys, "diff", source, source, "--inputs", inputs, "--json")
    assert code == 0 and json.loads(out)["inputs"] == {"input_ids": [2, 5], "attention_mask": [2, 5]}
    np.savez(inputs, input_ids=np.zeros((1, 3), np.int64))  # token ids alone: a causal LM's feeds complete them
    code, out, _ = _cli(capsys, "diff", source, source, "--inputs", inputs, "--json")
    assert code == 0 and json.loads(out)["inputs"] == {"input_ids": [1, 3], "attention_mask": [1, 3]}
    np.savez(inputs, ids_of_tokens=np.zeros((1, 3), np.int64))
    code, _, err = _cli(capsys, "diff", source, source, "--inputs", inputs)
    _assert_one_line_error(code, err, 2, "model input(s) input_ids, attention_mask not in")


def test_not_an_onnx_file(capsys, tmp_path):
    bogus = tmp_path / "model.onnx"
    bogus.write_text("this is not a protobuf")
    for command in (["inspect", bogus], ["rewrite", bogus], ["diff", bogus, bogus]):
        code, _, err = _cli(capsys, *command)
        _assert_one_line_error(code, err, 2, "is not an ONNX model")
    assert _listing(tmp_path) == ["model.onnx"]


def test_missing_external_data(capsys, copied_export):
    source = copied_export("llama", "dynamo", external_data=True)
    (source.parent / "model.onnx.data").unlink()
    before = _listing(source.parent)
    code, _, err = _cli(capsys, "rewrite", source, "-o", source.parent / "out.onnx")
    _assert_one_line_error(code, err, 2, "external data file 'model.onnx.data', which is missing")
    assert _listing(source.parent) == before


def test_output_equal_to_input_needs_force(capsys, copied_export):
    source = copied_export("llama", "torchscript")
    original = source.read_bytes()
    code, _, err = _cli(capsys, "rewrite", source, "-o", source, "--align", "32")
    _assert_one_line_error(code, err, 2, "would overwrite the input")
    assert source.read_bytes() == original and _listing(source.parent) == ["model.onnx"]
    code, _, _ = _cli(capsys, "rewrite", source, "-o", source, "--align", "32", "--force", "--quiet")
    assert code == 0 and _listing(source.parent) == ["model.onnx"]
    assert any(node.domain == svd_ops.DOMAIN for node in onnx.load(source).graph.node)


def test_output_over_the_inputs_external_data_needs_force(capsys, copied_export):
    source = copied_export("llama", "dynamo", external_data=True)
    code, _, err = _cli(capsys, "rewrite", source, "-o", source.parent / "model.onnx")
    _assert_one_line_error(code, err, 2, "would overwrite the input")


def test_no_linear_layers(capsys, tmp_path):
    path = tmp_path / "relu.onnx"
    onnx.save(graphs.no_linear_layers(), path)
    code, _, err = _cli(capsys, "rewrite", path, "-o", tmp_path / "out.onnx")
    _assert_one_line_error(code, err, 2, "no linear layer found: looked for MatMul/Gemm")
    assert _listing(tmp_path) == ["relu.onnx"]


def test_targets_that_match_nothing(capsys, export, tmp_path):
    code, _, err = _cli(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--include", "nope")
    _assert_one_line_error(code, err, 2, "none of the 15 linear layers matches")
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("keep", ["0", "1.5", "-0.2"])
def test_keep_outside_the_unit_interval(capsys, export, tmp_path, keep):
    code, _, err = _cli(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--keep", keep)
    _assert_one_line_error(code, err, 2, "--keep must be in (0, 1]")
    assert _listing(tmp_path) == []


def test_rank_above_min_k_n(capsys, export, tmp_path):
    code, _, err = _cli(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--rank", "300")
    _assert_one_line_error(code, err, 2, "--rank 300 is above min(K, N) = 256")
    assert _listing(tmp_path) == []


def test_bad_regex(capsys, export, tmp_path):
    code, _, err = _cli(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--exclude", "(")
    _assert_one_line_error(code, err, 2, "is not a valid regular expression")


def test_console_script_runs(tmp_path):
    executable = shutil.which("onnx-nmm") or f"{sys.executable} -m onnx_nmm"
    path = tmp_path / "m.onnx"
    onnx.save(graphs.matmul(), path)
    result = subprocess.run([*executable.split(), "inspect", str(path), "--lm-head"], capture_output=True, text=True)
    assert result.returncode == 0 and "lm_head" in result.stdout
    result = subprocess.run([*executable.split(), "inspect", str(tmp_path / "missing.onnx")], capture_output=True,
                            text=True)
    assert result.returncode == 2 and result.stderr.strip().endswith("give the path of an .onnx model")
