"""What a newcomer trips over: incompatible models, a tied head that grows the model, silent no-ops,
misleading advice, the wrong tokenizer, and small things (tolerances, file modes, labels)."""

import json
import os
import re
import stat
from pathlib import Path

import graphs
import numpy as np
import onnx
import pytest
from onnx import helper

import onnx_nmm
from onnx_nmm.cli import main


def _cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code, err, fragment):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "error:" in lines[0] and fragment in lines[0], err


def _gated_by(activation: str) -> onnx.ModelProto:
    """A Gemma-like MLP: down(act(gate(x)) · up(x)) with another activation than SiLU."""
    nodes = [helper.make_node("MatMul", ["X", "Wg"], ["g"], name="/mlp/gate_proj/MatMul"),
             helper.make_node(activation, ["g"], ["a"], name="act"),
             helper.make_node("MatMul", ["X", "Wu"], ["u"], name="/mlp/up_proj/MatMul"),
             helper.make_node("Mul", ["a", "u"], ["h"], name="mul"),
             helper.make_node("MatMul", ["h", "Wd"], ["Y"], name="/mlp/down_proj/MatMul")]
    weights = {"Wg": graphs.weight(16, 32, 1), "Wu": graphs.weight(16, 32, 2), "Wd": graphs.weight(32, 16, 3)}
    return graphs.model(nodes, weights, k=16)


def test_models_that_differ_are_an_input_error_naming_both(capsys, tmp_path):
    narrow, wide, renamed = tmp_path / "narrow.onnx", tmp_path / "wide.onnx", tmp_path / "renamed.onnx"
    onnx.save(graphs.matmul(16, 24), narrow)
    onnx.save(graphs.matmul(16, 32), wide)
    other = graphs.matmul(16, 24)
    other.graph.input[0].name = other.graph.node[0].input[0] = "Z"
    onnx.save(other, renamed)
    np.savez(tmp_path / "x.npz", X=np.ones((1, 2, 16), np.float32))
    code, _, err = _cli(capsys, "diff", narrow, wide, "--inputs", tmp_path / "x.npz")
    _one_line_error(code, err, f"output Y is [1, 2, 24] in {narrow} but [1, 2, 32] in {wide}")
    code, _, err = _cli(capsys, "diff", narrow, renamed, "--inputs", tmp_path / "x.npz")
    _one_line_error(code, err, f"{narrow} and {renamed} differ in 2 of their inputs ('X' only in {narrow}; 'Z' only "
                               f"in {renamed})")
    many = graphs.matmul(16, 24)  # 40 inputs the other has not: the first few are named, then the count
    for i in range(40):
        many.graph.input.append(onnx.helper.make_tensor_value_info(f"extra_{i}", onnx.TensorProto.FLOAT, [1]))
    onnx.save(many, tmp_path / "many.onnx")
    code, _, err = _cli(capsys, "diff", narrow, tmp_path / "many.onnx", "--inputs", tmp_path / "x.npz")
    _one_line_error(code, err, "differ in 40 of their inputs ('extra_0' only in")
    assert "and 37 more" in err and len(err) < 300 + 6 * len(str(tmp_path))  # the paths, then a few names


def test_inspect_without_linear_layers_fails_naming_what_it_saw(capsys, tmp_path):
    path = tmp_path / "relu.onnx"
    onnx.save(graphs.no_linear_layers(), path)
    code, _, err = _cli(capsys, "inspect", path)
    _one_line_error(code, err, "no linear layer found")
    assert "saw 1 Relu" in err


def test_a_tied_head_says_what_it_costs_and_the_report_counts_it(capsys, export, tmp_path):
    report = tmp_path / "r.json"
    source = export("llama-tied", "dynamo")
    with pytest.warns(UserWarning, match=r"shares its weight with .* instead of saving any"):
        code, out, _ = _cli(capsys, "rewrite", source, "-o", tmp_path / "o.onnx", "--lm-head", "--include", "lm_head",
                            "--keep", "0.5", "--align", "32", "--report", report)
    assert code == 0
    data = json.loads(report.read_text())
    (head,) = [layer for layer in data["layers"] if layer["role"] == "lm_head"]
    assert head["status"] == "factorized" and "its weight stays for" in head["reason"]
    assert head["parameters_after"] == head["rank"] * (head["k"] + head["n"]) + head["k"] * head["n"]
    totals = data["totals"]
    assert totals["kept_fraction"] > 1 and totals["weight_bytes_after"] > totals["weight_bytes_before"]
    grown = totals["weight_bytes_after"] - totals["weight_bytes_before"]
    assert os.path.getsize(tmp_path / "o.onnx") - os.path.getsize(source) == pytest.approx(grown, rel=0.05)
    said = " ".join(out.split())
    assert f"the model's weights {totals['weight_bytes_before'] / 1e6:,.1f} MB → " in said


