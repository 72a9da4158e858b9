"""MLP compression as a module (--method nystrom): the maths (onnx_nmm.decomposition.nystrom), the rule that finds MLPs
(passes/mlp_rules), the surgery (passes/mlp_narrowing), and the rewrite that plans widths."""

import json
from pathlib import Path

import graphs
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import onnx_nmm
from onnx_nmm import CalibrationOptions, FactorizationOptions, RankOptions, RewriteOptions
from onnx_nmm.decomposition.nystrom import NEURON_SCORES, MlpNarrowing
from onnx_nmm.errors import OptionError
from onnx_nmm.passes import find_linear_layers
from onnx_nmm.passes.mlp_narrowing import NarrowedMlp, NarrowedWeight, NarrowMlpPass, find_mlps

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
HIDDEN, WIDTH = 16, 24


def _swiglu() -> tuple[ir.Model, dict[str, np.ndarray]]:
    proto = graphs.swiglu_mlp(HIDDEN, WIDTH)
    weights = {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in proto.graph.initializer}
    return ir.serde.deserialize_model(proto), weights


def _intermediate(x: np.ndarray, weights: dict[str, np.ndarray]) -> np.ndarray:
    """h = silu(X·W_g) ⊙ (X·W_u), in float64."""
    g, u = x @ weights["Wg"].astype(np.float64), x @ weights["Wu"].astype(np.float64)
    return g / (1 + np.exp(-g)) * u


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x.astype(np.float32)})[0].astype(np.float64)


def _narrowed(model: ir.Model, kept: np.ndarray, down: np.ndarray) -> ir.Model:
    """`model` with its one MLP narrowed to `kept` and `down` as the output weight, through the pass."""
    (mlp,), _ = find_mlps(find_linear_layers(model))
    weights = [NarrowedWeight(layer, layer.weight_matrix()[:, kept]) for layer in mlp.projections]
    NarrowMlpPass([NarrowedMlp(mlp, kept, weights + [NarrowedWeight(mlp.down, down)])])(model)
    return model


def test_keeping_every_neuron_reproduces_the_mlp_exactly():
    model, weights = _swiglu()
    x = np.random.default_rng(0).standard_normal((2, 8, HIDDEN))
    expected = _run(model, x)
    h = _intermediate(x.reshape(-1, HIDDEN), weights)
    narrowing = MlpNarrowing(h.T @ h, weights["Wd"])
    everything = narrowing.kept(WIDTH)
    np.testing.assert_array_equal(narrowing.refit(everything), weights["Wd"].astype(np.float64))
    np.testing.assert_array_equal(_run(_narrowed(model, everything, narrowing.refit(everything)), x), expected)


@pytest.mark.parametrize("score", NEURON_SCORES)
def test_dropping_one_neuron_moves_the_output_by_the_predicted_amount(score):
    model, weights = _swiglu()
    x = np.random.default_rng(1).standard_normal((4, 32, HIDDEN))
    expected = _run(model, x)
    h = _intermediate(x.reshape(-1, HIDDEN), weights)
    narrowing = MlpNarrowing(h.T @ h, weights["Wd"], score=score)
    kept = narrowing.kept(WIDTH - 1)
    refit = narrowing.refit(kept)
    actual = _run(_narrowed(model, kept, refit), x)
    measured = np.sum((actual - expected) ** 2) / np.sum(expected ** 2)  # on the very tokens C came from
    assert measured > 0
    assert measured == pytest.approx(narrowing.relative_error(kept, refit), rel=1e-3)
    assert _run(model, x).shape[-1] == HIDDEN and actual.shape == expected.shape


def test_the_refit_beats_keeping_the_rows_and_the_scores_order_the_neurons():
    rng = np.random.default_rng(2)
    h = rng.standard_normal((512, WIDTH)) * rng.uniform(0.1, 3.0, WIDTH)
    h[:, 0] = h[:, 1] + h[:, 2]  # a neuron the others explain: the refit can do without it
    down = rng.standard_normal((WIDTH, HIDDEN))
    for score in NEURON_SCORES:
        narrowing = MlpNarrowing(h.T @ h, down, score=score, ridge=1e-9)
        order = narrowing.order()
        assert sorted(order) == list(range(WIDTH))  # every neuron, once
        kept = narrowing.kept(WIDTH - 4)
        assert narrowing.relative_error(kept, narrowing.refit(kept)) < narrowing.relative_error(kept, down[kept])
    greedy = MlpNarrowing(h.T @ h, down, score="greedy", ridge=1e-9)
    assert greedy.relative_error(greedy.kept(WIDTH - 1), greedy.refit(greedy.kept(WIDTH - 1))) < 1e-12


