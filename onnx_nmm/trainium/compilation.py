"""Lower a rewritten model for Trainium (`compile`).

    fuse MLPs where faster ─ lower to PyTorch ─ check against onnxruntime ─ plan a kernel per custom op
                    ─ torch_neuronx.trace (custom ops as @nki.jit kernels) ─ folder: NEFF, TorchScript, manifest

Shapes are static on Neuron, so the batch and sequence length are fixed here. Each MLP runs on the kernel
modelled fastest at this shape (launch_costs.choose_mlp_kernel): its fused kernel, its projections launched one
by one, or for a factorized MLP the dense MLP kernel on its factors multiplied back; the manifest keeps the
times compared. Without the Neuron SDK, NeuronSdkMissing says what to install before any work, and nothing is
written; `dry_run` does every step but the trace and writes the manifest. The folder is written under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
import onnx_ir as ir

from onnx_nmm.model_io import write_text_atomically
from onnx_nmm.model_source import ModelSource
from onnx_nmm.progress import Progress
from onnx_nmm.runtime.backend_runner import Model
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.graph_probe import first_step
from onnx_nmm.trainium import compile_steps, neuron
from onnx_nmm.trainium.compile_steps import Compilation, CompileOptions
from onnx_nmm.trainium.static_compilation import compile_for_generation


def compile(model: Model, output: str | os.PathLike, options: CompileOptions | None = None,
            overwrite: bool = False, progress: Progress | None = None) -> Compilation:
    """Lower `model` for Trainium into the folder `output` (refused when it holds files, unless it is a folder
    compile wrote and `overwrite` is set); `progress` hears each step."""
    options, progress = options or CompileOptions(), progress or Progress()
    output = Path(output)
    compile_steps.refuse_to_replace(output, overwrite)
    neuron.refuse_without_sdk(options.dry_run, options.tp)
    with progress.phase("loading the model"):
        source = ModelSource.of(model)
    if options.max_context is not None:
        return compile_for_generation(source, output, options, progress)
    from onnx_nmm.kernels.nki_kernels.nki_api import USING_EMULATOR

    tokens = options.batch * options.seq_len
    with progress.phase("choosing MLP kernels"):
        mlps = compile_steps.fuse_mlps(source.model, tokens, options.target, options.fuse_mlp)
    with progress.phase("lowering and checking against onnxruntime"):
        proto = ir.to_proto(source.model)
        onnx.load_external_data_for_model(proto, source.weights_folder)  # untouched weights live beside the input
        branches = len(proto.graph.node)
        proto = first_step(proto)  # a merged decoder compiles as the prefill its first step is
        first_step_only = len(proto.graph.node) != branches

        from onnx_nmm.lowering import TorchMath, lower

        module = lower(proto, TorchMath())
        reference = compile_steps.source_reference_session(source)
        inputs = CausalLm.of_source(source).random_feeds(options.batch, options.seq_len, seed=0)
        check = compile_steps.check_lowering(module, reference, inputs)
        kernels = neuron.plan_kernels(proto, tokens, options.target, model_costs=USING_EMULATOR)
    manifest = {
        "model": source.label, "target": options.target, "batch": options.batch, "seq_len": options.seq_len,
        "inputs": [{"name": name, "shape": list(array.shape), "dtype": str(array.dtype)}
                   for name, array in inputs.items()],
        "outputs": [{"name": o.name, "shape": check["shapes"][o.name]} for o in reference.get_outputs()],
        "fused_mlps": mlps.fused, "unfused_mlps": mlps.unfused, "mlp_kernels": mlps.chosen,
        "lowering_check": {k: v for k, v in check.items() if k != "shapes"},
        **kernels.to_dict(), "dry_run": options.dry_run, "first_step_only": first_step_only,
    }
    with compile_steps.staged_folder(output) as folder:
        if not options.dry_run:
            with progress.phase("tracing for Neuron"):
                manifest.update(compile_steps.trace(module, inputs, folder, options.target))
        write_text_atomically(folder / "manifest.json", json.dumps(manifest, indent=2))
    return Compilation(output, manifest, kernels)