def test_fusion_that_fuses_nothing_says_why(capsys, tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(_gated_by("Relu"), path)
    with pytest.warns(UserWarning,
                      match=r"^no MLP could be fused: 1 gated by Relu, an activation onnx-nmm does not fuse"):
        code, _, _ = _cli(capsys, "rewrite", path, "-o", tmp_path / "o.onnx", "--rank", "8", "--fuse-mlp", "--quiet")
    assert code == 0


def test_a_gelu_gated_mlp_is_fused(capsys, tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(_gated_by("Gelu"), path)
    code, _, err = _cli(capsys, "rewrite", path, "-o", tmp_path / "o.onnx", "--rank", "8", "--fuse-mlp", "--quiet")
    fused = [node for node in onnx.load(tmp_path / "o.onnx").graph.node if node.op_type == "SvdGatedMLP"]
    assert code == 0 and [attribute.s for node in fused for attribute in node.attribute
                          if attribute.name == "activation"] == [b"gelu"], err


def test_a_gate_read_outside_its_activation_is_not_fused(capsys, tmp_path):
    """Fusing would drop the gate's value that another node reads."""
    model = _gated_by("Gelu")
    model.graph.node.append(helper.make_node("Identity", ["g"], ["gate_copy"], name="reader"))
    model.graph.output.append(helper.make_tensor_value_info("gate_copy", onnx.TensorProto.FLOAT, ["b", "s", 32]))
    onnx.save(model, tmp_path / "mlp.onnx")
    with pytest.warns(UserWarning,
                      match=r"^no MLP could be fused: 1 an Identity node outside the MLP reads a value inside it"):
        code, _, err = _cli(capsys, "rewrite", tmp_path / "mlp.onnx", "-o", tmp_path / "o.onnx", "--rank", "8",
                            "--fuse-mlp", "--quiet")
    assert code == 0, err


def test_an_mlp_with_reshapes_of_unknown_shape_between_its_projections_is_not_fused(capsys, export, tmp_path):
    """TorchScript's GPT-2 reshapes to 3-D and back between c_fc and c_proj, and its graph holds no shapes."""
    report = tmp_path / "r.json"
    with pytest.warns(UserWarning, match="no MLP could be fused: 2 reshapes between its projections, and no shapes"):
        code, _, _ = _cli(capsys, "rewrite", export("gpt2", "torchscript"), "-o", tmp_path / "o.onnx", "--keep", "0.5",
                          "--align", "32", "--fuse-mlp", "--report", report, "--quiet")
    assert code == 0 and len(json.loads(report.read_text())["unfused_mlps"]) == 2


def test_the_damping_note_names_the_cause(capsys, export, tmp_path):
    report = tmp_path / "r.json"
    code, out, _ = _cli(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", "random",
                        "--calib-samples", "2", "--seq-len", "32", "--align", "32", "--keep", "0.5",
                        "--method", "whiten", "--report", report)
    notes = {layer["role"]: layer["conditioning"] for layer in json.loads(report.read_text())["layers"]}
    assert code == 0 and notes["gate"].endswith("(64 calibration tokens for 256 input channels: "
                                                "calibrate on more tokens)")
    assert "the note column says why" in " ".join(out.split())


def test_a_text_from_another_tokenizer_is_refused_before_onnxruntime_complains(capfd, export, tmp_path):
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, input_ids=np.full((2, 16), 5000, np.int64))  # the tiny models know 1000 tokens
    for argv in (["eval", export("llama", "dynamo"), "--text", foreign, "--window", "8"],
                 ["rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", foreign]):
        code = main([str(arg) for arg in argv])
        err = capfd.readouterr().err  # onnxruntime's own log lines would show here, from C++
        _one_line_error(code, err, "outside")
        assert "tokenize with the model's own tokenizer" in err
    assert not (tmp_path / "o.onnx").exists()


def test_negative_tolerances_are_refused(capsys, export):
    source = export("llama", "dynamo")
    code, _, err = _cli(capsys, "diff", source, source, "--atol", "-1")
    _one_line_error(code, err, "--atol must be ≥ 0, got -1.0")


def test_reports_get_the_permissions_models_get(capsys, export, tmp_path):
    report = tmp_path / "r.json"
    code, _, _ = _cli(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--report", report,
                      "--quiet")
    mask = os.umask(0)
    os.umask(mask)
    assert code == 0 and stat.S_IMODE(report.stat().st_mode) == stat.S_IMODE((tmp_path / "o.onnx").stat().st_mode)
    assert stat.S_IMODE(report.stat().st_mode) == 0o666 & ~mask


def test_one_file_on_two_backends_is_labelled_by_backend(capsys, export, tmp_path):
    source = export("llama", "dynamo")
    rewritten = tmp_path / "r.onnx"
    assert main(["rewrite", str(source), "-o", str(rewritten), "--keep", "0.5", "--align", "32", "--quiet"]) == 0
    code, out, _ = _cli(capsys, "diff", rewritten, rewritten, "--backend", "torch", "--seq-len", "4")
    title = " ".join(out.split())
    assert code == 0 and f"{rewritten} (torch) vs {rewritten} (ort)" in title


def test_a_checkpoint_becomes_an_onnx_model_the_other_commands_take(capsys, tmp_path):
    import onnx
    import torch

    from onnx_nmm import TinyShape, build_model

    model = build_model("llama", TinyShape(hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, vocab=300))
    model.save_pretrained(tmp_path / "checkpoint")
    output = tmp_path / "model.onnx"
    code, out, err = _cli(capsys, "export", tmp_path / "checkpoint", "-o", output)
    assert code == 0 and f"wrote {output}" in out and output.exists()
    assert "torchvision" not in err  # torch.onnx's note about each torchvision op it skips
    assert [value.name for value in onnx.load(output).graph.input] == [
        "input_ids", "attention_mask", "position_ids", "past_key_values.0.key", "past_key_values.0.value"]
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids), use_cache=False).logits.numpy()
    np.savez(tmp_path / "ids.npz", input_ids=ids)  # token ids alone: an empty cache, a mask and positions added
    assert main(["run", str(output), "--inputs", str(tmp_path / "ids.npz"), "-o", str(tmp_path / "logits.npz")]) == 0
    with np.load(tmp_path / "logits.npz") as logits:
        np.testing.assert_allclose(logits["logits"], expected, atol=1e-4)
    capsys.readouterr()
    inspected = json.loads(_cli(capsys, "inspect", output, "--json")[1])
    assert inspected["layers"][0]["module_path"] == "model.layers.0.self_attn.q_proj"  # the checkpoint's own paths
    full = tmp_path / "full.onnx"
    assert main(["rewrite", str(output), "-o", str(full), "--rank", "full", "--targets", "all", "--quiet"]) == 0
    code, _, _ = _cli(capsys, "diff", output, full, "--past-len", "5", "--seq-len", "1", "--atol", "1e-4")
    assert code == 0  # a decode step after a filled cache, exact at full rank

    code, _, _ = _cli(capsys, "export", tmp_path / "checkpoint", "-o", tmp_path / "plain.onnx", "--no-cache")
    assert code == 0 and [value.name for value in onnx.load(tmp_path / "plain.onnx").graph.input] == [
        "input_ids", "attention_mask"]
    code, _, err = _cli(capsys, "export", tmp_path / "checkpoint", "-o", output)
    _one_line_error(code, err, "exists; choose another -o or set --force to replace it")
    code, _, err = _cli(capsys, "export", tmp_path / "ids.npz", "-o", tmp_path / "other.onnx")
    _one_line_error(code, err, "is neither a .gguf file nor a Hugging Face model folder")
    code, _, err = _cli(capsys, "export", tmp_path / "nothere.gguf", "-o", tmp_path / "other.onnx")
    _one_line_error(code, err, "nothere.gguf: no such file or folder")
    assert not (tmp_path / "other.onnx").exists()


