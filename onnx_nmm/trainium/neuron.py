"""What `onnx-nmm compile` needs around the lowering: the Neuron SDK, kernel plans per node, the trace.

The Neuron SDK (torch-neuronx, neuronx-cc, nki; and neuronx-distributed for a model split over NeuronCores,
`--tp` above 1) is distributed only from AWS's package repository; PyPI's packages of those names are
placeholders. Where it is missing, compile says so before any work and writes nothing (errors.NeuronSdkMissing);
a dry run, which stops before the trace, needs none.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from onnx_nmm.errors import NEURON_INDEX, ModelError, NeuronSdkMissing
from onnx_nmm.kernel_table import KernelSpec, kernel_spec
from onnx_nmm.passes import svd_ops
from onnx_nmm.trainium.launch_costs import best_dense_cost, kernel_cost

NEURON_PACKAGES = {"torch_neuronx": "torch-neuronx", "neuronxcc": "neuronx-cc", "nki": "nki"}
# What traces the rank programs of a model split over NeuronCores (trainium/rank_tracing.py).
TP_PACKAGES = {"neuronx_distributed": "neuronx-distributed"}


def missing_neuron_packages(tp: int = 1) -> list[str]:
    """The pip names of the Neuron SDK packages this machine lacks to trace a model over `tp` NeuronCores (PyPI
    placeholders count as lacking)."""
    from onnx_nmm.kernels.nki_kernels.nki_api import USING_EMULATOR

    needed = {**NEURON_PACKAGES, **(TP_PACKAGES if tp > 1 else {})}
    missing = [pip for module, pip in needed.items() if module != "nki" and importlib.util.find_spec(module) is None]
    if USING_EMULATOR:
        missing.append(NEURON_PACKAGES["nki"])
    return missing


def refuse_without_sdk(dry_run: bool, tp: int = 1) -> None:
    """A compile that traces needs the Neuron SDK (with neuronx-distributed when `tp` is above 1): without it,
    NeuronSdkMissing before any work is done."""
    missing = [] if dry_run else missing_neuron_packages(tp)
    if missing:
        raise NeuronSdkMissing(f"the Neuron SDK is not installed (missing: {', '.join(missing)}), so nothing can be "
                               f"traced and nothing was written. On a Trainium machine: pip install --extra-index-url "
                               f"{NEURON_INDEX} {' '.join(missing)}; here, set {{dry_run}} to do every step but the "
                               "trace", dry_run="dry_run")


@dataclass
class KernelEntry:
    """One custom op of the lowered graph and the kernel that runs it on Trainium."""

    node: str
    op: str
    kernel: str
    tokens: int
    dims: dict[str, int]
    plan: dict[str, int]
    modelled_us: float | None = None  # the fused kernel, modelled on the target
    modelled_dense_us: float | None = None  # the same layer(s) with dense weights, modelled
    hbm_mb: float | None = None
    hbm_dense_mb: float | None = None


@dataclass
class KernelSummary:
    target: str
    entries: list[KernelEntry] = field(default_factory=list)
    modelled: bool = False

    def to_dict(self) -> dict:
        totals = {}
        if self.modelled and self.entries:
            totals = {"modelled_us": sum(_known_cost(e.modelled_us) for e in self.entries),
                      "modelled_dense_us": sum(_known_cost(e.modelled_dense_us) for e in self.entries)}
        return {"target": self.target, "modelled": self.modelled, **totals,
                "kernels": [asdict(entry) for entry in self.entries]}


def _known_cost(cost: float | None) -> float:
    assert cost is not None, "a modelled summary models every kernel"
    return cost


def plan_kernels(proto: onnx.ModelProto, tokens: int, target: str, model_costs: bool) -> KernelSummary:
    """A kernel and its block sizes for every ai.onnx_nmm node at `tokens` rows (onnx_nmm.kernel_table);
    modelled costs if asked.

    Raises ModelError naming the node when no blocking of its shape fits the target's SBUF.
    """
    shapes = {tensor.name: tuple(tensor.dims) for tensor in proto.graph.initializer}
    summary = KernelSummary(target=target, modelled=model_costs)
    for node in proto.graph.node:
        if node.domain != svd_ops.DOMAIN:
            continue
        spec = kernel_spec(node.op_type)
        weights = [shapes.get(name) for name in node.input[1:]]
        if any(shape is None or len(shape) != 2 for shape in spec.matrices(weights)):
            raise ModelError(f"node '{node.name}': its weights are not 2-D initializers; the kernels need constant "
                             "weights")
        try:
            dims = spec.dims(weights)
            plan = spec.plan(tokens, dims, target)
        except ValueError as error:
            raise ModelError(f"node '{node.name}' cannot run on {target} at {tokens} tokens: {error}") from None
        entry = KernelEntry(node.name, node.op_type, spec.kernel, tokens, dims, _plan_dict(plan))
        if model_costs:
            entry.modelled_us, entry.modelled_dense_us, entry.hbm_mb, entry.hbm_dense_mb = _modelled(
                spec, tokens, dims, target)
        summary.entries.append(entry)
    return summary


def _plan_dict(plan) -> dict[str, int]:
    return {key: int(value) for key, value in vars(plan).items() if not key.startswith("_")}


def _modelled(spec: KernelSpec, tokens: int, dims: dict[str, int], target: str) -> tuple[float, float, float, float]:
    """(fused µs, dense µs, fused HBM MB, dense HBM MB), all modelled with the kernels' cost model. "Dense" is the
    best dense path of the same layer(s) (launch_costs.best_dense_cost): for an MLP, the faster of the dense MLP
    kernel and its dense projections launched one by one. Launch costs are memoized by shape."""
    fused = kernel_cost(spec.kernel, spec.shapes(tokens, dims), target)
    dense = best_dense_cost(spec.op, dims, tokens, target)
    return fused[0] * 1e6, dense[0] * 1e6, fused[1] / 1e6, dense[1] / 1e6


def trace_for_neuron(module, example_inputs: tuple, workdir: Path, target: str, separate_weights: bool = False,
                     input_output_aliases: dict | None = None):
    """torch_neuronx.trace of the lowered module (custom ops already on NeuronKernels): graph + NKI → NEFF; with
    `separate_weights`, the weights stay out of the NEFF (inline_weights_to_neff=False); `input_output_aliases`
    ({module parameter: output index}) keeps those parameters on the device, updated in place from the outputs."""
    import torch_neuronx

    os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    return torch_neuronx.trace(module, example_inputs, input_output_aliases=input_output_aliases or {},
                               compiler_workdir=str(workdir), compiler_args=["--target", target],
                               inline_weights_to_neff=not separate_weights)
