"""The kernel benchmark: its rows, its bars, and `onnx-nmm bench-kernels`."""

import json

import pytest

from onnx_nmm.cli import main
from onnx_nmm.kernels.bench import benchmark

LLAMA_1B = benchmark.MODELS[0]


@pytest.fixture(scope="module")
def rows():
    return benchmark.run_benchmark(models=(LLAMA_1B,), tokens=(1, 128), targets=("trn1",))


def test_each_row_models_all_four_variants(rows):
    assert [(row.tokens, row.target) for row in rows] == [(1, "trn1"), (128, "trn1")]
    for row in rows:
        assert set(row.costs) == set(benchmark.VARIANTS)
        assert [len(row.launches[v]) for v in benchmark.VARIANTS] == [4, 1, 7, 4, 1]
        # Low-rank variants move fewer bytes than dense; the fused MLP keeps act in SBUF.
        hbm = {v: row.costs[v].hbm_bytes for v in benchmark.VARIANTS}
        assert hbm["fused_mlp"] < hbm["fused_xuv"] <= hbm["unfused"] < hbm["dense"]
        assert hbm["dense_mlp"] < hbm["dense"]  # the dense MLP kernel keeps its activation on chip too
        assert row.seconds(row.best_dense) == min(row.seconds("dense"), row.seconds("dense_mlp"))
        assert all(s > 0.95 for s in row.xuv_kernel_speedups())


def test_the_summary_states_both_bars(rows):
    summary = benchmark.summarize(rows)
    assert summary["xuv_bar"] == 1.35
    assert summary["xuv_vs_unfused_kernel_mean"] == pytest.approx(
        sum(s for row in rows for s in row.xuv_kernel_speedups()) / 6
    )
    (decode,) = summary["decode"]
    assert decode["parameter_ratio"] == pytest.approx(2048 * 8192 / (1280 * (2048 + 8192)))
    # every dense kernel launch of both dense paths against its own roofline: 3 dense_matmul and 1 dense MLP a row
    worst = summary["dense_kernels_over_roofline_max"]
    assert set(worst) == {"dense_matmul", "dense_gated_mlp"} and min(worst.values()) >= 1.0
    within, launches = summary["dense_kernels_within_goal"]
    assert launches == 2 * 4 and within == sum(ratio <= benchmark.DENSE_ROOFLINE_GOAL for row in rows
                                               for _, ratio in row.dense_kernels_over_roofline())
    # the launches over the goal, each named: which dense path, which launch of it, which kernel
    over = summary["dense_kernels_over_goal"]
    assert len(over) == launches - within
    for launch in over:
        row = next(r for r in rows if r.tokens == launch["tokens"] and r.target == launch["target"])
        cost = row.launches[launch["variant"]][launch["launch"]]
        assert cost.kernels[0] == launch["kernel"] and cost.over_roofline == launch["over_roofline"] > 1.10


def test_above_one_tile_of_tokens_the_dense_path_hands_the_down_projection_act_transposed():
    small = benchmark.MlpShape("small", hidden=256, intermediate=512, rank=128)
    kernels = [cost.kernels[0] for cost in benchmark.launch_costs("dense", small, 256, "trn2", "bfloat16")]
    assert kernels == ["dense_matmul", "dense_matmul", "silu_mul_transposed", "dense_matmul_lhsT"]
    kernels = [cost.kernels[0] for cost in benchmark.launch_costs("dense", small, 128, "trn2", "bfloat16")]
    assert kernels == ["dense_matmul", "dense_matmul", "silu_mul", "dense_matmul"]


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_at_one_token_the_fused_mlp_beats_dense_and_reads_fewer_bytes(target):
    """Decoding is weight-bound: fewer weight bytes must mean a faster MLP (the bar against the parameter
    ratio is bench-kernels' to report, not a test's)."""
    for shape in benchmark.MODELS:
        dense = benchmark._sequence(benchmark.launch_costs("dense", shape, 1, target, "bfloat16"))
        (fused,) = benchmark.launch_costs("fused_mlp", shape, 1, target, "bfloat16")
        assert fused.total_s < dense.total_s, shape.model
        assert fused.hbm_bytes < dense.hbm_bytes, shape.model


def test_every_time_is_at_least_its_roofline(rows):
    for row in rows:
        for variant in benchmark.VARIANTS:
            assert row.over_roofline(variant) >= 1.0, (row.tokens, variant)
        assert len(row.xuv_kernels_over_roofline()) == 3


def test_the_table_says_modelled_and_how_it_was_made(rows):
    text = benchmark.markdown(rows, "onnx-nmm bench-kernels --tokens 1,128", "bfloat16")
    assert "Modelled" in text and "`onnx-nmm bench-kernels --tokens 1,128`" in text
    assert text.count("| trn1 | Llama-3.2-1B |") == 4  # the times and the roofline table


def test_the_command_writes_the_table_json_and_chart(tmp_path, capsys):
    code = main(["bench-kernels", "--models", "Llama-3.2-1B", "--tokens", "1", "--target", "trn2",
                 "--out", str(tmp_path)])
    assert code == 0
    assert {p.name for p in tmp_path.iterdir()} == {
        "bench-kernels.md", "bench-kernels.json", "bench-kernels.png", "bench-kernels-roofline.png"}
    report = json.loads((tmp_path / "bench-kernels.json").read_text())
    assert "modelled" in report["note"] and report["rows"][0]["target"] == "trn2"
    assert "(modelled)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("option", "message"),
    [(["--tokens", "0"], "between 1 and 8192"), (["--tokens", "a"], "comma-separated"),
     (["--models", "GPT-5"], "unknown GPT-5")],
)
def test_bad_options_get_a_one_line_error(tmp_path, capsys, option, message):
    assert main(["bench-kernels", "--out", str(tmp_path), *option]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    assert not any(tmp_path.iterdir())
