"""Rewriting models larger than memory (onnx_nmm.scale): streamed output equal to the in-memory rewrite's,
resumed after kill -9 with the same bytes as an uninterrupted run, on Ray with the same factors, planned
with --dry-run."""

import contextlib
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from scale_model import write_llama_shaped
from threadpoolctl import threadpool_limits

import onnx_nmm
from onnx_nmm.cli import main

OPTIONS = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.8, align=32), selection=onnx_nmm.Selection("all"))
CLI_OPTIONS = ["--keep", "0.8", "--align", "32", "--targets", "all", "--threads", "1", "--quiet"]
ONE_THREAD = onnx_nmm.StreamOptions(threads=1)  # the tests share 2 cores: BLAS threads waiting on each other are slow


@pytest.fixture(scope="module")
def llama_shaped(tmp_path_factory):
    """3 layers of a Llama-shaped decoder in bf16 external data: 21 linear layers."""
    return write_llama_shaped(tmp_path_factory.mktemp("scale") / "in", 256, 512, 64, 3)


def _files(output):
    return output.read_bytes(), onnx_nmm.external_data_path(output).read_bytes()


class _Recorder(onnx_nmm.Progress):
    def __init__(self):
        self.details, self.phases = [], []

    @contextlib.contextmanager
    def phase(self, description, total=None):
        recorder = self
        self.phases.append(description)

        class Phase(onnx_nmm.Phase):
            def advance(self, amount=1, detail=None):
                recorder.details.append(detail)

        yield Phase()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_streamed_rewrite_writes_what_the_in_memory_one_does(llama_shaped, tmp_path, dtype):
    model = llama_shaped if dtype == "bfloat16" else write_llama_shaped(tmp_path / "in", 256, 512, 64, 3, dtype)
    streamed = onnx_nmm.rewrite_streamed(model, tmp_path / "a" / "out.onnx", OPTIONS, ONE_THREAD)
    with threadpool_limits(1):
        in_memory = onnx_nmm.rewrite(model, OPTIONS)
    in_memory.save(tmp_path / "b" / "out.onnx", external_data=True)
    assert _files(tmp_path / "a" / "out.onnx") == _files(tmp_path / "b" / "out.onnx")
    assert len(streamed.report.factorized) == 21 and not (tmp_path / "a" / "out.onnx.partial").exists()
    assert {row.dtype for row in streamed.report.factorized} == {dtype}
    x = np.random.default_rng(0).standard_normal((1, 3, 256)).astype(np.float32)
    (y,) = ort.InferenceSession(str(tmp_path / "a" / "out.onnx")).run(None, {"hidden_states.0": x})
    assert np.all(np.isfinite(y))


KILLED_CHILD = textwrap.dedent("""
    import contextlib, os, signal, sys
    import onnx_nmm

    model, output, phase_name, after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    class Killer(onnx_nmm.Progress):  # kill -9 once `after` steps of the phase are done
        @contextlib.contextmanager
        def phase(self, description, total=None):
            if description == phase_name and after == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            done = []

            class Phase(onnx_nmm.Phase):
                def advance(self, amount=1, detail=None):
                    done.append(detail)
                    if description == phase_name and len(done) == after:
                        os.kill(os.getpid(), signal.SIGKILL)

            yield Phase()

    options = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.8, align=32),
                                      selection=onnx_nmm.Selection("all"))
    onnx_nmm.rewrite_streamed(model, output, options, onnx_nmm.StreamOptions(threads=1), progress=Killer())
""")


def _killed_run(model, output, phase, after):
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD, str(model), str(output), phase, str(after)],
                           capture_output=True, text=True)
    assert child.returncode == -9, child.stderr


def test_a_rewrite_killed_while_factorizing_resumes_to_the_same_bytes(llama_shaped, tmp_path):
    single = tmp_path / "single" / "model.nmm.onnx"
    assert main(["rewrite", str(llama_shaped), "-o", str(single), "--stream", *CLI_OPTIONS]) == 0
    resumed = tmp_path / "resumed" / "model.nmm.onnx"
    _killed_run(llama_shaped, resumed, "factorizing", 5)
    assert not resumed.exists() and not onnx_nmm.external_data_path(resumed).exists()
    assert len(list(onnx_nmm.work_dir_of(resumed).glob("*.json"))) == 1 + 5  # the manifest and 5 matrices
    progress = _Recorder()
    onnx_nmm.rewrite_streamed(llama_shaped, resumed, OPTIONS, ONE_THREAD, progress)
    assert sum("(resumed)" in (detail or "") for detail in progress.details) == 5
    assert _files(resumed) == _files(single) and not onnx_nmm.work_dir_of(resumed).exists()