def test_the_errors_of_every_width_are_the_same_a_block_of_rows_at_a_time(monkeypatch):
    from onnx_nmm.decomposition import nystrom

    rng = np.random.default_rng(7)
    h = rng.standard_normal((400, WIDTH))
    narrowing = MlpNarrowing(h.T @ h, rng.standard_normal((WIDTH, HIDDEN)))
    widths = [1, 5, 8, 16, WIDTH]
    whole = narrowing.relative_errors(widths)
    monkeypatch.setattr(nystrom, "BLOCK_ROWS", 3)
    assert narrowing.relative_errors(widths) == pytest.approx(whole, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("score", NEURON_SCORES)
def test_the_errors_of_every_width_at_once_are_those_of_one_refit_per_width(score):
    """The nested computation the budgets use (one Cholesky factor for every width) against a solve per width;
    with no ridge on a singular C it falls back to the solves."""
    rng = np.random.default_rng(5)
    h = rng.standard_normal((400, WIDTH)) * rng.uniform(0.1, 3.0, WIDTH)
    narrowing = MlpNarrowing(h.T @ h, rng.standard_normal((WIDTH, HIDDEN)), score=score)
    widths = [1, 5, 8, 16, WIDTH - 1, WIDTH]
    at_once = narrowing.relative_errors(widths)
    for width in widths:
        kept = narrowing.kept(width)
        assert at_once[width] == pytest.approx(narrowing.relative_error(kept, narrowing.refit(kept)), rel=1e-9,
                                               abs=1e-12)
    singular = MlpNarrowing(h[:8].T @ h[:8], narrowing.down, score=score, ridge=0.0)
    kept = singular.kept(8)
    assert singular.relative_errors([8])[8] == singular.relative_error(kept, singular.refit(kept))


def test_the_ridge_is_chosen_on_held_out_activations():
    rng = np.random.default_rng(3)
    h = rng.standard_normal((40, WIDTH))  # few tokens: the calibration correlation is noisy
    held_out = rng.standard_normal((4000, WIDTH))
    narrowing = MlpNarrowing(h.T @ h, rng.standard_normal((WIDTH, HIDDEN)))
    chosen = narrowing.choose_ridge(held_out.T @ held_out, WIDTH - 8)
    errors = {}
    for ridge in (1e-4, 1e-1):
        narrowing.ridge = ridge
        kept = narrowing.kept(WIDTH - 8)
        errors[ridge] = narrowing.relative_error(kept, narrowing.refit(kept), held_out.T @ held_out)
    narrowing.ridge = chosen
    kept = narrowing.kept(WIDTH - 8)
    assert narrowing.relative_error(kept, narrowing.refit(kept), held_out.T @ held_out) <= min(errors.values()) + 1e-12


@pytest.mark.parametrize("architecture, exporter", [("llama", "dynamo"), ("gpt2", "torchscript"), ("gpt2", "dynamo"),
                                                    ("phi", "dynamo"), ("qwen2", "torchscript"),
                                                    ("gemma", "dynamo-noopt")])
def test_a_narrowed_mlp_computes_what_its_zeroed_rows_do(export, architecture, exporter):
    """Dropping neurons is exactly zeroing their rows of the output projection: the narrowed graph (its
    reshapes, biases and activation rewired to the kept width) must compute what that does."""
    path = export(architecture, exporter)
    narrowed, zeroed = onnx_nmm.model_io.load_model(path), onnx_nmm.model_io.load_model(path)
    rng = np.random.default_rng(4)
    items = []
    for mlp in find_mlps(find_linear_layers(narrowed))[0]:
        kept = np.sort(rng.choice(mlp.width, mlp.width // 2, replace=False))
        down = rng.standard_normal((len(kept), mlp.down.n)).astype(np.float32) * 0.05
        weights = [NarrowedWeight(layer, layer.weight_matrix()[:, kept], bias=None if layer.bias is None
                                  else layer.bias_vector()[kept]) for layer in mlp.projections]
        items.append(NarrowedMlp(mlp, kept, weights + [NarrowedWeight(mlp.down, down)]))
        zero_rows = np.zeros((mlp.width, mlp.down.n), np.float32)
        zero_rows[kept] = down
        (twin,) = [layer for layer in find_linear_layers(zeroed) if layer.name == mlp.down.name]
        NarrowMlpPass([NarrowedMlp(_mlp_of(zeroed, twin.name), np.arange(mlp.width), [
            NarrowedWeight(layer, layer.weight_matrix(), bias=None if layer.bias is None else layer.bias_vector())
            for layer in _mlp_of(zeroed, twin.name).projections] + [NarrowedWeight(twin, zero_rows)])])(zeroed)
    assert len(items) == 2
    NarrowMlpPass(items)(narrowed)
    tokens = rng.integers(0, 1000, (2, 12))
    outputs = [_logits(model, tokens) for model in (narrowed, zeroed)]
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)
    widths = {value.shape[-1] for node in narrowed.graph for value in node.outputs
              if value.shape is not None and len(value.shape) and node.op_type in ("Mul", "Sigmoid")}
    assert items[0].mlp.width not in widths  # the values between the projections are declared narrower


def _mlp_of(model: ir.Model, down_name: str):
    return next(mlp for mlp in find_mlps(find_linear_layers(model))[0] if mlp.down.name == down_name)


def _logits(model: ir.Model, tokens: np.ndarray) -> np.ndarray:
    from onnx_nmm.model_source import ModelSource
    from onnx_nmm.runtime.causal_lm import CausalLm

    source = ModelSource(model)
    return source.session().run(None, CausalLm.of_source(source).feeds(tokens))[0]


def test_an_mlp_that_cannot_be_narrowed_says_why(export):
    layers = find_linear_layers(onnx_nmm.model_io.load_model(export("phi3", "dynamo")))
    mlps, why = find_mlps(layers)
    assert not mlps and all("Split" in reason for reason in why.values()) and len(why) == 2
    model = ir.serde.deserialize_model(graphs.swiglu_mlp(HIDDEN, WIDTH))
    reader = ir.Node("", "Relu", [next(node for node in model.graph if node.name == "mul").outputs[0]], num_outputs=1)
    model.graph.append(reader)
    model.graph.outputs.append(reader.outputs[0])
    assert find_mlps(find_linear_layers(model))[1] == {
        "/mlp/down_proj/MatMul": "a Relu node outside the MLP reads a value between its projections"}


def _nystrom(ranks: RankOptions, **selection) -> RewriteOptions:
    return RewriteOptions(ranks=ranks, selection=onnx_nmm.Selection(**selection),
                          factorization=FactorizationOptions(method="nystrom"),
                          calibration=CalibrationOptions("random", samples=8, seq_len=32))


def test_a_nystrom_rewrite_narrows_every_mlp_to_the_aligned_width(export):
    result = onnx_nmm.rewrite(export("llama", "dynamo"), _nystrom(RankOptions(keep=0.75, align=32)))
    rows = [layer for layer in result.report.layers if layer.status != "skipped"]
    assert {layer.status for layer in rows} == {"narrowed"} and {layer.width for layer in rows} == {384}
    assert result.report.totals()["kept_fraction"] == pytest.approx(0.75)
    products = [node for node in result.model.graph if node.op_type == "MatMul" and node.inputs[1].is_initializer()]
    assert {tuple(node.inputs[1].const_value.shape) for node in products} >= {(256, 384), (384, 256)}


def test_one_budget_spends_parameters_across_narrowing_and_factorization(export):
    path = export("llama", "dynamo")
    result = onnx_nmm.rewrite(path, _nystrom(RankOptions(keep=0.6, align=32, budget="global"), targets="all"))
    statuses = {layer.role: layer.status for layer in result.report.layers if layer.status != "skipped"}
    assert set(statuses.values()) >= {"narrowed", "factorized"}
    assert {statuses[role] for role in ("gate", "up", "down")} <= {"narrowed", "dense"}
    uniform = onnx_nmm.rewrite(path, _nystrom(RankOptions(keep=0.6, align=32), targets="all"))
    assert result.report.totals()["kept_fraction"] <= uniform.report.totals()["kept_fraction"] + 1e-9


def test_a_quality_budget_measures_widths_on_held_out_windows(export):
    result = onnx_nmm.rewrite(export("llama", "dynamo"), _nystrom(RankOptions(max_kl=0.05, align=64)))
    budget = result.report.quality_budget
    assert budget["measured"] <= 0.05 and budget["moves_considered"] > 0
    assert set(budget["sensitivity"]) == {"model.layers.0.mlp", "model.layers.1.mlp"}


def test_quantized_mlps_stay_quantized_and_their_kept_columns_exact(tmp_path):
    source = FORMATS / "genai-int4" / "model.onnx"
    before = onnx_nmm.model_io.load_model(source)
    with pytest.warns(UserWarning):
        result = onnx_nmm.rewrite(source, _nystrom(RankOptions(keep=0.5, align=16)))
    after = result.model
    for op in ("MatMulNBits", "MatMul"):
        assert sum(node.op_type == op for node in after.graph) == sum(node.op_type == op for node in before.graph)
    old = {layer.name: layer for layer in find_linear_layers(before)}
    for layer in find_linear_layers(after):
        if layer.role in ("gate", "up"):
            assert layer.weight.quantized is not None and layer.n == old[layer.name].n // 2
            dense = old[layer.name].weight_matrix()
            kept = [j for j in range(dense.shape[1]) if any(np.array_equal(dense[:, j], column)
                                                            for column in layer.weight_matrix().T)]
            assert len(kept) == layer.n  # every kept column exactly as it was stored
    result.save(tmp_path / "model.onnx")
    assert ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])


