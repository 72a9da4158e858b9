"""Lower a rewritten model for Trainium (`compile`).

    fuse MLPs where faster ─ lower to PyTorch ─ check against onnxruntime ─ plan a kernel per custom op
                    ─ torch_neuronx.trace (custom ops as @nki.jit kernels) ─ folder: NEFF, TorchScript, manifest

Shapes are static on Neuron, so the batch and sequence length are fixed here. Each MLP becomes one fused kernel
where that kernel is modelled faster at this shape than its projections launched one by one
(launch_costs.choose_mlp_kernel); the manifest keeps both times. Without the Neuron SDK every
step up to the trace runs, then NeuronSdkMissing says what to install; `dry_run` stops there on purpose and
writes the manifest. The folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnx_nmm.errors import LoweringMismatch, NeuronSdkMissing, OptionError, OutputError
from onnx_nmm.kernel_table import kernel_spec
from onnx_nmm.kernels.hardware import TRAINIUM_TARGETS
from onnx_nmm.model_io import make_public, write_text_atomically
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes.dense_mlp_fusion import fuse_every_mlp
from onnx_nmm.quality import metrics
from onnx_nmm.runtime import ort_runner
from onnx_nmm.runtime.backend_runner import Model
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.graph_probe import first_step
from onnx_nmm.trainium import neuron
from onnx_nmm.trainium.launch_costs import choose_mlp_kernel

# A lowering error shows as a logits difference far above fp32 rounding (a 30-layer graph: ~1e-4).
LOWERING_ATOL_SCALE, LOWERING_RTOL = 1e-4, 1e-3


@dataclass(frozen=True)
class CompileOptions:
    """target: the Trainium generation; batch, seq_len: the static shape; fuse_mlp: each MLP as one fused kernel
    (SvdGatedMLP, SvdMLP, GatedMLP or MLP) where it is modelled faster than its projections one by one;
    dry_run: stop before the trace, writing the manifest only."""

    target: str = "trn2"
    batch: int = 1
    seq_len: int = 128
    fuse_mlp: bool = True
    dry_run: bool = False

    def __post_init__(self):
        if self.target not in TRAINIUM_TARGETS:
            raise OptionError(f"{{target}} must be one of {', '.join(TRAINIUM_TARGETS)}, got {self.target!r}",
                              target="target")
        if self.batch < 1 or self.seq_len < 1:
            raise OptionError("{batch} and {seq_len} must be positive", batch="batch", seq_len="seq_len")


@dataclass
class Compilation:
    folder: Path
    manifest: dict
    kernels: neuron.KernelSummary


def compile(model: Model, output: str | os.PathLike, options: CompileOptions | None = None,
            overwrite: bool = False) -> Compilation:
    """Lower `model` for Trainium into the folder `output` (refused when it holds files, unless `overwrite`)."""
    options = options or CompileOptions()
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise OutputError(f"{output} is a file, and compile writes a folder (graphs, NEFFs, manifest); choose a "
                          "folder name for {output}", output="output")
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise OutputError(f"{output} exists and is not empty; choose another {{output}} or set {{overwrite}} to "
                          "replace it", output="output", overwrite="overwrite")
    from onnx_nmm.kernels.nki_api import USING_EMULATOR

    source = ModelSource.of(model)
    choices: dict[str, dict] = {}  # the MLP kernel chosen for each MLP, and the times compared
    chooser = _mlp_chooser(options.batch * options.seq_len, options.target, choices) if USING_EMULATOR else None
    fused, unfused = fuse_every_mlp(source.model, chooser) if options.fuse_mlp else ([], {})
    proto = ir.to_proto(source.model)
    onnx.load_external_data_for_model(proto, source.weights_folder)  # untouched weights still live beside the input
    branches = len(proto.graph.node)
    proto = first_step(proto)  # a merged decoder compiles as the prefill its first step is
    first_step_only = len(proto.graph.node) != branches

    from onnx_nmm.lowering import TorchMath, lower

    module = lower(proto, TorchMath())
    reference = source.session()
    inputs = CausalLm.of_source(source).random_feeds(options.batch, options.seq_len, seed=0)
    check = _check_lowering(module, reference, inputs)
    kernels = neuron.plan_kernels(proto, options.batch * options.seq_len, options.target, model_costs=USING_EMULATOR)
    missing = [] if options.dry_run else neuron.missing_neuron_packages()
    if missing:
        raise NeuronSdkMissing(neuron.missing_sdk_message(missing), dry_run="dry_run")

    manifest = {
        "model": source.label, "target": options.target, "batch": options.batch, "seq_len": options.seq_len,
        "inputs": [{"name": name, "shape": list(array.shape), "dtype": str(array.dtype)}
                   for name, array in inputs.items()],
        "outputs": [{"name": o.name, "shape": check["shapes"][o.name]} for o in reference.get_outputs()],
        "fused_mlps": fused, "unfused_mlps": unfused,
        "mlp_kernels": list(choices.values()) if chooser is not None or not options.fuse_mlp else
                       "not modelled: the Neuron SDK's nki is installed, so every MLP that can be fused is",
        "lowering_check": {k: v for k, v in check.items() if k != "shapes"},
        **kernels.to_dict(), "dry_run": options.dry_run, "first_step_only": first_step_only,
    }
    with _staged_folder(output) as folder:
        if not options.dry_run:
            manifest.update(_trace(module, inputs, folder, options.target))
        write_text_atomically(folder / "manifest.json", json.dumps(manifest, indent=2))
    return Compilation(output, manifest, kernels)


def _mlp_chooser(tokens: int, target: str, choices: dict[str, dict]):
    """The fusion passes' question, answered by the modelled times of the fused kernel and of the projections
    one by one at `tokens` rows; every answer is kept in `choices`, by MLP."""

    def choose(name: str, op: str, shapes: list[tuple[int, ...]]) -> str | None:
        choice = choose_mlp_kernel(op, kernel_spec(op).dims(shapes), tokens, target)
        choices[name] = {"mlp": name, **choice.to_dict()}
        return None if choice.fuse else choice.reason()

    return choose


def _check_lowering(module, session, inputs: dict[str, np.ndarray]) -> dict:
    """Run the lowered module (custom ops as torch math) and onnxruntime on the same inputs."""
    import torch

    from onnx_nmm.lowering import call_lowered

    expected = ort_runner.run(session, inputs)
    result = call_lowered(module, *(torch.from_numpy(inputs[spec.name]) for spec in session.get_inputs()))
    actual = dict(zip(expected, result if isinstance(result, (tuple, list)) else (result,)))
    worst = {}
    for name, reference in expected.items():
        candidate = actual[name].numpy()
        comparison = metrics.compare(name, reference, candidate,
                                     atol=LOWERING_ATOL_SCALE * float(np.abs(reference).max()),
                                     rtol=LOWERING_RTOL)
        if comparison.mismatched:
            raise LoweringMismatch(f"the lowered module differs from onnxruntime on output '{name}' (max |Δ| "
                                   f"{comparison.max_abs:.3g}): a lowering bug, please report it with the model")
        worst[name] = comparison.max_abs
    return {"max_abs": max(worst.values()), "against": "onnxruntime CPU",
            "shapes": {name: list(array.shape) for name, array in expected.items()}}


def _trace(module, inputs: dict[str, np.ndarray], folder: Path, target: str) -> dict:
    """The Neuron trace: custom ops on the @nki.jit kernels; NEFF and TorchScript into `folder`."""
    import torch

    from onnx_nmm.lowering import NeuronKernels, set_backend

    set_backend(module, NeuronKernels(target=target))
    example = tuple(torch.from_numpy(array) for array in inputs.values())
    traced = neuron.trace_for_neuron(module, example, folder / "compiler", target)
    torch.jit.save(traced, str(folder / "model.pt"))
    neffs = sorted(str(path.relative_to(folder)) for path in (folder / "compiler").rglob("*.neff"))
    return {"torchscript": "model.pt", "neff": neffs}


class _staged_folder:
    """A temporary sibling folder, renamed to `target` when the block succeeds (removed otherwise)."""

    def __init__(self, target: Path):
        self.target = target

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix=".onnx-nmm-", dir=self.target.parent))
        make_public(self.folder)
        return self.folder

    def __exit__(self, kind, error, trace):
        if kind is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            return False
        if self.target.exists():
            shutil.rmtree(self.target)
        self.folder.rename(self.target)
        return False
