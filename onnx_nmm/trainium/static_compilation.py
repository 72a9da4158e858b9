"""Compile a model that generates (`compile --max-context`): the static-cache graphs Neuron runs, each made
fast for its own shape.

    static cache (runtime/static_cache.py): a prefill per bucket, one decode step, over max_context positions
      └ per graph: each MLP on its fastest kernel at the graph's tokens
    folder (runtime/compiled_folder.py): the graphs sharing one weights file
      └ generation checked against the model as given (generation_check.py): refused, and nothing left, if it
        differs
      └ per graph, read back: plan kernels ─ lower ─ check against onnxruntime; then the manifest
      └ with the Neuron SDK: each graph traced (custom ops as @nki.jit kernels), weights kept out of the NEFFs,
        the decode step's cache kept on the device as its state (trainium/cache_state.py)

A prefill of 512 tokens and a decode step of one are different shapes, and the fastest MLP kernel differs
between them, so each graph chooses its own (launch_costs.choose_mlp_kernel); the manifest keeps, per graph,
every choice and the modelled times it compared. Without the SDK compile stops before any of this
(compilation.compile); `dry_run` writes the whole folder but the traces, which `generate DIR` runs on the CPU.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnx_nmm.model_io import write_text_atomically
from onnx_nmm.model_source import ModelSource
from onnx_nmm.progress import Progress
from onnx_nmm.runtime import compiled_folder
from onnx_nmm.runtime.static_cache import StaticCache, static_cache
from onnx_nmm.trainium import compile_steps, neuron
from onnx_nmm.trainium.compile_steps import Compilation, CompileOptions, MlpKernels
from onnx_nmm.trainium.generation_check import check_generation
from onnx_nmm.trainium.sharded_compilation import compile_sharded


def compile_for_generation(source: ModelSource, output: Path, options: CompileOptions,
                           progress: Progress) -> Compilation:
    """The static-cache graphs of `source` for `options.max_context` positions, compiled into `output`;
    `progress` hears each step."""
    assert options.max_context is not None
    if options.tp > 1:
        return compile_sharded(source, output, options, progress)
    with progress.phase("building the static graphs"):
        graphs = static_cache(source, options.max_context, options.buckets, options.batch)
    with progress.phase("choosing MLP kernels", total=len(graphs.graphs())) as phase:
        mlps, models = {}, {}
        for name, model, tokens in graphs.graphs():
            assert isinstance(model, ir.Model), "static_cache builds its graphs in memory"
            mlps[name] = compile_steps.fuse_mlps(model, options.batch * tokens, options.target, options.fuse_mlp)
            models[name] = model
            phase.advance(detail=name)
    with compile_steps.staged_folder(output) as folder:
        with progress.phase("writing the folder"):
            compiled_folder.write_graphs(folder, models)
            compiled_folder.copy_tokenizer(source.path, folder)
        with progress.phase("checking the graphs against the model as given"):
            generation = check_generation(source, _as_written(graphs, folder))
        entries, summaries = [], {}
        with progress.phase("lowering and checking each graph", total=len(graphs.graphs())) as phase:
            for name, model, tokens in graphs.graphs():  # each graph read back from the folder: any size runs
                entry, summaries[name] = _compiled_graph(name, model, tokens, mlps[name], graphs, folder, options,
                                                         progress)
                entries.append(entry)
                phase.advance(detail=name)
        manifest = {"model": source.label, "target": options.target, "batch": options.batch,
                    "max_context": options.max_context, "buckets": list(graphs.buckets),
                    "cache": compiled_folder.cache_manifest(graphs), "weights": compiled_folder.WEIGHTS,
                    "graphs": entries, "generation_check": generation.to_dict(), "dry_run": options.dry_run,
                    "traced": not options.dry_run}
        write_text_atomically(folder / compiled_folder.MANIFEST, json.dumps(manifest, indent=2))
    return Compilation(output, manifest, summaries["decode"], summaries)


def _compiled_graph(name: str, model, tokens: int, mlps: MlpKernels, graphs: StaticCache, folder: Path,
                    options: CompileOptions, progress: Progress) -> tuple[dict, neuron.KernelSummary]:
    """The graph `name` as the folder holds it: its kernels planned, lowered and checked against onnxruntime,
    and traced unless a dry run; its manifest entry (with `mlps`, the MLP kernels chosen for it) and kernel
    summary."""
    from onnx_nmm.kernels.nki_kernels.nki_api import USING_EMULATOR

    path = folder / f"{name}.onnx"
    summary = neuron.plan_kernels(onnx.load(path, load_external_data=False), options.batch * tokens, options.target,
                                  model_costs=USING_EMULATOR)
    feeds = graphs.example_feeds(name)
    module, check = _lowered_and_checked(path, feeds)
    entry = {"name": name, "file": path.name, "kind": "decode" if name == "decode" else "prefill", "tokens": tokens,
             "fused_mlps": mlps.fused, "unfused_mlps": mlps.unfused, "mlp_kernels": mlps.chosen,
             "lowering_check": check, **summary.to_dict()}
    if not options.dry_run:
        with progress.phase(f"tracing {name} for Neuron"):
            entry |= _traced(module, model, feeds, graphs, folder, options.target, name)
    return entry, summary


def _as_written(graphs: StaticCache, folder: Path) -> StaticCache:
    """`graphs` as the folder holds them (each MLP on its kernel, weights in one file), read by path."""
    written = {name: (folder / f"{name}.onnx", tokens) for name, _, tokens in graphs.graphs()}
    return replace(graphs, prefill={tokens: path for name, (path, tokens) in written.items() if name != "decode"},
                   decode=written["decode"][0])


def _traced(module, model, feeds: dict[str, np.ndarray], graphs, folder: Path, target: str, name: str) -> dict:
    """The graph's Neuron trace, weights kept out of the NEFF (the graphs share them). The decode step is traced
    as a CacheState: its cache stays on the device, aliased to the present outputs that update it."""
    from onnx_nmm.trainium.cache_state import CacheState

    inputs = [value.name for value in model.graph.inputs]
    if name != "decode":
        return compile_steps.trace(module, {input_name: feeds[input_name] for input_name in inputs}, folder, target,
                                   name, separate_weights=True)
    state = CacheState(module, inputs, graphs.layout, graphs.cache_shapes)
    aliases = state.aliases([value.name for value in model.graph.outputs], graphs.layout)
    return {**compile_steps.trace(state, {input_name: feeds[input_name] for input_name in state.step_inputs}, folder,
                                  target, name, separate_weights=True, input_output_aliases=aliases),
            "cache_state": {"step_inputs": state.step_inputs, "aliased": True}}


def _lowered_and_checked(path: Path, feeds: dict[str, np.ndarray]):
    """The graph at `path` lowered to PyTorch (custom ops as torch math), and how far it is from onnxruntime on
    `feeds`."""
    from onnx_nmm.lowering import TorchMath, lower

    module = lower(path, TorchMath())
    check = compile_steps.check_lowering(module, compile_steps.reference_session(path), feeds)
    return module, {key: value for key, value in check.items() if key != "shapes"}
