"""Token ids in windows (`TokenWindows`), and the tokenizer that makes them from text (`load_tokenizer`)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnx_nmm.errors import DataError, MissingDependencyError


@dataclass
class TokenWindows:
    """`samples` sequences of `seq_len` token ids, and where they came from."""

    tokens: np.ndarray  # [samples, seq_len], int64
    description: str
    ids: list[str] = field(default_factory=list)  # one name per window, saying where it came from ("kjv.txt#12")

    def __post_init__(self):
        if not self.ids:  # none given: the source the description names, and the row
            self.ids = [f"{self.description.split(':')[0]}#{i}" for i in range(len(self.tokens))]

    def take(self, rows) -> TokenWindows:
        """The windows at `rows` (indices), with their ids."""
        rows = list(rows)
        return TokenWindows(self.tokens[rows], self.description, [self.ids[i] for i in rows])

    def batches(self, batch_size: int):
        for start in range(0, len(self.tokens), batch_size):
            yield self.tokens[start:start + batch_size]

    @property
    def token_count(self) -> int:
        return int(self.tokens.size)


# A folder holding one of these is one transformers reads a tokenizer from.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
GGUF_MAGIC = b"GGUF"  # the first bytes of every GGUF file


def is_tokenizer_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder holding a tokenizer (one of TOKENIZER_MARKERS)."""
    return Path(path).is_dir() and any((Path(path) / name).is_file() for name in TOKENIZER_MARKERS)


def check_tokenizer(spec: str | os.PathLike) -> None:
    """Refuse a tokenizer path that is missing, a folder without a tokenizer, or a file that is not a GGUF one:
    cheap, so said before a model loads rather than after."""
    path = Path(spec)
    if not path.exists():
        raise DataError(f"tokenizer {spec}: no such file or folder; give a tokenizer folder or a .gguf file")
    if path.is_dir() and not is_tokenizer_folder(path):
        raise DataError(f"tokenizer {spec} is a folder without a tokenizer (none of {', '.join(TOKENIZER_MARKERS)}); "
                        "give the folder of the model's tokenizer or its .gguf file")
    if path.is_file() and not _is_gguf(path):
        raise DataError(f"tokenizer {spec} is a file but not a GGUF one; give the folder that holds the tokenizer, "
                        "or a .gguf file")


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def load_tokenizer(spec: str | os.PathLike):
    """A transformers tokenizer from a folder, or from a GGUF file (its folder and file name)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise MissingDependencyError("reading text needs transformers: pip install 'onnx-nmm[export]'") from None
    check_tokenizer(spec)
    path = Path(spec)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if path.is_file():
                return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            return AutoTokenizer.from_pretrained(str(path))
    except Exception as error:
        raise DataError(f"cannot load a tokenizer from {spec}: {str(error).splitlines()[0]}") from None
