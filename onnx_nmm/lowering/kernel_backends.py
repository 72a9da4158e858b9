"""Who computes the `ai.onnx_nmm` ops of a lowered model.

    torch      plain PyTorch math in the model's dtype: the reference for the lowering itself;
    emulator   the NKI kernels of onnx_nmm.kernels on the NumPy emulator, in bfloat16, as on Trainium;
    neuron     the same @nki.jit kernels on XLA tensors, for torch_neuronx.trace (needs the Neuron SDK).

Kernels take x as [tokens, features]: leading dimensions are flattened on the way in and restored
on the way out; an output bias is added after the kernel, in the model's dtype (SvdMLP's first bias comes
before its activation, so the kernel adds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    name = "torch"

    def svd_matmul(self, node: str, x, u, v, bias=None):
        y = torch.matmul(torch.matmul(x, u), v)
        return y + bias if bias is not None else y

    def gated_mlp(self, node: str, x, ug, vg, uu, vu, ud, vd, activation: str = "silu"):
        gate = torch.matmul(torch.matmul(x, ug), vg)
        up = torch.matmul(torch.matmul(x, uu), vu)
        return torch.matmul(torch.matmul(ACTIVATIONS[activation](gate) * up, ud), vd)

    def mlp(self, node: str, x, u1, v1, b1, u2, v2, b2, activation: str):
        hidden = ACTIVATIONS[activation](torch.matmul(torch.matmul(x, u1), v1) + b1)
        return torch.matmul(torch.matmul(hidden, u2), v2) + b2

    def dense_gated_mlp(self, node: str, x, wg, wu, wd, activation: str = "silu"):
        return torch.matmul(ACTIVATIONS[activation](torch.matmul(x, wg)) * torch.matmul(x, wu), wd)

    def dense_mlp(self, node: str, x, w1, b1, w2, b2, activation: str):
        return torch.matmul(ACTIVATIONS[activation](torch.matmul(x, w1) + b1), w2) + b2


@dataclass
class EmulatorKernels:
    """The fused kernels on the emulator, in bfloat16; `calls` records every launch."""

    target: str = "trn2"
    name: str = "emulator"
    calls: list[KernelCall] = field(default_factory=list)

    def svd_matmul(self, node: str, x, u, v, bias=None):
        from onnx_nmm.kernels import fused_xuv

        y = self._launch(node, "fused_xuv", fused_xuv, x, u, v)
        return y + bias if bias is not None else y

    def gated_mlp(self, node: str, x, ug, vg, uu, vu, ud, vd, activation: str = "silu"):
        from onnx_nmm.kernels import fused_svd_mlp

        return self._launch(node, "fused_svd_mlp", fused_svd_mlp, x, ug, vg, uu, vu, ud, vd, activation=activation)

    def mlp(self, node: str, x, u1, v1, b1, u2, v2, b2, activation: str):
        from onnx_nmm.kernels import fused_svd_ungated_mlp

        return self._launch(node, "fused_svd_ungated_mlp", fused_svd_ungated_mlp, x, u1, v1, b1, u2, v2,
                            activation=activation) + b2

    def dense_gated_mlp(self, node: str, x, wg, wu, wd, activation: str = "silu"):
        from onnx_nmm.kernels import dense_gated_mlp

        return self._launch(node, "dense_gated_mlp", dense_gated_mlp, x, wg, wu, wd, activation=activation)

    def dense_mlp(self, node: str, x, w1, b1, w2, b2, activation: str):
        from onnx_nmm.kernels import dense_ungated_mlp

        return self._launch(node, "dense_ungated_mlp", dense_ungated_mlp, x, w1, b1, w2, activation=activation) + b2

    def _launch(self, node, name, kernel, x, *factors, **options):
        import ml_dtypes

        from onnx_nmm.kernels import run

        rows = x.reshape(-1, x.shape[-1])
        arrays = [t.detach().to(torch.float32).cpu().numpy().astype(ml_dtypes.bfloat16) for t in (rows, *factors)]
        self.calls.append(KernelCall(node, name, tuple(a.shape for a in arrays)))
        y = run(kernel, *arrays, target=self.target, **options)
        return torch.from_numpy(y.astype("float32")).to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


@dataclass
class NeuronKernels:
    """The @nki.jit kernels called on XLA tensors inside a torch_neuronx trace (bfloat16 inside).

    Block sizes are planned on the host from the static shapes, so the kernel body runs no planning code.
    """

    target: str = "trn2"
    name: str = "neuron"

    def svd_matmul(self, node: str, x, u, v, bias=None):
        from onnx_nmm.kernels import fused_xuv
        from onnx_nmm.kernels.blocking import plan_xuv

        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        plan = plan_xuv(rows.shape[0], u.shape[0], u.shape[1], v.shape[1], "bfloat16", target=self.target)
        y = fused_xuv(rows, u.to(torch.bfloat16), v.to(torch.bfloat16), plan=plan)
        y = y.to(x.dtype).reshape(*x.shape[:-1], v.shape[1])
        return y + bias if bias is not None else y

    def gated_mlp(self, node: str, x, ug, vg, uu, vu, ud, vd, activation: str = "silu"):
        from onnx_nmm.kernels import fused_svd_mlp
        from onnx_nmm.kernels.blocking import plan_mlp

        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        plan = plan_mlp(rows.shape[0], ug.shape[0], vg.shape[1], ug.shape[1], uu.shape[1], ud.shape[1], "bfloat16",
                        target=self.target)
        factors = [t.to(torch.bfloat16) for t in (ug, vg, uu, vu, ud, vd)]
        return fused_svd_mlp(rows, *factors, plan=plan, activation=activation).to(x.dtype).reshape(x.shape)

    def mlp(self, node: str, x, u1, v1, b1, u2, v2, b2, activation: str):
        from onnx_nmm.kernels import fused_svd_ungated_mlp
        from onnx_nmm.kernels.blocking import plan_ungated_mlp

        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        plan = plan_ungated_mlp(rows.shape[0], u1.shape[0], v1.shape[1], u1.shape[1], u2.shape[1], "bfloat16",
                                target=self.target)
        factors = [t.to(torch.bfloat16) for t in (u1, v1, b1, u2, v2)]
        y = fused_svd_ungated_mlp(rows, *factors, plan=plan, activation=activation)
        return y.to(x.dtype).reshape(x.shape) + b2

    def dense_gated_mlp(self, node: str, x, wg, wu, wd, activation: str = "silu"):
        from onnx_nmm.kernels import dense_gated_mlp
        from onnx_nmm.kernels.blocking import plan_dense_mlp

        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        plan = plan_dense_mlp(rows.shape[0], wg.shape[0], wg.shape[1], True, "bfloat16", target=self.target)
        weights = [t.to(torch.bfloat16) for t in (wg, wu, wd)]
        return dense_gated_mlp(rows, *weights, plan=plan, activation=activation).to(x.dtype).reshape(x.shape)

    def dense_mlp(self, node: str, x, w1, b1, w2, b2, activation: str):
        from onnx_nmm.kernels import dense_ungated_mlp
        from onnx_nmm.kernels.blocking import plan_dense_mlp

        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        plan = plan_dense_mlp(rows.shape[0], w1.shape[0], w1.shape[1], False, "bfloat16", target=self.target)
        weights = [t.to(torch.bfloat16) for t in (w1, b1, w2)]
        return dense_ungated_mlp(rows, *weights, plan=plan, activation=activation).to(x.dtype).reshape(x.shape) + b2


def backend_named(name: str, target: str = "trn2"):
    if name == "torch":
        return TorchMath()
    if name == "emulator":
        return EmulatorKernels(target=target)
    if name == "neuron":
        return NeuronKernels(target=target)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
