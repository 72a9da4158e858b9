"""Windows of a text start with the BOS token when the tokenizer puts one before a text: evaluation,
diff --text, calibration (hence sensitivity) and fine-tuning alike; --no-bos turns it off."""

import json
from pathlib import Path

import numpy as np
import pytest

import onnx_nmm
from onnx_nmm.calibration.calibration_data import CalibrationData, bos_id, text_tokens
from onnx_nmm.calibration.tokens import load_tokenizer
from onnx_nmm.cli import main
from onnx_nmm.model_source import ModelSource

PLAIN = Path(__file__).resolve().parent / "data" / "formats" / "genai-fp32"  # a tokenizer that adds no BOS
TEXT = "the quick brown fox jumps over the lazy dog and runs far away into the deep dark forest " * 40


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory) -> Path:
    """The same BPE, made to start every text with token 0, as Llama's and Gemma's tokenizers do."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = load_tokenizer(PLAIN)
    bos = tokenizer.convert_ids_to_tokens(0)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    tokenizer.bos_token = bos
    folder = tmp_path_factory.mktemp("bos-tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT)
    return path


def test_a_tokenizer_that_adds_bos_is_told_from_one_that_does_not(bos_tokenizer):
    assert bos_id(load_tokenizer(bos_tokenizer)) == 0
    assert bos_id(load_tokenizer(PLAIN)) is None  # as SmolLM2's and Qwen2.5's: evaluation is unchanged


def test_calibration_and_training_windows_start_with_bos_then_the_text_in_order(bos_tokenizer, text, export):
    ids = text_tokens(text, load_tokenizer(bos_tokenizer))
    graph = ModelSource(export("llama", "dynamo")).model.graph
    calibration = CalibrationData(onnx_nmm.CalibrationOptions(str(text), bos_tokenizer, samples=3, seq_len=16), graph)
    training = onnx_nmm.TrainingData(str(text), bos_tokenizer, seq_len=16, samples=3)
    for windows in (calibration.windows(), training.windows()):
        assert windows.tokens.shape == (3, 16) and (windows.tokens[:, 0] == 0).all()
        assert np.array_equal(windows.tokens[:, 1:].reshape(-1), ids[:45])
        assert "each starting with BOS (id 0)" in windows.description
    without = onnx_nmm.TrainingData(str(text), bos_tokenizer, seq_len=16, samples=3, bos=False).windows()
    assert np.array_equal(without.tokens.reshape(-1), ids[:48])
    plain = onnx_nmm.TrainingData(str(text), PLAIN, seq_len=16, samples=3).windows()
    assert np.array_equal(plain.tokens.reshape(-1), ids[:48]) and "BOS" not in plain.description


def test_eval_and_diff_score_windows_that_start_with_bos_and_say_so(bos_tokenizer, text, export, capsys):
    model = export("llama", "dynamo")
    scored = ["--text", str(text), "--tokenizer", str(bos_tokenizer), "--window", "32", "--max-windows", "3"]
    assert main(["eval", str(model), *scored, "--json"]) == 0
    with_bos = json.loads(capsys.readouterr().out)
    assert with_bos["bos"] == 0 and with_bos["tokens_scored"] == 3 * 31 and with_bos["stride"] == 31
    assert main(["eval", str(model), *scored, "--no-bos", "--json"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert without["bos"] is None and without["tokens_scored"] == 3 * 31 and without["stride"] == 32
    assert with_bos["perplexity"] != without["perplexity"]

    assert main(["diff", str(model), str(model), *scored]) == 0
    assert "each starting with BOS (id 0)" in capsys.readouterr().out
