"""What the help texts say, checked against what the commands do: one name per idea, one wording per
behaviour, and the defaults as they are."""

import fnmatch
import json
import re
import shlex
import warnings
from pathlib import Path

import onnx
import pytest

from onnx_nmm.cli import build_parser, main
from onnx_nmm.model_io import load_model
from onnx_nmm.passes import find_linear_layers, svd_ops


def _cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _commands() -> dict:
    """Every sub-command's parser, by name."""
    return next(action for action in build_parser()._actions if action.dest == "command").choices


def _flag_help(command: str, flag: str) -> str:
    """The help text of `flag` in `command`, on one line."""
    action = next(action for action in _commands()[command]._actions if flag in action.option_strings)
    return " ".join(action.help.split()) % {"default": action.default}


def _ops(path) -> list[str]:
    return [node.op_type for node in onnx.load(path).graph.node]


def test_rewrite_says_it_narrows_with_calibration_and_factorizes_without(capsys, export, tmp_path):
    top = " ".join(build_parser().format_help().split())
    assert "narrow its MLPs to the neurons that matter (plain, narrower MatMuls; the default with calibration text)" \
        in top and "or factorize them into SvdMatMul custom ops" in top
    source = export("llama", "dynamo")
    narrowed, factorized = tmp_path / "narrowed.onnx", tmp_path / "factorized.onnx"
    code, _, _ = _cli(capsys, "rewrite", source, "-o", narrowed, "--calib", "random", "--calib-samples", "8",
                      "--calib-window", "32", "--align", "32", "--quiet")
    assert code == 0 and svd_ops.SVD_MATMUL not in _ops(narrowed)
    mlp = [layer for layer in find_linear_layers(load_model(narrowed)) if layer.group == "mlp"]
    assert len(mlp) == 6 and all(32 in (layer.k, layer.n) for layer in mlp)  # plain MatMuls, 32 of 512 neurons
    code, _, _ = _cli(capsys, "rewrite", source, "-o", factorized, "--keep", "0.5", "--align", "32", "--quiet")
    assert code == 0 and _ops(factorized).count(svd_ops.SVD_MATMUL) == 6


def test_an_invalid_choice_is_one_line_naming_the_choices(capsys, export, tmp_path):
    with pytest.raises(SystemExit) as exit:
        main(["rewrite", str(export("llama", "dynamo")), "--method", "pca"])
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err == "onnx-nmm rewrite: error: --method must be one of svd, whiten, fisher, nystrom (got pca)\n"
    with pytest.raises(SystemExit):
        main(["rewrit"])
    assert capsys.readouterr().err.startswith("onnx-nmm: error: COMMAND must be one of export, inspect, rewrite,")
    with pytest.raises(SystemExit):  # any other usage error: one line, pointing at the command's help
        main(["rewrite"])
    assert capsys.readouterr().err == ("onnx-nmm rewrite: error: the following arguments are required: model "
                                       "(`onnx-nmm rewrite --help` lists its flags)\n")


def test_keep_says_what_the_default_is_with_and_without_calibration(capsys, export, tmp_path):
    keep = _flag_help("rewrite", "--keep")
    assert "default 0.8 without --calib; with --calib tokens and no other rule, --max-ppl-increase 0.02" in keep
    assert _flag_help("inspect", "--keep").endswith("(default 0.8)")  # inspect takes no calibration
    source, report = export("llama", "dynamo"), tmp_path / "r.json"
    code, _, _ = _cli(capsys, "rewrite", source, "-o", tmp_path / "o.onnx", "--calib", "random", "--calib-samples",
                      "8", "--calib-window", "32", "--align", "32", "--quiet", "--report", report)
    assert code == 0 and json.loads(report.read_text())["rule"].startswith("perplexity budget +2.0%")
    code, _, _ = _cli(capsys, "rewrite", source, "-o", tmp_path / "p.onnx", "--align", "32", "--quiet",
                      "--report", report, "--force")
    assert code == 0 and json.loads(report.read_text())["rule"] == "keep=0.8, align=32"


SMALL_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1000)


def test_bench_names_the_model_it_adds_from_shapes_factorized_keep(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_CONFIG))
    assert "add, after each MODEL, the same model with its --targets layers factorized at keep K" in \
        _flag_help("bench", "--factorized-keep")
    priced = ["bench", config, "--target", "trn1", "--prompt-lengths", "8", "--contexts", "16", "--json"]
    code, out, _ = _cli(capsys, *priced, "--factorized-keep", "0.5")
    assert code == 0 and [model["products"]["fused MLP"] for model in json.loads(out)["models"]] == [0, 2]
    code, _, err = _cli(capsys, *priced, "--factorized-keep", "1.5")
    assert code == 2 and "--factorized-keep must be in (0, 1]" in err
    code, _, err = _cli(capsys, "bench", config, "--factorized-keep", "0.5")
    assert code == 2 and "--factorized-keep, --no-fuse-mlp and config.json models are priced" in err


