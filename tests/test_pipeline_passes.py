"""Each rewrite step on its own, given the values it takes: the steps that only read the model return what
they found, the passes that change it a PassResult carrying what they made."""

import graphs
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnx_nmm import CalibrationOptions, Dense, FactorizationOptions, RankOptions, RewriteOptions, Selection
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes import FuseMlpPass, find_linear_layers, svd_ops
from onnx_nmm.pipeline import (
    FactorizeLayers,
    Factorizer,
    FuseMlps,
    MlpNarrowings,
    Planner,
    Statistics,
    calibration_data,
    find_targets,
    gather_statistics,
)
from onnx_nmm.progress import Progress

EVERY_LAYER = Selection(targets="all", lm_head=True)


def _options(ranks=RankOptions(), selection=EVERY_LAYER, calibration=None, **options):
    return RewriteOptions(ranks=ranks, selection=selection, calibration=calibration, **options)


def _plan(source: ModelSource, options: RewriteOptions) -> dict:
    """The plan of an uncalibrated rewrite."""
    statistics = Statistics()
    factorizer = Factorizer(options.factorization, None, options.ranks.align)
    planner = Planner(options, find_targets(source.model, options), factorizer,
                      MlpNarrowings(statistics, options.factorization), None, statistics, source, Progress())
    return planner.choose(source.model).plan


def _factorize(source: ModelSource, options: RewriteOptions, plan: dict):
    factorizer = Factorizer(options.factorization, None, options.ranks.align)
    return FactorizeLayers(options, plan, factorizer, Progress())(source.model)


def _run(proto, x):
    model = ir.to_proto(proto) if isinstance(proto, ir.Model) else proto
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})[0]


def _x(k, seed=0):
    return np.random.default_rng(seed).standard_normal((2, 5, k)).astype(np.float32)


def test_statistics_are_gathered_without_changing_the_model(export, tmp_path):
    np.savez(tmp_path / "ids.npz", input_ids=np.random.default_rng(0).integers(0, 1000, (2, 16), dtype=np.int64))
    options = _options(selection=Selection(), ranks=RankOptions(keep=0.8),
                       factorization=FactorizationOptions(method="whiten"),
                       calibration=CalibrationOptions(tmp_path / "ids.npz", save_statistics=tmp_path / "s.npz"))
    source = ModelSource(export("llama", "dynamo"))
    before = [node.op_type for node in source.model.graph]
    statistics = gather_statistics(find_targets(source.model, options), calibration_data(options, source, Progress()),
                                   options, source, Progress())
    assert [node.op_type for node in source.model.graph] == before
    gate, up, down = [layer for layer in find_linear_layers(source.model) if layer.group == "mlp"][:3]
    assert statistics.grams.tokens == 32 and gate.x.name == up.x.name and statistics.held_out is None
    assert statistics.grams.grams[gate.x.name].shape == (256, 256)
    assert statistics.grams.grams[down.x.name].shape == (512, 512)
    assert (tmp_path / "s.npz").exists() and statistics.windows == [f"{tmp_path / 'ids.npz'}#{i}" for i in (0, 1)]


def test_statistics_are_not_gathered_when_nothing_needs_them(export):
    options, source = _options(), ModelSource(export("llama", "dynamo"))
    statistics = gather_statistics(find_targets(source.model, options), None, options, source, Progress())
    assert statistics.grams is None and statistics.description == ""


@pytest.mark.parametrize("ranks, expected", [
    (RankOptions(keep=0.5, align=4), 4),  # 16×24 keeps half: 0.5·384/40 = 4.8 → 4
    (RankOptions(rank=7), 7),
    (RankOptions(rank="full"), 16),
    (RankOptions(energy=1.0, align=4), Dense("rank 16 saves nothing (break-even 10)")),
    (RankOptions(keep=0.9, align=16), Dense("rank 16 saves nothing (break-even 10)")),
    (RankOptions(ranks_from={"mm": 3}), 3),
    (RankOptions(ranks_from={"mm": None}), Dense("kept dense in the given plan")),
])
def test_the_plan_gives_every_target_a_rank_or_a_reason(ranks, expected):
    source = ModelSource(graphs.matmul(16, 24))
    before = ir.to_proto(source.model).SerializeToString()
    assert _plan(source, _options(ranks)) == {"mm": expected}
    assert ir.to_proto(source.model).SerializeToString() == before  # the plan reads the model, never changes it


