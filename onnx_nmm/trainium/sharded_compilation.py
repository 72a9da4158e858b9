"""Compile a model that generates split over N NeuronCores (`compile --max-context C --tp N`): every static-cache
graph becomes N rank programs joined by collectives.

    static cache (runtime/static_cache.py): a prefill per bucket, one decode step, the whole model's, their
      weights one array each that every graph reads (graph_session.weights_as_arrays)
      └ every graph: its outputs on onnxruntime, kept; run once more for its shapes (shape_propagation.probe)
      └ per graph, per rank: the rank's program (graph_sharding.rank_program), then each MLP on its fastest
        kernel at the rank's widths; written as <graph>.rank<r>.onnx, one weights file for all
    the whole graphs let go: from here on a graph is its rank programs' files
    generation checked against the model as given, the rank programs in lock-step (generation_check.py)
    per graph: the rank programs joined, against the whole graph's outputs kept; kernels planned per rank
    with the Neuron SDK: every graph traced with neuronx-distributed, rank 0's program for every rank, into one
      NxDModel (rank_tracing.py), which `generate DIR --backend neuron` runs
    manifest: tp, how the heads split, per graph its rank programs, the collectives joining them and where, and
      how each layer split

A dry run stops before the trace; `generate DIR --backend torch` runs the rank programs on the CPU either way.
What is in memory at once, besides the whole graphs' weights while they are split: onnxruntime's copy of them
and a graph's every value (the probe), or two rank programs of one graph; then the lowered rank programs of two
graphs at most (the generation check's).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnx_nmm.errors import LoweringMismatch, ModelError
from onnx_nmm.model_io import write_text_atomically
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes import find_linear_layers, roles, svd_ops
from onnx_nmm.progress import Progress
from onnx_nmm.quality import metrics
from onnx_nmm.runtime import compiled_folder, ort_runner
from onnx_nmm.runtime.collective_ops import ALL_GATHER, ALL_REDUCE, DOMAIN
from onnx_nmm.runtime.rank_programs import RankPrograms, RankProgramsRunner
from onnx_nmm.runtime.static_cache import StaticCache, static_cache
from onnx_nmm.trainium import compile_steps, neuron
from onnx_nmm.trainium.compile_steps import Compilation, CompileOptions
from onnx_nmm.trainium.generation_check import check_generation
from onnx_nmm.trainium.graph_session import graph_session, weights_as_arrays
from onnx_nmm.trainium.graph_sharding import rank_program
from onnx_nmm.trainium.rank_shares import RankShares
from onnx_nmm.trainium.rank_tracing import check_same_programs, trace_ranks
from onnx_nmm.trainium.shape_propagation import Probe, probe


def compile_sharded(source: ModelSource, output: Path, options: CompileOptions, progress: Progress) -> Compilation:
    """The static-cache graphs of `source` split over `options.tp` ranks, compiled into `output`."""
    assert options.max_context is not None and options.tp > 1
    with progress.phase("building the static graphs"):
        graphs = static_cache(source, options.max_context, options.buckets, options.batch)
        weights_as_arrays(_in_memory(graphs))  # read by every graph, split by every rank: never copied whole
        shares = rank_shares(graphs, options.tp)
    layers: dict[str, dict] = {}
    runs: dict[str, WholeGraphRun] = {}
    with compile_steps.staged_folder(output) as folder:
        with progress.phase(f"splitting each graph over {options.tp} NeuronCores",
                            total=len(graphs.graphs()) * options.tp) as phase:
            compiled_folder.write_graphs(folder, _rank_programs(graphs, shares, options, layers, runs, phase))
            compiled_folder.copy_tokenizer(source.path, folder)
        graphs = as_written(graphs, folder, options.tp)  # the whole graphs and their weights are let go here
        gc.collect()  # an onnx-ir graph is a cycle of nodes and values, which only the collector frees
        if not options.dry_run:  # a split NxD cannot trace is said now, not after the checks
            check_same_programs(graphs)
        with progress.phase("checking the rank programs against the model as given"):
            generation = check_generation(source, graphs)
        gc.collect()  # its lowered rank programs, torch.fx modules: cycles too
        entries, summaries = [], {}
        with progress.phase("checking each graph's rank programs against onnxruntime",
                            total=len(graphs.graphs())) as phase:
            for name, programs, tokens in graphs.graphs():
                assert isinstance(programs, RankPrograms)
                check = check_joined(programs, runs.pop(name), dict(graphs.layout.cache), shares, name)
                gc.collect()  # this graph's lowered rank programs, before the next graph's are
                kernels = [neuron.plan_kernels(onnx.load(path, load_external_data=False), options.batch * tokens,
                                               options.target, model_costs=_model_costs()) for path in programs.paths]
                summaries[name] = kernels[0]
                entries.append({"name": name, "kind": "decode" if name == "decode" else "prefill", "tokens": tokens,
                                "ranks": [path.name for path in programs.paths], **layers[name],
                                "lowering_check": check, **kernels[0].to_dict(),
                                "modelled_us_per_rank": [k.to_dict().get("modelled_us") for k in kernels]})
                phase.advance(detail=name)
        if not options.dry_run:
            traced = trace_ranks(graphs, folder, options.target, progress)
            for entry in entries:
                entry.update(traced[entry["name"]])
        manifest = {"model": source.label, "target": options.target, "batch": options.batch,
                    "max_context": options.max_context, "buckets": list(graphs.buckets), "tp": options.tp,
                    "sharding": sharding_manifest(shares), "collective_ops": COLLECTIVE_OPS,
                    "cache": compiled_folder.cache_manifest(graphs), "weights": compiled_folder.WEIGHTS,
                    "graphs": entries, "generation_check": generation.to_dict(), "dry_run": options.dry_run,
                    "traced": not options.dry_run}
        write_text_atomically(folder / compiled_folder.MANIFEST, json.dumps(manifest, indent=2))
    return Compilation(output, manifest, summaries["decode"], summaries)


COLLECTIVE_OPS = {
    "domain": DOMAIN,
    ALL_REDUCE: "every rank's input summed; every rank gets the sum (NxD: reduce_from_tensor_model_parallel_region)",
    ALL_GATHER: "every rank's input concatenated along `axis`, rank 0 first; every rank gets it "
                "(NxD: gather_from_tensor_model_parallel_region)",
}


def rank_shares(graphs: StaticCache, tp: int) -> RankShares:
    """How `graphs` split over `tp` ranks: their query heads (from the attention's output projection's input
    width), their KV heads and head size (from the cache). OptionError when tp does not divide them."""
    batch, kv_heads, _, head_dim = next(iter(graphs.cache_shapes.values()))
    decode = graphs.decode
    assert isinstance(decode, ir.Model), "static_cache builds its graphs in memory"
    q_width = next((layer.k for layer in find_linear_layers(decode) if layer.role == "o"), None) or \
        next((_input_width(node) for node in decode.graph if node.domain == svd_ops.DOMAIN and
              node.op_type == svd_ops.SVD_MATMUL and (roles.classify(roles.module_path(node)) or ("", ""))[1] == "o"),
             None)
    if not isinstance(q_width, int) or q_width % head_dim:
        raise ModelError(f"{graphs.label}: no attention output projection (o_proj, out_proj, ...) whose input is whole "
                         f"heads of {head_dim}, so its query heads cannot be counted and split")
    return RankShares(tp, q_width // head_dim, kv_heads, head_dim)


def _input_width(node: ir.Node) -> int | None:
    """The rows of a factorized layer's U."""
    u = node.inputs[1]
    return int(u.const_value.shape.numpy()[0]) if u is not None and u.const_value is not None else None


