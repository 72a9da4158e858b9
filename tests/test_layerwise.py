"""The layer-by-layer rewrite (onnx_nmm.layerwise): the decoder cut at its residual stream runs as the whole
model does, and narrowing one layer at a time gives what the in-memory rewrite gives, resumable after a kill."""

import functools
import json
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnx_nmm
from onnx_nmm.cli import build_parser, main
from onnx_nmm.cli.rewrite import rewrite_options
from onnx_nmm.export import ARCHITECTURES
from onnx_nmm.layerwise import damage_proxy, memory
from onnx_nmm.layerwise.analysis import LayerAnalysis, analyse_layers
from onnx_nmm.layerwise.dry_run import LayerwisePlan
from onnx_nmm.layerwise.rewrite import _sequential_if_within, rewrite_layerwise
from onnx_nmm.layerwise.segments import LayerSegments
from onnx_nmm.layerwise.work import LayerWork
from onnx_nmm.model_source import ModelSource
from onnx_nmm.pipeline import calibration_data
from onnx_nmm.pipeline.statistics import budget_windows
from onnx_nmm.pipeline.targets import find_targets
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.scale.work_dir import WorkDir

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
CALIBRATION = onnx_nmm.CalibrationOptions(source="random", samples=6, seq_len=24)


def _options(mode: str = "independent", **ranks) -> onnx_nmm.RewriteOptions:
    return onnx_nmm.RewriteOptions(factorization=onnx_nmm.FactorizationOptions(method="nystrom"),
                                   ranks=onnx_nmm.RankOptions(align=8, sensitivity_windows=2, **ranks),
                                   calibration=replace(CALIBRATION, mode=mode))


def _segments(path: Path) -> LayerSegments:
    source = ModelSource(path)
    options = _options(keep=0.5)
    return LayerSegments.of(source, find_targets(source.model, options), options)


def _logits_through_segments(segments: LayerSegments, tokens: np.ndarray) -> np.ndarray:
    carried: dict[str, np.ndarray] = {}
    for segment in segments.cut.segments:
        outputs = segments.session(segment).run(segment.outputs, segments.feeds(segment, tokens, carried))
        carried |= dict(zip(segment.outputs, outputs))
    return carried[segments.cut.head.outputs[0]]


def _logits(path: Path, tokens: np.ndarray) -> np.ndarray:
    source = ModelSource(path)
    return source.session().run(None, CausalLm.of_source(source).feeds(tokens))[0]


@pytest.mark.parametrize("architecture", [a for a in ARCHITECTURES if a not in ("phi", "phi3")])
def test_the_segments_run_in_turn_compute_the_whole_models_logits(export, architecture):
    path = export(architecture, "torchscript")
    segments = _segments(path)
    tokens = np.random.default_rng(0).integers(0, 200, (1, 12))
    assert segments.layers == 2 and segments.cut.segments[1].carried_inputs  # layer 1 reads what layer 0 wrote
    assert np.array_equal(_logits_through_segments(segments, tokens), _logits(path, tokens))


@pytest.mark.parametrize("form", ["dynamo-kv", "optimum-merged", "optimum-past-qwen2", "genai-int4"])
def test_every_form_with_a_cache_cuts_into_segments_that_compute_its_logits(export, form):
    path = export("llama", "dynamo", cache=True) if form == "dynamo-kv" else FORMATS / form / "model.onnx"
    segments = _segments(path)
    tokens = np.random.default_rng(1).integers(0, 200, (1, 10))
    assert all(not name.startswith("present") for segment in segments.cut.segments for name in segment.outputs)
    np.testing.assert_allclose(_logits_through_segments(segments, tokens), _logits(path, tokens), atol=1e-5)


def test_a_model_whose_layers_add_attention_and_mlp_in_parallel_still_cuts_exactly(export):
    path = export("phi", "torchscript")
    tokens = np.random.default_rng(2).integers(0, 200, (1, 12))
    np.testing.assert_allclose(_logits_through_segments(_segments(path), tokens), _logits(path, tokens), atol=1e-6)


def test_the_activation_session_gives_the_rows_whose_gram_the_gram_session_gives(export):
    segments = _segments(export("llama", "dynamo", cache=True))
    tokens = np.random.default_rng(0).integers(0, 200, (2, 16))
    carried: dict[str, np.ndarray] = {}
    for segment in segments.cut.segments[:1]:
        carried |= dict(zip(segment.outputs, segments.session(segment).run(segment.outputs,
                                                                           segments.feeds(segment, tokens, carried))))
    layer, mlp = 1, segments.mlps[1]
    feeds = segments.feeds(segments.cut.segments[layer], tokens, carried)
    session, plan = segments.gram_session(layer)
    gram = plan.assemble(session.run(None, feeds)[:plan.block_count])[mlp.down.x.name]
    (rows,) = segments.activation_session(layer).run(None, feeds)
    assert rows.shape == (2 * 16, mlp.width)
    np.testing.assert_allclose(rows.astype(np.float64).T @ rows, gram, rtol=1e-4, atol=1e-4 * np.abs(gram).max())


