"""Each rewrite pass on its own, as a model → model unit over a hand-made context."""

import graphs
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnx_nmm import CalibrationOptions, Dense, FactorizationOptions, RankOptions, RewriteOptions, Selection
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes import FuseMlpPass, find_linear_layers, svd_ops
from onnx_nmm.pipeline import FactorizeLayers, FuseMlps, GatherStatistics, PlanRanks, RewriteContext

EVERY_LAYER = Selection(targets="all", lm_head=True)


def _context(proto, ranks=RankOptions(), selection=EVERY_LAYER, calibration=None, **options):
    return RewriteContext(RewriteOptions(ranks=ranks, selection=selection, calibration=calibration, **options),
                          ModelSource(proto))


def _run(proto, x):
    model = ir.to_proto(proto) if isinstance(proto, ir.Model) else proto
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})[0]


def _x(k, seed=0):
    return np.random.default_rng(seed).standard_normal((2, 5, k)).astype(np.float32)


def test_statistics_are_gathered_without_changing_the_model(export, tmp_path):
    np.savez(tmp_path / "ids.npz", input_ids=np.random.default_rng(0).integers(0, 1000, (2, 16), dtype=np.int64))
    context = _context(export("llama", "dynamo"), selection=Selection(), ranks=RankOptions(keep=0.8),
                       factorization=FactorizationOptions(method="whiten"),
                       calibration=CalibrationOptions(tmp_path / "ids.npz", save_statistics=tmp_path / "s.npz"))
    before = [node.op_type for node in context.source.model.graph]
    result = GatherStatistics(context)(context.source.model)
    assert not result.modified and [node.op_type for node in result.model.graph] == before
    gate, up, down = [layer for layer in find_linear_layers(context.source.model) if layer.group == "mlp"][:3]
    assert context.statistics.tokens == 32 and gate.x.name == up.x.name
    assert context.statistics.grams[gate.x.name].shape == (256, 256)
    assert context.statistics.grams[down.x.name].shape == (512, 512)
    assert (tmp_path / "s.npz").exists()


def test_statistics_are_not_gathered_when_nothing_needs_them(export):
    context = _context(export("llama", "dynamo"))
    assert not GatherStatistics(context)(context.source.model).modified and context.statistics is None


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
    context = _context(graphs.matmul(16, 24), ranks)
    result = PlanRanks(context)(context.source.model)
    assert not result.modified and context.plan == {"mm": expected}


def test_the_global_plan_spends_no_more_than_the_uniform_one(export):
    context = _context(export("gpt2", "dynamo"), RankOptions(keep=0.5, align=32, budget="global"), Selection())
    PlanRanks(context)(context.source.model)
    layers = {layer.name: layer for layer in find_linear_layers(context.source.model)}
    spent = sum(layers[name].k * layers[name].n if isinstance(rank, Dense) else rank * (layers[name].k + layers[name].n)
                for name, rank in context.plan.items())
    uniform = sum(32 * round(0.5 * layer.k * layer.n / ((layer.k + layer.n) * 32)) * (layer.k + layer.n)
                  for layer in layers.values() if layer.group == "mlp")
    assert context.plan.keys() == {name for name, layer in layers.items() if layer.group == "mlp"}
    assert spent <= uniform


