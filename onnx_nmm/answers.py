"""Does a rewritten model still answer as the dense one does? Both answer a few check prompts greedily, and
the answers are compared token for token.

Perplexity can hide it: a compressed chat model may keep a passable perplexity and still stop answering
(SmolLM2-135M with 8 % of its MLP parameters removed by whitened SVD repeats "What is the capital of
France?" where the dense model says "The capital of France is Paris."). The prompts are general questions
no calibration text holds; each is asked as a user turn of the tokenizer's chat template, when it has one.
An answer agrees when it begins with the dense model's first COMPARED_TOKENS tokens (all of them, when the
dense answer is shorter). Some drift is expected of any compression, so the rewrite warns when half of the
answers or more diverge.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from onnx_nmm.decoding import Decoder
from onnx_nmm.generation import continuation, prompt_ids, stop_tokens

CHECK_PROMPTS = ("What is the capital of France?", "Why is the sky blue?", "How many legs does a spider have?",
                 "What do bees make?")
COMPARED_TOKENS = 8
# Answers beyond the compared tokens, kept for the report.
ANSWER_TOKENS = 16


@dataclass
class AnswerCheck:
    prompts: list[str]
    dense: list[str]  # the dense model's greedy answers
    rewritten: list[str]
    agreeing: list[bool]  # whether each answer begins with the dense answer's first COMPARED_TOKENS tokens

    @property
    def diverged(self) -> list[int]:
        return [i for i, agrees in enumerate(self.agreeing) if not agrees]

    def warning(self) -> str:
        """One line when half of the answers or more diverge, naming the first; "" otherwise."""
        if 2 * len(self.diverged) < len(self.prompts):
            return ""
        first = self.diverged[0]
        return (f"the rewritten model's greedy answers differ from the dense model's within {COMPARED_TOKENS} tokens "
                f"for {len(self.diverged)} of {len(self.prompts)} check prompts (e.g. {self.prompts[first]!r}: "
                f"{_shown(self.rewritten[first])} instead of {_shown(self.dense[first])}): keep more parameters "
                "(a larger --keep, or --max-ppl-increase) and check with `onnx-nmm generate`")

    def to_dict(self) -> dict:
        return asdict(self) | {"compared_tokens": COMPARED_TOKENS}


def check_answers(dense, rewritten, tokenizer, prompts: tuple[str, ...] = CHECK_PROMPTS) -> AnswerCheck:
    """Greedy answers of `dense` and `rewritten` (anything model_source.ModelSource takes) to `prompts`, with a
    loaded `tokenizer` (calibration_data.load_tokenizer)."""
    stops = stop_tokens(tokenizer)
    answers = []
    for model in (dense, rewritten):
        decoder = Decoder(model)
        answers.append([continuation(decoder, prompt_ids(tokenizer, prompt)[1], _greedy, stops, ANSWER_TOKENS)[0]
                        for prompt in prompts])
    agreeing = [rewritten[:len(dense[:COMPARED_TOKENS])] == dense[:COMPARED_TOKENS]
                for dense, rewritten in zip(*answers)]
    texts = [[tokenizer.decode(tokens, skip_special_tokens=True) for tokens in side] for side in answers]
    return AnswerCheck(list(prompts), texts[0], texts[1], agreeing)


def _greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def _shown(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "…")
