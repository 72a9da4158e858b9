"""Generation's inner loop in onnxruntime: a prefill over the prompt, then one step per new token, each step
fed the cache the step before left (causal_lm.CausalLm reads which input is what).

A model without a KV cache has nothing to carry over: each step reads the whole sequence again, which is
what generating with such a model costs.
"""

from __future__ import annotations

import numpy as np

from onnx_nmm import ort_runner
from onnx_nmm.causal_lm import CausalLm
from onnx_nmm.model_source import ModelSource


class Decoder:
    """A causal LM on onnxruntime CPU, stepping through a sequence token by token."""

    def __init__(self, model, threads: int | None = None):
        source = ModelSource.of(model)
        self.label = source.label
        self.model = CausalLm.of_source(source)
        self.session = source.session(threads)
        self.logits = self.session.get_outputs()[0].name
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
        return self._run(tokens if self.model.has_cache else self.tokens)

    def _run(self, new: np.ndarray) -> np.ndarray:
        outputs = ort_runner.run(self.session, self.model.feeds(new, self.cache))
        if self.model.has_cache:
            self.cache = self.model.cache_after(outputs)
        return outputs[self.logits][:, -1]
