"""Fisher statistics: how much the model's predictions depend on each target layer's outputs.

For a linear layer y = x·W inside the model, K-FAC (Martens & Grosse, 2015) approximates the Fisher
information of the model's next-token distributions with respect to W by a Kronecker product of two
Gram matrices over the T calibration tokens,

    F ≈ A ⊗ G,     A = Σ_t x_t x_tᵀ  (the layer's inputs, K×K),     G = Σ_t g_t g_tᵀ  (N×N),

where g_t = ∂ℓ/∂y_t is the gradient of a window's log-loss ℓ with respect to the layer's output, with the
next tokens *sampled from the model's own distribution*: that makes F the Fisher, the curvature of the KL
divergence to the dense model (the empirical Fisher of the text's own tokens did slightly worse on
SmolLM2 in a side experiment). A change ΔW of the weight then raises the mean KL divergence per token
by about

    ΔKL ≈ ½ tr(ΔWᵀ A ΔW G) / T²  =  ½ ‖Sᵀ·ΔW·T_G‖_F² / T²          (A = S Sᵀ, G = T_G T_Gᵀ)

so the factors that minimise it come from the truncated SVD of Sᵀ·W·T_G (onnx_nmm.decomposition.whitening, two-sided),
and the singular values left out predict, in nats, what each rank of each layer costs. That is a
yardstick shared by all layers, which input-only whitening (each layer's error relative to its own
output) is not: it is what `--budget global` spends parameters by when these statistics are there.

Both Grams are gathered in one pass over the calibration windows through the model lowered to PyTorch
(onnxruntime has no backward pass): a forward hook on each target's node adds its input's xᵀx and asks
its output for its gradient, which adds gᵀg. Products are float32 within a batch; A sums in float64
across batches, G in float32. G is damped by a tenth of its mean diagonal before it is factorized
(onnx_nmm.decomposition.whitening), so float32's seven digits are more than it needs, and it is the bigger half: on
Qwen2.5-0.5B the 48 gate and up outputs are 4864 wide, 4.5 GB of G in float32 against 9.1 GB in float64.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from onnx_nmm.calibration.activation_stats import GramStatistics
from onnx_nmm.errors import DataError, ExecutionError, ModelError
from onnx_nmm.passes import LinearLayer

if TYPE_CHECKING:
    from onnx_nmm.model_source import ModelSource


def predicted_kl(truncated_energy: float, tokens: int) -> float:
    """½ ‖Sᵀ·ΔW·T_G‖_F² / T²: the mean KL divergence per token that a weight error of this weighted
    energy adds, to second order."""
    return 0.5 * truncated_energy / tokens**2


def collect_fisher_statistics(source: ModelSource, layers: list[LinearLayer], batches: Iterable[np.ndarray],
                              description: str = "", seed: int = 0,
                              on_batch: Callable[[int], None] | None = None) -> GramStatistics:
    """Input Grams (by input value name) and output-gradient Grams (by layer name) of `layers`, over the
    token-id windows [B, S] of `batches`, for the causal LM `source` (its original model).

    Raises ExecutionError if a Gram is not finite, ModelError if a layer's output does not reach the loss.
    """
    import torch
    import torch.nn.functional as F

    from onnx_nmm.lowering import CausalLmInputs, lower, modules_by_output
    from onnx_nmm.runtime.graph_probe import first_step

    module = lower(first_step(source.full_proto()), consume=True)
    producers = modules_by_output(module)
    inputs = CausalLmInputs(source)
    input_grams = {layer.x.name: _Sum(torch.float64) for layer in layers}
    output_grams = {layer.name: _Sum(torch.float32) for layer in layers}
    observed: set[str] = set()  # inputs already counted in this batch (gate and up share one)

    def watch(layer: LinearLayer):
        def hook(_module, arguments, output):
            if layer.x.name not in observed:
                observed.add(layer.x.name)
                input_grams[layer.x.name].add(arguments[0])
            if not output.requires_grad:  # the first target from the input side: start the backward pass here
                output.requires_grad_(True)
            output.register_hook(output_grams[layer.name].add)
        return hook

    handles = []
    for layer in layers:
        node_module = producers.get(layer.node.outputs[0].name)
        if node_module is None:
            raise RuntimeError(f"the lowering has no module computing {layer.name}")
        handles.append(node_module.register_forward_hook(watch(layer)))
    generator = torch.Generator().manual_seed(seed)
    tokens = 0
    try:
        for batch in batches:
            observed.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # onnx2torch's internal deprecations, which say nothing about the model
                logits = module(*inputs(batch))
            logits = (logits[0] if isinstance(logits, (tuple, list)) else logits).float()
            with torch.no_grad():
                sampled = torch.multinomial(torch.softmax(logits.flatten(0, 1), dim=-1), 1, generator=generator)
            F.cross_entropy(logits.flatten(0, 1), sampled.flatten(), reduction="sum").backward()
            tokens += int(batch.size)
            if on_batch is not None:
                on_batch(int(batch.size))
    finally:
        for handle in handles:
            handle.remove()
    if tokens == 0:
        raise DataError("the calibration set is empty")
    return GramStatistics(grams=_finished(input_grams, "input"), tokens=tokens, description=description,
                          output_grams=_finished(output_grams, "output-gradient"))


class _Sum:
    """Σ rowsᵀ·rows over the batches of a [..., width] tensor: float32 products, a total of `dtype`."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.total = None  # a torch tensor once the first batch is in

    def add(self, values) -> None:
        rows = values.detach().reshape(-1, values.shape[-1]).float()
        if self.total is None:
            self.total = (rows.T @ rows).to(self.dtype)
        elif self.dtype == rows.dtype:
            self.total.addmm_(rows.T, rows)  # in place: no second width² buffer
        else:
            self.total += rows.T @ rows


def _finished(sums: dict[str, _Sum], kind: str) -> dict[str, np.ndarray]:
    for name, total in sums.items():
        if total.total is None:
            raise ModelError(f"no {kind} Gram was gathered for '{name}': its output does not reach the model's "
                             "first output (the logits)")
        if not bool(total.total.diagonal().isfinite().all()):
            raise ExecutionError(f"the {kind} Gram of '{name}' is not finite (NaN or Inf): the model overflows on "
                                 "these inputs; check the calibration data, or run in float32")
    return {name: total.total.numpy() for name, total in sums.items()}