def test_docs_commands_are_written_as_a_user_types_them():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        assert not re.search(r"(?<![\w.])/(work|root|home|tmp|Users)/", text), f"{page.name} names one machine's paths"
        assert "../" + "shared/" not in text, f"{page.name} links outside the repository"


def test_every_flag_says_what_it_does():
    from onnx_nmm.cli import build_parser

    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    for command, parser in subparsers.choices.items():
        for action in parser._actions:
            if action.dest != "help":
                assert action.help, f"onnx-nmm {command} {action.option_strings or action.dest} has no help text"


def test_counts_and_piped_tables_read_right(capsys, tmp_path):
    path = tmp_path / "head.onnx"
    onnx.save(graphs.matmul(16, 24), path)
    code, out, _ = _cli(capsys, "rewrite", path, "-o", tmp_path / "o.onnx", "--lm-head", "--rank", "4")
    assert code == 0 and "1 layer factorized," in " ".join(out.split())
    code, out, _ = _cli(capsys, "inspect", path)  # piped: no dimming to see, a column instead
    assert code == 0 and "targeted" in out and "see the targeted column" in " ".join(out.split())


def test_a_piped_table_keeps_every_layer_name_whole(capsys, export, tmp_path):
    from onnx_nmm.passes import find_linear_layers

    source = export("qwen3", "dynamo")
    code, out, _ = _cli(capsys, "rewrite", source, "-o", tmp_path / "o.onnx", "--targets", "all", "--keep", "0.5",
                        "--align", "32")
    assert code == 0 and "…" not in out
    paths = {layer.module_path for layer in find_linear_layers(onnx_nmm.model_io.load_model(source))}
    assert all(path.split("layers.")[-1] in out for path in paths if "layers." in path)


