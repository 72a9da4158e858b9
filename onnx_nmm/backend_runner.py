"""Run a model on any backend: onnxruntime, or the PyTorch lowering with its custom ops on a kernel backend.

    ort        onnxruntime on CPU (the reference);
    torch      the lowered module, SvdMatMul/SvdGatedMLP as plain torch math (fp32);
    emulator   the lowered module, SvdMatMul/SvdGatedMLP on the NKI kernels on the emulator (bf16).
"""

from __future__ import annotations

import os

import numpy as np
import onnx

from onnx_nmm import ort_runner
from onnx_nmm.errors import UserError

RUN_BACKENDS = ("ort", "torch", "emulator")


class ModelRunner:
    """A model prepared once for a backend; call it with {input name: array}, get {output name: array}.

    `kernel_calls` lists the kernel launches so far (emulator backend only).
    """

    def __init__(self, path: str | os.PathLike, backend: str = "ort", target: str = "trn2"):
        if backend not in RUN_BACKENDS:
            raise UserError(f"unknown backend {backend!r}; choose from {', '.join(RUN_BACKENDS)}")
        self.backend = backend
        graph = onnx.load(str(path), load_external_data=False).graph
        initializers = {tensor.name for tensor in graph.initializer}
        self.input_names = [value.name for value in graph.input if value.name not in initializers]
        self.output_names = [value.name for value in graph.output]
        self.session = ort_runner.create_session(path)  # the reference, and the input specs for every backend
        self.kernels = None
        if backend != "ort":
            from onnx_nmm.lowering import backend_named, lower

            self.kernels = backend_named(backend, target)
            self.module = lower(path, self.kernels)

    @property
    def kernel_calls(self) -> list:
        return getattr(self.kernels, "calls", [])

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in inputs]
        if missing:
            raise UserError(f"no value given for model input(s) {', '.join(missing)}")
        if self.backend == "ort":
            return ort_runner.run(self.session, inputs)
        import torch

        from onnx_nmm.lowering import call_lowered

        result = call_lowered(self.module, *(torch.from_numpy(np.ascontiguousarray(inputs[name]))
                                             for name in self.input_names))
        results = result if isinstance(result, (tuple, list)) else (result,)
        return {name: tensor.numpy() for name, tensor in zip(self.output_names, results)}

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """The first output (the logits of a causal LM) for token ids [B, S]."""
        return self(ort_runner.token_inputs(self.session, tokens))[self.output_names[0]]
