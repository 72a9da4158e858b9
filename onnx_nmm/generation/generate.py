"""Text generation: a prompt through the tokenizer (and its chat template), a prefill, then one token at a
time from the KV cache until the end-of-sequence token or the token limit.

Greedy by default; with a temperature, tokens are sampled from the softmax of logits / temperature,
restricted to the smallest set of tokens whose probabilities add up to top_p (nucleus sampling).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnx_nmm.calibration.calibration_data import check_token_ids
from onnx_nmm.calibration.tokens import is_tokenizer_folder, load_tokenizer
from onnx_nmm.errors import DataError, OptionError
from onnx_nmm.generation.decoding import Decoder
from onnx_nmm.model_io import check_model_path
from onnx_nmm.model_source import ModelSource
from onnx_nmm.runtime import compiled_folder
from onnx_nmm.runtime.backend_runner import Model, check_backend
from onnx_nmm.runtime.static_cache import StaticDecoder


@dataclass(frozen=True)
class GenerateOptions:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy, the most likely token every step
    top_p: float = 1.0
    seed: int = 0
    chat: bool = True  # the prompt as a user turn of the tokenizer's chat template, when it has one
    backend: str = "ort"
    target: str = "trn2"
    threads: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise OptionError("{max_new_tokens} must be at least 1", max_new_tokens="max_new_tokens")
        if self.temperature < 0:
            raise OptionError("{temperature} must be 0 (greedy) or positive", temperature="temperature")
        if not 0 < self.top_p <= 1:
            raise OptionError("{top_p} must be in (0, 1]", top_p="top_p")
        if self.backend != "neuron":  # a compiled folder's traces (generate checks it is one)
            check_backend(self.backend, self.target)


@dataclass
class Generation:
    prompt: str  # the prompt as the model read it (chat template applied)
    prompt_tokens: int
    tokens: list[int]  # the new token ids, the end-of-sequence token not included
    text: str
    stopped_by: str  # "eos" or "max_new_tokens"
    first_token_s: float  # tokenized prompt to first new token: the prefill
    decode_s: float  # every later token

    @property
    def decode_tokens_per_s(self) -> float | None:
        steps = len(self.tokens) - 1 + (self.stopped_by == "eos")
        return steps / self.decode_s if steps and self.decode_s > 0 else None

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
                "text": self.text, "stopped_by": self.stopped_by, "first_token_s": self.first_token_s,
                "decode_s": self.decode_s, "decode_tokens_per_s": self.decode_tokens_per_s}


def generate(model: Model, prompt: str, tokenizer: str | os.PathLike | None = None,
             options: GenerateOptions = GenerateOptions(),
             on_text: Callable[[str], None] | None = None) -> Generation:
    """Continue `prompt` with `model`; `on_text` receives the new text piece by piece as it is decoded.

    `model` may be a folder `compile --max-context` wrote: its static-shape graphs then run, the prompt padded to
    the smallest bucket that holds it, each new token one decode step over the fixed-size cache.
    `tokenizer`: a tokenizer folder or a .gguf file; by default the model's folder when it holds one (as an
    onnxruntime-genai folder and a compiled folder do)."""
    if not prompt.strip():
        raise DataError("the prompt is empty; give some text to continue")
    path = Path(model) if isinstance(model, (str, os.PathLike)) else None
    compiled = path if path is not None and compiled_folder.is_compiled_folder(path) else None
    if path is not None and compiled is None:
        check_model_path(path)
    if options.backend == "neuron" and compiled is None:
        raise OptionError("the neuron {backend} runs the traces of a compiled folder (compile with {max_context} on "
                          "a machine with the Neuron SDK); give that folder", backend="backend",
                          max_context="max_context")
    # the tokenizer before the model: a wrong one is said in a second, not after the model has loaded
    loaded = load_tokenizer(tokenizer if tokenizer is not None else _tokenizer_in(compiled or _folder_of(model)))
    decoder: Decoder | StaticDecoder
    if compiled is not None:
        decoder = StaticDecoder(compiled_folder.read(compiled)[1], options.backend, options.target, options.threads)
    else:
        decoder = Decoder(ModelSource.of(model), options.threads, options.backend, options.target)
    prompt, ids = prompt_ids(loaded, prompt, options.chat)
    check_token_ids(ids, decoder.vocabulary, "the prompt", decoder.label)
    if isinstance(decoder, StaticDecoder):
        decoder.graphs.check_fits(ids.size, options.max_new_tokens)
    stream = _TextStream(loaded, on_text)
    new, stopped_by, first_token_s, decode_s = continuation(decoder, ids, _sampler(options), stop_tokens(loaded),
                                                            options.max_new_tokens, stream.add)
    stream.finish(new)
    return Generation(prompt, int(ids.size), new, loaded.decode(new, skip_special_tokens=True), stopped_by,
                      first_token_s, decode_s)


def prompt_ids(tokenizer, prompt: str, chat: bool = True) -> tuple[str, np.ndarray]:
    """The prompt as the model reads it (as a user turn of the tokenizer's chat template, when it has one and
    `chat`), and its token ids."""
    templated = chat and bool(getattr(tokenizer, "chat_template", None))
    if templated:  # the template writes the special tokens itself
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    ids = np.asarray(tokenizer(prompt, add_special_tokens=not templated)["input_ids"], np.int64)
    if ids.size == 0:
        raise DataError("the prompt is empty; give some text to continue")
    return prompt, ids


def continuation(decoder: Decoder | StaticDecoder, ids: np.ndarray, pick: Callable[[np.ndarray], int], stops: set[int],
                 max_new_tokens: int, on_tokens: Callable[[list[int]], None] | None = None
                 ) -> tuple[list[int], str, float, float]:
    """The new tokens after `ids` (a prefill, then one step a token), how it stopped ("eos" or
    "max_new_tokens"), and the seconds to the first token and for the rest."""
    start = time.perf_counter()
    token = pick(decoder.prefill(ids[None])[0])
    first_token_s = time.perf_counter() - start
    new: list[int] = []
    stopped_by = "max_new_tokens"
    start = time.perf_counter()
    while True:
        if token in stops:
            stopped_by = "eos"
            break
        new.append(token)
        if on_tokens is not None:
            on_tokens(new)
        if len(new) == max_new_tokens:
            break
        token = pick(decoder.step(np.array([[token]]))[0])
    return new, stopped_by, first_token_s, time.perf_counter() - start


def _folder_of(model) -> Path | None:
    """The folder of the model's file, where its tokenizer may be; None for a model held in memory."""
    path = model if isinstance(model, (str, os.PathLike)) else getattr(model, "path", None)
    return Path(path).parent if path is not None else None


