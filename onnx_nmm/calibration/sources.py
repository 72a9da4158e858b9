"""What a calibration source is, decided in one place (`calibration_source`), as a typed value:

    TextFile        a text file, read with a tokenizer and cut into windows
    TokenIdsFile    an .npz holding input_ids [samples, seq_len]
    StatisticsFile  an .npz of statistics saved by an earlier rewrite (no tokens)
    RandomTokens    "random": random token ids (tests only)
    GeneratedText   "generated[:N]": windows the model writes itself
    TokenArray      token ids [samples, seq_len] given as an array

Options, the calibration data and the CLI take what `calibration_source` made and ask it what it is; nothing
else looks at a source's spelling or suffix, so a new kind is added here once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np

from onnx_nmm.errors import OptionError

RANDOM = "random"


@dataclass(frozen=True)
class _SourceFile:
    """A source read from a file, named by its path as given."""

    path: str | os.PathLike

    def __str__(self) -> str:
        return str(self.path)


class TextFile(_SourceFile):
    """A text, read with a tokenizer and cut into windows."""


class TokenIdsFile(_SourceFile):
    """An .npz holding input_ids [samples, seq_len]."""


class StatisticsFile(_SourceFile):
    """An .npz of statistics an earlier rewrite saved."""


@dataclass(frozen=True)
class RandomTokens:
    def __str__(self) -> str:
        return RANDOM


@dataclass(frozen=True, eq=False)
class TokenArray:
    ids: np.ndarray = field(repr=False)

    def __str__(self) -> str:
        return "token ids"


def calibration_source(raw) -> CalibrationSource:
    """What `raw` (a path, "random", "generated[:N]", an array of token ids, or one of the typed sources) is; an
    .npz is opened to tell token ids from saved statistics."""
    if isinstance(raw, (TextFile, TokenIdsFile, StatisticsFile, RandomTokens, TokenArray, GeneratedText)):
        return raw
    generated = parse_generated(raw)
    if generated is not None:
        return generated
    if not isinstance(raw, (str, os.PathLike)):
        return TokenArray(np.asarray(raw))
    if str(raw) == RANDOM:
        return RandomTokens()
    if not str(raw).endswith(".npz"):
        return TextFile(raw)
    from onnx_nmm.calibration.activation_stats import GramStatistics

    return StatisticsFile(raw) if GramStatistics.is_statistics_file(raw) else TokenIdsFile(raw)


def calibration_sources(raw) -> tuple[CalibrationSource, ...]:
    """One source or several (a list or tuple; an array is one source of token ids), each as calibration_source
    makes it."""
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise OptionError("{source} is an empty list: give at least one text, token ids or generated:N",
                              source="calibration.source")
        return tuple(calibration_source(item) for item in raw)
    return (calibration_source(raw),)


GENERATED = "generated"
DEFAULT_GENERATED_SAMPLES = 64
_SPEC = re.compile(rf"^{GENERATED}(?::(\d+))?$")


@dataclass(frozen=True)
class GeneratedText:
    """A token source sampled from a model: `samples` windows of the calibration's `seq_len` tokens.

    generator:   the model that writes (default: the model being rewritten, or the teacher of a
                 fine-tuning); another export of the same model, e.g. one with a KV cache, is faster
    start_token: the id each window starts with (default: the tokenizer's BOS, else its end-of-text token)
    """

    samples: int = DEFAULT_GENERATED_SAMPLES
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    batch: int = 8
    generator: str | os.PathLike | None = None
    start_token: int | None = None

    def __post_init__(self):
        for name in ("samples", "batch"):
            if getattr(self, name) < 1:
                raise OptionError(f"{{{name}}} of generated text must be a positive integer, got "
                                  f"{getattr(self, name)}", **{name: f"generated.{name}"})
        if not self.temperature > 0:
            raise OptionError(f"{{temperature}} must be positive, got {self.temperature}",
                              temperature="generated.temperature")
        if not 0 < self.top_p <= 1:
            raise OptionError(f"{{top_p}} must be in (0, 1], got {self.top_p}", top_p="generated.top_p")

    @classmethod
    def from_spec(cls, source) -> GeneratedText | None:
        """"generated" or "generated:N" as generated text; None for any other source."""
        return parse_generated(source)

    def describe(self, seq_len: int) -> str:
        return (f"{GENERATED}: {self.samples} windows of {seq_len} tokens sampled from the model (temperature "
                f"{self.temperature:g}, top-p {self.top_p:g}, seeds {self.seed}–{self.seed + self.batches() - 1})")

    def batches(self, samples: int | None = None) -> int:
        """How many batches `samples` windows (default: its own count) are generated in."""
        return -(-(samples or self.samples) // self.batch)


def parse_generated(source) -> GeneratedText | None:
    """`source` as generated text when it is "generated" or "generated:N" (or already a GeneratedText)."""
    if isinstance(source, GeneratedText):
        return source
    if not isinstance(source, str):
        return None
    match = _SPEC.match(source.strip())
    if match is None:
        if source.strip().startswith(GENERATED + ":"):
            raise OptionError(f"{source!r}: write {GENERATED}:N with N the number of windows, e.g. {GENERATED}:64",
                              source="calibration.source")
        return None
    return GeneratedText(samples=int(match.group(1)) if match.group(1) else DEFAULT_GENERATED_SAMPLES)


CalibrationSource = TextFile | TokenIdsFile | StatisticsFile | RandomTokens | GeneratedText | TokenArray
