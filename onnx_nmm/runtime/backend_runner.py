"""Run a model on any backend: onnxruntime, or the PyTorch lowering with its custom ops on a kernel backend.

    ort        onnxruntime on CPU (the reference);
    torch      the lowered module, the ai.onnx_nmm ops as plain torch math (fp32);
    emulator   the lowered module, the ai.onnx_nmm ops on the NKI kernels on the emulator (bf16).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnx_nmm.errors import DataError, OptionError
from onnx_nmm.kernels.pricing.hardware import TRAINIUM_TARGETS
from onnx_nmm.model_io import make_public
from onnx_nmm.model_source import ModelSource
from onnx_nmm.runtime import ort_runner
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.graph_probe import first_step
from onnx_nmm.teacher import CALIBRATION

RUN_BACKENDS = ("ort", "torch", "emulator")

Model = str | os.PathLike | ir.Model | onnx.ModelProto


class ModelRunner:
    """A model prepared once for a backend; call it with {input name: array}, get {output name: array}.

    `kernel_calls` lists the kernel launches so far (emulator backend only).
    """

    def __init__(self, model: Model | ModelSource, backend: str = "ort", target: str = "trn2",
                 threads: int | None = None):
        check_backend(backend, target)
        source = ModelSource.of(model)
        self.backend, self.label = backend, source.label
        self.calibrated = CALIBRATION in source.model.metadata_props  # a rewrite fitted to calibration data
        graph = source.model.graph
        self.input_names = [value.name or "" for value in graph.inputs if not value.is_initializer()]
        self.output_names = [value.name or "" for value in graph.outputs]
        self.causal_lm = CausalLm.of_source(source)  # the inputs by their meaning (token ids, mask, KV cache)
        self.vocabulary = self.causal_lm.vocabulary
        self.session = source.session(threads)  # the reference, and the input specs for every backend
        self.kernels = None
        self.first_step_only = False  # a merged decoder lowered as the branch its first step takes
        if backend != "ort":
            from onnx_nmm.lowering import backend_named, lower

            self.kernels = backend_named(backend, target)
            proto = source.full_proto()
            nodes = len(proto.graph.node)
            proto = first_step(proto)
            self.first_step_only = len(proto.graph.node) != nodes
            self.module = lower(proto, self.kernels)
            if threads:
                import torch

                torch.set_num_threads(threads)

    @property
    def kernel_calls(self) -> list:
        return getattr(self.kernels, "calls", [])

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in inputs]
        if missing:
            raise DataError(f"{self.label} takes input(s) {', '.join(missing)}, which were not given (given: "
                            f"{', '.join(inputs) or 'nothing'})")
        if self.backend == "ort":
            return ort_runner.run(self.session, inputs)
        import torch

        from onnx_nmm.lowering import call_lowered

        result = call_lowered(self.module, *(torch.from_numpy(np.ascontiguousarray(inputs[name]))
                                             for name in self.input_names))
        results = result if isinstance(result, (tuple, list)) else (result,)
        return {name: tensor.numpy() for name, tensor in zip(self.output_names, results)}

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """The first output (the logits of a causal LM) for token ids [B, S], after an empty cache."""
        return self(self.causal_lm.feeds(tokens))[self.output_names[0]]

    def random_tokens(self, batch: int, length: int, seed: int) -> np.ndarray:
        return self.causal_lm.random_tokens(batch, length, seed)

    def inputs(self, inputs: str | os.PathLike | dict[str, np.ndarray] | None, batch: int, seq_len: int,
               seed: int) -> dict[str, np.ndarray]:
        """Feeds for this model: read from an .npz, given as arrays, or random token ids [batch, seq_len].

        Given token ids alone are completed as a causal LM's feeds (mask, positions, the cache given or an
        empty one), so an .npz of input_ids runs a KV-cache model too."""
        if inputs is None:
            return self.causal_lm.random_feeds(batch, seq_len, seed)
        given = inputs if isinstance(inputs, dict) else ort_runner.load_inputs(inputs)
        missing = [name for name in self.input_names if name not in given]
        tokens = self.causal_lm.tokens
        if missing and tokens is not None and tokens.name in given:
            cache_names = [entry.input.name for entry in self.causal_lm.cache]
            cache = {name: given[name] for name in cache_names} if all(name in given for name in cache_names) else None
            given = {**self.causal_lm.feeds(np.asarray(given[tokens.name]), cache), **given}
            missing = [name for name in self.input_names if name not in given]
        if missing:
            where = inputs if not isinstance(inputs, dict) else "the inputs given"
            raise DataError(f"model input(s) {', '.join(missing)} not in {where}, which holds "
                            f"{', '.join(given) or 'nothing'}: give them all, or a causal LM's token ids alone")
        return {name: given[name] for name in self.input_names}


def check_backend(backend: str, target: str) -> None:
    if backend not in RUN_BACKENDS:
        raise OptionError(f"{{backend}} must be one of {', '.join(RUN_BACKENDS)}, got {backend!r}", backend="backend")
    if target not in TRAINIUM_TARGETS:
        raise OptionError(f"{{target}} must be one of {', '.join(TRAINIUM_TARGETS)}, got {target!r}", target="target")


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    kernel_calls: list = field(default_factory=list)  # lowering.KernelCall per launch (emulator backend)

    def save(self, path: str | os.PathLike) -> Path:
        """The outputs as an .npz (keys = output names) at `path`, named as given, through a temporary file renamed
        into place: an interrupted save leaves no partial file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".onnx-nmm-", suffix=".npz", delete=False) as file:
            staged = Path(file.name)
            try:
                np.savez(file, allow_pickle=False, **self.outputs)
            except BaseException:
                staged.unlink()
                raise
        make_public(staged)
        staged.replace(path)
        return path


def run_model(model: Model, inputs: str | os.PathLike | dict[str, np.ndarray] | None = None, backend: str = "ort",
              target: str = "trn2", batch: int = 1, seq_len: int = 16, seed: int = 0) -> RunResult:
    """One forward pass of `model` on `backend`: on `inputs` (an .npz or arrays), or on random token ids."""
    if batch < 1 or seq_len < 1:
        raise OptionError("{batch} and {seq_len} must be positive", batch="batch", seq_len="seq_len")
    runner = ModelRunner(model, backend, target)
    outputs = runner(runner.inputs(inputs, batch, seq_len, seed))
    return RunResult(outputs, list(runner.kernel_calls))