def test_keeping_every_neuron_the_layerwise_rewrite_writes_the_same_function(export, tmp_path):
    path = export("llama", "dynamo", cache=True)
    result = rewrite_layerwise(path, tmp_path / "out.onnx", _options(keep=1.0))
    tokens = np.random.default_rng(3).integers(0, 200, (1, 16))
    np.testing.assert_allclose(_logits(tmp_path / "out.onnx", tokens), _logits(path, tokens), atol=1e-5)
    assert {row.status for row in result.report.layers} == {"dense"}
    assert all(row.parameters_after == row.parameters_before > 0 for row in result.report.layers)
    assert not onnx_nmm.work_dir_of(tmp_path / "out.onnx").exists()


def test_layer_by_layer_narrows_as_the_in_memory_rewrite_does(export, tmp_path):
    path = export("llama", "torchscript")
    options = _options(keep=0.5)
    layerwise = rewrite_layerwise(path, tmp_path / "layerwise.onnx", options)
    in_memory = onnx_nmm.rewrite(path, options)
    in_memory.save(tmp_path / "in-memory.onnx")
    assert [(row.name, row.width) for row in layerwise.report.layers] == \
        [(row.name, row.width) for row in in_memory.report.layers if row.status == "narrowed"]
    tokens = np.random.default_rng(4).integers(0, 200, (1, 16))
    np.testing.assert_allclose(_logits(tmp_path / "layerwise.onnx", tokens),
                               _logits(tmp_path / "in-memory.onnx", tokens), atol=1e-4)


def test_a_quality_budget_chosen_layer_by_layer_is_measured_at_the_output(export, tmp_path):
    path = export("llama", "torchscript")
    result = rewrite_layerwise(path, tmp_path / "out.onnx", _options(max_ppl_increase=0.05))
    budget = result.report.quality_budget
    assert budget["layer_by_layer"] and budget["budget"] is not None
    assert len(budget["spread"]["per_window"]) == 2
    narrowed = [row for row in result.report.layers if row.status == "narrowed"]
    assert narrowed and budget["measured"] <= np.log1p(0.05)  # within its budget, by measurement
    assert len(budget["sensitivity"]) == 2 and all(len(points) == 2 for points in budget["sensitivity"].values())
    evaluations = dict(budget["evaluations"])  # the sweeps measured: the chosen prefix and those over
    assert evaluations[budget["moves_applied"]] == budget["measured"]
    assert all(damage > np.log1p(0.05) for prefix, damage in evaluations.items() if prefix > budget["moves_applied"])
    assert set(result.report.seconds) == {"calibration", "analysis sweep", "narrowing sweeps", "writing"}
    marks = list(result.report.peak_rss_bytes.values())  # the high-water mark at each phase's end, in order
    assert result.report.peak_rss_bytes.keys() == result.report.seconds.keys() and marks == sorted(marks)


def test_keeping_every_neuron_a_sequential_rewrite_has_nothing_to_refit_and_writes_the_same_function(export,
                                                                                                    tmp_path):
    path = export("llama", "dynamo", cache=True)
    result = rewrite_layerwise(path, tmp_path / "out.onnx", _options("sequential", keep=1.0))
    tokens = np.random.default_rng(5).integers(0, 200, (1, 16))
    np.testing.assert_allclose(_logits(tmp_path / "out.onnx", tokens), _logits(path, tokens), atol=1e-5)
    assert "sequential" not in (result.report.quality_budget or {})  # every MLP dense: no refit sweep


