"""Where calibration, training and evaluation tokens come from: windows of each kind of source
(calibration.sources says what a source is: a text file read with a Hugging Face tokenizer — a tokenizer folder,
or a GGUF file whose tokenizer transformers can read — and cut into non-overlapping windows, an .npz holding
input_ids [samples, seq_len], token ids given as an array, "random" ids (tests only), windows the model writes,
or, for calibration, statistics saved by an earlier rewrite). `token_windows` turns any token source into
windows; `CalibrationData` holds what a rewrite's calibration options point at, and gives the statistics.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnx_nmm.calibration.activation_stats import GramStatistics, collect_gram_matrices
from onnx_nmm.calibration.generated_text import generated_windows
from onnx_nmm.calibration.sources import (
    CalibrationSource,
    GeneratedText,
    RandomTokens,
    StatisticsFile,
    TextFile,
    TokenArray,
    TokenIdsFile,
    calibration_source,
)
from onnx_nmm.calibration.tokens import TokenWindows, check_tokenizer, load_tokenizer
from onnx_nmm.errors import DataError, OptionError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import CalibrationOptions
from onnx_nmm.passes import LinearLayer
from onnx_nmm.progress import Progress
from onnx_nmm.runtime.causal_lm import vocabulary_size


def bos_id(tokenizer) -> int | None:
    """The BOS token id `tokenizer` puts before every text, or None when it puts none (SmolLM2's, GPT-2's)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def text_tokens(path: str | os.PathLike, tokenizer) -> np.ndarray:
    """All token ids of a text file, as one sequence."""
    check_text_file(path)
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sequence longer than the model's maximum": we cut it ourselves
        return np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64)


def check_text_file(path: str | os.PathLike) -> None:
    """Refuse a text that is missing, a folder, or empty: before a model is loaded, not after."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"text file {path}: no such file")
    if not path.is_file():
        raise DataError(f"text file {path} is a folder: give a UTF-8 text file")
    with path.open("rb") as text:
        if not text.read(1 << 16).strip():
            raise DataError(f"text file {path} is empty")


def check_source_files(options: CalibrationOptions | None) -> None:
    """The calibration options' text files, tokenizer and saved statistics are there (check_token_sources; a text
    needs its tokenizer unless saved statistics stand in for what it gives): checked before the model is loaded,
    so a typo costs no time."""
    if options is None:
        return
    check_token_sources(list(options.sources), options.tokenizer, "calibration.tokenizer",
                        needs_tokenizer=options.statistics is None)
    if options.statistics is not None and not Path(options.statistics).is_file():
        raise DataError(f"{options.statistics}: no such file")


def check_token_sources(sources: list, tokenizer: str | os.PathLike | None, tokenizer_option: str,
                        needs_tokenizer: bool = True) -> None:
    """What token sources name is there, checked before a model loads rather than after: each text file exists
    and is not empty, and has a `tokenizer` when `needs_tokenizer`; each .npz exists; a tokenizer given is a
    tokenizer folder or a .gguf file (`tokenizer_option` names the option in errors)."""
    for source in map(calibration_source, sources):
        if isinstance(source, TextFile):
            check_text_file(source.path)
            if tokenizer is None and needs_tokenizer:
                raise OptionError(f"{source} is text: give its {{tokenizer}} (a tokenizer folder or a .gguf file)",
                                  tokenizer=tokenizer_option)
        elif isinstance(source, (TokenIdsFile, StatisticsFile)) and not Path(source.path).is_file():
            raise DataError(f"{source}: no such file")
    if tokenizer is not None:
        check_tokenizer(tokenizer)


def windows_from_text(path: str | os.PathLike, tokenizer, samples: int | None, seq_len: int,
                      spread: bool = False, bos: bool = True) -> TokenWindows:
    """Non-overlapping windows of `seq_len` tokens: consecutive from the start of the text, or with `spread`,
    evenly spaced over the whole of it (a long text's opening need not look like the rest). When the
    tokenizer starts a text with BOS (and `bos`), each window is BOS and seq_len − 1 tokens of text."""
    ids = text_tokens(path, tokenizer)
    first = bos_id(tokenizer) if bos else None
    text_len = seq_len - (first is not None)
    available = len(ids) // text_len
    if available == 0:
        raise DataError(f"{path} holds {len(ids)} tokens, fewer than one window of {seq_len}; use a longer text "
                        "or shorter windows")
    count = available if samples is None else min(samples, available)
    if samples is not None and samples > available:
        warnings.warn(f"{path} has only {available} windows of {seq_len} tokens; using {available}, not {samples}",
                      stacklevel=2)
    windows = ids[: available * text_len].reshape(available, text_len)
    picks = np.linspace(0, available - 1, count).round().astype(int) if spread else np.arange(count)
    where = f"spread over all {available}" if spread and count < available else "from the start"
    chosen, description = windows[picks], f"{path}: {count} windows of {seq_len} tokens, {where}"
    if first is not None:
        chosen = np.concatenate([np.full((count, 1), first, dtype=np.int64), chosen], axis=1)
        description += f", each starting with BOS (id {first})"
    return TokenWindows(chosen, description, [f"{Path(path).name}#{i}" for i in picks])


def windows_from_array(ids, samples: int | None, description: str) -> TokenWindows:
    """Token ids [samples, seq_len] as windows, the first `samples` of them."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"{description}: token ids must be integers [samples, seq_len], got {ids.dtype} "
                        f"{list(ids.shape)}")
    ids = ids.astype(np.int64)[:samples]
    return TokenWindows(ids, f"{description}: {len(ids)} sequences of {ids.shape[1]} tokens")


