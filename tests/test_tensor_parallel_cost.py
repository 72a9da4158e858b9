"""Tensor parallelism, priced: the NeuronLink collectives, how each layer splits as NxD Inference splits it, the
low-rank split of a factorized layer, and `bench --target --tp`. Every figure asserted is the model's arithmetic,
never a speed."""

import json

import pytest

import onnx_nmm
from onnx_nmm.cli import main
from onnx_nmm.trainium import tensor_parallel
from onnx_nmm.trainium.collectives import ALL_GATHER, ALL_REDUCE, MESH, RDH, RING, collective
from onnx_nmm.trainium.decoder_shape import DenseMlp, Factorized, FusedMlp
from onnx_nmm.trainium.launch_costs import activation_cost, choose_mlp_kernel, kernel_cost, roofline
from onnx_nmm.trainium.speed import COLLECTIVE, PARTS, price

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=1000)
LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=128256)
HOP = 1.5e-6  # "about 1-2 us" per hop (intranode-collective-comm.rst)
TRN1_DMA = 16 * 17e9  # 16 DMA engines of 17 B/ns per NeuronCore-v2
TRN2_DMA = 16 * 23e9


@pytest.mark.parametrize("kind, phases", [(ALL_REDUCE, 2), (ALL_GATHER, 1)])
def test_a_collective_costs_its_hops_and_the_ring_bytes_over_the_rank_bandwidth(kind, phases):
    """An all-reduce sends 2(N−1)/N of the buffer from each rank, an all-gather (N−1)/N of its result; the hops are
    those of the runtime's algorithm at that size; a rank sends at its share of the chip's NeuronLink."""
    tokens, width = 1, 4096
    buffer = 2 * width * tokens
    eight = collective(kind, "o_proj", width, tokens, 8, "trn1")  # 4 trn1 chips of 2 cores: 192 GB/s a rank
    assert eight.algorithm == MESH  # 8 KiB, under 1 MB
    assert eight.sent_bytes == pytest.approx(phases * 7 / 8 * buffer)
    assert eight.seconds == pytest.approx(phases * 2 * HOP + phases * 7 / 8 * buffer / (384e9 / 2))
    assert eight.label == f"{kind} (o_proj, 4096×bf16 per token)"

    one_chip = collective(kind, "o_proj", width, tokens, 2, "trn1")  # the two cores of one chip: their DMA engines
    assert one_chip.seconds == pytest.approx(phases * HOP + phases * 1 / 2 * buffer / TRN1_DMA)

    mid = collective(kind, "down_proj", width, 512, 16, "trn1")  # 4 MiB over 8 chips: RDH, log2(8) + 1 hops
    assert mid.algorithm == RDH
    assert mid.seconds == pytest.approx(phases * 4 * HOP + phases * 15 / 16 * 2 * width * 512 / 192e9)

    large = collective(kind, "lm_head logits", 128256, 512, 32, "trn2")  # 125 MiB: a ring, N−1 hops a phase
    assert large.algorithm == RING
    share = min(TRN2_DMA, 1024e9 / 8)  # 8 NeuronCore-v3 a chip share its 1,024 GB/s
    assert large.seconds == pytest.approx(phases * 31 * HOP + phases * 31 / 32 * 2 * 128256 * 512 / share)


def test_one_neuroncore_prices_each_product_as_its_one_launch_with_no_collective():
    dense = onnx_nmm.decoder_shape_of_config(SMALL, "small")
    rewritten = onnx_nmm.factorized(dense, keep=0.5, targets="all", align=32)
    for tokens, context in ((64, 0), (1, 128)):
        step = price(rewritten, tokens, context, "trn1")
        assert set(step.parts) <= set(PARTS) and step.low_rank_saving_s == 0 and step.splits == {}
        attention = [p for p in rewritten.products if isinstance(p, Factorized) and p.group == "attention"]
        assert step.parts["attention projections"].seconds == pytest.approx(sum(
            kernel_cost("fused_xuv", ((tokens, p.k), (p.k, p.rank), (p.rank, p.n)), "trn1")[0] for p in attention))
        mlps = [p for p in rewritten.products if isinstance(p, FusedMlp)]
        assert step.parts["MLP"].seconds == pytest.approx(sum(
            choose_mlp_kernel(p.op, dict(zip(("H", "I", "rank_gate", "rank_up", "rank_down"), p.sizes)), tokens,
                              "trn1").cost[0] for p in mlps))
        assert price(rewritten, tokens, context, "trn1", tp=1).parts == step.parts
    assert onnx_nmm.estimate_trainium([dense], onnx_nmm.TrainiumOptions(
        prompt_lengths=(8,), contexts=(16,), generation=(4, 2))).to_dict()["tp"] == 1