def _tokenizer_in(folder: Path | None) -> Path:
    if folder is None or not is_tokenizer_folder(folder):
        raise DataError("generating needs a {tokenizer}: a tokenizer folder or a .gguf file", tokenizer="tokenizer")
    return folder


def stop_tokens(tokenizer) -> set[int]:
    """The token ids that end an answer: the EOS, and the end-of-turn token of a chat template."""
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    # A chat template ends a turn with its own token (<|im_end|>, <|eot_id|>, <end_of_turn>), not always the EOS.
    for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        token = tokenizer.convert_tokens_to_ids(name)
        if isinstance(token, int) and token != tokenizer.unk_token_id:
            stops.add(token)
    return stops


def _sampler(options: GenerateOptions) -> Callable[[np.ndarray], int]:
    """The rule that turns a position's logits into the next token id."""
    if options.temperature == 0:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(options.seed)

    def sample(logits: np.ndarray) -> int:
        scaled = logits.astype(np.float64) / options.temperature
        probabilities = np.exp(scaled - scaled.max())
        probabilities /= probabilities.sum()
        order = np.argsort(-probabilities)
        # The nucleus: the most likely tokens until their mass reaches top_p (the one crossing it included).
        nucleus = order[: int(np.searchsorted(np.cumsum(probabilities[order]), options.top_p)) + 1]
        kept = probabilities[nucleus] / probabilities[nucleus].sum()
        return int(rng.choice(nucleus, p=kept))

    return sample


class _TextStream:
    """Hands out the new text as tokens arrive. A token can end inside a multi-byte character, which the
    tokenizer decodes as U+FFFD until the next token completes it: such text waits."""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None):
        self.tokenizer, self.on_text, self.sent = tokenizer, on_text, 0

    def add(self, tokens: list[int]) -> None:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if self.on_text is not None and not text.endswith("\ufffd") and len(text) > self.sent:
            self.on_text(text[self.sent:])
            self.sent = len(text)

    def finish(self, tokens: list[int]) -> None:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if self.on_text is not None and len(text) > self.sent:
            self.on_text(text[self.sent:])