def test_the_global_plan_spends_no_more_than_the_uniform_one(export):
    source = ModelSource(export("gpt2", "dynamo"))
    plan = _plan(source, _options(RankOptions(keep=0.5, align=32, budget="global"), Selection()))
    layers = {layer.name: layer for layer in find_linear_layers(source.model)}
    spent = sum(layers[name].k * layers[name].n if isinstance(rank, Dense) else rank * (layers[name].k + layers[name].n)
                for name, rank in plan.items())
    uniform = sum(32 * round(0.5 * layer.k * layer.n / ((layer.k + layer.n) * 32)) * (layer.k + layer.n)
                  for layer in layers.values() if layer.group == "mlp")
    assert plan.keys() == {name for name, layer in layers.items() if layer.group == "mlp"}
    assert spent <= uniform


def test_factorization_follows_the_plan_and_names_its_factors():
    proto = graphs.swiglu_mlp(hidden=32, intermediate=64)
    source = ModelSource(proto)
    layers = find_linear_layers(source.model)
    gate, up, down = (layer.name for layer in layers)
    result = _factorize(source, _options(), {gate: 32, up: 8, down: Dense("kept for the test")})
    assert result.modified and set(result.factor_names) == {gate, up}
    initializers = source.model.graph.initializers
    for layer, rank in ((gate, 32), (up, 8)):
        u, v = result.factor_names[layer]
        assert initializers[u].const_value.shape == (32, rank) and initializers[v].const_value.shape == (rank, 64)
    statuses = {outcome.name: (outcome.status, outcome.rank, outcome.reason) for outcome in result.rows}
    assert statuses == {gate: ("factorized", 32, "explicit rank saves nothing"), up: ("factorized", 8, ""),
                        down: ("dense", None, "kept for the test")}
    assert [node.op_type for node in source.model.graph].count(svd_ops.SVD_MATMUL) == 2
    # gate at full rank is exact; up is its best rank-8 approximation (plain SVD: Eckart–Young)
    wg, wu, wd = (graphs.weight(*shape, seed) for shape, seed in (((32, 64), 1), ((32, 64), 2), ((64, 32), 3)))
    p, sigma, q = np.linalg.svd(wu.astype(np.float64), full_matrices=False)
    x = _x(32).astype(np.float64)
    gated = x @ wg
    expected = (gated / (1 + np.exp(-gated)) * (x @ (p[:, :8] * sigma[:8] @ q[:8]))) @ wd
    np.testing.assert_allclose(_run(source.model, x.astype(np.float32)), expected, rtol=1e-4, atol=1e-4)


def test_fusion_turns_a_factorized_gated_mlp_into_one_op_that_computes_the_same():
    proto = graphs.swiglu_mlp(hidden=32, intermediate=64)
    source, options = ModelSource(proto), _options(RankOptions(rank="full"), fuse_mlp=True)
    _factorize(source, options, _plan(source, options))
    unfused = ir.to_proto(source.model)
    result = FuseMlps()(source.model)
    assert result.modified and result.fused == ["mlp"]  # the module path of the down projection's parent
    assert [node.op_type for node in source.model.graph] == [svd_ops.SVD_GATED_MLP]
    x = _x(32)
    np.testing.assert_allclose(_run(source.model, x), _run(unfused, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_run(source.model, x), _run(proto, x), rtol=1e-4, atol=1e-4)


def test_fusion_leaves_a_partly_dense_mlp_alone():
    source = ModelSource(graphs.swiglu_mlp(hidden=32, intermediate=64))
    gate, up, down = (layer.name for layer in find_linear_layers(source.model))
    _factorize(source, _options(), {gate: 8, up: 8, down: Dense("kept for the test")})
    fusion = FuseMlpPass()(source.model)
    assert not fusion.modified and fusion.fused == []
