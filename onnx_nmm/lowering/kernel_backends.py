"""Who computes the `ai.onnx_nmm` ops of a lowered model.

    torch      plain PyTorch math in the model's dtype: the reference for the lowering itself;
    emulator   the NKI kernels of onnx_nmm.kernels on the NumPy emulator, in bfloat16, as on Trainium;
    neuron     the same @nki.jit kernels on XLA tensors, for torch_neuronx.trace (needs the Neuron SDK).

Every backend runs an op as `run(node, op, x, *inputs, activation=...)`, the inputs in the op's order; the
kernel backends launch the op's kernel in onnx_nmm.kernel_table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from onnx_nmm.kernel_table import KernelSpec, kernel_spec
from onnx_nmm.passes import svd_ops

BACKENDS = ("torch", "emulator", "neuron")
# The MLP ops' activations (svd_ops.ACTIVATIONS) in PyTorch.
ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda gate: torch.nn.functional.gelu(gate, approximate="tanh"),
}


@dataclass
class KernelCall:
    """One kernel launch, kept for the report: which kernel, on which shapes."""

    node: str
    kernel: str
    shapes: tuple[tuple[int, ...], ...]


class TorchMath:
    """Each op's arithmetic in PyTorch, in the model's dtype."""

    name = "torch"

    def run(self, node: str, op: str, x, *inputs, activation: str = "silu"):
        return _TORCH_MATH[op](x, *inputs, act=ACTIVATIONS[activation])


def _svd_matmul(x, u, v, bias=None, act=None):
    y = torch.matmul(torch.matmul(x, u), v)
    return y + bias if bias is not None else y


def _svd_gated_mlp(x, ug, vg, uu, vu, ud, vd, act):
    gate = torch.matmul(torch.matmul(x, ug), vg)
    up = torch.matmul(torch.matmul(x, uu), vu)
    return torch.matmul(torch.matmul(act(gate) * up, ud), vd)


def _svd_mlp(x, u1, v1, b1, u2, v2, b2, act):
    hidden = act(torch.matmul(torch.matmul(x, u1), v1) + b1)
    return torch.matmul(torch.matmul(hidden, u2), v2) + b2


def _gated_mlp(x, wg, wu, wd, act):
    return torch.matmul(act(torch.matmul(x, wg)) * torch.matmul(x, wu), wd)


def _mlp(x, w1, b1, w2, b2, act):
    return torch.matmul(act(torch.matmul(x, w1) + b1), w2) + b2


_TORCH_MATH: dict[str, Callable[..., torch.Tensor]] = {
    svd_ops.SVD_MATMUL: _svd_matmul, svd_ops.SVD_GATED_MLP: _svd_gated_mlp, svd_ops.SVD_MLP: _svd_mlp,
    svd_ops.GATED_MLP: _gated_mlp, svd_ops.MLP: _mlp}


class _KernelLaunches(ABC):
    """An op as its kernel in onnx_nmm.kernel_table: X flattened to [tokens, features], the kernel launched on it
    and the op's weights, the output bias added after, the leading dimensions restored."""

    @abstractmethod
    def _launch(self, node: str, spec: KernelSpec, rows: torch.Tensor, weights, options: dict[str, str]
                ) -> torch.Tensor:
        """The kernel of `spec` on `rows` [tokens, features] and the op's weights: [tokens, outputs]."""

    def run(self, node: str, op: str, x, *inputs, activation: str = "silu"):
        spec = kernel_spec(op)
        weights, bias = spec.split(inputs)
        options = {"activation": activation} if spec.activation else {}
        rows = self._launch(node, spec, x.reshape(-1, x.shape[-1]), weights, options)
        y = rows.to(x.dtype).reshape(*x.shape[:-1], rows.shape[-1])
        return y + bias if bias is not None else y


@dataclass
class EmulatorKernels(_KernelLaunches):
    """The kernels on the emulator, in bfloat16; `calls` records every launch."""

    target: str = "trn2"
    name: str = "emulator"
    calls: list[KernelCall] = field(default_factory=list)

    def _launch(self, node, spec, rows, weights, options):
        import ml_dtypes

        from onnx_nmm import kernels

        arrays = [t.detach().to(torch.float32).cpu().numpy().astype(ml_dtypes.bfloat16) for t in (rows, *weights)]
        self.calls.append(KernelCall(node, spec.kernel, tuple(a.shape for a in arrays)))
        y = kernels.run(getattr(kernels, spec.kernel), *arrays, target=self.target, **options)
        return torch.from_numpy(y.astype("float32"))


@dataclass
class NeuronKernels(_KernelLaunches):
    """The @nki.jit kernels called on XLA tensors inside a torch_neuronx trace (bfloat16 inside).

    Block sizes are planned on the host from the static shapes, so the kernel body runs no planning code.
    """

    target: str = "trn2"
    name: str = "neuron"

    def _launch(self, node, spec, rows, weights, options):
        from onnx_nmm import kernels

        plan = spec.plan(rows.shape[0], spec.dims([tuple(w.shape) for w in weights]), self.target)
        operands = [t.to(torch.bfloat16) for t in (rows, *weights)]
        return getattr(kernels, spec.kernel)(*operands, plan=plan, **options)


def backend_named(name: str, target: str = "trn2"):
    if name == "torch":
        return TorchMath()
    if name == "emulator":
        return EmulatorKernels(target=target)
    if name == "neuron":
        return NeuronKernels(target=target)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