# Each meaning of the old --seq-len, its name now, and the command line that gives it.
WINDOWS = {
    "rewrite": ("--calib-window", ["rewrite", "m.onnx"]),
    "diff": ("--tokens", ["diff", "a.onnx", "b.onnx"]),
    "run": ("--tokens", ["run", "m.onnx"]),
    "compile": ("--trace-tokens", ["compile", "m.onnx"]),
    "finetune": ("--train-window", ["finetune", "m.onnx"]),
}


@pytest.mark.parametrize("command", WINDOWS)
def test_seq_len_is_a_former_name_of_each_meanings_own_flag(command):
    from onnx_nmm.cli._parsing import OldFlagName

    flag, argv = WINDOWS[command]
    assert build_parser().parse_args([*argv, flag, "7"]).seq_len == 7
    with pytest.warns(OldFlagName, match=f"^onnx-nmm {command}: note: --seq-len is now {flag}; the old name still "
                                         "works$"):
        assert build_parser().parse_args([*argv, "--seq-len", "7"]).seq_len == 7
    assert "formerly --seq-len" in _flag_help(command, flag)
    assert not any("--seq-len" in action.option_strings and action.help != "==SUPPRESS=="
                   for action in _commands()[command]._actions)  # hidden from --help


def test_a_former_name_prints_one_note_and_errors_name_the_new_flag(capsys, export):
    import subprocess
    import sys

    source = export("llama", "dynamo")
    result = subprocess.run([sys.executable, "-m", "onnx_nmm", "diff", str(source), str(source), "--seq-len", "4",
                             "--json"], capture_output=True, text=True)
    assert result.returncode == 0 and json.loads(result.stdout)["inputs"]["input_ids"] == [1, 4]
    assert result.stderr == "onnx-nmm diff: note: --seq-len is now --tokens; the old name still works\n"
    for argv, said in ((["diff", source, source, "--tokens", "0"], "--batch and --tokens must be positive"),
                       (["run", source, "--tokens", "0"], "--batch and --tokens must be positive"),
                       (["rewrite", source, "--calib", "random", "--calib-window", "0"],
                        "--calib-window must be a positive integer"),
                       (["compile", source, "--trace-tokens", "0"], "--batch and --trace-tokens must be positive"),
                       (["finetune", source, "--train-window", "1"], "--train-window must be at least 2"),
                       (["finetune", source, "--distill-temperature", "0"], "--distill-temperature must be positive")):
        code, _, err = _cli(capsys, *argv)
        assert code == 2 and said in err, err


def _helps(flag: str) -> dict[str, str]:
    """`flag`'s help in every command that has it, by command."""
    return {command: _flag_help(command, flag) for command, parser in _commands().items()
            if any(flag in action.option_strings for action in parser._actions)}


def test_force_quiet_and_target_say_the_same_thing_for_the_same_behaviour():
    forces, quiets, targets = _helps("--force"), _helps("--quiet"), _helps("--target")
    assert set(forces) == {"export", "rewrite", "run", "bench", "compile", "finetune"}
    assert all(text.startswith("replace an existing ") and text.endswith(
        "; without --force, one that exists is refused before any work") for text in forces.values()), forces
    assert set(quiets) == {"export", "rewrite", "diff", "eval", "bench", "finetune"}
    assert all(text.startswith("no progress bar") for text in quiets.values()), quiets
    assert set(targets) == {"run", "eval", "diff", "generate", "bench", "compile", "bench-kernels"}
    assert all(text.startswith("the Trainium generation ") for text in targets.values()), targets
    emulated = {command for command, text in targets.items() if "read only with --backend emulator" in text}
    assert emulated == {"run", "eval", "diff", "generate"}  # the rest name what they do with it


def test_force_names_every_file_it_replaces(capsys, export, tmp_path):
    """The files --force's help names are the ones the command refuses to replace without it."""
    source, existing = export("llama", "dynamo"), tmp_path / "existing"
    existing.write_bytes(b"keep me")
    named = {"rewrite": ["--report", "--plot", "--save-calib-stats"], "finetune": ["--report", "--plot"],
             "bench": ["--plot"], "bench --target": ["--plot"]}
    argv = {"rewrite": ["rewrite", source, "-o", tmp_path / "o.onnx", "--method", "whiten", "--calib", "random"],
            "finetune": ["finetune", source, "-o", tmp_path / "t.onnx"], "bench": ["bench", source],
            "bench --target": ["bench", source, "--target", "trn1"]}
    for command, flags in named.items():
        said = _flag_help(command.split()[0], "--force")
        assert all(f"{flag} " in said or f"{flag}," in said for flag in flags), said
        for flag in flags:
            code, _, err = _cli(capsys, *argv[command], flag, existing)
            assert code == 2 and f"{flag} {existing} exists" in err and "--force" in err, err
    assert existing.read_bytes() == b"keep me" and not list(tmp_path.glob("*.onnx"))


