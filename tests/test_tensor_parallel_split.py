"""`compile --tp`'s rank programs, graph by graph: each layer kind split as NxD Inference splits it, the KV heads
replicated when fewer than the ranks, factorized layers by each of their splits, an intermediate width tp does
not divide, fused MLP ops; the rank programs run together on the CPU give the whole graph's outputs (onnxruntime)
within float rounding."""

import numpy as np
import onnx
import pytest
from exported_models import exported_model

from onnx_nmm import OptionError, RankOptions, RewriteOptions, rewrite
from onnx_nmm.errors import ModelError
from onnx_nmm.passes.dense_mlp_fusion import fuse_every_mlp
from onnx_nmm.runtime import compiled_folder
from onnx_nmm.runtime.rank_programs import RankPrograms
from onnx_nmm.runtime.static_cache import static_cache
from onnx_nmm.trainium import graph_sharding
from onnx_nmm.trainium.graph_sharding import rank_program
from onnx_nmm.trainium.rank_shares import RankShares
from onnx_nmm.trainium.shape_propagation import _reshaped, probe
from onnx_nmm.trainium.sharded_compilation import check_joined, rank_shares, whole_graph_run

BUCKET, CONTEXT = 8, 32


def _split_and_checked(model_path, tp: int, folder, prepare=lambda model: None) -> dict[str, dict]:
    """Every graph of `model_path`'s static cache split over `tp` ranks, written to `folder`, and run together
    against onnxruntime on the whole graph: per graph, the check and the rank programs' joins and splits."""
    graphs = static_cache(model_path, CONTEXT, (BUCKET,))
    shares = rank_shares(graphs, tp)
    results = {}
    for name, model, tokens in graphs.graphs():
        prepare(model)
        whole = whole_graph_run(model, graphs.example_feeds(name), name)
        found = probe(model, whole.feeds)
        programs = [rank_program(model, rank, shares, found.copy(), list(graphs.cache_shapes), tokens, "trn1",
                                 graphs.layout.tokens) for rank in range(tp)]
        compiled_folder.write_graphs(folder, {f"{name}.rank{rank}": program.model
                                              for rank, program in enumerate(programs)})
        paths = RankPrograms(tuple(folder / f"{name}.rank{rank}.onnx" for rank in range(tp)))
        results[name] = {"check": check_joined(paths, whole, dict(graphs.layout.cache), shares, name),
                         "programs": programs,
                         "paths": paths}
    return results


def _weights(path) -> int:
    """The elements of a rank program's weight matrices (initializers of more than 1,000 elements)."""
    proto = onnx.load(path, load_external_data=False)
    sizes = [int(np.prod(tensor.dims)) for tensor in proto.graph.initializer]
    return sum(size for size in sizes if size > 1000)


@pytest.fixture(scope="module")
def dense_llama():
    return exported_model("llama", "dynamo", cache=True)  # 4 query heads, 2 KV heads, intermediate 512


@pytest.fixture(scope="module")
def factorized_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("factorized") / "model.onnx"
    rewrite(exported_model("llama", "dynamo", cache=True), RewriteOptions(ranks=RankOptions(keep=0.9, align=32))
            ).save(path)
    return path


def test_each_rank_holds_its_heads_and_kv_heads():
    shares = RankShares(tp=2, heads=4, kv_heads=2, head_dim=3)
    assert shares.query_columns(1).tolist() == [6, 7, 8, 9, 10, 11]  # heads 2 and 3
    assert shares.kv_columns(1).tolist() == [3, 4, 5]  # KV head 1, which heads 2 and 3 read
    replicated = RankShares(tp=4, heads=4, kv_heads=2, head_dim=1)
    assert [list(replicated.kv_head_indices(rank)) for rank in range(4)] == [[0], [0], [1], [1]]
    assert replicated.replicated_kv and replicated.local_kv_heads == 1
    assert RankShares(tp=3, heads=9, kv_heads=3, head_dim=64).kv_columns(2).tolist() == list(range(128, 192))
    assert [len(RankShares(tp=4, heads=4, kv_heads=4, head_dim=1).even(10, rank)) for rank in range(4)] == \
        [3, 3, 2, 2]


@pytest.mark.parametrize("heads, kv_heads, tp, refusal", [
    (4, 2, 3, "does not divide the model's 4 query heads: choose a tp that does \\(1, 2, 4\\)"),
    (6, 2, 3, "neither divides the model's 2 KV heads nor is a multiple of them"),
])
def test_a_tp_that_does_not_divide_the_heads_is_refused(heads, kv_heads, tp, refusal):
    with pytest.raises(OptionError, match=refusal):
        RankShares(tp=tp, heads=heads, kv_heads=kv_heads, head_dim=64)


def test_a_reshape_gives_the_ranks_share_to_the_outermost_axis_of_its_group():
    assert _reshaped((1, 8, 576), (1, 8, 9, 64), (1, 8, 192), "q") == (1, 8, 3, 64)  # heads, not the head size
    assert _reshaped((1, 2, 2, 32, 64), (1, 4, 32, 64), (1, 1, 2, 32, 64), "repeat_kv") == (1, 2, 32, 64)
    assert _reshaped((1, 8, 4, 64), (1, 8, 256), (1, 8, 2, 64), "o") == (1, 8, 128)