def test_factorization_follows_the_plan_and_names_its_factors():
    proto = graphs.swiglu_mlp(hidden=32, intermediate=64)
    context = _context(proto)
    layers = find_linear_layers(context.source.model)
    gate, up, down = (layer.name for layer in layers)
    context.plan = {gate: 32, up: 8, down: Dense("kept for the test")}
    factorize = FactorizeLayers(context)
    result = factorize(context.source.model)
    assert result.modified and set(factorize.factor_names) == {gate, up}
    initializers = context.source.model.graph.initializers
    for layer, rank in ((gate, 32), (up, 8)):
        u, v = factorize.factor_names[layer]
        assert initializers[u].const_value.shape == (32, rank) and initializers[v].const_value.shape == (rank, 64)
    statuses = {outcome.name: (outcome.status, outcome.rank, outcome.reason) for outcome in context.report.layers}
    assert statuses == {gate: ("factorized", 32, "explicit rank saves nothing"), up: ("factorized", 8, ""),
                        down: ("dense", None, "kept for the test")}
    assert [node.op_type for node in context.source.model.graph].count(svd_ops.SVD_MATMUL) == 2
    # gate at full rank is exact; up is its best rank-8 approximation (plain SVD: Eckart–Young)
    wg, wu, wd = (graphs.weight(*shape, seed) for shape, seed in (((32, 64), 1), ((32, 64), 2), ((64, 32), 3)))
    p, sigma, q = np.linalg.svd(wu.astype(np.float64), full_matrices=False)
    x = _x(32).astype(np.float64)
    gated = x @ wg
    expected = (gated / (1 + np.exp(-gated)) * (x @ (p[:, :8] * sigma[:8] @ q[:8]))) @ wd
    np.testing.assert_allclose(_run(context.source.model, x.astype(np.float32)), expected, rtol=1e-4, atol=1e-4)


def test_fusion_turns_a_factorized_gated_mlp_into_one_op_that_computes_the_same():
    proto = graphs.swiglu_mlp(hidden=32, intermediate=64)
    context = _context(proto, RankOptions(rank="full"), fuse_mlp=True)
    ir.passes.Sequential(PlanRanks(context), FactorizeLayers(context))(context.source.model)
    unfused = ir.to_proto(context.source.model)
    result = FuseMlps(context)(context.source.model)
    assert result.modified and context.report.fused_mlps == ["mlp"]  # the module path of the down projection's parent
    assert [node.op_type for node in context.source.model.graph] == [svd_ops.SVD_GATED_MLP]
    x = _x(32)
    np.testing.assert_allclose(_run(context.source.model, x), _run(unfused, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_run(context.source.model, x), _run(proto, x), rtol=1e-4, atol=1e-4)


def test_fusion_leaves_a_partly_dense_mlp_alone():
    context = _context(graphs.swiglu_mlp(hidden=32, intermediate=64))
    gate, up, down = (layer.name for layer in find_linear_layers(context.source.model))
    context.plan = {gate: 8, up: 8, down: Dense("kept for the test")}
    FactorizeLayers(context)(context.source.model)
    fusion = FuseMlpPass()
    assert not fusion(context.source.model).modified and fusion.fused == []


# The context's slots a pass fills for the later ones, and the pass that fills each.
HANDED_ON = {"statistics": "GatherStatistics", "held_out_statistics": "GatherStatistics", "plan": "PlanRanks"}


@pytest.mark.parametrize("options", [
    RewriteOptions(ranks=RankOptions(keep=0.5, align=16)),
    RewriteOptions(ranks=RankOptions(keep=0.5, align=16, budget="global"), factorization=FactorizationOptions("whiten"),
                   calibration=CalibrationOptions("random", samples=4, seq_len=16)),
    RewriteOptions(ranks=RankOptions(keep=0.8, align=16, budget="sensitivity", sensitivity_windows=2),
                   factorization=FactorizationOptions("nystrom"), check_answers=False,
                   calibration=CalibrationOptions("random", samples=6, seq_len=16)),
], ids=["svd", "whiten-global", "nystrom-sensitivity"])
def test_no_pass_reads_what_a_later_pass_hands_on(export, monkeypatch, options):
    """A slot of RewriteContext read before the pass that fills it has started would be None: a bug that
    passes for 'no statistics'."""
    import onnx_nmm
    from onnx_nmm.pipeline import context

    started, too_early = [], []
    run = context.RewritePass.call
    get = context.RewriteContext.__getattribute__

    def call(self, model):
        started.append(type(self).__name__)
        return run(self, model)

    def read(self, name):
        if name in HANDED_ON and HANDED_ON[name] not in started:
            too_early.append((name, started[-1] if started else "before any pass"))
        return get(self, name)

    monkeypatch.setattr(context.RewritePass, "call", call)
    monkeypatch.setattr(context.RewriteContext, "__getattribute__", read)
    onnx_nmm.rewrite(export("llama", "dynamo"), options)
    assert started[:2] == ["GatherStatistics", "PlanRanks"] and not too_early, too_early