def test_a_sequential_refit_keeps_the_plans_neurons_and_refits_each_layer_after_the_first(export, tmp_path):
    path = export("llama", "torchscript")
    independent = rewrite_layerwise(path, tmp_path / "independent.onnx", _options(keep=0.5)).report
    sequential = rewrite_layerwise(path, tmp_path / "sequential.onnx", _options("sequential", keep=0.5)).report
    assert [(row.name, row.width) for row in sequential.layers] == [(row.name, row.width) for row in independent.layers]
    first, second = ([row for row in report.layers if row.role == "down"] for report in (independent, sequential))
    assert first[0].whitened_loss == second[0].whitened_loss  # layer 0's inputs are the embedding's in both
    assert all("refitted to the compressed model's inputs" in row.reason for row in second)
    independent_weights, sequential_weights = (_initializers(tmp_path / f"{name}.onnx")
                                               for name in ("independent", "sequential"))
    assert independent_weights.keys() == sequential_weights.keys()
    differ = [name for name, weight in independent_weights.items()
              if not np.array_equal(weight, sequential_weights[name])]
    assert len(differ) == 1 and independent_weights[differ[0]].shape == sequential_weights[differ[0]].shape
    budget = sequential.quality_budget
    assert budget["sequential"]["written"] and budget["sequential"]["measured"] > 0
    assert budget["sequential"]["measured"] != budget["measured"] > 0  # the independent fit's, measured too
    assert "sequential refit" in sequential.seconds and "sequential refit" not in independent.seconds


def test_a_sequential_refit_over_the_budget_is_not_written_and_says_so():
    report = onnx_nmm.RewriteReport("keep", "mlp", "nystrom", quality_budget={"measured": 0.01})
    with pytest.warns(UserWarning, match="the independent fit was written"):
        stage = _sequential_if_within(report, 0.02, "narrowing-00003", [], np.array([0.02, 0.03, 0.01]),
                                      ["text#0", "generated#1", "text#2"])
    assert stage == "narrowing-00003" and report.quality_budget["sequential"] == {"measured": 0.03, "written": False}


def _initializers(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(path)
    return {tensor.name: onnx.numpy_helper.to_array(tensor, str(path.parent)) for tensor in model.graph.initializer}


KILLED_CHILD = textwrap.dedent("""
    import contextlib, json, os, signal, sys
    import onnx_nmm
    from onnx_nmm.layerwise.rewrite import _sequential_if_within, rewrite_layerwise

    model, output, phase_name, after, mode, ranks = sys.argv[1:4] + [int(sys.argv[4]), sys.argv[5], sys.argv[6]]

    class Killer(onnx_nmm.Progress):  # kill -9 once `after` steps of the phase are done
        @contextlib.contextmanager
        def phase(self, description, total=None):
            done = []

            class Phase(onnx_nmm.Phase):
                def advance(self, amount=1, detail=None):
                    done.append(detail)
                    if description.startswith(phase_name) and len(done) == after:
                        os.kill(os.getpid(), signal.SIGKILL)

            yield Phase()

    options = onnx_nmm.RewriteOptions(
        factorization=onnx_nmm.FactorizationOptions(method="nystrom"),
        ranks=onnx_nmm.RankOptions(align=8, sensitivity_windows=2, **json.loads(ranks)),
        calibration=onnx_nmm.CalibrationOptions(source="random", samples=6, seq_len=24, mode=mode))
    rewrite_layerwise(model, output, options, progress=Killer())
""")


BUDGET = {"max_ppl_increase": 0.05}


@pytest.mark.parametrize("phase, after, mode, ranks", [
    ("layer by layer: what narrowing", 1, "independent", BUDGET),
    ("layer by layer: narrowing", 1, "independent", BUDGET),
    ("layer by layer: refitting", 1, "sequential", {"keep": 0.5})])  # no budget: the sequential refit is written
def test_a_layerwise_rewrite_killed_in_the_middle_resumes_to_the_same_bytes(export, tmp_path, phase, after, mode,
                                                                            ranks):
    path = export("llama", "dynamo", cache=True)
    single = tmp_path / "single" / "out.onnx"
    rewrite_layerwise(path, single, _options(mode, **ranks))
    resumed = tmp_path / "resumed" / "out.onnx"
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD, str(path), str(resumed), phase, str(after), mode,
                            json.dumps(ranks)], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert not resumed.exists() and onnx_nmm.work_dir_of(resumed).exists()
    rewrite_layerwise(path, resumed, _options(mode, **ranks))
    for name in ("out.onnx", "out.onnx.data"):
        assert (resumed.parent / name).read_bytes() == (single.parent / name).read_bytes(), name


def test_the_layerwise_rewrite_refuses_what_it_does_not_do(export, tmp_path):
    path = export("llama", "torchscript")
    with pytest.raises(onnx_nmm.OptionError, match="narrows MLPs"):
        rewrite_layerwise(path, tmp_path / "out.onnx", onnx_nmm.RewriteOptions(
            factorization=onnx_nmm.FactorizationOptions(method="whiten"), calibration=CALIBRATION))
    assert not (tmp_path / "out.onnx").exists()