def test_nystrom_options_are_refused_where_they_mean_nothing():
    with pytest.raises(OptionError, match="nystrom narrows MLPs to a kept width"):
        _nystrom(RankOptions(rank=8))
    with pytest.raises(OptionError, match="learns from calibration data"):
        RewriteOptions(factorization=FactorizationOptions(method="nystrom"))
    with pytest.raises(OptionError, match="neuron_score"):
        FactorizationOptions(method="nystrom", neuron_score="best")


def test_the_answer_check_measures_how_likely_the_rewritten_model_finds_the_dense_answers(tmp_path):
    """The rewrite asks the check prompts when it has a tokenizer: a rewrite that keeps everything gives the dense
    answers, as likely as the dense model does; one that keeps almost nothing does not, and the warning names a
    prompt and both answers."""
    from onnx_nmm import load_tokenizer
    from onnx_nmm.generation.answers import MAX_ANSWER_DROP, check_answers
    from onnx_nmm.model_source import ModelSource

    folder = FORMATS / "genai-fp32"
    np.savez(tmp_path / "ids.npz", input_ids=np.random.default_rng(0).integers(0, 300, (6, 32)))
    kept = RewriteOptions(ranks=RankOptions(rank="full"), factorization=FactorizationOptions(factor_dtype="float32"),
                          calibration=CalibrationOptions(str(tmp_path / "ids.npz"), tokenizer=folder))
    answers = onnx_nmm.rewrite(folder / "model.onnx", kept).report.answers
    assert answers["same_start"] == [True] * 4 and answers["dense"] == answers["rewritten"]
    assert max(abs(drop) for drop in answers["drops"]) < 1e-3 and answers["max_answer_drop"] == MAX_ANSWER_DROP

    broken = onnx_nmm.model_io.load_model(folder / "model.onnx")  # confident, and wrong
    rng = np.random.default_rng(1)
    for layer in find_linear_layers(broken):
        layer.weight.storage.const_value = ir.tensor(rng.normal(0, 1, layer.weight.tensor.shape).astype(np.float32))
    check = check_answers(folder / "model.onnx", ModelSource(broken, folder=folder), load_tokenizer(folder))
    assert check.mean_drop > MAX_ANSWER_DROP and "less likely" in check.warning()
    assert check.prompts[int(np.argmax(check.drops))] in check.warning()


