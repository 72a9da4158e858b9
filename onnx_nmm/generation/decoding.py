"""Generation's inner loop: a prefill over the prompt, then one step per new token, each step fed the cache
the step before left (causal_lm.CausalLm reads which input is what).

A model without a KV cache has nothing to carry over: each step reads the whole sequence again, which is
what generating with such a model costs. So does a merged decoder on the PyTorch backends, which lower the
branch its first step takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_nmm.model_source import ModelSource
from onnx_nmm.runtime.backend_runner import ModelRunner


@dataclass(frozen=True)
class DecoderState:
    """Where a sequence stands: its token ids so far and the cache they left (None: no cache)."""
    tokens: np.ndarray
    cache: dict[str, np.ndarray] | None


class Decoder:
    """A causal LM stepping through a sequence token by token, on onnxruntime CPU (`backend="ort"`) or on
    the PyTorch lowering (`"torch"`, `"emulator"`)."""

    def __init__(self, model, threads: int | None = None, backend: str = "ort", target: str = "trn2"):
        source = ModelSource.of(model)
        self.label = source.label
        self.runner = ModelRunner(source, backend, target, threads)
        self.model = self.runner.causal_lm
        self.vocabulary = self.model.vocabulary
        self.uses_cache = self.model.has_cache and not self.runner.first_step_only
        self.logits = self.runner.output_names[0]
        self.tokens = np.zeros((1, 0), np.int64)
        self.cache: dict[str, np.ndarray] | None = None

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Start a sequence with token ids [B, S]; the logits of its last position [B, vocabulary]."""
        self.tokens, self.cache = np.asarray(tokens, np.int64), None
        return self._run(self.tokens)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Append one token per sequence [B, 1]; the logits of the new position [B, vocabulary]."""
        tokens = np.asarray(tokens, np.int64).reshape(self.tokens.shape[0], 1)
        self.tokens = np.concatenate([self.tokens, tokens], axis=1)
        return self._run(tokens if self.uses_cache else self.tokens)

    @property
    def state(self) -> DecoderState:
        return DecoderState(self.tokens, self.cache)

    def resume(self, state: DecoderState) -> None:
        """Go back to where the sequence stood (a step never changes the arrays of a state it left)."""
        self.tokens, self.cache = state.tokens, state.cache

    def _run(self, new: np.ndarray) -> np.ndarray:
        outputs = self.runner(self.model.feeds(new, self.cache if self.uses_cache else None))
        if self.uses_cache:
            self.cache = self.model.cache_after(outputs)
        return outputs[self.logits][:, -1]
