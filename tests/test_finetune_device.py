"""`finetune --device`: the torch device training runs on; one that torch does not know or cannot use here is a
one-line error before any work, and "cpu" is what the default does."""

import numpy as np
import pytest
import torch
from exported_models import exported_model

import onnx_nmm
from onnx_nmm.cli import main
from onnx_nmm.model_io import load_model

pytestmark = pytest.mark.xdist_group("lowering")

VOCAB = 1000
UNUSABLE = "cuda" if not torch.cuda.is_available() else "cuda:99"  # a device this machine does not have


@pytest.fixture(scope="module")
def rewritten_llama(tmp_path_factory):
    """A tiny Llama whose MLPs are SvdGatedMLP ops at keep 0.5."""
    output = tmp_path_factory.mktemp("llama") / "rewritten.onnx"
    assert main(["rewrite", str(exported_model("llama", "dynamo")), "-o", str(output), "--keep", "0.5", "--align",
                 "32", "--quiet", "--fuse-mlp"]) == 0
    return output


@pytest.mark.parametrize("device, message", [
    ("bogus", "device 'bogus' is no torch device: give cpu, cuda, cuda:N or mps"),
    (UNUSABLE, f"device '{UNUSABLE}' is not usable on this machine"),
    ("meta", "device 'meta' holds no numbers to train"),
])
def test_a_device_torch_cannot_train_on_is_refused_by_the_library(device, message):
    with pytest.raises(onnx_nmm.OptionError, match=message):
        onnx_nmm.FinetuneOptions(device=device)


@pytest.mark.parametrize("device, message", [
    ("bogus", "--device 'bogus' is no torch device: give cpu, cuda, cuda:N or mps"),
    (UNUSABLE, f"--device '{UNUSABLE}' is not usable on this machine"),
])
def test_a_device_torch_cannot_train_on_is_a_one_line_error_and_writes_nothing(capsys, rewritten_llama, tmp_path,
                                                                              device, message):
    np.savez(tmp_path / "train.npz", input_ids=np.zeros((4, 16), np.int64))
    output = tmp_path / "tuned.onnx"
    code = main(["finetune", str(rewritten_llama), "--text", str(tmp_path / "train.npz"), "-o", str(output),
                 "--device", device])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not output.exists()


def test_training_on_the_cpu_device_gives_what_the_default_gives(rewritten_llama):
    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, 16), dtype=np.int64)
    data = onnx_nmm.TrainingData(tokens)
    training = onnx_nmm.TrainingOptions(steps=3, batch=2, learning_rate=1e-3)
    default = onnx_nmm.finetune(rewritten_llama, data, onnx_nmm.FinetuneOptions(training, threads=1))
    on_cpu = onnx_nmm.finetune(rewritten_llama, data, onnx_nmm.FinetuneOptions(training, threads=1, device="cpu"))
    assert onnx_nmm.FinetuneOptions().device == "cpu"
    assert default.training.losses == on_cpu.training.losses
    before = load_model(rewritten_llama).graph.initializers
    trained = [name for name in before if ".svd_" in name]
    for name in trained:
        tuned = default.model.graph.initializers[name].const_value.numpy()
        assert np.array_equal(tuned, on_cpu.model.graph.initializers[name].const_value.numpy())
        assert not np.array_equal(tuned, before[name].const_value.numpy())
