"""compile's check against the model it was given: a compiled folder must generate what that model generates.

    the model as given, its own dynamic cache, onnxruntime CPU   ─┐ one prompt, then the reference's greedy
    the folder's prefill and decode graphs, lowered to PyTorch    ─┘ tokens fed to both, a step at a time;
      (what `generate DIR --backend torch` runs, and what           each step's logits compared
       the Neuron trace is made from)

The lowering check compares each static graph with itself on onnxruntime, so it cannot see a static graph that
computes something else than the model: positions or masks derived from a cache that is now always full, a
write at the wrong position. This check can. The prompt stops two tokens short of the smallest bucket and the
steps run past it, so that the decode steps cross from the positions a prefill wrote to those they wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_nmm.errors import GenerationMismatch
from onnx_nmm.model_source import ModelSource
from onnx_nmm.quality import metrics
from onnx_nmm.runtime import ort_runner
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.static_cache import StaticCache, StaticDecoder
from onnx_nmm.trainium.compile_steps import source_reference_session

DECODE_STEPS = 4
# Wrong positions or masks move logits by a good part of their range; padding and float rounding by ~1e-5 of it.
GENERATION_ATOL_SCALE = 1e-3


@dataclass(frozen=True)
class GenerationCheck:
    """How far the compiled graphs' logits were from the model's, step by step (the prefill is step 0), and the
    greedy tokens each would have picked."""

    prompt_tokens: int
    max_abs: list[float]
    tolerance: float
    reference_tokens: list[int]
    compiled_tokens: list[int]

    def to_dict(self) -> dict:
        return {"against": "the model as given, onnxruntime CPU, dynamic cache", "prompt_tokens": self.prompt_tokens,
                "steps": len(self.max_abs) - 1, "max_abs": max(self.max_abs), "per_step_max_abs": self.max_abs,
                "tolerance": self.tolerance, "tokens_agree": self.reference_tokens == self.compiled_tokens}


def check_generation(source: ModelSource, graphs: StaticCache) -> GenerationCheck:
    """Run `source` and the compiled `graphs` (on the torch backend) on one prompt; GenerationMismatch when a
    step's logits differ beyond the tolerance."""
    prompt_tokens = max(1, min(graphs.buckets[0], graphs.max_context - DECODE_STEPS) - 2)
    prompt, expected = _reference_steps(source, prompt_tokens)
    compiled = StaticDecoder(graphs, backend="torch")
    actual = [compiled.prefill(prompt)]
    for logits in expected[:-1]:
        actual.append(compiled.step(_greedy(logits)))
    tolerance = GENERATION_ATOL_SCALE * max(float(np.abs(logits).max()) for logits in expected)
    differences = [metrics.compare("logits", want, got).max_abs for want, got in zip(expected, actual)]
    check = GenerationCheck(prompt_tokens, differences, tolerance,
                            [int(logits.argmax()) for logits in expected], [int(logits.argmax()) for logits in actual])
    worst = int(np.argmax(differences))
    if differences[worst] > tolerance:
        step = "the prefill" if worst == 0 else f"decode step {worst} (position {prompt_tokens + worst - 1})"
        raise GenerationMismatch(
            f"the compiled graphs generate other text than {source.label}: at {step} of a {prompt_tokens}-token "
            f"prompt their logits differ by {differences[worst]:.3g} (tolerance {tolerance:.2g}; greedy tokens "
            f"{check.compiled_tokens} against {check.reference_tokens}); nothing was written. The static cache "
            "cannot reproduce this model: please report it with the model")
    return check


def _reference_steps(source: ModelSource, prompt_tokens: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """A random prompt of `prompt_tokens`, and the logits of the model as given on it, then on each of its greedy
    tokens, DECODE_STEPS of them. Run before the compiled graphs are lowered, so that onnxruntime's session of
    the model is let go first: the two are never in memory at once."""
    reference = _Reference(source)
    prompt = reference.model.random_tokens(1, prompt_tokens, seed=0)
    logits = [reference.prefill(prompt)]
    for _ in range(DECODE_STEPS):
        logits.append(reference.step(_greedy(logits[-1])))
    return prompt, logits


def _greedy(logits: np.ndarray) -> np.ndarray:
    """The token [1, 1] the logits of one position pick."""
    return logits.argmax(-1).reshape(1, 1)


class _Reference:
    """The model as given on onnxruntime, its own dynamic cache carried from step to step (int4 weights computed
    in float, as the compiled graphs compute them: compile_steps.float_reference)."""

    def __init__(self, source: ModelSource):
        self.session = source_reference_session(source)
        self.model = CausalLm.of_source(source)
        self.logits = self.session.get_outputs()[0].name
        self.cache: dict[str, np.ndarray] | None = None

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        self.cache = None
        return self.step(tokens)

    def step(self, new: np.ndarray) -> np.ndarray:
        """The logits of the last of the token ids `new` [1, n], after the cache so far."""
        outputs = ort_runner.run(self.session, self.model.feeds(new, self.cache))
        self.cache = self.model.cache_after(outputs)
        return outputs[self.logits][:, -1]
