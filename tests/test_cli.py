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


def test_the_rewrite_summary_counts_every_outcome_and_the_table_groups_alike_layers(capsys, export, tmp_path):
    report = tmp_path / "r.json"
    code, out, _ = _cli(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--targets", "all",
                        "--keep", "0.9", "--report", report)  # at align 128 no attention matrix saves anything
    said = " ".join(out.split())
    assert code == 0 and ("6 layers factorized, 8 targeted but kept dense (the note says why), 1 left alone (not "
                          "targeted)") in said
    rows = [line for line in out.splitlines() if line.startswith("│ model.")]
    assert len(rows) == 6 + 4  # each MLP matrix its own errors; q, k, v and o of both layers one row each
    assert any("model.layers.{0,1}.self_attn.k_proj (2 layers)" in row and "rank 128 saves nothing" in row
               and "0.07M" in row for row in rows)  # the group's parameters summed
    assert [layer["status"] for layer in json.loads(report.read_text())["layers"]].count("dense") == 8


def test_folded_layer_names():
    from onnx_nmm.pipeline.report import folded_names

    assert folded_names(["layers.3.mlp", "layers.0.mlp", "layers.1.mlp", "layers.2.mlp", "layers.5.mlp",
                         "layers.7.mlp", "layers.8.mlp"]) == "layers.{0-3,5,7,8}.mlp"
    assert folded_names(["layers.0.mlp.up", "layers.1.mlp.down"]) == "layers.0.mlp.up, layers.1.mlp.down"
    assert folded_names(["h.0.mlp.c_fc", "h.1.mlp.c_fc"]) == "h.{0,1}.mlp.c_fc"


def test_inspect_says_what_a_rewrite_narrowed_and_factorized(capsys, export, tmp_path):
    source = export("llama", "dynamo")
    narrowed, factorized = tmp_path / "narrowed.onnx", tmp_path / "factorized.onnx"
    assert main(["rewrite", str(source), "-o", str(narrowed), "--calib", "random", "--calib-samples", "8",
                 "--calib-window", "32", "--align", "32", "--quiet"]) == 0
    assert main(["rewrite", str(source), "-o", str(factorized), "--keep", "0.5", "--align", "32", "--quiet"]) == 0
    code, out, _ = _cli(capsys, "inspect", narrowed)
    said = " ".join(out.split())
    assert code == 0 and f"Rewritten by onnx-nmm from {source.resolve()}" in said
    assert "6 narrowed (32 of 512 neurons kept in 6 layers)" in said and "keep=0.8" not in said
    assert said.count("narrowed: 32 of 512 neurons kept") == 6  # the rank column says what each MLP layer became
    data = json.loads(_cli(capsys, "inspect", factorized, "--json")[1])
    rows = {(row["role"], row["op"], row["k"], row["n"], tuple(row["ranks"])) for row in data["rewrite"]["factorized"]}
    assert rows == {("mlp/gate", "SvdMatMul", 256, 512, (96,)), ("mlp/up", "SvdMatMul", 256, 512, (96,)),
                    ("mlp/down", "SvdMatMul", 512, 256, (96,))}
    totals = data["rewrite"]["totals"]
    assert totals["factorized_layers"] == 6 and totals["parameters"] == 6 * 96 * (256 + 512)
    assert totals["parameters_before"] == 6 * 256 * 512
    code, out, _ = _cli(capsys, "inspect", factorized, "--keep", "0.5", "--align", "32")  # what another would do
    assert code == 0 and "6 factorized (ranks 96)" in " ".join(out.split()) and "at keep=0.5" in out