def test_the_in_memory_rewrite_refuses_sequential_narrowing_in_one_line_naming_stream(export, tmp_path, capsys):
    path = export("llama", "torchscript")
    code = main([str(a) for a in ("rewrite", path, "-o", tmp_path / "out.onnx", "--method", "nystrom", "--keep", 0.5,
                                  "--calib", "random", "--calib-mode", "sequential")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "layer by layer (--stream)" in err and "--calib-mode independent" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out.onnx").exists()


def test_a_streamed_rewrite_narrows_layer_by_layer_with_the_default_budget(export, tmp_path, capsys):
    path = export("llama", "dynamo", cache=True)
    code = main([str(a) for a in ("rewrite", path, "-o", tmp_path / "out.onnx", "--stream", "--calib", "random",
                                  "--calib-samples", 6, "--calib-window", 24, "--sensitivity-windows", 2,
                                  "--calib-mix", 0, "--align", 8, "--report", tmp_path / "report.json")])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["method"].startswith("nystrom") and report["quality_budget"]["layer_by_layer"]


def test_a_model_too_large_for_memory_is_rewritten_layer_by_layer_and_says_so(export, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 1 << 20)
    path = export("llama", "dynamo", cache=True)
    code = main([str(a) for a in ("rewrite", path, "-o", tmp_path / "out.onnx", "--calib", "random",
                                  "--calib-samples", 6, "--calib-window", 24, "--sensitivity-windows", 2,
                                  "--calib-mix", 0, "--align", 8)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "rewriting it one layer at a time" in err and "GB available" in err
    assert (tmp_path / "out.onnx.data").exists()


def test_without_calibration_the_rewrite_says_what_it_learns_from(export, tmp_path, capsys):
    path = export("llama", "torchscript")
    assert main(["rewrite", str(path), "-o", str(tmp_path / "svd.onnx")]) == 0
    assert "no --calib: weight-only SVD, which often leaves a model that no longer answers" in \
        capsys.readouterr().err


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    """A tiny Llama of four decoder layers (the cached exports have two)."""
    path = tmp_path_factory.mktemp("four-layers") / "model.onnx"
    shape = onnx_nmm.TinyShape(hidden=64, intermediate=128, layers=4, heads=2, kv_heads=1, vocab=300)
    onnx_nmm.export_causal_lm(onnx_nmm.build_model("llama", shape), path, "torchscript")
    return path


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """analysed(model, reference_layers) -> every layer's analysis, its damages in KL (always positive)."""

    @functools.cache
    def analyse(path: Path, reference_layers: int) -> list[LayerAnalysis]:
        options = _options(max_kl=0.05, reference_layers=reference_layers)
        source = ModelSource(path)
        segments = LayerSegments.of(source, find_targets(source.model, options), options)
        data = calibration_data(options, source, onnx_nmm.Progress())
        output = tmp_path_factory.mktemp("analysis") / "out.onnx"
        work = LayerWork(WorkDir.open(output, "analysis", resume=False))
        return analyse_layers(segments, data.windows(), budget_windows(data, None), 1, "kl", work,
                              onnx_nmm.Progress())

    return analyse


def test_measuring_every_layer_gives_each_the_damage_of_its_own_paths(export, four_layers, analysed):
    every = analysed(four_layers, 0)
    assert [analysis.references for analysis in analysed(four_layers, 4)] == \
        [analysis.references for analysis in every]  # M ≥ L: every layer is a calibration layer
    assert all(len(analysis.references) == 2 and analysis.mlp_energy > 0 and analysis.stream_energy > 0
               for analysis in every)
    two = export("llama", "dynamo", cache=True)  # two layers: M = 2 measures both
    assert damage_proxy.calibration_layers(2, 2) == [0, 1]
    assert [analysis.references for analysis in analysed(two, 2)] == \
        [analysis.references for analysis in analysed(two, 0)]


def test_between_calibration_layers_the_damage_is_the_proxy_scaled_by_the_interpolated_ratio(four_layers, analysed):
    measured, proxied = analysed(four_layers, 0), analysed(four_layers, 2)
    assert damage_proxy.calibration_layers(4, 2) == [0, 3]
    for layer in (0, 3):  # the calibration layers' paths are the same whatever else is carried
        assert proxied[layer].references == measured[layer].references
    first, last = proxied[0], proxied[3]
    for position in range(2):
        ratios = [analysis.references[position][1] / analysis.proxy(analysis.references[position][0])
                  for analysis in (first, last)]
        for layer in (1, 2):
            width, damage = proxied[layer].references[position]
            t = layer / 3
            expected = proxied[layer].proxy(width) * ratios[0] ** (1 - t) * ratios[1] ** t
            assert damage == pytest.approx(expected, rel=1e-12)
    again = LayerAnalysis.from_json(proxied[1].to_json())  # the energies survive a resume
    assert (again.mlp_energy, again.stream_energy) == (proxied[1].mlp_energy, proxied[1].stream_energy)


def test_the_damage_proxy_spaces_calibration_layers_and_interpolates_ratios_in_log_space():
    assert damage_proxy.calibration_layers(32, 8) == [0, 4, 9, 13, 18, 22, 27, 31]
    assert damage_proxy.calibration_layers(5, 0) == damage_proxy.calibration_layers(5, 8) == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(damage_proxy.interpolated_ratios({0: 1.0, 4: 16.0}, 5), [1, 2, 4, 8, 16])
    # a ratio that is not positive says nothing of the scale: the next calibration layer's stands in
    np.testing.assert_allclose(damage_proxy.interpolated_ratios({0: 2.0, 2: -1.0, 4: 2.0}, 5), [2] * 5)
    assert list(damage_proxy.interpolated_ratios({0: 0.0}, 3)) == [1, 1, 1]
    proxies = [[0.1, 0.4], [0.2, 0.5], [0.3, 0.6]]
    damages = damage_proxy.reference_damages(proxies, {0: [0.1, 0.8], 2: [1.2, 0.6]})
    np.testing.assert_allclose(damages, [[0.1, 0.8], [0.2 * 2, 0.5 * np.sqrt(2)], [1.2, 0.6]])
    assert damage_proxy.local_proxy(0.5, 2.0, 4.0) == 0.25
    with pytest.raises(onnx_nmm.OptionError, match="at least 2"):
        onnx_nmm.RankOptions(reference_layers=1)
    args = build_parser().parse_args(["rewrite", "m.onnx", "-o", "o.onnx", "--reference-layers", "3"])
    assert rewrite_options(args).ranks.reference_layers == 3


def test_with_calibration_layers_the_modelled_analysis_grows_linearly_in_depth():
    plan = LayerwisePlan(2, 6, 2, 24, 1.0, 0.2, 0.5, 0.1, 0.25, 0.0, 0.0, 0, 1, 2, reference_layers=8)
    analysis = [replace(plan, narrowing_sweeps=0).seconds_for(layers) for layers in (32, 64, 96)]
    assert analysis[2] - analysis[1] == pytest.approx(analysis[1] - analysis[0], rel=0.01)
    every = [replace(plan, narrowing_sweeps=0, reference_layers=0).seconds_for(layers) for layers in (32, 64, 96)]
    assert every[2] - every[1] > 1.5 * (every[1] - every[0])  # every layer measured: quadratic


def test_the_dry_run_times_one_layer_models_the_sweeps_and_writes_nothing(export, tmp_path, capsys):
    path = export("llama", "dynamo", cache=True)
    plan = onnx_nmm.plan_layerwise(path, _options(max_ppl_increase=0.05))
    assert plan.layers == 2 and plan.windows == 6 and plan.held_out == 2 and plan.sample_layer == 1
    assert 0 < plan.layer_seconds and 0 < plan.refit_seconds < plan.maths_seconds and 0 < plan.head_seconds
    assert 0 < plan.session_seconds
    assert plan.analysis_seconds > 0 and plan.narrowing_seconds > 0 and plan.peak_bytes > 0
    assert plan.narrowing_sweeps == 5 and onnx_nmm.plan_layerwise(path, _options(keep=0.5)).narrowing_sweeps == 1
    assert plan.seconds_for(plan.layers) == pytest.approx(plan.seconds)
    code = main([str(a) for a in ("rewrite", path, "-o", tmp_path / "out.onnx", "--calib", "random", "--dry-run")])
    out = capsys.readouterr().out
    assert code == 0 and "layer by layer: 2 layers" in out and "Nothing was written" in out
    assert not list(tmp_path.iterdir())


def test_with_a_tokenizer_the_layerwise_rewrite_checks_the_answers_after_writing(tmp_path):
    folder = FORMATS / "genai-fp32"
    options = onnx_nmm.RewriteOptions(
        factorization=onnx_nmm.FactorizationOptions(method="nystrom"),
        ranks=onnx_nmm.RankOptions(align=8, sensitivity_windows=2, keep=0.75),
        calibration=onnx_nmm.CalibrationOptions(source="random", samples=6, seq_len=24, tokenizer=folder))
    result = rewrite_layerwise(folder / "model.onnx", tmp_path / "out.onnx", options)
    answers = result.report.answers
    assert answers and len(answers["prompts"]) == len(answers["dense"]) == len(answers["rewritten"]) > 0