def test_quiet_silences_what_its_help_says(capsys, export, tmp_path):
    source = export("llama", "dynamo")
    assert _flag_help("eval", "--quiet") == "no progress bar; the results still print"
    code, out, err = _cli(capsys, "diff", source, source, "--tokens", "4", "--quiet")
    assert code == 0 and "cosine" in out and err == ""
    assert _flag_help("rewrite", "--quiet").startswith("no progress bar and no table or summary")
    code, out, err = _cli(capsys, "rewrite", source, "-o", tmp_path / "o.onnx", "--rank", "8", "--quiet")
    assert code == 0 and out == "" and err == ""


def test_finetune_takes_rewrites_calibration_flags_and_names_its_temperature():
    from onnx_nmm.cli._parsing import OldFlagName

    parse = build_parser().parse_args
    as_rewrite = parse(["finetune", "m.onnx", "--calib", "a.txt", "--calib", "generated:8", "--calib-generator",
                        "kv.onnx", "--calib-samples", "3", "--calib-window", "16"])
    as_finetune = parse(["finetune", "m.onnx", "--text", "a.txt", "--text", "generated:8", "--generator", "kv.onnx",
                         "--samples", "3", "--train-window", "16"])
    assert vars(as_rewrite) == vars(as_finetune)
    assert as_finetune.text == ["a.txt", "generated:8"] and as_finetune.seq_len == 16
    assert "distillation loss" in _flag_help("finetune", "--distill-temperature")
    assert "sample from softmax(logits / T)" in _flag_help("generate", "--temperature")
    with pytest.warns(OldFlagName, match="--temperature is now --distill-temperature"):
        assert parse(["finetune", "m.onnx", "--temperature", "2"]).temperature == 2


def test_bench_kernels_writes_to_o_like_every_other_command(tmp_path):
    from onnx_nmm.cli._parsing import OldFlagName

    parse = build_parser().parse_args
    assert parse(["bench-kernels", "-o", str(tmp_path)]).out == parse(["bench-kernels", "--output", str(tmp_path)]).out
    with pytest.warns(OldFlagName, match="--out is now --output"):
        assert parse(["bench-kernels", "--out", str(tmp_path)]).out == tmp_path


ROOT = Path(__file__).resolve().parent.parent


def _commands_in(page: Path, variables: dict[str, str]) -> list[list[str]]:
    """The `onnx-nmm` command lines in a page's shell blocks, its $VARIABLES filled in, comments dropped."""
    blocks = re.findall(r"```\n(.*?)```", page.read_text(), re.S)
    lines = [command for block in blocks for line in block.splitlines()
             for command in line.split("  #")[0].split(" && ") if command.startswith("onnx-nmm ")]
    for name, value in variables.items():
        lines = [line.replace(f"${name}", value) for line in lines]
    return [shlex.split(line)[1:] for line in lines]


def test_the_readme_first_screen_uses_the_files_make_demo_leaves_and_commands_the_cli_takes():
    import assets

    readme = ROOT / "README.md"
    two = re.search(r"## Two commands\n(.*?)\n## ", readme.read_text(), re.S).group(1)
    assert "make demo " in two and "make test " in two  # the two that set everything up on a fresh machine
    screen = re.search(r"## First steps.*?```\n(.*?)```", readme.read_text(), re.S).group(1)
    variables = dict(re.findall(r"^(\w+)=(\$\([^)]*\)|\S+)", screen, re.M))
    assert fnmatch.fnmatch(str(assets.smollm2_gguf().relative_to(ROOT)), variables["GGUF"][len("$(ls "):-1])
    assert variables["CALIB"] == ".cache/assets/kjv-calibration.txt" == str(
        (assets.CACHE / "kjv-calibration.txt").relative_to(ROOT)) and 'f"kjv-{part}.txt"' in Path(
        assets.__file__).read_text()
    assert variables["HELD_OUT"] == ".cache/assets/lee-background.txt" and '"lee-background.txt"' in Path(
        assets.__file__).read_text()
    commands = [*_commands_in(readme, {"GGUF": "m.gguf", "CALIB": "c.txt", "HELD_OUT": "h.txt"}),
                *_commands_in(ROOT / "docs" / "usage.md", {})]
    assert len(commands) > 20 and {command[0] for command in commands} >= {"export", "rewrite", "diff", "bench"}
    for command in commands:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a renamed flag's note is an error here: the docs use the new names
            build_parser().parse_args(command)
