"""Does a rewritten model still answer as the dense one does? Both answer a few check prompts greedily, and
the rewritten model is asked how likely it finds the dense model's answers.

Perplexity on a text can hide it: a compressed chat model may keep a passable perplexity and still stop
answering (SmolLM2-135M with 8 % of its MLP parameters removed by whitened SVD answers "What is the capital
of France?" with "The capital of France is France." where the dense model says "... is Paris."). The prompts
are general questions no calibration text holds, each asked as a user turn of the tokenizer's chat
template when it has one.

Greedy answers are brittle: any compression rewords some of them ("Bees make honey, ..." for "Bees are
incredibly complex creatures ..."), and rewording is not forgetting. What the check measures is the drop,
in nats per token, of the log-likelihood of the dense model's answer under the rewritten model against
the dense model's own (teacher-forced on prompt and answer): a model that rewords keeps the dense answer
likely, one that stopped answering does not. On SmolLM2 the mean over the prompts was 0.36–0.76 for
narrowed MLPs that reword (7.8 % to 14 % of the MLP parameters removed) and 1.85 for the whitened rewrite
above; past MAX_ANSWER_DROP the rewrite warns. It warns as well when most greedy answers no longer begin with
the dense answer's first COMPARED_TOKENS tokens: the drop does not tell a reworded answer from a wrong one
("The sky is not blue, it's a shade of gray" came with a drop of 0.56), so the answers are then worth reading.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from onnx_nmm.generation.decoding import Decoder
from onnx_nmm.generation.generate import continuation, prompt_ids, stop_tokens
from onnx_nmm.quality.metrics import log_softmax
from onnx_nmm.runtime.backend_runner import ModelRunner

CHECK_PROMPTS = ("What is the capital of France?", "Why is the sky blue?", "How many legs does a spider have?",
                 "What do bees make?")
ANSWER_TOKENS = 16
COMPARED_TOKENS = 8
MAX_ANSWER_DROP = 1.0  # nats per token, the mean over the prompts


@dataclass
class AnswerCheck:
    prompts: list[str]
    dense: list[str]  # the dense model's greedy answers
    rewritten: list[str]
    drops: list[float]  # per prompt: log-likelihood of the dense answer, dense minus rewritten, nats per token
    same_start: list[bool]  # whether each greedy answer begins with the dense one's first COMPARED_TOKENS tokens

    @property
    def mean_drop(self) -> float:
        return float(np.mean(self.drops))

    @property
    def diverging(self) -> int:
        return self.same_start.count(False)

    def warning(self) -> str:
        """One line when the rewritten model no longer gives the dense model's answers; "" otherwise."""
        unlikely, diverged = self.mean_drop > MAX_ANSWER_DROP, 2 * self.diverging > len(self.prompts)
        if not (unlikely or diverged):
            return ""
        shown = [i for i, same in enumerate(self.same_start) if not same] or range(len(self.prompts))
        worst = max(shown, key=lambda i: self.drops[i])
        what = (f"finds the dense model's answers to {len(self.prompts)} check prompts {self.mean_drop:.2f} nats per "
                f"token less likely (more than {MAX_ANSWER_DROP:g})" if unlikely else
                f"answers {self.diverging} of {len(self.prompts)} check prompts otherwise than the dense model "
                f"from the first {COMPARED_TOKENS} tokens")
        return (f"the rewritten model {what}: it answers {self.prompts[worst]!r} with "
                f"{_shown(self.rewritten[worst])} instead of {_shown(self.dense[worst])}; read its answers with "
                "`onnx-nmm generate`, and if they are wrong keep more parameters (a larger --keep, or a smaller "
                "--max-ppl-increase)")

    def to_dict(self) -> dict:
        return asdict(self) | {"mean_drop": self.mean_drop, "compared_tokens": COMPARED_TOKENS,
                               "max_answer_drop": MAX_ANSWER_DROP}


def check_answers(dense, rewritten, tokenizer, prompts: tuple[str, ...] = CHECK_PROMPTS) -> AnswerCheck:
    """Greedy answers of `dense` and `rewritten` (anything model_source.ModelSource takes) to `prompts`, and how
    likely the rewritten model finds the dense answers; `tokenizer` loaded (calibration_data.load_tokenizer)."""
    stops = stop_tokens(tokenizer)
    asked = [prompt_ids(tokenizer, prompt)[1] for prompt in prompts]
    answers, likelihoods = [], []
    for model in (dense, rewritten):
        decoder = Decoder(model)
        answers.append([continuation(decoder, ids, _greedy, stops, ANSWER_TOKENS)[0] for ids in asked])
        likelihoods.append([_answer_log_likelihood(decoder.runner, ids, answer)
                            for ids, answer in zip(asked, answers[0])])
        del decoder  # one model's session at a time
    drops = [float(d - r) for d, r in zip(*likelihoods)]
    same = [rewritten[:len(dense[:COMPARED_TOKENS])] == dense[:COMPARED_TOKENS] for dense, rewritten in zip(*answers)]
    texts = [[tokenizer.decode(tokens, skip_special_tokens=True) for tokens in side] for side in answers]
    return AnswerCheck(list(prompts), texts[0], texts[1], drops, same)


def _answer_log_likelihood(runner: ModelRunner, prompt: np.ndarray, answer: list[int]) -> float:
    """Mean log-probability per token of `answer` after `prompt` (teacher-forced, one pass)."""
    if not answer:
        return 0.0
    sequence = np.concatenate([prompt, np.asarray(answer, np.int64)])[None]
    log_probs = log_softmax(runner.logits(sequence)[0].astype(np.float64))
    positions = np.arange(len(prompt) - 1, sequence.shape[1] - 1)
    return float(log_probs[positions, sequence[0, positions + 1]].mean())


def _greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def _shown(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "…")
