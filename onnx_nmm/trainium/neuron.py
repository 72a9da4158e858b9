"""What `onnx-nmm compile` needs around the lowering: the Neuron SDK, kernel plans per node, the trace.

The Neuron SDK (torch-neuronx, neuronx-cc, nki) is distributed only from AWS's package repository;
PyPI's packages of those names are placeholders. Where it is missing, compile does every step up to
the trace and says so (errors.NeuronSdkMissing).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from onnx_nmm.errors import ModelError
from onnx_nmm.passes import svd_ops

NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"
NEURON_PACKAGES = {"torch_neuronx": "torch-neuronx", "neuronxcc": "neuronx-cc", "nki": "nki"}


def missing_neuron_packages() -> list[str]:
    """The pip names of the Neuron SDK packages this machine lacks (PyPI placeholders count as lacking)."""
    from onnx_nmm.kernels.nki_api import USING_EMULATOR

    missing = [pip for module, pip in NEURON_PACKAGES.items() if module != "nki"
               and importlib.util.find_spec(module) is None]
    if USING_EMULATOR:
        missing.append(NEURON_PACKAGES["nki"])
    return missing


def missing_sdk_message(missing: list[str]) -> str:
    return (f"the Neuron SDK is not installed (missing: {', '.join(missing)}); everything up to the trace ran. "
            f"On a Trainium machine: pip install --extra-index-url {NEURON_INDEX} {' '.join(missing)}; "
            "or set {dry_run} to write the manifest without tracing")


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
            totals = {"modelled_us": sum(e.modelled_us for e in self.entries),
                      "modelled_dense_us": sum(e.modelled_dense_us for e in self.entries)}
        return {"target": self.target, "modelled": self.modelled, **totals,
                "kernels": [asdict(entry) for entry in self.entries]}


def plan_kernels(proto: onnx.ModelProto, tokens: int, target: str, model_costs: bool) -> KernelSummary:
    """A kernel and its block sizes for every ai.onnx_nmm node at `tokens` rows; modelled costs if asked.

    Raises ModelError naming the node when no blocking of its shape fits the target's SBUF.
    """
    from onnx_nmm.kernels.blocking import plan_dense_mlp, plan_mlp, plan_ungated_mlp, plan_xuv

    shapes = {tensor.name: tuple(tensor.dims) for tensor in proto.graph.initializer}
    summary = KernelSummary(target=target, modelled=model_costs)
    costs: dict[tuple, tuple] = {}
    for node in proto.graph.node:
        if node.domain != svd_ops.DOMAIN:
            continue
        factors = [shapes.get(name) for name in node.input[1:]]
        if any(shape is None or len(shape) != 2 for shape in _matrices(node.op_type, factors)):
            raise ModelError(f"node '{node.name}': its weights are not 2-D initializers; the kernels need constant "
                             "weights")
        try:
            if node.op_type in svd_ops.DENSE_MLP_OPS:
                gated = node.op_type == svd_ops.GATED_MLP
                (h, i) = factors[0]
                kernel = "dense_gated_mlp" if gated else "dense_ungated_mlp"
                plan = plan_dense_mlp(tokens, h, i, gated, "bfloat16", target=target)
                entry = KernelEntry(node.name, node.op_type, kernel, tokens, {"H": h, "I": i}, _plan_dict(plan))
            elif node.op_type == svd_ops.SVD_MATMUL:
                (k, rank), (_, n) = factors[0], factors[1]
                dims = {"K": k, "rank": rank, "N": n}
                plan = plan_xuv(tokens, k, rank, n, "bfloat16", target=target)
                entry = KernelEntry(node.name, node.op_type, "fused_xuv", tokens, dims, _plan_dict(plan))
            elif node.op_type == svd_ops.SVD_GATED_MLP:
                (h, rg), (_, i), (_, ru), _, (_, rd), _ = factors[:6]
                dims = {"H": h, "I": i, "rank_gate": rg, "rank_up": ru, "rank_down": rd}
                plan = plan_mlp(tokens, h, i, rg, ru, rd, "bfloat16", target=target)
                entry = KernelEntry(node.name, node.op_type, "fused_svd_mlp", tokens, dims, _plan_dict(plan))
            else:
                (h, r1), (_, i), _, (_, r2), _ = factors[:5]
                dims = {"H": h, "I": i, "rank_1": r1, "rank_2": r2}
                plan = plan_ungated_mlp(tokens, h, i, r1, r2, "bfloat16", target=target)
                entry = KernelEntry(node.name, node.op_type, "fused_svd_ungated_mlp", tokens, dims, _plan_dict(plan))
        except ValueError as error:
            raise ModelError(f"node '{node.name}' cannot run on {target} at {tokens} tokens: {error}") from None
        if model_costs:
            key = (entry.kernel, tuple(entry.dims.values()))
            if key not in costs:
                costs[key] = _modelled(entry, target)
            entry.modelled_us, entry.modelled_dense_us, entry.hbm_mb, entry.hbm_dense_mb = costs[key]
        summary.entries.append(entry)
    return summary


def _matrices(op_type: str, factors: list) -> list:
    """The shapes of the op's U and V inputs (its biases are vectors)."""
    if op_type in (svd_ops.SVD_MLP, svd_ops.MLP):
        return [factors[i] for i in ((0, 1, 3, 4) if op_type == svd_ops.SVD_MLP else (0, 2))]
    return {svd_ops.SVD_GATED_MLP: factors[:6], svd_ops.GATED_MLP: factors[:3]}.get(op_type, factors[:2])


