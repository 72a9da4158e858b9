"""What both kinds of `compile` share: their options and result, and their steps: choose each MLP's kernel by
its modelled time, check the lowering against onnxruntime, trace for Neuron, write the folder whole or not at
all."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnx_nmm.errors import LoweringMismatch, OptionError, OutputError
from onnx_nmm.kernel_table import kernel_spec
from onnx_nmm.kernels.pricing.hardware import TRAINIUM_TARGETS, instance
from onnx_nmm.model_io import make_public
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes.dense_mlp_fusion import fuse_every_mlp
from onnx_nmm.passes.mlp_densify import DensifyMlpPass
from onnx_nmm.quality import metrics
from onnx_nmm.runtime import compiled_folder, ort_runner
from onnx_nmm.runtime.device_ranks import NXD_FOLDER
from onnx_nmm.trainium import neuron
from onnx_nmm.trainium.launch_costs import choose_mlp_kernel

# A lowering error shows as a logits difference far above fp32 rounding (a 30-layer graph: ~1e-4).
LOWERING_ATOL_SCALE, LOWERING_RTOL = 1e-4, 1e-3
# What a trace writes into its folder: the TorchScript module, and the Neuron compiler's work folder (the NEFF).
TORCHSCRIPT, NEURON_WORKDIR = "model.pt", "compiler"


@dataclass(frozen=True)
class CompileOptions:
    """target: the Trainium generation; batch, seq_len: the static shape; fuse_mlp: each MLP as one fused kernel
    (SvdGatedMLP, SvdMLP, GatedMLP or MLP) where it is modelled faster than its projections one by one;
    dry_run: stop before the trace, writing the manifest only.

    max_context: compile a model that generates instead of one shape (static_compilation): a prefill graph per
    bucket (prompt lengths; default 128, 512, 2048 below max_context, and max_context) and a decode step over a
    KV cache of max_context positions; seq_len is then unused.

    tp: split the model that generates over that many NeuronCores (sharded_compilation): each graph becomes tp
    rank programs joined by collectives, traced with neuronx-distributed unless a dry run (rank_tracing)."""

    target: str = "trn2"
    batch: int = 1
    seq_len: int = 128
    fuse_mlp: bool = True
    dry_run: bool = False
    max_context: int | None = None
    buckets: tuple[int, ...] | None = None
    tp: int = 1

    def __post_init__(self):
        if self.target not in TRAINIUM_TARGETS:
            raise OptionError(f"{{target}} must be one of {', '.join(TRAINIUM_TARGETS)}, got {self.target!r}",
                              target="target")
        if self.batch < 1 or self.seq_len < 1:
            raise OptionError("{batch} and {seq_len} must be positive", batch="batch", seq_len="seq_len")
        machine = instance(self.target)
        if not 1 <= self.tp <= machine.cores:
            raise OptionError(f"{{tp}} must be from 1 to {machine.cores}, the NeuronCores of a {machine.name}, "
                              f"got {self.tp}", tp="tp")
        if self.tp > 1 and self.max_context is None:
            raise OptionError("{tp} splits a model that generates: give {max_context} too", tp="tp",
                              max_context="max_context")
        if self.buckets is not None and self.max_context is None:
            raise OptionError("{buckets} are prompt lengths of a model that generates: give {max_context} too",
                              buckets="buckets", max_context="max_context")


@dataclass
class Compilation:
    folder: Path
    manifest: dict
    kernels: neuron.KernelSummary  # of the one graph; with max_context, of the decode step
    graphs: dict[str, neuron.KernelSummary] = field(default_factory=dict)  # with max_context, every graph's


@dataclass
class MlpKernels:
    """What the fusion made of a graph's MLPs: the fused ones, why the others were not, and per MLP the kernel
    chosen with the modelled times compared (a note instead when the real nki is installed: then every MLP that
    can be fused is)."""

    fused: list[str]
    unfused: dict[str, str]
    chosen: list[dict] | str


def fuse_mlps(model, tokens: int, target: str, fuse: bool) -> MlpKernels:
    """Each MLP of `model` (changed in place) on its fastest kernel at `tokens` rows: fused, its projections one
    by one, or — a factorized MLP whose dense MLP kernel beats both — densified (passes/mlp_densify.py)."""
    from onnx_nmm.kernels.nki_kernels.nki_api import USING_EMULATOR

    if not fuse:
        return MlpKernels([], {}, [])
    if not USING_EMULATOR:
        fused, unfused = fuse_every_mlp(model)
        return MlpKernels(fused, unfused, "not modelled: the Neuron SDK's nki is installed, so every MLP that can "
                                          "be fused is")
    choices: dict[str, dict] = {}

    def choose(name: str, op: str, shapes: list[tuple[int, ...]]) -> str | None:
        choice = choose_mlp_kernel(op, kernel_spec(op).dims(shapes), tokens, target)
        choices[name] = {"mlp": name, **choice.to_dict()}
        return None if choice.fuse else choice.reason()

    fused, unfused = fuse_every_mlp(model, choose)
    densify = DensifyMlpPass({name for name, choice in choices.items() if choice["densified"]})
    densify(model)
    for name, choice in choices.items():
        if choice["densified"] and name not in densify.densified:  # its factors are not plain initializers
            choice.update(densified=False, chose=f"{choice['op']} (its factors cannot be multiplied back here)")
    return MlpKernels(fused, unfused, list(choices.values()))


def float_reference(proto: onnx.ModelProto) -> bool:
    """Sets every MatMulNBits of `proto` that computes at an accuracy_level above 0 to compute in float; whether
    there was one. Above 0 onnxruntime's CPU kernel quantizes the activations to int8 (a CPU speed setting, the
    default of onnxruntime-genai's int4 builds), which the lowered program does not do, nor the device: the
    reference it is checked against must not either."""
    levels = [attribute for node in proto.graph.node if node.op_type == "MatMulNBits"
              for attribute in node.attribute if attribute.name == "accuracy_level" and attribute.i > 0]
    for attribute in levels:
        attribute.i = 0
    return bool(levels)


def reference_session(path: Path):
    """onnxruntime on the graph at `path` as the lowering's reference (float_reference)."""
    proto = onnx.load(path, load_external_data=False)
    if not float_reference(proto):
        return ort_runner.create_session(path)
    return ort_runner.create_session(proto.SerializeToString(), label=path, extra_config={
        "session.model_external_initializers_file_folder_path": str(path.parent)})