def windows_from_npz(path: str | os.PathLike, samples: int | None) -> TokenWindows:
    """Token ids from an .npz holding `input_ids` [samples, seq_len]."""
    try:
        with np.load(path) as archive:
            if "input_ids" not in archive.files:
                raise DataError(f"{path} has no 'input_ids' array (it has {', '.join(archive.files) or 'nothing'})")
            ids = np.asarray(archive["input_ids"])
    except DataError:
        raise
    except Exception as error:
        raise DataError(f"cannot read {path}: {error}; give an .npz saved with numpy.savez") from None
    return windows_from_array(ids, samples, str(path))


def random_windows(vocabulary: int, samples: int, seq_len: int, seed: int = 0) -> TokenWindows:
    warnings.warn("calibrating on random token ids: fine for tests, meaningless for quality; calibrate on text",
                  stacklevel=2)
    ids = np.random.default_rng(seed).integers(0, vocabulary, size=(samples, seq_len), dtype=np.int64)
    return TokenWindows(ids, f"random: {samples} sequences of {seq_len} tokens")


def token_windows(source, tokenizer: str | os.PathLike | None, samples: int | None, seq_len: int,
                  spread: bool = False, vocabulary: Callable[[], int] | None = None,
                  tokenizer_option: str = "tokenizer", bos: bool = True) -> TokenWindows:
    """Windows of any token source: a text file (with `tokenizer`), an .npz of input_ids, an array of token
    ids, or "random" (ids below `vocabulary()`). `spread` and `bos` (start each window with the BOS token
    the tokenizer adds, if it adds one) apply to text only: token ids are taken as they are."""
    source = calibration_source(source)
    if spread and not isinstance(source, TextFile):
        raise OptionError("{spread} chooses windows of a text: give a text file as the source",
                          spread="calibration.spread")
    if isinstance(source, (TokenIdsFile, StatisticsFile)):  # statistics: windows_from_npz says they hold no ids
        return windows_from_npz(source.path, samples)
    if isinstance(source, TokenArray):
        return windows_from_array(source.ids, samples, "token ids")
    if isinstance(source, RandomTokens):
        if vocabulary is None:
            raise DataError("random token ids need the model's vocabulary size")
        return random_windows(vocabulary(), samples or 16, seq_len)
    if isinstance(source, GeneratedText):
        raise OptionError(f"{source.describe(seq_len)} is sampled from a model: this use of token windows has "
                          "none to sample from", source="calibration.source")
    if tokenizer is None:
        raise OptionError(f"{source} is text: give its {{tokenizer}} (a tokenizer folder or a .gguf file)",
                          tokenizer=tokenizer_option)
    return windows_from_text(source.path, load_tokenizer(tokenizer), samples, seq_len, spread, bos)


def read_tokens(source, tokenizer: str | os.PathLike | None, tokenizer_option: str = "tokenizer"
                ) -> tuple[np.ndarray, int | None]:
    """All token ids of a text file, or of an .npz's input_ids read as one sequence; and the BOS token id the
    tokenizer starts a text with (None for an .npz, whose ids are taken as they are)."""
    if isinstance(calibration_source(source), (TokenIdsFile, StatisticsFile)):
        return windows_from_npz(source, None).tokens.reshape(-1), None
    if tokenizer is None:
        raise OptionError(f"{source} is text: give its {{tokenizer}} (a tokenizer folder or a .gguf file)",
                          tokenizer=tokenizer_option)
    loaded = load_tokenizer(tokenizer)
    return text_tokens(source, loaded), bos_id(loaded)


def calibration_text(options: CalibrationOptions) -> str | os.PathLike | None:
    """The first text file the calibration reads, if it reads one."""
    return next((source.path for source in options.sources if isinstance(source, TextFile)), None)


