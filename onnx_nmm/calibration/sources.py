"""What a calibration source is, decided in one place (`source_kind`).

A source is a text file (read with a tokenizer), an .npz of token ids (`input_ids` [samples, seq_len]), an .npz
of statistics saved by an earlier rewrite, "random" (random token ids: tests only), windows the model writes
itself ("generated[:N]", or a GeneratedText with its sampling options), or token ids as an array in memory.
Options, the calibration data and the CLI all ask `source_kind`, so a new kind is added here once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from onnx_nmm.errors import OptionError

RANDOM = "random"


def source_kind(source) -> str:
    """"text", "token_ids", "statistics", "random", "generated" or "array" (an .npz is opened to tell token ids
    from saved statistics)."""
    kind = _kind_by_name(source)
    if kind != "npz":
        return kind
    from onnx_nmm.calibration.activation_stats import GramStatistics

    return "statistics" if GramStatistics.is_statistics_file(source) else "token_ids"


def is_text(source) -> bool:
    """Whether `source` is a text file (nothing is opened)."""
    return _kind_by_name(source) == "text"


def is_npz(source) -> bool:
    """Whether `source` names an .npz, of token ids or of statistics (nothing is opened)."""
    return _kind_by_name(source) == "npz"


def _kind_by_name(source) -> str:
    """source_kind's answer as far as the source's type and spelling tell it: an .npz is just "npz"."""
    if parse_generated(source) is not None:
        return "generated"
    if not isinstance(source, (str, os.PathLike)):
        return "array"
    if str(source) == RANDOM:
        return "random"
    return "npz" if str(source).endswith(".npz") else "text"


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
