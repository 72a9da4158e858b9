"""The Trainium view, modelled: decoder shapes from ONNX graphs and configs, and their price on a NeuronCore."""

import json

import pytest

import onnx_nmm
from onnx_nmm import kernels
from onnx_nmm.cli import main
from onnx_nmm.export import TinyShape, build_config
from onnx_nmm.kernels.pricing.hardware import TRN1
from onnx_nmm.ranks.rank_plan import block_aligned_rank
from onnx_nmm.trainium.decoder_shape import DenseMlp, FusedMlp, Linear
from onnx_nmm.trainium.speed import ELEMENT_BYTES, KERNEL, ROOFLINE, price

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)


def _dims(shape):
    return sorted((p.group, p.role, p.block, *((p.hidden, p.intermediate) if isinstance(p, DenseMlp) else (p.k, p.n)))
                  for p in shape.products if isinstance(p, (Linear, DenseMlp)))


def test_an_exported_kv_cache_model_has_the_shape_its_config_gives(export):
    from_graph = onnx_nmm.decoder_shape(export("llama", "dynamo", cache=True))
    from_config = onnx_nmm.decoder_shape_of_config(build_config("llama", TinyShape()).to_dict())
    for field in ("layers", "hidden", "q_width", "kv_width", "head_dim", "vocab", "activations"):
        assert getattr(from_graph, field) == getattr(from_config, field), field
    assert _dims(from_graph) == _dims(from_config)
    assert from_graph.notes == ()


def test_a_rewritten_model_is_priced_as_compile_runs_it_with_its_gated_mlps_fused(export, tmp_path):
    options = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.5, align=32))
    onnx_nmm.rewrite(export("llama", "dynamo", cache=True), options).save(tmp_path / "rewritten.onnx")

    fused = onnx_nmm.decoder_shape(tmp_path / "rewritten.onnx")
    unfused = onnx_nmm.decoder_shape(tmp_path / "rewritten.onnx", fuse_mlp=False)
    assert fused.counts() == {"dense": 4 * 2 + 1, "factorized": 0, "fused MLP": 2, "dense MLP": 0}
    assert fused.activations == ()  # the gating runs inside the fused kernel
    assert unfused.counts() == {"dense": 4 * 2 + 1, "factorized": 3 * 2, "fused MLP": 0, "dense MLP": 0}
    assert unfused.activations == ((512, True),) * 2
    rank = block_aligned_rank(256, 512, 0.5, 32)
    assert {p.ranks for p in fused.products if isinstance(p, FusedMlp)} == {(rank, rank, rank)}


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_factorizing_a_shape_gives_the_shape_of_the_rewrite_compile_runs(export, tmp_path, exporter):
    """Shapes only against the real thing, on an ungated (fc1/fc2) model: factorized(decoder_shape(dense)) has the
    products of decoder_shape(rewrite(dense)). The dynamo export's MLPs fuse into one SvdMLP each; the
    TorchScript export's reshape between fc1 and fc2 with no shapes to show they keep the rows, so compile fuses
    neither its dense MLPs nor its factorized ones, and the shapes say so."""
    dense = export("gpt2", exporter)
    options = onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.5, align=32))
    onnx_nmm.rewrite(dense, options).save(tmp_path / "rewritten.onnx")
    modelled = onnx_nmm.factorized(onnx_nmm.decoder_shape(dense), keep=0.5, targets="mlp", align=32)
    rewritten = onnx_nmm.decoder_shape(tmp_path / "rewritten.onnx")
    assert modelled.counts() == rewritten.counts()
    assert rewritten.counts()["fused MLP"] == (2 if exporter == "dynamo" else 0)
    assert ({(p.block, p.hidden, p.intermediate, p.ranks) for p in modelled.products if isinstance(p, FusedMlp)}
            == {(p.block, p.hidden, p.intermediate, p.ranks) for p in rewritten.products if isinstance(p, FusedMlp)})
    assert modelled.activations == rewritten.activations