def test_a_rewrite_killed_while_writing_resumes_with_the_same_command(llama_shaped, tmp_path):
    single = tmp_path / "single" / "model.nmm.onnx"
    onnx_nmm.rewrite_streamed(llama_shaped, single, OPTIONS, ONE_THREAD)
    resumed = tmp_path / "resumed" / "model.nmm.onnx"
    _killed_run(llama_shaped, resumed, "writing", 0)
    assert not resumed.exists() and len(list(onnx_nmm.work_dir_of(resumed).glob("*.json"))) == 1 + 21
    assert main(["rewrite", str(llama_shaped), "-o", str(resumed), "--stream", *CLI_OPTIONS]) == 0
    assert _files(resumed) == _files(single)


def test_work_of_other_options_is_discarded_with_a_warning(llama_shaped, tmp_path):
    output = tmp_path / "out.onnx"
    _killed_run(llama_shaped, output, "factorizing", 2)
    other = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.5, align=32))
    with pytest.warns(UserWarning, match="another input or with other options: starting afresh"):
        result = onnx_nmm.rewrite_streamed(llama_shaped, output, other, ONE_THREAD)
    assert {layer.rank for layer in result.report.factorized} == {96} and len(result.report.factorized) == 9


def test_restart_discards_the_work_of_a_killed_run(llama_shaped, tmp_path):
    output = tmp_path / "out.onnx"
    _killed_run(llama_shaped, output, "factorizing", 3)
    progress = _Recorder()
    onnx_nmm.rewrite_streamed(llama_shaped, output, OPTIONS, onnx_nmm.StreamOptions(threads=1, resume=False), progress)
    assert not any("(resumed)" in (detail or "") for detail in progress.details) and output.exists()


def test_streaming_refuses_what_needs_the_model_in_memory(llama_shaped, tmp_path, capsys):
    code = main(["rewrite", str(llama_shaped), "-o", str(tmp_path / "out.onnx"), "--stream", "--fuse-mlp"])
    assert code != 0 and "--fuse-mlp" in capsys.readouterr().err
    code = main(["rewrite", str(llama_shaped), "-o", str(tmp_path / "out.onnx"), "--ray", "--method", "nystrom",
                 "--calib", "random", "--keep", "0.9"])
    err = capsys.readouterr().err
    assert code == 2 and "narrowing MLPs runs layer by layer on this machine" in err
    assert len(err.strip().splitlines()) == 1
    code = main(["rewrite", str(llama_shaped), "-o", str(tmp_path / "out.onnx"), "--stream", "--include", "nothing"])
    assert code != 0 and "none of the" in capsys.readouterr().err
    code = main(["rewrite", str(llama_shaped), "-o", str(llama_shaped), "--stream", "--force"])
    assert code != 0 and "would overwrite the input" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_ray_without_ray_installed_says_how_to_install_it(llama_shaped, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    code = main(["rewrite", str(llama_shaped), "-o", str(tmp_path / "out.onnx"), "--ray"])
    err = capsys.readouterr().err
    assert code != 0 and "pip install 'onnx-nmm[ray]'" in err and len(err.strip().splitlines()) == 1


def test_the_dry_run_plans_and_writes_nothing(llama_shaped, tmp_path, capsys):
    output = tmp_path / "out.onnx"
    assert main(["rewrite", str(llama_shaped), "-o", str(output), "--dry-run", *CLI_OPTIONS[:-1]]) == 0
    out = capsys.readouterr().out
    assert "21 targets" in out and "measured" in out and "modelled" in out and not list(tmp_path.iterdir())
    code = main(["rewrite", str(llama_shaped), "-o", str(output), "--dry-run", "--energy", "0.9"])
    assert code != 0 and "--keep" in capsys.readouterr().err and not list(tmp_path.iterdir())
    plan = onnx_nmm.plan_rewrite(llama_shaped, OPTIONS, threads=1)
    assert plan.sample_seconds > 0 and plan.seconds_on(4) <= plan.seconds
    gate = next(layer for layer in plan.layers if layer.role == "gate")
    assert (gate.rank, gate.bytes_before, gate.bytes_after) == (128, 256 * 512 * 2, 128 * (256 + 512) * 2)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # a local Ray cluster starts in ~5 s
@pytest.mark.xdist_group("ray")  # one local cluster: every Ray test on one xdist worker
def test_ray_workers_make_the_same_factors_as_one_process(llama_shaped, tmp_path, local_ray):
    serial = onnx_nmm.rewrite_streamed(llama_shaped, tmp_path / "serial" / "out.onnx", OPTIONS, ONE_THREAD)
    progress = _Recorder()
    distributed = onnx_nmm.rewrite_streamed(llama_shaped, tmp_path / "ray" / "out.onnx", OPTIONS,
                                            onnx_nmm.StreamOptions(ray="local", threads=1), progress)
    assert _files(tmp_path / "serial" / "out.onnx") == _files(tmp_path / "ray" / "out.onnx")
    assert len([detail for detail in progress.details if detail and " s)" in detail]) == 21  # one bar, every task
    assert [row.rank for row in distributed.report.layers] == [row.rank for row in serial.report.layers]
    with pytest.raises(onnx_nmm.OptionError, match="asks each Ray task for 3 CPUs"):  # would wait forever
        onnx_nmm.rewrite_streamed(llama_shaped, tmp_path / "too-many" / "out.onnx", OPTIONS,
                                  onnx_nmm.StreamOptions(ray="local", threads=3))
    assert not (tmp_path / "too-many").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_spectra_for_the_energy_rule_come_from_ray_workers(llama_shaped, tmp_path, local_ray):
    options = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(energy=0.7, align=32))
    onnx_nmm.rewrite_streamed(llama_shaped, tmp_path / "serial" / "out.onnx", options, ONE_THREAD)
    progress = _Recorder()
    onnx_nmm.rewrite_streamed(llama_shaped, tmp_path / "ray" / "out.onnx", options,
                              onnx_nmm.StreamOptions(ray="local", threads=1), progress)
    assert "spectra on Ray" in progress.phases
    assert _files(tmp_path / "serial" / "out.onnx") == _files(tmp_path / "ray" / "out.onnx")


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_calibration_split_over_ray_workers_sums_to_the_serial_grams(export, tmp_path, local_ray):
    model = export("llama", "torchscript", external_data=True)
    results, progress = {}, _Recorder()
    for name, stream in (("serial", ONE_THREAD), ("ray", onnx_nmm.StreamOptions(ray="local", threads=1))):
        calibration = onnx_nmm.CalibrationOptions(source="random", samples=4, seq_len=16,
                                                  save_statistics=tmp_path / f"{name}.npz")
        options = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.5, align=32), calibration=calibration,
                                          factorization=onnx_nmm.FactorizationOptions(method="whiten"))
        results[name] = onnx_nmm.rewrite_streamed(model, tmp_path / name / "out.onnx", options, stream, progress)
    assert any(phase.startswith("calibrating on 2 Ray workers") for phase in progress.phases)
    serial, distributed = (np.load(tmp_path / f"{name}.npz") for name in ("serial", "ray"))
    assert sorted(serial.files) == sorted(distributed.files) and len(serial.files) > 2
    for key in serial.files:
        if key.startswith("gram:"):
            np.testing.assert_allclose(distributed[key], serial[key], rtol=1e-9, atol=1e-9)
    losses = [[row.whitened_loss for row in result.report.factorized] for result in results.values()]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4)