@pytest.mark.parametrize("tp", [2, 4])  # 4: more ranks than the 2 KV heads, each replicated on two ranks
def test_dense_layers_split_as_nxd_splits_them_and_the_ranks_together_give_the_whole_graph(dense_llama, tmp_path,
                                                                                            tp):
    results = _split_and_checked(dense_llama, tp, tmp_path)
    for name, result in results.items():
        assert result["check"]["max_abs"] < 1e-4, name
        splits = result["programs"][0].splits
        assert splits["model.layers.0.self_attn.q_proj"] == "column-parallel"
        assert splits["model.layers.0.self_attn.o_proj"] == "row-parallel, output all-reduced"
        assert splits["model.layers.1.mlp.gate_proj"] == "column-parallel"
        assert splits["model.layers.1.mlp.down_proj"] == "row-parallel, output all-reduced"
        assert splits["lm_head"].startswith("column-parallel over the vocabulary")
        joins = [(join.op, join.after) for join in result["programs"][0].joins]
        assert joins[0] == ("AllGather", "model.embed_tokens") and joins[-1] == ("AllGather", "lm_head")
        assert [op for op, _ in joins[1:-1]] == ["AllReduce"] * 4  # o and down of 2 layers
    decode = results["decode"]
    kv = 2 * 2 * 256 * 128  # k and v of 2 layers, 2 KV heads of 64
    whole = 1000 * 256 * 2 + 2 * (2 * 256 * 256 + 3 * 256 * 512) + kv  # embedding and lm_head, q and o, MLPs, k and v
    kept_kv = kv // min(tp, 2)  # replicated: a rank holds one KV head, not 2/tp of one
    assert _weights(decode["paths"].paths[1]) == (whole - kv) // tp + kept_kv
    cache = onnx.load(decode["paths"].paths[0], load_external_data=False).graph.input
    assert [dim.dim_value for dim in cache[3].type.tensor_type.shape.dim][1:] == [2 // min(tp, 2), CONTEXT, 64]


FACTORIZED_WAYS = {
    "column": ["U whole, V column-split", "U row-split, X·U all-reduced, V column-split"],
    "row": ["U row-split, V whole, output all-reduced", "U row-split, X·U all-reduced, V whole",
            "U row-split, X·U all-reduced, V column-split, output all-gathered"],
}


@pytest.mark.parametrize("column, row", [(column, row) for column in FACTORIZED_WAYS["column"]
                                         for row in FACTORIZED_WAYS["row"]])
def test_each_split_of_a_factorized_layer_gives_the_whole_graph(factorized_llama, tmp_path, monkeypatch, column, row):
    """Whichever split the pricing takes, column- or row-parallel, the rank-r all-reduce of X·U included."""
    def chosen(ways):
        wanted = column if "V column-split" in ways[0].how and "whole" in ways[0].how.split(",")[0] else row
        return next(way for way in ways if way.how == wanted)

    monkeypatch.setattr(graph_sharding, "cheapest", chosen)
    results = _split_and_checked(factorized_llama, 2, tmp_path)
    splits = results["decode"]["programs"][1].splits
    assert splits["model.layers.0.mlp.up_proj"] == column and splits["model.layers.1.mlp.down_proj"] == row
    joins = [(join.op, join.width) for join in results["decode"]["programs"][0].joins]
    if "X·U all-reduced" in row:
        assert any(op == "AllReduce" and width < 256 for op, width in joins)  # r wide, not the hidden size
    for result in results.values():
        assert result["check"]["max_abs"] < 1e-4


def test_fused_mlp_ops_and_a_width_tp_does_not_divide_split_by_their_intermediate(tmp_path):
    """An MLP fused into GatedMLP (the dense MLP kernel, as a narrowed MLP runs) whose intermediate, 500, is not a
    multiple of the 4 ranks: they take 125 each; the ranks together give the whole graph."""
    from onnx_nmm import build_model, export_causal_lm
    from onnx_nmm.export import TinyShape

    path = tmp_path / "narrow.onnx"
    export_causal_lm(build_model("llama", TinyShape(intermediate=500, kv_heads=4)), path, "dynamo", cache=True)
    results = _split_and_checked(path, 4, tmp_path, prepare=lambda model: fuse_every_mlp(model))
    for result in results.values():
        assert result["check"]["max_abs"] < 1e-4
    assert results["decode"]["programs"][0].splits["model.layers.0.mlp"].startswith("GatedMLP")


def test_a_fused_svd_mlp_splits_too(factorized_llama, tmp_path):
    results = _split_and_checked(factorized_llama, 2, tmp_path, prepare=lambda model: fuse_every_mlp(model))
    assert results["decode"]["programs"][0].splits["model.layers.0.mlp"].startswith("SvdGatedMLP")
    for result in results.values():
        assert result["check"]["max_abs"] < 1e-4


def test_q_k_and_v_in_one_projection_are_refused_in_one_line(tmp_path):
    with pytest.raises(ModelError, match="qkv_proj computes q, k and v in one projection, which tp does not split yet"):
        _split_and_checked(exported_model("phi3", "dynamo", cache=True), 2, tmp_path)
