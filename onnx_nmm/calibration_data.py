"""Where calibration and evaluation tokens come from: a text file, an .npz of inputs, or random ids.

Text is tokenized once with a Hugging Face tokenizer (a tokenizer folder, or a GGUF file whose
tokenizer transformers can read) and cut into non-overlapping windows of `seq_len` tokens.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnx_nmm.errors import UserError

RANDOM = "random"


@dataclass
class TokenWindows:
    """`samples` sequences of `seq_len` token ids, and where they came from."""

    tokens: np.ndarray  # [samples, seq_len], int64
    description: str

    def batches(self, batch_size: int):
        for start in range(0, len(self.tokens), batch_size):
            yield self.tokens[start:start + batch_size]

    @property
    def token_count(self) -> int:
        return int(self.tokens.size)


def load_tokenizer(spec: str | os.PathLike):
    """A transformers tokenizer from a folder, or from a GGUF file (its folder and file name)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError("reading text needs transformers: pip install 'onnx-nmm[export]'") from None
    path = Path(spec)
    if not path.exists():
        raise UserError(f"tokenizer {spec}: no such file or folder; give a tokenizer folder or a .gguf file")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if path.is_file():
                return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            return AutoTokenizer.from_pretrained(str(path))
    except Exception as error:
        raise UserError(f"cannot load a tokenizer from {spec}: {str(error).splitlines()[0]}") from None


def text_tokens(path: str | os.PathLike, tokenizer) -> np.ndarray:
    """All token ids of a text file, as one sequence."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"text file {path}: no such file")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UserError(f"text file {path} is empty")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sequence longer than the model's maximum": we cut it ourselves
        return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def windows_from_text(path: str | os.PathLike, tokenizer, samples: int | None, seq_len: int,
                      spread: bool = False) -> TokenWindows:
    """Non-overlapping windows of `seq_len` tokens: consecutive from the start of the text, or with `spread`,
    evenly spaced over the whole of it (a long text's opening need not look like the rest)."""
    ids = text_tokens(path, tokenizer)
    available = len(ids) // seq_len
    if available == 0:
        raise UserError(f"{path} holds {len(ids)} tokens, fewer than one window of {seq_len}; use a longer text "
                        "or a smaller --seq-len")
    count = available if samples is None else min(samples, available)
    if samples is not None and samples > available:
        warnings.warn(f"{path} has only {available} windows of {seq_len} tokens; using {available}, not {samples}")
    windows = ids[: available * seq_len].reshape(available, seq_len)
    picks = np.linspace(0, available - 1, count).round().astype(int) if spread else np.arange(count)
    where = f"spread over all {available}" if spread and count < available else "from the start"
    return TokenWindows(windows[picks], f"{path}: {count} windows of {seq_len} tokens, {where}")


def windows_from_npz(path: str | os.PathLike, samples: int | None) -> TokenWindows:
    """Token ids from an .npz holding `input_ids` [samples, seq_len]."""
    try:
        with np.load(path) as archive:
            if "input_ids" not in archive.files:
                raise UserError(f"{path} has no 'input_ids' array (it has {', '.join(archive.files) or 'nothing'})")
            ids = np.asarray(archive["input_ids"], dtype=np.int64)
    except UserError:
        raise
    except Exception as error:
        raise UserError(f"cannot read {path}: {error}; give an .npz saved with numpy.savez") from None
    if ids.ndim != 2:
        raise UserError(f"{path}: input_ids must be [samples, seq_len], got shape {list(ids.shape)}")
    ids = ids if samples is None else ids[:samples]
    return TokenWindows(ids, f"{path}: {len(ids)} sequences of {ids.shape[1]} tokens")


def random_windows(vocab: int, samples: int, seq_len: int, seed: int = 0) -> TokenWindows:
    warnings.warn("calibrating on random token ids: fine for tests, meaningless for quality; use --calib TEXT")
    ids = np.random.default_rng(seed).integers(0, vocab, size=(samples, seq_len), dtype=np.int64)
    return TokenWindows(ids, f"random: {samples} sequences of {seq_len} tokens")


def calibration_windows(source: str, tokenizer: str | None, samples: int | None, seq_len: int,
                        vocab: int | None = None, spread: bool = False) -> TokenWindows:
    """Windows from `--calib SOURCE`: a text file (with --tokenizer; `spread` over it or from its start), an
    .npz, or `random`."""
    if source == RANDOM:
        if vocab is None:
            raise UserError("random calibration needs the vocabulary size")
        return random_windows(vocab, samples or 16, seq_len)
    if source.endswith(".npz"):
        return windows_from_npz(source, samples)
    if tokenizer is None:
        raise UserError(f"--calib {source} is text: give its tokenizer with --tokenizer (a folder or a .gguf file)")
    return windows_from_text(source, load_tokenizer(tokenizer), samples, seq_len, spread)