def test_a_streamed_rewrite_of_a_dynamo_export_keeps_its_small_constants_in_the_graph(export, tmp_path):
    """Shapes and axes the checker's shape inference reads stay in the graph; the weights go to the data file."""
    output = tmp_path / "out.onnx"
    onnx_nmm.rewrite_streamed(export("llama", "dynamo", cache=True), output, OPTIONS, ONE_THREAD)
    graph = onnx.load(str(output), load_external_data=False).graph
    external = [tensor for tensor in graph.initializer if tensor.data_location == onnx.TensorProto.EXTERNAL]
    inline = [tensor for tensor in graph.initializer if tensor.data_location != onnx.TensorProto.EXTERNAL]
    assert external and inline and all(len(tensor.raw_data) < 1024 for tensor in inline)
    assert ort.InferenceSession(str(output)).get_outputs()[0].name == "logits"


def test_the_writer_copies_external_data_without_offset_or_length_whole(tmp_path):
    """ONNX lets a tensor's external data give no offset and no length: the tensor is then the whole file."""
    import onnx_ir as ir

    from onnx_nmm.scale.writer import write_streamed

    weight = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    (tmp_path / "weight.bin").write_bytes(weight.tobytes())
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 32]))
    w = ir.Value(name="w", const_value=ir.ExternalTensor("weight.bin", None, None, ir.DataType.FLOAT,
                                                         shape=ir.Shape(weight.shape), name="w", base_dir=tmp_path))
    matmul = ir.node("MatMul", [x, w])
    matmul.outputs[0].name = "y"
    model = ir.Model(ir.Graph([x], matmul.outputs, nodes=[matmul], initializers=[w], opset_imports={"": 21}),
                     ir_version=10)
    (tmp_path / "staging").mkdir()
    output = write_streamed(model, tmp_path / "out" / "model.onnx", tmp_path / "staging")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(onnx.load(output).graph.initializer[0]), weight)