def test_answers_that_mostly_diverge_are_worth_a_warning_even_when_likely():
    """A likely dense answer does not make the greedy one right: when most greedy answers leave the dense ones
    within the first tokens, the rewrite warns and shows one of them."""
    from onnx_nmm.generation.answers import AnswerCheck

    prompts = ["What is the capital of France?", "Why is the sky blue?", "Spider legs?", "Bees?"]
    dense = ["Paris.", "Rayleigh scattering.", "Eight.", "Honey."]
    rewritten = ["Paris, France.", "The sky is not blue.", "Four.", "Honey."]
    diverged = AnswerCheck(prompts, dense, rewritten, [0.1, 0.5, 0.3, 0.0], [False, False, False, True])
    assert diverged.diverging == 3 and "3 of 4 check prompts otherwise" in diverged.warning()
    assert "'Why is the sky blue?' with 'The sky is not blue.' instead of 'Rayleigh scattering.'" in diverged.warning()
    half = AnswerCheck(prompts, dense, rewritten, [0.1, 0.5, 0.3, 0.0], [True, False, False, True])
    assert half.warning() == ""  # rewording some answers is what any compression does


def test_an_mlp_nystrom_cannot_narrow_is_factorized_and_the_report_says_why(export):
    result = onnx_nmm.rewrite(export("phi3", "dynamo"), _nystrom(RankOptions(keep=0.5, align=32)))
    rows = [layer for layer in result.report.layers if layer.status != "skipped"]
    assert {layer.status for layer in rows} == {"factorized"}  # whitened, as the gate_up cannot be split
    assert all("not narrowed: a Split node sits between it and the projections feeding it" in layer.reason
               for layer in rows)