def _plan_dict(plan) -> dict[str, int]:
    return {key: int(value) for key, value in vars(plan).items() if not key.startswith("_")}


def _modelled(entry: KernelEntry, target: str) -> tuple[float, float, float, float]:
    """(fused µs, dense µs, fused HBM MB, dense HBM MB), all modelled with the kernels' cost model. A dense MLP's
    "dense" is its projections launched one by one."""
    from onnx_nmm.kernels import (
        dense_gated_mlp,
        dense_matmul,
        dense_ungated_mlp,
        estimate,
        fused_svd_mlp,
        fused_svd_ungated_mlp,
        fused_xuv,
        silu_mul,
    )

    m, d = entry.tokens, entry.dims
    if entry.kernel in ("dense_gated_mlp", "dense_ungated_mlp"):
        h, i = d["H"], d["I"]
        gated = entry.kernel == "dense_gated_mlp"
        fused = (estimate(dense_gated_mlp, (m, h), (h, i), (h, i), (i, h), target=target) if gated else
                 estimate(dense_ungated_mlp, (m, h), (h, i), (i,), (i, h), target=target))
        dense = [estimate(dense_matmul, (m, h), (h, i), target=target)] * (2 if gated else 1)
        dense += [estimate(silu_mul, (m, i), (m, i), target=target)] if gated else []
        dense += [estimate(dense_matmul, (m, i), (i, h), target=target)]
    elif entry.kernel == "fused_xuv":
        fused = estimate(fused_xuv, (m, d["K"]), (d["K"], d["rank"]), (d["rank"], d["N"]), target=target)
        dense = [estimate(dense_matmul, (m, d["K"]), (d["K"], d["N"]), target=target)]
    elif entry.kernel == "fused_svd_ungated_mlp":
        h, i = d["H"], d["I"]
        fused = estimate(fused_svd_ungated_mlp, (m, h), (h, d["rank_1"]), (d["rank_1"], i), (i,), (i, d["rank_2"]),
                         (d["rank_2"], h), target=target)
        # the dense pair alone: its activation, a launch of its own, is left out (the dense time is a floor)
        dense = [estimate(dense_matmul, (m, h), (h, i), target=target),
                 estimate(dense_matmul, (m, i), (i, h), target=target)]
    else:
        h, i = d["H"], d["I"]
        fused = estimate(fused_svd_mlp, (m, h), (h, d["rank_gate"]), (d["rank_gate"], i), (h, d["rank_up"]),
                         (d["rank_up"], i), (i, d["rank_down"]), (d["rank_down"], h), target=target)
        dense = [estimate(dense_matmul, (m, h), (h, i), target=target),
                 estimate(dense_matmul, (m, h), (h, i), target=target),
                 estimate(silu_mul, (m, i), (m, i), target=target),
                 estimate(dense_matmul, (m, i), (i, h), target=target)]
    dense_s = sum(cost.total_s for cost in dense)
    dense_bytes = sum(cost.hbm_read_bytes + cost.hbm_write_bytes for cost in dense)
    return (fused.total_s * 1e6, dense_s * 1e6, (fused.hbm_read_bytes + fused.hbm_write_bytes) / 1e6,
            dense_bytes / 1e6)


def trace_for_neuron(module, example_inputs: tuple, workdir: Path, target: str):
    """torch_neuronx.trace of the lowered module (custom ops already on NeuronKernels): graph + NKI → NEFF."""
    import torch_neuronx

    os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    return torch_neuronx.trace(module, example_inputs, compiler_workdir=str(workdir),
                               compiler_args=["--target", target])