def check_token_ids(tokens: np.ndarray, vocabulary: int | None, source: str, model: str) -> None:
    """Refuse token ids the model cannot embed, before onnxruntime prints its own complaint: a text
    tokenized with another model's tokenizer."""
    if tokens.size and (tokens.min() < 0 or (vocabulary is not None and tokens.max() >= vocabulary)):
        raise DataError(f"{source} holds token ids in [{tokens.min()}, {tokens.max()}], outside {model}'s vocabulary "
                        f"of {vocabulary}: tokenize with the model's own tokenizer")


class CalibrationData:
    """What a rewrite's calibration options point at, decided once: token windows to run the model (whose
    graph is `graph`) on, statistics saved earlier, or both (saved statistics, and a text for what must run
    the model); and the statistics they give.

    The source is one token source or several, mixed (`[text, "generated:64"]`): each text gives the
    options' `samples` windows, each generated source its own count (onnx_nmm.calibration.generated_text), sampled
    from `model` unless it names a generator. With `held_out` > 0, that many further windows are drawn from
    the same sources and kept apart: `windows()` (statistics, sequential calibration) never includes them,
    `held_out_windows()` (what the quality budgets are measured on) is only them — disjoint by construction.
    """

    def __init__(self, options: CalibrationOptions, graph: ir.Graph, model=None, held_out: int = 0,
                 progress: Progress | None = None):
        self.options = options
        self.graph = graph
        self.model = model
        self.held_out = held_out
        self.progress = progress or Progress()  # hears the sampling of generated windows, which takes minutes
        sources = options.sources
        saved = sources[0] if len(sources) == 1 and isinstance(sources[0], StatisticsFile) else None
        if options.statistics is not None and not GramStatistics.is_statistics_file(options.statistics):
            raise DataError(f"{options.statistics} is not a statistics file saved by an earlier rewrite")
        self.statistics_file = options.statistics or (saved.path if saved is not None else None)
        self.token_sources: list[CalibrationSource] = [] if saved is not None else list(sources)
        if options.spread and not any(isinstance(s, TextFile) for s in self.token_sources):
            raise OptionError("{spread} chooses windows of a text: give {source} a text file",
                              spread="calibration.spread", source="calibration.source")
        self._split: tuple[TokenWindows, TokenWindows] | None = None

    @property
    def token_source(self):
        """The token sources, or None when the options hold only saved statistics."""
        return self.token_sources or None

    def statistics(self, source: ModelSource, layers: list[LinearLayer], output_grams: bool, seed: int,
                   progress: Progress) -> GramStatistics:
        """The Grams of `layers`: loaded when the options point at saved ones, else gathered by running
        `source`'s original model on the windows — XᵀX in onnxruntime, or with `output_grams` (fisher) XᵀX and
        the output-gradient Grams in PyTorch — and saved when asked."""
        if self.model is None:
            self.model = source
        if self.statistics_file is not None:
            statistics = GramStatistics.load(self.statistics_file)
        else:
            statistics = self._gather(source, layers, output_grams, seed, progress)
            if self.options.save_statistics is not None:
                statistics.save(self.options.save_statistics)
        if output_grams and not statistics.output_grams:
            raise DataError(f"{statistics.description or 'these statistics'} hold no output-gradient Grams, which "
                            "{method} fisher weighs by: calibrate on a text or token ids, or load statistics a "
                            "fisher rewrite saved", method="factorization.method")
        return statistics

    def _gather(self, source: ModelSource, layers: list[LinearLayer], output_grams: bool, seed: int,
                progress: Progress) -> GramStatistics:
        windows = self.windows()
        batches = windows.batches(self.options.batch)
        with progress.phase(f"calibrating ({windows.description})", total=windows.token_count) as phase:
            if output_grams:
                from onnx_nmm.decomposition.fisher import collect_fisher_statistics

                statistics = collect_fisher_statistics(source, layers, batches, windows.description, seed=seed,
                                                       on_batch=phase.advance)
            else:
                statistics = collect_gram_matrices(source, observed_inputs(layers), batches, windows.description,
                                                   on_batch=phase.advance)
        statistics.windows = tuple(windows.ids)
        return statistics

    def windows(self, samples: int | None = None) -> TokenWindows:
        """The calibration windows (never a held-out one): all of them, or the first `samples`."""
        windows = self._windows()[0]
        return windows if samples is None else windows.take(range(min(samples, len(windows.tokens))))

    def held_out_windows(self) -> TokenWindows:
        """The `held_out` windows drawn from the same sources as, and disjoint from, `windows()`."""
        if self.held_out < 1:
            raise ValueError("these calibration data hold no windows out")
        kept, held = self._windows()
        if not len(held.tokens):
            raise DataError(f"the calibration sources give {len(kept.tokens)} window(s), too few to hold any out for "
                            "measuring a budget on: give a longer text or more token ids")
        return held

    def _windows(self) -> tuple[TokenWindows, TokenWindows]:
        if self._split is not None:
            return self._split
        if self.token_source is None:
            raise OptionError(f"{self.statistics_file} holds statistics, but this rewrite runs the model on "
                              "calibration tokens (sequential calibration, a quality budget, or fisher): give "
                              "{source} a text or token ids, and the statistics as {statistics}",
                              source="calibration.source", statistics="calibration.statistics")
        # Held-out windows: an equal share from each source, taken after (or, spread, between) its own.
        shares = [self.held_out // len(self.token_sources) + (i < self.held_out % len(self.token_sources))
                  for i in range(len(self.token_sources))]
        kept, held = [], []
        for source, share in zip(self.token_sources, shares):
            windows, count = self._source_windows(source, share)
            spread = self.options.spread and isinstance(source, TextFile)
            held_rows = _held_out_rows(len(windows.tokens), share, spread=spread)
            rows = [i for i in range(len(windows.tokens)) if i not in held_rows][:count]
            kept.append(_recounted(windows.take(rows), len(windows.tokens)))
            if held_rows:
                held.append(replace(windows.take(sorted(held_rows)), description=f"{len(held_rows)} windows "
                                   f"held out from {windows.description}"))
        self._split = joined_windows(kept), joined_windows(held)
        return self._split

    def _source_windows(self, source: CalibrationSource, extra: int) -> tuple[TokenWindows, int]:
        """`source`'s calibration windows and `extra` more; and how many calibration windows it gives."""
        o = self.options
        if isinstance(source, GeneratedText):
            if self.model is None:
                raise OptionError("generated calibration text is sampled from the model: this use of the "
                                  "calibration data has no model to sample from", source="calibration.source")
            samples = source.samples + extra
            description = f"sampling calibration text ({source.describe(o.seq_len)})"
            with self.progress.phase(description, total=source.batches(samples)) as phase:
                windows = generated_windows(source, self.model, o.seq_len, o.tokenizer, samples,
                                            on_batch=phase.advance)
            count = source.samples
        else:
            windows = token_windows(source, o.tokenizer, o.samples + extra, o.seq_len,
                                    o.spread and isinstance(source, TextFile), self._vocabulary,
                                    tokenizer_option="calibration.tokenizer", bos=o.bos)
            count = o.samples
        check_token_ids(windows.tokens, vocabulary_size(self.graph), windows.description.split(":")[0], "the model")
        return windows, count

    def _vocabulary(self) -> int:
        vocabulary = vocabulary_size(self.graph)
        if vocabulary is None:
            raise DataError("cannot tell the vocabulary size for random token ids; calibrate on a text or token ids")
        return vocabulary