def test_a_long_command_on_a_non_terminal_says_how_far_it_is(capsys, export, tmp_path, monkeypatch):
    """No progress bars in a log, CI or nohup: a line every LOG_INTERVAL seconds instead, with how far the
    phase is; a phase shorter than that says nothing."""
    from onnx_nmm.cli import _common

    monkeypatch.setattr(_common, "LOG_INTERVAL", 0.05)
    code = main(["rewrite", str(export("llama", "dynamo")), "-o", str(tmp_path / "o.onnx"), "--calib", "random",
                 "--calib-samples", "4", "--seq-len", "32", "--keep", "0.5", "--align", "32"])
    err = capsys.readouterr().err
    assert code == 0
    lines = [line for line in err.splitlines() if line.startswith("onnx-nmm: ")]
    assert any(re.match(r"onnx-nmm: \S.*: (\d+/\d+ \(\d+%\), \d+ s|done in \d+ s)", line) for line in lines), err
    monkeypatch.setattr(_common, "LOG_INTERVAL", 60)
    assert main(["rewrite", str(export("llama", "dynamo")), "-o", str(tmp_path / "p.onnx"), "--keep", "0.5",
                 "--align", "32"]) == 0
    assert "onnx-nmm: " not in capsys.readouterr().err


def test_a_phase_interrupted_in_a_log_does_not_say_it_is_done(capsys, export, tmp_path, monkeypatch):
    """^C during a rewrite: the phase it stopped says how far it got, then "interrupted", never "done"."""
    import time

    from onnx_nmm.cli import _common

    def interrupted_rewrite(source, options, progress):
        with progress.phase("measuring sensitivity", total=4) as phase:
            phase.advance()
            time.sleep(0.2)
            raise KeyboardInterrupt

    monkeypatch.setattr(_common, "LOG_INTERVAL", 0.05)
    monkeypatch.setattr(onnx_nmm, "rewrite", interrupted_rewrite)
    code, _, err = _cli(capsys, "rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--keep", "0.5")
    assert code == 130 and "onnx-nmm: measuring sensitivity: 1/4 (25%)" in err, err
    assert "done in" not in err and err.strip().splitlines()[-1].endswith("interrupted; no output was written")
    assert not (tmp_path / "o.onnx").exists()


def test_an_output_that_is_a_folder_is_refused_before_any_work(capsys, export, tmp_path):
    folder = tmp_path / "adir"
    folder.mkdir()
    code = main(["rewrite", str(export("llama", "dynamo")), "-o", str(folder), "--keep", "0.5"])
    err = capsys.readouterr().err
    assert code == 2 and "is a folder: give -o a file name in it" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == [folder] and not list(folder.iterdir())  # no orphan data beside it


