"""Compile a model that generates (`compile --max-context`): the static-cache graphs Neuron runs, each made
fast for its own shape.

    static cache (runtime/static_cache.py): a prefill per bucket, one decode step, over max_context positions
      └ per graph: fuse each MLP where faster at its tokens ─ lower ─ check against onnxruntime ─ plan kernels
    folder (runtime/compiled_folder.py): the graphs sharing one weights file, the manifest
      └ with the Neuron SDK: each graph traced (custom ops as @nki.jit kernels), weights kept out of the NEFFs

A prefill of 512 tokens and a decode step of one are different shapes, and the fastest MLP kernel differs
between them, so each graph chooses its own (launch_costs.choose_mlp_kernel); the manifest keeps, per graph,
every choice and the modelled times it compared. Without the SDK the whole folder is written before
NeuronSdkMissing says what to install (`generate DIR` runs it on the CPU); `dry_run` stops there on purpose.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx_ir as ir

from onnx_nmm.errors import NeuronSdkMissing
from onnx_nmm.model_io import write_text_atomically
from onnx_nmm.model_source import ModelSource
from onnx_nmm.runtime import compiled_folder
from onnx_nmm.runtime.static_cache import StaticCache, static_cache
from onnx_nmm.trainium import compile_steps, neuron
from onnx_nmm.trainium.compile_steps import Compilation, CompileOptions

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "config.json")


def compile_for_generation(source: ModelSource, output: Path, options: CompileOptions) -> Compilation:
    """The static-cache graphs of `source` for `options.max_context` positions, compiled into `output`."""
    from onnx_nmm.kernels.nki_api import USING_EMULATOR

    assert options.max_context is not None
    graphs = static_cache(source, options.max_context, options.buckets, options.batch)
    entries, summaries, modules = [], {}, {}
    for name, model, tokens in graphs.graphs():
        assert isinstance(model, ir.Model)
        rows = options.batch * tokens
        mlps = compile_steps.fuse_mlps(model, rows, options.target, options.fuse_mlp)
        modules[name], check = _lowered_and_checked(model, graphs, name)
        summaries[name] = neuron.plan_kernels(ir.to_proto(model), rows, options.target, model_costs=USING_EMULATOR)
        entries.append({"name": name, "file": f"{name}.onnx", "kind": "decode" if name == "decode" else "prefill",
                        "tokens": tokens, "fused_mlps": mlps.fused, "unfused_mlps": mlps.unfused,
                        "mlp_kernels": mlps.chosen,
                        "lowering_check": check, **summaries[name].to_dict()})
    missing = [] if options.dry_run else neuron.missing_neuron_packages()
    manifest = {"model": source.label, "target": options.target, "batch": options.batch,
                "max_context": options.max_context, "buckets": list(graphs.buckets),
                "cache": compiled_folder.cache_manifest(graphs), "weights": compiled_folder.WEIGHTS,
                "graphs": entries, "dry_run": options.dry_run, "traced": not options.dry_run and not missing}
    with compile_steps.staged_folder(output) as folder:
        compiled_folder.write_graphs(folder, {name: model for name, model, _ in graphs.graphs()})
        _copy_tokenizer(source, folder)
        if manifest["traced"]:
            for (name, model, _), entry in zip(graphs.graphs(), entries):
                feeds = graphs.example_feeds(name)
                entry.update(compile_steps.trace(modules[name], {value.name: feeds[value.name]
                                                                 for value in model.graph.inputs},
                                                 folder, options.target, name, separate_weights=True))
        write_text_atomically(folder / compiled_folder.MANIFEST, json.dumps(manifest, indent=2))
    if missing:
        raise NeuronSdkMissing(neuron.missing_sdk_message(missing) + f"; {output}/ holds every graph, which "
                               "`onnx-nmm generate` runs on the CPU", dry_run="dry_run")
    return Compilation(output, manifest, summaries["decode"], summaries)


def _lowered_and_checked(model: ir.Model, graphs: StaticCache, name: str):
    """The graph lowered to PyTorch (custom ops as torch math), and how far it is from onnxruntime on the graph's
    example feeds."""
    from onnx_nmm.lowering import TorchMath, lower

    proto = ir.to_proto(model)
    session = ModelSource.of(model).session()
    module = lower(proto, TorchMath(), consume=True)
    check = compile_steps.check_lowering(module, session, graphs.example_feeds(name))
    return module, {key: value for key, value in check.items() if key != "shapes"}


def _copy_tokenizer(source: ModelSource, folder: Path) -> None:
    """The tokenizer files beside the model, so that `generate DIR` finds them as it does beside a model."""
    if source.path is None:
        return
    for name in TOKENIZER_FILES:
        if (source.path.parent / name).is_file():
            shutil.copy2(source.path.parent / name, folder / name)