def _held_out_rows(available: int, share: int, spread: bool) -> set[int]:
    """Which of `available` windows to hold out: the last `share` (a text read from its start, generated
    windows), or evenly spaced among them (a text read spread out). At least one window stays in."""
    share = min(share, available - 1)
    if share <= 0:
        return set()
    if spread:
        return {int(i) for i in np.linspace(1, available - 1, share).round()}
    return set(range(available - share, available))


def _recounted(windows: TokenWindows, drawn: int) -> TokenWindows:
    """`windows`, its description counting the windows it holds rather than the `drawn` it was taken from."""
    windows.description = windows.description.replace(f": {drawn} ", f": {len(windows.tokens)} ", 1)
    return windows


def joined_windows(parts: list[TokenWindows]) -> TokenWindows:
    """Windows of several sources, one after the other (all of one length)."""
    parts = [part for part in parts if len(part.tokens)]
    if not parts:
        return TokenWindows(np.zeros((0, 0), np.int64), "no windows", [])
    if len({part.tokens.shape[1] for part in parts}) > 1:
        raise DataError("the calibration sources give windows of different lengths: "
                        + ", ".join(f"{part.description} ({part.tokens.shape[1]})" for part in parts)
                        + "; give token ids of the calibration's {seq_len}", seq_len="calibration.seq_len")
    if len(parts) == 1:
        return parts[0]
    return TokenWindows(np.concatenate([part.tokens for part in parts]), " + ".join(p.description for p in parts),
                        [i for part in parts for i in part.ids])


def observed_inputs(layers: list[LinearLayer]) -> dict[str, int]:
    """The distinct inputs of `layers` (value name → width K): what calibration observes. Layers reading the
    same input (gate and up) share one Gram."""
    return {layer.x.name: layer.k for layer in layers}