def test_each_layer_kind_splits_as_nxd_inference_splits_it():
    """q/k/v column-parallel by head, o row-parallel then an all-reduce of the hidden size, the MLP with its
    intermediate split then an all-reduce, the lm_head over the vocabulary with its logits all-gathered, the
    embedding's rows all-gathered; the attention core on the rank's heads and their KV cache."""
    shape = onnx_nmm.decoder_shape_of_config(SMALL, "small")
    sharding = tensor_parallel.Sharding.of(shape, 2)
    assert (sharding.heads, sharding.kv_heads, sharding.q_width, sharding.kv_width) == (2, 1, 128, 64)
    tokens = 32

    def only_way(role: str) -> tensor_parallel.Split:
        product = next(p for p in shape.products if getattr(p, "role", None) == role)
        ways = tensor_parallel.splits(product, sharding, tokens, "trn1")
        assert len(ways) == 1  # a dense layer splits one way
        return ways[0]

    for role, k, n in (("q", 256, 128), ("k", 256, 64), ("v", 256, 64)):
        assert only_way(role).cost == kernel_cost("dense_matmul", ((tokens, k), (k, n)), "trn1")
        assert only_way(role).collectives == ()
    o = only_way("o")
    assert o.cost == kernel_cost("dense_matmul", ((tokens, 128), (128, 256)), "trn1")
    assert [(c.kind, c.what, c.width) for c in o.collectives] == [(ALL_REDUCE, "o_proj", 256)]
    head = only_way("lm_head")
    assert head.cost == kernel_cost("dense_matmul", ((tokens, 256), (256, 500)), "trn1")
    assert [(c.kind, c.width) for c in head.collectives] == [(ALL_GATHER, 1000)]
    mlp = tensor_parallel.splits(next(p for p in shape.products if isinstance(p, DenseMlp)), sharding, tokens, "trn1")
    assert len(mlp) == 1 and mlp[0].cost == choose_mlp_kernel("GatedMLP", {"H": 256, "I": 256}, tokens, "trn1").cost
    assert [(c.kind, c.what, c.width) for c in mlp[0].collectives] == [(ALL_REDUCE, "down_proj", 256)]

    step = price(shape, 1, 512, "trn1", tp=2)
    collectives = {name: part for name, part in step.parts.items() if part.how == COLLECTIVE}
    assert set(collectives) == {"all-reduce (o_proj, 256×bf16 per token)", "all-reduce (down_proj, 256×bf16 per token)",
                                "all-gather (lm_head logits, 1000×bf16 per token)",
                                "all-gather (embedding, 256×bf16 per token)"}
    one_per_layer = collective(ALL_REDUCE, "o_proj", 256, 1, 2, "trn1")
    assert collectives["all-reduce (o_proj, 256×bf16 per token)"].seconds == pytest.approx(2 * one_per_layer.seconds)
    keys = 512 + 1  # the rank's one KV head over the cache, its two query heads
    attention = roofline(2 * (2 * 64 * 513 + 2 * 64 + 2 * 128), "trn1", tensor_flops=4 * 128 * keys,
                         elementwise=3 * 2 * keys)
    assert step.parts["attention core"].seconds == pytest.approx(2 * attention[0])