def test_a_budget_reuses_the_sensitivities_an_earlier_one_measured(export, tmp_path, monkeypatch):
    from onnx_nmm.ranks import sensitivity
    path = export("llama", "dynamo")
    first = onnx_nmm.rewrite(path, _nystrom(RankOptions(keep=0.75, align=64, budget="sensitivity")))
    (tmp_path / "first.json").write_text(json.dumps(first.report.to_dict()))
    references, choices = [], []  # a reference is measured by calling the probe, a plan by its windows' damages
    per_window = sensitivity.DamageProbe.damage_per_window
    monkeypatch.setattr(sensitivity.DamageProbe, "__call__",
                        lambda self, plan: references.append(plan) or float(np.mean(per_window(self, plan))))
    monkeypatch.setattr(sensitivity.DamageProbe, "damage_per_window",
                        lambda self, plan: choices.append(plan) or per_window(self, plan))
    again = onnx_nmm.rewrite(path, _nystrom(RankOptions(keep=0.5, align=64, budget="sensitivity",
                                                        sensitivity_from=tmp_path / "first.json")))
    assert again.report.quality_budget["sensitivity"] == first.report.quality_budget["sensitivity"]
    assert not references and choices  # only the choice is measured, none of the 2 × 2 references
    with pytest.raises(OptionError, match="with --budget sensitivity|budget sensitivity"):
        RankOptions(keep=0.5, sensitivity_from=tmp_path / "first.json")


def test_the_ridge_chosen_on_held_out_rows_is_the_one_chosen_on_their_gram():
    rng = np.random.default_rng(4)
    h = rng.standard_normal((40, WIDTH))
    held_out = rng.standard_normal((30, WIDTH))  # fewer rows than neurons: the rows are smaller than the Gram
    down = rng.standard_normal((WIDTH, HIDDEN))
    on_gram, on_rows = MlpNarrowing(h.T @ h, down), MlpNarrowing(h.T @ h, down)
    assert on_rows.choose_ridge_on_rows(held_out.astype(np.float32), WIDTH - 8) == \
        on_gram.choose_ridge(held_out.T @ held_out, WIDTH - 8)
    kept = on_rows.kept(WIDTH - 8)
    refit = on_rows.refit(kept)
    residual = held_out @ down - held_out[:, kept] @ refit
    assert on_rows.relative_error(kept, refit, held_out.T @ held_out) == pytest.approx(
        np.sum(residual**2) / np.sum((held_out @ down) ** 2), rel=1e-9)