def test_a_missing_or_empty_calibration_text_is_refused_before_the_model_loads(capsys, tmp_path, monkeypatch):
    import onnx_nmm.pipeline as pipeline

    def never(model):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(pipeline.ModelSource, "of", never)
    (tmp_path / "empty.txt").write_text("\n  \n")
    for text, message in ((tmp_path / "missing.txt", "no such file"), (tmp_path / "empty.txt", "is empty"),
                          (tmp_path, "is a folder")):
        code = main(["rewrite", str(tmp_path / "model.onnx"), "-o", str(tmp_path / "o.onnx"), "--calib", str(text),
                     "--tokenizer", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_wrong_tokenizer_or_an_empty_text_is_refused_before_the_model_loads(capsys, export, tmp_path, monkeypatch):
    """Every command that takes --tokenizer or a text checks them first: a typo costs a second, not a load."""
    from onnx_nmm.model_source import ModelSource

    def never(model):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ModelSource, "of", never)
    model, tokenizer = export("llama", "dynamo"), Path(__file__).parent / "data" / "formats" / "genai-fp32"
    text, empty, no_tokenizer = tmp_path / "text.txt", tmp_path / "empty.txt", tmp_path / "folder"
    text.write_text("some text to score")
    empty.write_text(" \n")
    no_tokenizer.mkdir()
    np.savez(tmp_path / "ids.npz", input_ids=np.zeros((2, 8), np.int64))
    cases = [
        (["eval", model, "--text", tmp_path / "missing.txt", "--tokenizer", tokenizer], "no such file"),
        (["eval", model, "--text", empty, "--tokenizer", tokenizer], "is empty"),
        (["eval", model, "--text", text], "is text: give its --tokenizer"),
        (["eval", model, "--text", text, "--tokenizer", tmp_path / "missing"], "no such file or folder"),
        (["eval", model, "--text", text, "--tokenizer", no_tokenizer], "is a folder without a tokenizer"),
        (["eval", model, "--text", text, "--tokenizer", text], "is a file but not a GGUF one"),
        (["diff", model, model, "--text", empty, "--tokenizer", tokenizer], "is empty"),
        (["diff", model, model, "--text", text, "--tokenizer", no_tokenizer], "is a folder without a tokenizer"),
        (["finetune", model, "--text", empty, "--tokenizer", tokenizer, "-o", tmp_path / "t.onnx"], "is empty"),
        (["finetune", model, "--text", text, "--tokenizer", no_tokenizer, "-o", tmp_path / "t.onnx"],
         "is a folder without a tokenizer"),
        (["finetune", model, "--text", tmp_path / "ids.npz", "--eval-text", empty, "--tokenizer", tokenizer, "-o",
          tmp_path / "t.onnx"], "is empty"),
        (["generate", model, "--prompt", "hello", "--tokenizer", no_tokenizer], "is a folder without a tokenizer"),
        (["generate", model, "--prompt", "hello"], "generating needs a --tokenizer"),
        (["generate", model, "--prompt", " ", "--tokenizer", tokenizer], "the prompt is empty"),
        (["rewrite", model, "-o", tmp_path / "o.onnx", "--calib", text, "--tokenizer", no_tokenizer],
         "is a folder without a tokenizer"),
        (["rewrite", model, "-o", tmp_path / "o.onnx", "--calib", text], "is text: give its --tokenizer"),
        (["rewrite", model, "-o", tmp_path / "o.onnx", "--stream", "--method", "whiten", "--keep", "0.8", "--calib",
          empty, "--tokenizer", tokenizer], "is empty"),
    ]
    for argv, said in cases:
        code, _, err = _cli(capsys, *argv)
        _one_line_error(code, err, said)
    assert not (tmp_path / "t.onnx").exists() and not (tmp_path / "o.onnx").exists()


def test_a_missing_report_to_reuse_is_refused_before_the_model_loads(capsys, tmp_path, monkeypatch):
    import onnx_nmm.pipeline as pipeline

    def never(model):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(pipeline.ModelSource, "of", never)
    missing = tmp_path / "missing.json"
    for flags, flag in ((["--ranks-from", missing], "--ranks-from"),
                        (["--keep", "0.9", "--budget", "sensitivity", "--calib", "random",
                          "--sensitivity-from", missing],
                         "--sensitivity-from")):
        code, _, err = _cli(capsys, "rewrite", tmp_path / "model.onnx", "-o", tmp_path / "o.onnx", *flags)
        _one_line_error(code, err, f"{flag} {missing}: no such file")


def test_a_folder_given_as_the_model_says_what_to_give_instead(capsys, tmp_path):
    import shutil

    genai = tmp_path / "genai"
    shutil.copytree(Path(__file__).resolve().parent / "data" / "formats" / "genai-fp32", genai)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for folder, said in ((genai, "an onnxruntime-genai folder: give its model"),
                         (tmp_path / "hf", "a Hugging Face model folder: export it first"),
                         (tmp_path / "empty", "is a folder, not a model")):
        code, _, err = _cli(capsys, "inspect", folder)
        _one_line_error(code, err, said)


def test_force_has_one_meaning_replace_an_existing_output(capsys, export, tmp_path):
    source, existing = export("llama", "dynamo"), tmp_path / "existing.onnx"
    existing.write_bytes(b"keep me")
    code, _, err = _cli(capsys, "rewrite", source, "-o", existing, "--keep", "0.5")
    _one_line_error(code, err, "exists; choose another -o or set --force to replace it")
    assert existing.read_bytes() == b"keep me"
    code, out, _ = _cli(capsys, "rewrite", source, "-o", existing, "--keep", "0.5", "--force")
    assert code == 0 and existing.stat().st_size > 1000
    code, out, _ = _cli(capsys, "rewrite", source, "-o", tmp_path / "new" / "deeper" / "o.onnx", "--keep", "0.5")
    assert code == 0 and f"(the folder {tmp_path / 'new'} was created for it)" in " ".join(out.split())


def test_a_weight_shared_by_gate_and_up_is_named_as_such(capsys, tmp_path):
    model = graphs.swiglu_mlp(16, 24)
    model.graph.node.insert(0, helper.make_node("Identity", ["Wg"], ["Wg_again"], name="dedup"))
    for node in model.graph.node:  # the TorchScript exporter's dedup: up reads gate's weight through Identity
        if node.name == "/mlp/up_proj/MatMul":
            node.input[1] = "Wg_again"
    onnx.save(model, tmp_path / "shared.onnx")
    with pytest.warns(UserWarning) as warned:
        code, _, _ = _cli(capsys, "rewrite", tmp_path / "shared.onnx", "-o", tmp_path / "o.onnx", "--rank", "4")
    assert code == 0
    said = [str(warning.message) for warning in warned]
    assert any("mlp.gate_proj shares its weight with mlp.up_proj (up), which keeps it" in text for text in said)
    assert not any("tied embedding" in text for text in said)


def test_the_random_token_note_is_for_calibrated_rewrites_only(capsys, export, tmp_path):
    """Random token ids say little about a rewrite fitted to text; they say what they say about one that was
    not fitted to anything, with no excuse offered."""
    source = export("llama", "dynamo")
    plain, calibrated = tmp_path / "plain.onnx", tmp_path / "calibrated.onnx"
    assert main(["rewrite", str(source), "-o", str(plain), "--keep", "0.25", "--align", "32", "--quiet"]) == 0
    assert main(["rewrite", str(source), "-o", str(calibrated), "--keep", "0.25", "--align", "32", "--method",
                 "whiten", "--calib", "random", "--calib-samples", "4", "--seq-len", "32", "--quiet"]) == 0
    assert not onnx_nmm.diff(source, plain).calibrated and onnx_nmm.diff(source, calibrated).calibrated
    code, out, _ = _cli(capsys, "diff", source, plain)
    assert code == 0 and "unlike anything a calibrated rewrite was fitted to" not in out


def test_no_command_writes_over_an_existing_output_without_force(capsys, export, tmp_path):
    """rewrite, finetune, export (above), compile, bench: a model, a folder, a report or a plot that exists is
    kept as it was and named in one line, before any long work."""
    source, rewritten = export("llama", "dynamo"), tmp_path / "r.onnx"
    assert main(["rewrite", str(source), "-o", str(rewritten), "--keep", "0.5", "--align", "32", "--quiet"]) == 0
    np.savez(tmp_path / "train.npz", input_ids=np.random.default_rng(0).integers(0, 1000, (8, 16)))
    existing = tmp_path / "existing"
    existing.write_bytes(b"keep me")
    compiled = tmp_path / "compiled"
    compiled.mkdir()
    (compiled / "old.neff").write_bytes(b"keep me")
    cases = [
        (["rewrite", source, "-o", tmp_path / "a.onnx", "--keep", "0.5", "--report", existing], "--report"),
        (["rewrite", source, "-o", tmp_path / "a.onnx", "--keep", "0.5", "--plot", existing], "--plot"),
        (["rewrite", source, "-o", tmp_path / "a.onnx", "--method", "whiten", "--calib", "random",
          "--save-calib-stats", existing], "--save-calib-stats"),
        (["finetune", rewritten, "--text", tmp_path / "train.npz", "-o", existing], "exists; choose another -o"),
        (["finetune", rewritten, "--text", tmp_path / "train.npz", "-o", tmp_path / "t.onnx", "--report", existing],
         "--report"),
        (["compile", rewritten, "--seq-len", "4", "--dry-run", "-o", compiled], "exists and is not empty"),
        (["compile", rewritten, "--seq-len", "4", "--dry-run", "-o", existing, "--force"], "compile writes a folder"),
        (["bench", rewritten, "--plot", existing], "--plot"),
    ]
    for argv, said in cases:
        code, _, err = _cli(capsys, *argv)
        _one_line_error(code, err, said)
        assert existing.read_bytes() == b"keep me" and not (tmp_path / "a.onnx").exists()
    assert [path.name for path in compiled.iterdir()] == ["old.neff"]
    code, _, _ = _cli(capsys, "rewrite", source, "-o", tmp_path / "a.onnx", "--keep", "0.5", "--report", existing,
                      "--force", "--quiet")
    assert code == 0 and json.loads(existing.read_text())["layers"]


def test_run_keeps_an_existing_output_unless_force(capsys, export, tmp_path):
    """run -o is refused in one line before the run when the file exists; --force replaces it, through a
    temporary file (nothing else is left in the folder), at the name given."""
    source, existing = export("llama", "dynamo"), tmp_path / "outputs"
    existing.write_bytes(b"keep me")
    code, _, err = _cli(capsys, "run", source, "--tokens", "4", "-o", existing)
    _one_line_error(code, err, "exists; choose another -o or set --force to replace it")
    assert existing.read_bytes() == b"keep me"
    code, _, err = _cli(capsys, "run", source, "--tokens", "4", "-o", tmp_path)
    _one_line_error(code, err, "is a folder: give -o a file name in it")
    code, _, err = _cli(capsys, "run", source, "--tokens", "4", "-o", existing, "--force")
    assert code == 0, err
    with np.load(existing) as saved:
        assert saved["logits"].shape[:2] == (1, 4)
    assert [path.name for path in tmp_path.iterdir()] == ["outputs"]


def test_every_command_with_a_progress_bar_takes_quiet(capsys, export, tmp_path):
    source = export("llama", "dynamo")
    np.savez(tmp_path / "ids.npz", input_ids=np.random.default_rng(0).integers(0, 1000, (2, 16)))
    for argv in (["diff", source, source, "--seq-len", "4"], ["eval", source, "--text", tmp_path / "ids.npz"],
                 ["rewrite", source, "-o", tmp_path / "r.onnx", "--rank", "8"]):
        code, _, err = _cli(capsys, *argv, "--quiet")
        assert code == 0 and err == "", (argv, err)
    for command in ("export", "finetune", "bench"):
        assert "--quiet" in _help_of(command)


def _help_of(command: str) -> str:
    from onnx_nmm.cli import build_parser

    parser = build_parser()
    (subparsers,) = [action for action in parser._actions if action.choices and command in action.choices]
    return subparsers.choices[command].format_help()


def test_the_demo_runs_commands_the_cli_takes(tmp_path):
    """`make demo`'s steps (tools/demo.py) are real commands with flags the CLI accepts; a renamed flag would
    otherwise surface only in a run of several minutes."""
    import demo

    from onnx_nmm.cli import build_parser

    steps = demo.real_steps(tmp_path, "0.97", tmp_path / "m.gguf", tmp_path / "c.txt", tmp_path / "h.txt")
    assert [step[0] for step in steps] == ["export", "rewrite", *["generate"] * 4, "diff", "bench"]
    for step in steps:
        build_parser().parse_args([str(arg) for arg in step])


@pytest.mark.slow
def test_make_smoke_runs_the_tool_end_to_end(tmp_path):
    import subprocess
    import sys

    demo = Path(__file__).resolve().parent.parent / "tools" / "demo.py"
    result = subprocess.run([sys.executable, str(demo), "--tiny", "--out", str(tmp_path)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "llama-kv.nmm.onnx").exists() and "top-1 agree" in result.stdout


def test_a_reader_that_leaves_early_is_no_error(export):
    """`onnx-nmm inspect model.onnx --json | head -1`: the pipe closes before the output is written."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "onnx_nmm", "inspect", str(export("llama", "dynamo")), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait() == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