def source_reference_session(source: ModelSource):
    """onnxruntime on the model as given, as what the compiled programs are checked against (float_reference)."""
    proto = source.graph_proto()
    return source.session_of(proto) if float_reference(proto) else source.session()


def check_lowering(module, session, inputs: dict[str, np.ndarray]) -> dict:
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


def trace(module, inputs: dict[str, np.ndarray], folder: Path, target: str, subfolder: str = "",
          separate_weights: bool = False, input_output_aliases: dict | None = None) -> dict:
    """The Neuron trace on `inputs` (in the module's input order): custom ops on the @nki.jit kernels; NEFF and
    TorchScript into `folder`/`subfolder`; `separate_weights` keeps the weights out of the NEFF (graphs that
    share them); `input_output_aliases` keeps state on the device (cache_state.CacheState)."""
    import torch

    from onnx_nmm.lowering import NeuronKernels, set_backend

    set_backend(module, NeuronKernels(target=target))
    example = tuple(torch.from_numpy(array) for array in inputs.values())
    workdir = folder / subfolder
    workdir.mkdir(parents=True, exist_ok=True)
    traced = neuron.trace_for_neuron(module, example, workdir / NEURON_WORKDIR, target, separate_weights,
                                     input_output_aliases)
    torch.jit.save(traced, str(workdir / TORCHSCRIPT))
    neffs = sorted(str(path.relative_to(folder)) for path in (workdir / NEURON_WORKDIR).rglob("*.neff"))
    return {"torchscript": str((workdir / TORCHSCRIPT).relative_to(folder)), "neff": neffs}


def refuse_to_replace(output: Path, overwrite: bool) -> None:
    """compile writes a folder, and replacing one deletes it: a file is refused, and so is a folder holding
    anything compile did not write, even with `overwrite`; a folder compile wrote is replaced only with
    `overwrite`."""
    if output.exists() and not output.is_dir():
        raise OutputError(f"{output} is a file, and compile writes a folder (graphs, NEFFs, manifest); choose a "
                          "folder name for {output}", output="output")
    present = sorted(path.name for path in output.iterdir()) if output.is_dir() else []
    if not present:
        return
    foreign = [name for name in present if name not in _entries_compile_wrote(output)]
    if foreign:
        names = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputError(f"{output} exists and is not empty, and compile did not write {names}: choose another "
                          "{output} or an empty folder ({overwrite} replaces only a folder compile wrote)",
                          output="output", overwrite="overwrite")
    if not overwrite:
        raise OutputError(f"{output} exists and is not empty; choose another {{output}} or set {{overwrite}} to "
                          "replace it", output="output", overwrite="overwrite")


def _entries_compile_wrote(folder: Path) -> set[str]:
    """The names a compile writes into `folder`, by the manifest it left there (none without one): with
    max_context the graphs, their weights, the tokenizer files and a trace folder per graph (over NeuronCores, the
    rank programs and the one NxD trace folder); at one static shape the trace."""
    try:
        manifest = json.loads((folder / compiled_folder.MANIFEST).read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(manifest, dict):
        return set()
    if "cache" in manifest and isinstance(manifest.get("graphs"), list):
        graphs = [graph for graph in manifest["graphs"] if isinstance(graph, dict)]
        ranks = [str(file) for graph in graphs if isinstance(graph.get("ranks"), list) for file in graph["ranks"]]
        traced_ranks = [NXD_FOLDER] if ranks else []
        return {compiled_folder.MANIFEST, compiled_folder.WEIGHTS, *compiled_folder.TOKENIZER_FILES, *ranks,
                *traced_ranks,
                *(str(graph.get("file")) for graph in graphs), *(str(graph.get("name")) for graph in graphs)}
    if "lowering_check" in manifest and "seq_len" in manifest:
        return {compiled_folder.MANIFEST, TORCHSCRIPT, NEURON_WORKDIR}
    return set()


class staged_folder:
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