def sharding_manifest(shares: RankShares) -> dict:
    return {"query_heads": shares.heads, "kv_heads": shares.kv_heads, "head_dim": shares.head_dim,
            "query_heads_per_rank": shares.local_heads, "kv_heads_per_rank": shares.local_kv_heads,
            "kv_heads_replicated": shares.replicated_kv,
            "kv_heads_of_rank": [list(shares.kv_head_indices(rank)) for rank in range(shares.tp)],
            "note": shares.note()}


def as_written(graphs: StaticCache, folder: Path, tp: int) -> StaticCache:
    """`graphs` as the folder holds them: each graph's rank programs, the cache stacked over the ranks."""
    def programs(name: str) -> RankPrograms:
        return RankPrograms(tuple(folder / f"{name}.rank{rank}.onnx" for rank in range(tp)))

    shares = {name: (tp, shape[0], max(1, shape[1] // tp), *shape[2:]) for name, shape in graphs.cache_shapes.items()}
    return replace(graphs, prefill={tokens: programs(name) for name, _, tokens in graphs.graphs() if name != "decode"},
                   decode=programs("decode"), cache_shapes=shares)


def _in_memory(graphs: StaticCache) -> Iterator[ir.Model]:
    for _, model, _ in graphs.graphs():
        assert isinstance(model, ir.Model), "static_cache builds its graphs in memory"
        yield model


def _rank_programs(graphs: StaticCache, shares: RankShares, options: CompileOptions, layers: dict[str, dict],
                   runs: dict[str, WholeGraphRun], phase) -> Iterator[tuple[str, ir.Model]]:
    """Each graph's rank programs, one at a time, each MLP on its fastest kernel at the rank's widths; what each
    graph's joins and splits are into `layers`, what it computes on onnxruntime into `runs`."""
    # Every graph is run before any rank program is made: onnxruntime's copy of the weights and every value of a
    # graph (the probe's) are the most the split holds, and no rank program is held beside them.
    probes: dict[str, Probe] = {}
    for name, model, _ in graphs.graphs():
        assert isinstance(model, ir.Model)
        runs[name] = whole_graph_run(model, graphs.example_feeds(name), name)
        probes[name] = probe(model, runs[name].feeds)
    for name, model, tokens in graphs.graphs():
        assert isinstance(model, ir.Model)
        for rank in range(shares.tp):
            program = rank_program(model, rank, shares, probes[name].copy(), list(graphs.cache_shapes),
                                   options.batch * tokens, options.target, graphs.layout.tokens)
            mlps = compile_steps.fuse_mlps(program.model, options.batch * tokens, options.target, options.fuse_mlp)
            if rank == 0:
                layers[name] = {"collectives": [join.to_dict() for join in program.joins], "splits": program.splits,
                                "fused_mlps": mlps.fused, "unfused_mlps": mlps.unfused, "mlp_kernels": mlps.chosen}
            yield f"{name}.rank{rank}", program.model
            gc.collect()  # the program written before this one, a cycle of nodes and values holding its weights
            phase.advance(detail=f"{name}, rank {rank}")


@dataclass(frozen=True)
class WholeGraphRun:
    """A graph's example feeds and its outputs on them, onnxruntime on the whole graph: what its rank programs run
    together must give, kept so that the graph itself need not be."""

    feeds: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]


def whole_graph_run(model: ir.Model, feeds: dict[str, np.ndarray], name: str) -> WholeGraphRun:
    return WholeGraphRun(feeds, ort_runner.run(graph_session(model, name), feeds))


def check_joined(programs: RankPrograms, whole: WholeGraphRun, cache: dict[str, str], shares: RankShares,
                 name: str) -> dict:
    """The rank programs lowered to PyTorch and run together against onnxruntime on the whole graph, on the
    graph's example feeds: every output (the cache, past → present, as each rank holds it)."""
    stacked = {key: _by_rank(value, shares) if key in cache else value for key, value in whole.feeds.items()}
    actual = RankProgramsRunner(programs, cache)(stacked)
    worst = 0.0
    for output, reference in whole.outputs.items():
        if output in cache.values():
            reference = _by_rank(reference, shares)
        comparison = metrics.compare(output, reference, actual[output],
                                     atol=compile_steps.LOWERING_ATOL_SCALE * float(np.abs(reference).max()),
                                     rtol=compile_steps.LOWERING_RTOL)
        if comparison.mismatched:
            raise LoweringMismatch(f"{name}'s {shares.tp} rank programs differ from onnxruntime on the whole graph on "
                                   f"output '{output}' (max |Δ| {comparison.max_abs:.3g}): please report it with the "
                                   "model")
        worst = max(worst, comparison.max_abs)
    return {"max_abs": worst, "against": "onnxruntime CPU on the whole graph, the rank programs lowered to PyTorch "
                                         "and run together"}


def _by_rank(cache: np.ndarray, shares: RankShares) -> np.ndarray:
    """A cache tensor [batch, KV heads, ...] as the ranks hold it, stacked [tp, batch, KV heads per rank, ...]."""
    return np.stack([cache[:, shares.kv_head_indices(rank)] for rank in range(shares.tp)])


def _model_costs() -> bool:
    from onnx_nmm.kernels.nki_kernels.nki_api import USING_EMULATOR

    return USING_EMULATOR