@pytest.mark.parametrize("heads, kv_heads, tp, per_rank, note", [
    (32, 8, 32, (1, 1), "8 KV heads replicated to one per NeuronCore"),  # Llama-3-8B: REPLICATE_TO_TP_DEGREE
    (24, 8, 32, (1, 1), "24 query heads padded to 32 and 8 KV heads replicated to one per NeuronCore"),  # 3.2-3B
    (24, 8, 8, (3, 1), ""),
    (9, 3, 3, (3, 1), ""),  # SmolLM2-135M: the KV heads split evenly
    (9, 3, 2, (5, 5), "9 query heads padded to 10 and 3 KV heads replicated to one per query head"),  # CONVERT_TO_MHA
])
def test_heads_are_padded_and_kv_heads_replicated_as_nxd_does(heads, kv_heads, tp, per_rank, note):
    """A tp that does not divide the heads is not refused: the query heads are padded with empty ones, as NxD
    Inference pads them (gqa.get_shardable_head_counts), and the shape's notes say so."""
    shape = onnx_nmm.decoder_shape_of_config({**SMALL, "hidden_size": heads * 64, "num_attention_heads": heads,
                                              "num_key_value_heads": kv_heads}, "model")
    sharding = tensor_parallel.Sharding.of(shape, tp)
    assert (sharding.heads, sharding.kv_heads) == per_rank
    assert (sharding.q_width, sharding.kv_width) == (per_rank[0] * 64, per_rank[1] * 64)
    assert note in sharding.note and f"{per_rank[0]} query and {per_rank[1]} KV heads per NeuronCore" in sharding.note
    o_proj = next(p for p in shape.products if getattr(p, "role", None) == "o")
    assert sharding.rows(o_proj) == per_rank[0] * 64  # the padded heads' rows of o_proj


def test_the_low_rank_split_is_taken_when_cheaper_and_all_reduces_r_columns_instead_of_n():
    """A row-parallel factorized layer: at a long prefill, all-reducing X·U's rank-128 intermediate and keeping V
    whole beats all-reducing the 1024-wide output; at a decode step the latency of either all-reduce is the same
    and the one fused_xuv launch wins."""
    dense = onnx_nmm.decoder_shape_of_config({**SMALL, "hidden_size": 1024, "intermediate_size": 8192,
                                              "num_attention_heads": 16, "num_key_value_heads": 4}, "m")
    rewritten = onnx_nmm.factorized(dense, keep=0.1, align=128, fuse_mlp=False)
    down = next(p for p in rewritten.products if isinstance(p, Factorized) and p.role == "down")
    assert (down.k, down.rank, down.n) == (8192, 128, 1024)
    sharding = tensor_parallel.Sharding.of(rewritten, 8)

    prefill = tensor_parallel.splits(down, sharding, 2048, "trn1")
    as_dense, low_rank = prefill[0], tensor_parallel.cheapest(prefill)
    assert [(c.kind, c.width) for c in as_dense.collectives] == [(ALL_REDUCE, 1024)]
    assert low_rank.how == "U row-split, X·U all-reduced, V whole"
    assert [(c.kind, c.what, c.width) for c in low_rank.collectives] == [(ALL_REDUCE, "down_proj's X·U", 128)]
    assert low_rank.collectives[0].sent_bytes == pytest.approx(as_dense.collectives[0].sent_bytes * 128 / 1024)
    assert low_rank.cost == tuple(map(sum, zip(kernel_cost("dense_matmul", ((2048, 1024), (1024, 128)), "trn1"),
                                               kernel_cost("dense_matmul", ((2048, 128), (128, 1024)), "trn1"))))
    assert low_rank.seconds < as_dense.seconds

    decode = tensor_parallel.splits(down, sharding, 1, "trn1")
    assert tensor_parallel.cheapest(decode) is decode[0]

    phase = price(rewritten, 2048, 0, "trn1", tp=8)
    assert "all-reduce (down_proj's X·U, 128×bf16 per token)" in phase.parts
    assert "all-reduce (down_proj, 1024×bf16 per token)" not in phase.parts
    assert phase.splits["down_proj: U row-split, X·U all-reduced, V whole"] == 2
    saved = [ways[0].seconds - tensor_parallel.cheapest(ways).seconds for ways in
             (tensor_parallel.splits(p, sharding, 2048, "trn1") for p in rewritten.products)]
    assert phase.low_rank_saving_s == pytest.approx(sum(saved)) and phase.low_rank_saving_s > 0
    assert (as_dense.partial_sums.width, low_rank.partial_sums.width) == (1024, 128)
    narrower = as_dense.partial_sums.seconds - low_rank.partial_sums.seconds  # the all-reduce's own saving
    assert phase.rank_all_reduce_saving_s == pytest.approx(2 * narrower) and narrower > 0


