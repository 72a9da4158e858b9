"""Calibration text the model writes itself: `--calib generated[:N]`.

A book calibrates the model for that book. Windows sampled from the dense model represent what the model
does in general — its own distribution of text — so statistics, quality budgets and distillation learned
from them are not tied to one corpus (docs/quality.md measures the difference).

Each window starts with the tokenizer's BOS token (`start_token`; without one, the end-of-text token that
separates pretraining documents) and continues with
`seq_len − 1` tokens sampled from softmax(logits / temperature) restricted to the nucleus holding `top_p`
of the probability (Holtzman et al., 2020). Windows are generated `batch` at a time through the KV cache
when the model has one (onnx_nmm.generation.decoding; without one every step re-reads the sequence, which costs
O(seq_len²): hours for 64 windows of 256 tokens of SmolLM2, so the time it will take is estimated and said
before it starts, with the way round it — a `generator` export with a cache). Batch b samples with its own seed
(`seed` + b), so a window depends only on the options and its position, and generating more windows
keeps the first ones. An end-of-text token mid-window is kept: the model then starts a new document, as
in its training data.

Generated windows are cached on disk (ONNX_NMM_CACHE, default ~/.cache/onnx-nmm) under a key made of the
generating model file (path, size, modification time) and the options: a second rewrite or a fine-tuning
of the same model reads them back instead of generating them again.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from onnx_nmm.calibration.sources import GENERATED, GeneratedText
from onnx_nmm.calibration.tokens import TokenWindows, load_tokenizer
from onnx_nmm.errors import DataError, OptionError

NUCLEUS_CANDIDATES = 1024  # tokens sorted at a sampling step when they hold the nucleus


def start_token(tokenizer) -> int:
    """The token a generated window starts with: the tokenizer's BOS (SmolLM2's is "<|im_start|>", and its
    windows read as general prose nonetheless), else the end-of-text token that separates pretraining
    documents ("<|endoftext|>": GPT-2's, Qwen's), else EOS."""
    if getattr(tokenizer, "bos_token_id", None) is not None:
        return int(tokenizer.bos_token_id)
    if "<|endoftext|>" in tokenizer.get_vocab():
        return int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        return int(tokenizer.eos_token_id)
    raise DataError("the tokenizer has neither a BOS nor an end-of-text token to start generated windows with")


def generated_windows(text: GeneratedText, model, seq_len: int, tokenizer=None, samples: int | None = None,
                      on_batch: Callable[[], None] | None = None, prompts: TokenWindows | None = None
                      ) -> TokenWindows:
    """`samples` (default text.samples) windows of `seq_len` tokens sampled from `text.generator` or `model`;
    `on_batch()` after each batch of them, generated or read from the cache. With `prompts` (at least `samples`
    windows of fewer than `seq_len` tokens), window i continues prompt i instead of starting from one token."""
    samples = samples or text.samples
    writer = text.generator if text.generator is not None else model
    if prompts is not None:
        if len(prompts.tokens) < samples or prompts.tokens.shape[1] >= seq_len:
            raise DataError(f"{samples} generated windows of {seq_len} tokens continue {len(prompts.tokens)} "
                            f"prompts of {prompts.tokens.shape[1]} tokens: give more prompts, or shorter ones")
        starts = prompts.tokens[:text.batches(samples) * text.batch]
    else:
        first = text.start_token
        if first is None:
            if tokenizer is None:
                raise OptionError("generated windows start with the tokenizer's BOS token: give the "
                                  "{tokenizer}", tokenizer="calibration.tokenizer")
            first = start_token(load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike))
                                else tokenizer)
        starts = np.full((text.batches(samples) * text.batch, 1), first, np.int64)  # whole batches
    cache = _cache_file(writer, text, seq_len, starts)
    cached = [_cached_batch(cache, b) if cache is not None else None for b in range(text.batches(samples))]
    to_sample = sum(row is None for row in cached)
    decoder = _decoder(writer, text, seq_len, starts, to_sample) if to_sample else None
    rows = []
    for b, row in enumerate(cached):
        if row is None:
            assert decoder is not None, "a decoder is made when a batch is to be sampled"
            row = sample_batch(decoder, text, seq_len, starts[b * text.batch:(b + 1) * text.batch], b)
            if cache is not None:
                _store_batch(cache, b, row)
        rows.append(row)
        if on_batch is not None:
            on_batch()
    tokens = np.concatenate(rows)[:samples]
    described = GeneratedText(**{**text.__dict__, "samples": samples}).describe(seq_len)
    if prompts is not None:
        described += f", continuing prompts of {prompts.tokens.shape[1]} tokens of {prompts.description}"
    return TokenWindows(tokens, described, [f"{GENERATED}#{i}" for i in range(samples)])


def _decoder(model, text: GeneratedText, seq_len: int, starts: np.ndarray, batches: int):
    """A Decoder of `model` to sample `batches` batches with; for a model without a KV cache, which re-reads the
    whole sequence at every step, first a warning of how long that will take and how to go faster."""
    from onnx_nmm.generation.decoding import Decoder

    decoder = Decoder(model)
    if not decoder.uses_cache:
        seconds = _cache_free_sampling_seconds(decoder, text, seq_len, int(starts[0, 0])) * batches
        warnings.warn(f"{decoder.label} has no KV cache, so sampling {batches * text.batch} windows of {seq_len} "
                      f"tokens re-reads the whole sequence at every step: about {_duration(seconds)} (estimated from "
                      "one pass). An export of the same model with a KV cache (onnx-nmm export writes one) as the "
                      "generator samples them far faster: --calib-generator, or --generator for finetune; or give a "
                      "text instead of generated windows", stacklevel=3)
    return decoder


def _cache_free_sampling_seconds(decoder, text: GeneratedText, seq_len: int, first: int) -> float:
    """About how long one batch takes on `decoder`, a model without a cache, from one timed pass: the batch's
    seq_len − 1 steps each re-read the sequence so far, half a window on average, and a pass costs about in
    proportion to its length."""
    start = time.perf_counter()
    decoder.prefill(np.full((text.batch, max(1, seq_len // 2)), first, np.int64))
    return (time.perf_counter() - start) * (seq_len - 1)


def _duration(seconds: float) -> str:
    """"40 s", "12 min", "3 h 20 min"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def sample_batch(decoder, text: GeneratedText, seq_len: int, starts: np.ndarray, index: int) -> np.ndarray:
    """Batch `index`: windows [len(starts), seq_len] sampled with `decoder` (a generation.decoding.Decoder) after
    their first tokens `starts` [rows, P], seeded by text.seed + index."""
    rng = np.random.default_rng(text.seed + index)
    tokens = np.asarray(starts, np.int64)
    logits = decoder.prefill(tokens)
    while tokens.shape[1] < seq_len:
        new = sample_nucleus(logits, text.temperature, text.top_p, rng)
        tokens = np.concatenate([tokens, new[:, None]], axis=1)
        if tokens.shape[1] < seq_len:
            logits = decoder.step(new[:, None])
    return tokens


