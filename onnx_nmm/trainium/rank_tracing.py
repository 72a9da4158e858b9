"""Trace the rank programs of a model split over N NeuronCores (`compile --max-context C --tp N`, without
--dry-run) with neuronx-distributed's ModelBuilderV2 units, into one NxDModel that `generate DIR --backend
neuron` loads (runtime/device_ranks.py).

    inside NxDParallelState(world_size=N, tensor_model_parallel_size=N), per graph (each prefill bucket, the
    decode step):
      rank 0's program lowered, its custom ops on the @nki.jit kernels, its collectives on NxD's mappings
        (collective_converters.nxd_join), as a RankGraph: the cache a state every graph shares
      ─ trace(RankGraph, kwargs=the graph's example step) ─ compile(hlo, metaneff, key=graph) → the graph's NEFF
    NxDModel(world_size=N) ─ add(graph, trace, NEFF) for every graph ─ save: nxd/model.pt, without weights

Why rank 0's program: NxD traces one program that every rank runs (SPMD), each rank with its own weights, which
generate reads from the folder's rank programs. So every rank's program must be rank 0's but for its weights'
values; `check_same_program` refuses, in one line and before any trace, a split whose ranks differ in shape.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from onnx_nmm.errors import ModelError
from onnx_nmm.progress import Progress
from onnx_nmm.runtime.device_ranks import NXD_FOLDER, NXD_MODEL, rank_graph, step_inputs
from onnx_nmm.runtime.rank_programs import RankPrograms
from onnx_nmm.runtime.static_cache import StaticCache

COMPILER_WORKDIR = "compiler"


def trace_ranks(graphs: StaticCache, folder: Path, target: str, progress: Progress) -> dict[str, dict]:
    """Every graph of `graphs` (each one's rank programs, in `folder`) traced and compiled for `target` into one
    NxDModel saved as folder/nxd/model.pt; per graph, its manifest entry's trace: the NxDModel file, the key the
    graph is run by and its NEFF."""
    import torch
    from neuronx_distributed import NxDModel, NxDParallelState
    from neuronx_distributed.trace.model_builder import compile as nxd_compile
    from neuronx_distributed.trace.model_builder import trace as nxd_trace

    from onnx_nmm.lowering import NeuronKernels
    from onnx_nmm.lowering.collective_converters import bind_collectives, nxd_join

    programs = check_same_programs(graphs)
    tp = programs["decode"].tp
    shapes = {past: shape[1:] for past, shape in graphs.cache_shapes.items()}  # one rank's cache: [tp, ...] less tp
    os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    workdir = folder / NXD_FOLDER
    workdir.mkdir(exist_ok=True)
    model = NxDModel(world_size=tp)
    traced: dict[str, dict] = {}
    with NxDParallelState(world_size=tp, tensor_model_parallel_size=tp), \
            progress.phase(f"tracing the rank programs over {tp} NeuronCores with neuronx-distributed",
                           total=len(programs)) as phase:
        for name, ranks in programs.items():
            module = rank_graph(name, ranks.paths[0], graphs.layout, shapes, NeuronKernels(target=target))
            bind_collectives(module, nxd_join)
            example = {parameter: torch.from_numpy(array)
                       for parameter, array in step_inputs(graphs.layout, graphs.example_feeds(name)).items()}
            artifacts = nxd_trace(module, kwargs=example)
            compiled = nxd_compile(artifacts.hlo, artifacts.metaneff, compiler_workdir=str(workdir / COMPILER_WORKDIR),
                                   compiler_args=f"--target {target}", key=name)
            model.add(key=name, trace_artifacts=artifacts, compilation_artifacts=compiled)
            traced[name] = {"torchscript": f"{NXD_FOLDER}/{NXD_MODEL}", "nxd_key": name,
                            "neff": [_relative(Path(compiled.neff_filepath), folder)]}
            phase.advance(detail=name)
    model.save(str(workdir / NXD_MODEL))  # without weights: generate sets each rank's from its rank programs
    return traced


def check_same_programs(graphs: StaticCache) -> dict[str, RankPrograms]:
    """Every graph's rank programs, by name, once each is checked to trace as one program (check_same_program)."""
    programs: dict[str, RankPrograms] = {}
    for name, ranks, _ in graphs.graphs():
        assert isinstance(ranks, RankPrograms), "a tp compile's graphs are rank programs"
        check_same_program(ranks, name)
        programs[name] = ranks
    return programs


def check_same_program(programs: RankPrograms, name: str) -> None:
    """ModelError unless every rank's program is rank 0's but for its weights' values: the same nodes with the same
    attributes, and initializers of the same shapes and types in the same order (their names carry the rank; the
    lowering names them by order). NxD traces one program for every rank."""
    def structure(path: Path) -> tuple[list, list]:
        graph = onnx.load(path, load_external_data=False).graph
        return ([(node.domain, node.op_type, [attribute.SerializeToString() for attribute in node.attribute])
                 for node in graph.node],
                [(tensor.name, list(tensor.dims), tensor.data_type) for tensor in graph.initializer])

    nodes, initializers = structure(programs.paths[0])
    for rank, path in enumerate(programs.paths[1:], start=1):
        their_nodes, theirs = structure(path)
        differs = next((f"{other[0]} {other[1]} against {mine[0]} {mine[1]}"
                        for mine, other in zip(initializers, theirs) if mine[1:] != other[1:]), None)
        if differs is None and (their_nodes != nodes or len(theirs) != len(initializers)):
            differs = "its nodes against rank 0's"
        if differs is not None:
            raise ModelError(f"{name}: rank {rank}'s program differs from rank 0's ({differs}), and "
                             "neuronx-distributed traces one program that every rank runs: a {tp} that divides "
                             "every split width (heads, intermediate, vocabulary) traces; this one runs on the CPU "
                             "with {dry_run}", tp="tp", dry_run="dry_run")


def _relative(path: Path, folder: Path) -> str:
    try:
        return str(path.resolve().relative_to(folder.resolve()))
    except ValueError:  # NxD wrote it elsewhere
        return str(path)
