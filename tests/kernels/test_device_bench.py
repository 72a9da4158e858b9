"""The device kit: launches run and checked on a device (the emulated stand-in here), the cost model fitted to
their times, and `bench-kernels --device` / `--fit` on a machine without Trainium."""

import json

import numpy as np
import pytest

from onnx_nmm.cli import main
from onnx_nmm.kernels.bench import device, device_fit
from onnx_nmm.kernels.bench.benchmark import MlpShape

TINY = MlpShape("tiny", hidden=256, intermediate=512, rank=128)
TOKENS = (1, 64)


@pytest.fixture(scope="module")
def launches():
    return device.grid_launches((TINY,), TOKENS, "trn2", "bfloat16")


def test_the_grid_has_each_distinct_launch_of_the_programs_once(launches):
    # per token count: 7 dense (gate and up alike), 1 dense MLP, 2 XUV, 1 MLP
    assert len(launches) == len(set(launches)) == 22
    assert {launch.kernel for launch in launches} == {"dense_matmul", "silu_mul", "dense_gated_mlp", "fused_xuv",
                                                      "fused_svd_mlp"}
    assert device.Launch("dense_matmul", ((64, 256), (256, 128)), "bfloat16", "trn2") in launches  # x·U unfused


def test_above_one_tile_of_tokens_the_transposed_activation_and_the_down_projection_run_right():
    chain = [launch for launch in device.grid_launches((TINY,), (192,), "trn2", "bfloat16")
             if launch.kernel in ("silu_mul_transposed", "dense_matmul_lhsT")]
    assert [launch.kernel for launch in chain] == ["silu_mul_transposed", "dense_matmul_lhsT"]
    report = device.bench_on_device(device.EmulatedDevice("trn2"), chain)
    assert all(result["ok"] for result in report["launches"])


def test_every_launch_runs_right_and_measures_its_model_on_a_faithful_device(launches):
    report = device.bench_on_device(device.EmulatedDevice("trn2"), launches)
    results = report["launches"]
    assert [device.launch_of(result) for result in results] == launches
    for result in results:
        assert result["ok"] and result["max_error"] <= result["error_bound"]
        assert result["measured_us"]["p50"] == pytest.approx(result["modelled_us"], rel=1e-9)
    assert "measured" in report["note"] and report["device"] in report["note"]


def test_the_fit_recovers_a_slower_dma_and_explains_the_times(launches, tmp_path, capsys):
    slow_dma = device.EmulatedDevice("trn2", {"dma_engine_bytes_per_s": 0.7, "pe_hz": 1.0})
    path = tmp_path / "bench-kernels-device.json"
    path.write_text(json.dumps(device.bench_on_device(slow_dma, launches)))

    assert main(["bench-kernels", "--fit", str(path)]) == 0
    fit = json.loads((tmp_path / "fit.json").read_text())
    factors = {name: values["factor"] for name, values in fit["parameters"].items()}
    assert factors["dma_engine_bytes_per_s"] == pytest.approx(0.7, rel=0.1)
    assert factors["pe_hz"] == pytest.approx(1.0, rel=0.1)
    residual = fit["median_abs_log_residual"]
    assert residual["after"] < residual["before"] / 10
    assert len(fit["launches"]) == len(launches)
    assert "only as good as the grid" in capsys.readouterr().out


def test_the_command_writes_measured_beside_modelled_for_every_launch(tmp_path, capsys):
    code = main(["bench-kernels", "--device", "emulator", "--target", "trn1", "--models", "Llama-3.2-1B",
                 "--tokens", "1", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "bench-kernels-device.json").read_text())
    assert "--device emulator" in report["command"] and len(report["launches"]) == 11
    assert all(result["ok"] and result["target"] == "trn1" for result in report["launches"])
    assert "measured (p50) vs modelled" in capsys.readouterr().out


def test_the_least_squares_leaves_an_unused_parameter_at_the_origin():
    point = device_fit.least_squares(lambda p: np.array([p[0] - 0.5, 2 * (p[0] - 0.5)]), 2, (-1.4, 1.4))
    assert point[0] == pytest.approx(0.5, abs=1e-6) and point[1] == 0


@pytest.mark.skipif(device.missing_neuron() is None, reason="this machine has the Neuron SDK and a device")
def test_without_the_sdk_the_device_run_is_one_line_and_writes_nothing(tmp_path, capsys):
    code = main(["bench-kernels", "--device", "--target", "trn2", "--tokens", "1", "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert code != 0 and error.count("\n") == 1
    assert "needs AWS's Neuron SDK and a Trainium device: pip install neuronx-cc nki" in error
    assert not any(tmp_path.iterdir())
