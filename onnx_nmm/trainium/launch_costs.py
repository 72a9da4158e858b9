"""What one launch costs on a NeuronCore (modelled), and the choices made from it: whether an MLP runs as its
one fused kernel or as its projections launched one by one, the activation between them; and the best dense
path of a layer, what every modelled speed-up is against.

A kernel's cost comes from the kernels' cost model (a trace of the kernel at that shape, memoized); an op that
is no kernel of ours (an activation between projections) is priced by a roofline on the same NeuronCore:
max(bytes / DMA bandwidth, TensorE FLOPs / TensorE peak, elementwise work / VectorE rate). Costs are
(seconds, HBM bytes, FLOPs), in bfloat16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from onnx_nmm.kernel_table import kernel_spec

ELEMENT_BYTES = 2  # bfloat16
Cost = tuple[float, float, float]  # seconds, HBM bytes, FLOPs


@functools.cache
def kernel_cost(kernel: str, shapes: tuple, target: str) -> Cost:
    """A launch of `kernel` (its name in onnx_nmm.kernels) on inputs of `shapes`, modelled."""
    import onnx_nmm.kernels as kernels

    cost = kernels.estimate(getattr(kernels, kernel), *shapes, dtype="bfloat16", target=target)
    return cost.total_s, cost.hbm_bytes, cost.flops


def roofline(bytes_: float, target: str, tensor_flops: float = 0.0, elementwise: float = 0.0) -> Cost:
    """One op at its physical limit on one NeuronCore."""
    from onnx_nmm.kernels.pricing.hardware import neuron_core

    core = neuron_core(target)
    seconds = max(bytes_ / core.dma_bytes_per_s, tensor_flops / core.pe_bf16_flops,
                  elementwise / (core.partitions * core.dve_hz))
    return seconds, bytes_, tensor_flops


def activation_cost(width: int, gated: bool, tokens: int, target: str) -> Cost:
    """An MLP activation run between its projections (act(g)·u read from and written to HBM), at its roofline."""
    return roofline(bytes_=ELEMENT_BYTES * (3 if gated else 2) * tokens * width, target=target,
                    elementwise=3 * tokens * width)


@dataclass(frozen=True)
class MlpChoice:
    """An MLP op at `tokens` rows: its fused kernel's cost against its projections' launches and activation and,
    for a factorized MLP, against the dense MLP kernel on its factors multiplied back (`dense`)."""

    op: str
    kernel: str  # the fused kernel
    separately: str  # what runs instead: "3 fused_xuv", "2 dense_matmul", ...
    tokens: int
    fused: Cost
    separate: Cost
    dense: Cost | None = None
    dense_kernel: str | None = None

    @property
    def ways(self) -> dict[str, tuple[str, Cost]]:
        """Each way to run the MLP ("fused", "separate", "dense" for a factorized one): what runs, and its cost."""
        ways = {"fused": (self.kernel, self.fused), "separate": (self.separately, self.separate)}
        if self.dense is not None:
            ways["dense"] = (f"{self.dense_kernel} on the factors multiplied back", self.dense)
        return ways

    @property
    def way(self) -> str:
        """The fastest way (a tie goes to the one listed first: the fused kernel, then the launches one by one)."""
        return min(self.ways, key=lambda way: self.ways[way][1][0])

    @property
    def fuse(self) -> bool:
        """One op for the MLP (its fused kernel, or the dense MLP kernel it becomes when densified)."""
        return self.way != "separate"

    @property
    def densify(self) -> bool:
        return self.way == "dense"

    @property
    def cost(self) -> Cost:
        return self.ways[self.way][1]

    def to_dict(self) -> dict:
        return {"op": self.op, "tokens": self.tokens, "fused": self.fuse, "densified": self.densify,
                "chose": self.ways[self.way][0], "fused_us": self.fused[0] * 1e6, "separate_us": self.separate[0] * 1e6,
                **({"dense_us": self.dense[0] * 1e6} if self.dense is not None else {})}

    def reason(self) -> str:
        """Why the MLP stays unfused, in the words of the fusion report."""
        return (f"{self.separately} launches are faster than one {self.kernel} at {self.tokens} tokens: "
                f"{self.separate[0] * 1e6:.1f} µs against {self.fused[0] * 1e6:.1f} µs (modelled)")


def choose_mlp_kernel(op: str, dims: dict[str, int], tokens: int, target: str) -> MlpChoice:
    """The fastest way to run an MLP op (onnx_nmm.kernel_table) at `tokens` rows on `target`, modelled: its fused
    kernel, its projections one by one, or (a factorized MLP) the dense MLP kernel on its factors' products."""
    spec = kernel_spec(op)
    launches = spec.separate_launches(tokens, dims)
    fused = kernel_cost(spec.kernel, spec.shapes(tokens, dims), target)
    parts = [kernel_cost(kernel, shapes, target) for kernel, shapes in launches]
    parts.append(activation_cost(dims["I"], spec.gated, tokens, target))
    seconds, bytes_, flops = (sum(values) for values in zip(*parts))
    dense, dense_kernel = None, None
    if spec.dense_op is not None and spec.dense_op != op:
        dense_spec = kernel_spec(spec.dense_op)
        dense_kernel = dense_spec.kernel
        dense = kernel_cost(dense_kernel, dense_spec.shapes(tokens, _dense_mlp_dims(dims)), target)
    return MlpChoice(op, spec.kernel, f"{len(launches)} {launches[0][0]}", tokens, fused, (seconds, bytes_, flops),
                     dense, dense_kernel)


def best_dense_cost(op: str, dims: dict[str, int], tokens: int, target: str) -> Cost:
    """The fastest way to run the layer(s) an op stands for with their dense weights (modelled): dense_matmul for a
    factorized layer; for an MLP the faster of the dense MLP kernel and its dense projections one by one."""
    spec = kernel_spec(op)
    if spec.dense_op is None:
        (x, w), = spec.dense_products(tokens, dims)
        return kernel_cost("dense_matmul", (x, w), target)
    return choose_mlp_kernel(spec.dense_op, _dense_mlp_dims(dims), tokens, target).cost


def _dense_mlp_dims(dims: dict[str, int]) -> dict[str, int]:
    """A factorized MLP's sizes as its dense op takes them (its ranks dropped)."""
    return {"H": dims["H"], "I": dims["I"]}