def sample_nucleus(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> np.ndarray:
    """One token per row of `logits` [B, V]: softmax(logits / temperature) restricted to the most likely tokens
    whose mass reaches top_p (the one crossing it included)."""
    scaled = logits.astype(np.float64) / temperature
    probabilities = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    order = _most_likely_first(probabilities, top_p)
    sorted_p = np.take_along_axis(probabilities, order, axis=-1)
    before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the more likely tokens
    sorted_p = np.where(before < top_p, sorted_p, 0.0)
    sorted_p /= sorted_p.sum(axis=-1, keepdims=True)
    picks = (sorted_p.cumsum(axis=-1) < rng.random((len(logits), 1))).sum(axis=-1)
    return order[np.arange(len(logits)), np.minimum(picks, order.shape[-1] - 1)].astype(np.int64)


def _most_likely_first(probabilities: np.ndarray, top_p: float) -> np.ndarray:
    """Token ids of each row, the most likely first: the NUCLEUS_CANDIDATES most likely when they hold the
    nucleus (top_p of the mass) in every row, else all of them. Sorting a 150k vocabulary at every step took
    three times as long as the model's step on Qwen2.5-0.5B; the nucleus is rarely more than a few hundred."""
    if probabilities.shape[-1] > NUCLEUS_CANDIDATES:
        candidates = np.argpartition(-probabilities, NUCLEUS_CANDIDATES - 1, axis=-1)[:, :NUCLEUS_CANDIDATES]
        mass = np.take_along_axis(probabilities, candidates, axis=-1)
        if (mass.sum(axis=-1) >= top_p).all():
            return np.take_along_axis(candidates, np.argsort(-mass, axis=-1), axis=-1)
    return np.argsort(-probabilities, axis=-1)


def _cache_file(model, text: GeneratedText, seq_len: int, starts: np.ndarray) -> Path | None:
    """Where the batches of this model, these options and these first tokens are cached; None for a model held
    in memory."""
    path = getattr(model, "path", model)  # a ModelSource's file
    if not isinstance(path, (str, os.PathLike)) or os.environ.get("ONNX_NMM_CACHE") == "off":
        return None
    path = Path(path).resolve()
    if not path.is_file():
        return None
    stat = path.stat()
    # windows from one start token keep the key they always had; prompted ones add their prompts' digest
    first = str(int(starts[0, 0])) if starts.shape[1] == 1 and (starts == starts[0, 0]).all() \
        else hashlib.sha256(np.ascontiguousarray(starts, np.int64).tobytes()).hexdigest()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{seq_len}|{first}|{text.temperature}|{text.top_p}|" \
          f"{text.seed}|{text.batch}"
    root = Path(os.environ.get("ONNX_NMM_CACHE", Path.home() / ".cache" / "onnx-nmm"))
    return root / "generated" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _cached_batch(folder: Path, index: int) -> np.ndarray | None:
    path = folder / f"batch{index}.npy"
    return np.load(path) if path.is_file() else None


def _store_batch(folder: Path, index: int, tokens: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    staged = folder / f".batch{index}.{os.getpid()}.npy"
    np.save(staged, tokens)
    staged.replace(folder / f"batch{index}.npy")