def test_factorizing_a_config_by_the_keep_rule_fuses_each_layer_mlp():
    dense = onnx_nmm.decoder_shape_of_config(SMALL, "small")
    rewritten = onnx_nmm.factorized(dense, keep=0.5, align=128)
    mlps = [p for p in rewritten.products if isinstance(p, FusedMlp)]
    assert [(m.block, m.hidden, m.intermediate) for m in mlps] == [(0, 256, 512), (1, 256, 512)]
    assert mlps[0].ranks == (128, 128, 128)  # 0.5·256·512/768 = 85 → one 128 tile
    assert rewritten.activations == ()
    assert rewritten.linear_parameters == dense.linear_parameters - 2 * (3 * 256 * 512 - 3 * 128 * 768)
    attention = onnx_nmm.factorized(dense, keep=0.25, targets="attention", align=32)
    # the MLPs and the lm_head stay dense
    assert attention.counts() == {"dense": 1, "factorized": 2 * 4, "fused MLP": 0, "dense MLP": 2}
    assert {p.role: p.rank for p in attention.products if p.block == 0 and p.group == "attention"} == {
        "q": 32, "k": 32, "v": 32, "o": 32}  # 0.25·256·128/384 = 21 rounds up to one 32 tile


def test_each_linear_product_costs_its_kernel_and_a_decode_step_reads_the_kv_cache_at_the_roofline():
    shape = onnx_nmm.decoder_shape_of_config(SMALL, "small")
    step = price(shape, tokens=1, context=256, target="trn1")
    fused = kernels.estimate(kernels.dense_gated_mlp, (1, 256), (256, 512), (256, 512), (512, 256), target="trn1")
    separate = sum(kernels.estimate(kernels.dense_matmul, (1, k), (k, n), target="trn1").total_s
                   for k, n in ((256, 512), (256, 512), (512, 256)))
    assert fused.total_s < separate  # a small MLP: one launch beats three
    assert step.parts["MLP"].seconds == pytest.approx(2 * min(fused.total_s, separate), rel=1e-12)
    assert step.parts["MLP"].how == KERNEL and step.parts["attention core"].how == ROOFLINE

    longer = price(shape, tokens=1, context=512, target="trn1")
    more_cache = 2 * shape.layers * shape.kv_width * 256 * ELEMENT_BYTES  # K and V of 256 more tokens
    assert longer.parts["attention core"].seconds - step.parts["attention core"].seconds == pytest.approx(
        more_cache / TRN1.dma_bytes_per_s)
    assert longer.seconds - step.seconds == pytest.approx(more_cache / TRN1.dma_bytes_per_s)


def test_a_factorized_model_is_modelled_faster_and_the_ratios_are_against_the_first():
    dense = onnx_nmm.decoder_shape_of_config({**SMALL, "hidden_size": 1024, "intermediate_size": 4096}, "dense")
    options = onnx_nmm.TrainiumOptions("trn2", prompt_lengths=(64,), contexts=(128, 1024), generation=(8, 4))
    result = onnx_nmm.estimate_trainium([dense, onnx_nmm.factorized(dense, keep=0.5)], options)
    first, rewritten = result.models
    assert result.decode_speedup(first, 128) == 1.0
    assert result.decode_speedup(rewritten, 128) > 1.2 and result.prefill_speedup(rewritten, 64) > 1.2
    assert result.ideal_decode_speedup(rewritten, 1024) < result.ideal_decode_speedup(rewritten, 128)
    steps = [price(dense, 1, context, "trn2").seconds for context in (8, 9, 10)]  # 3 decode steps after the prefill
    assert first.generation_s == pytest.approx(price(dense, 8, 0, "trn2").seconds + sum(steps))
    assert json.loads(json.dumps(result.to_dict()))["models"][1]["speedup"]["generation"]["end to end"] > 1


def test_bench_prices_a_config_and_its_rewrite_on_trainium(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    code = main(["bench", str(config), "--target", "trn1", "--keep", "0.5", "--prompt-lengths", "32",
                 "--contexts", "64", "--generation", "8,4", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["target"] == "trn1" and "modelled" in result["note"]
    assert [m["products"]["fused MLP"] for m in result["models"]] == [0, 2]
    assert [m["products"]["dense MLP"] for m in result["models"]] == [2, 0]

    plot = tmp_path / "decode.png"
    assert main(["bench", str(config), "--target", "trn1", "--prompt-lengths", "32", "--contexts", "64,128",
                 "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "Where a decode step at context 128 goes" in out and "nothing was run" in out
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_bench_refuses_what_only_pricing_can_do_and_configs_it_cannot_read(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    assert main(["bench", str(config)]) == 2
    assert "add --target trn1 or trn2" in capsys.readouterr().err
    config.write_text(json.dumps({"hidden_size": 8}))
    assert main(["bench", str(config), "--target", "trn2"]) != 0
    error = capsys.readouterr().err.strip()
    assert "has no num_hidden_layers" in error and len(error.splitlines()) == 1