def test_a_fused_mlp_split_over_ranks_takes_its_fused_kernel_or_its_projections_each_split_its_way():
    dense = onnx_nmm.decoder_shape_of_config(LLAMA_3_8B, "8b")
    mlp = next(p for p in onnx_nmm.factorized(dense, keep=0.8).products if isinstance(p, FusedMlp))
    sharding = tensor_parallel.Sharding.of(dense, 8)
    ways = tensor_parallel.splits(mlp, sharding, 1, "trn1")
    fused = choose_mlp_kernel(mlp.op, dict(zip(("H", "I", "rank_gate", "rank_up", "rank_down"),
                                               (4096, 14336 // 8, *mlp.ranks))), 1, "trn1")
    assert ways[0].cost == fused.cost
    assert [(c.kind, c.width) for c in ways[0].collectives] == [(ALL_REDUCE, 4096)]
    # the projections: gate and up with U whole or row-split, times down's three row-parallel ways
    assert len(ways) == 1 + 2 * 3
    rank, down_rank = mlp.ranks[0], mlp.ranks[2]
    both = next(w for w in ways if w.how == "projections: gate_proj and up_proj U row-split; "
                                            "down_proj U row-split, V whole, output all-reduced")
    assert [(c.what, c.width) for c in both.collectives] == [("gate_proj and up_proj's X·U", 2 * rank),
                                                             ("down_proj", 4096)]
    launches = [kernel_cost("dense_matmul", ((1, 512), (512, rank)), "trn1"),  # U's 4096/8 rows on each rank
                kernel_cost("dense_matmul", ((1, rank), (rank, 1792)), "trn1")] * 2  # V's 14336/8 columns
    launches += [activation_cost(1792, True, 1, "trn1"),
                 kernel_cost("fused_xuv", ((1, 1792), (1792, down_rank), (down_rank, 4096)), "trn1")]
    assert both.cost[0] == pytest.approx(sum(cost[0] for cost in launches))
    assert tensor_parallel.cheapest(ways).seconds == min(w.seconds for w in ways)


def test_tp_is_refused_beyond_the_instance_and_without_a_target_in_one_line(tmp_path, capsys):
    assert onnx_nmm.TrainiumOptions("trn2", tp=128).tp == 128  # a trn2.48xlarge: 16 chips of 8 NeuronCores
    for target, tp in (("trn1", 33), ("trn2", 129), ("trn1", 0)):
        with pytest.raises(onnx_nmm.OptionError, match="tp must be from 1 to"):
            onnx_nmm.TrainiumOptions(target, tp=tp)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    assert main(["bench", str(config), "--target", "trn1", "--tp", "64"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--tp must be from 1 to 32, the NeuronCores of a trn1.32xlarge, got 64" in error
    assert len(error.splitlines()) == 1
    assert main(["bench", str(config), "--tp", "2"]) == 2
    assert "add --target trn1 or trn2" in capsys.readouterr().err


def test_bench_prices_llama_3_8b_at_tp_8_naming_its_collectives(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B))
    assert main(["bench", str(config), "--target", "trn1", "--tp", "8", "--prompt-lengths", "128", "--contexts",
                 "512", "--generation", "8,2"]) == 0
    out = capsys.readouterr().out
    for name in ("all-reduce (o_proj, 4096×bf16 per token)", "all-reduce (down_proj, 4096×bf16 per token)",
                 "all-gather (lm_head logits, 128256×bf16 per token)", "all-gather (embedding, 4096×bf16 per token)"):
        assert name in out
    assert "on each of 8 NeuronCores" in out and "4 query and 1 KV heads per NeuronCore" in out
    assert "trn1.32xlarge" in out

    assert main(["bench", str(config), "--target", "trn1", "--tp", "8", "--prompt-lengths", "128", "--contexts",
                 "512", "--generation", "8,2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["tp"], result["instance"]) == (8, "trn1.32xlarge")
    step = result["models"][0]["decode"][0]
    assert step["parts"]["all-reduce (o_proj, 4096×bf16 per token)"]["how"] == COLLECTIVE
    assert step["splits"]["o_proj: row-parallel"] == 32
