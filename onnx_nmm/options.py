"""The options of a rewrite: typed, validated when made, each default written here and only here.

    RewriteOptions
      ├─ ranks          RankOptions            how each target's rank is chosen (docs/design.md §2)
      ├─ selection      Selection              which linear layers are targets
      ├─ factorization  FactorizationOptions   plain, whitened or Fisher-weighted SVD, and how it is computed
      ├─ calibration    CalibrationOptions     the data activation-aware methods and budgets learn from
      └─ fuse_mlp                              MLPs into one SvdGatedMLP or SvdMLP each

Errors name options by their path in RewriteOptions ("ranks.keep"); the CLI spells them as flags.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from onnx_nmm.calibration.sources import (
    CalibrationSource,
    GeneratedText,
    StatisticsFile,
    TextFile,
    calibration_sources,
    parse_generated,
)
from onnx_nmm.decomposition import methods
from onnx_nmm.decomposition.lowrank import SVD_METHODS
from onnx_nmm.decomposition.nystrom import DEFAULT_SCORE, NEURON_SCORES
from onnx_nmm.errors import OptionError
from onnx_nmm.passes import TARGETS

DEFAULT_KEEP = 0.8
# With calibration tokens and no rule given: as much as fits within this perplexity increase on held-out
# windows. A budget measured on the calibration text alone costs several times more on other text (SmolLM2,
# Old Testament: +2 % there was +15 % on modern prose, and wrong answers), so a text that narrows MLPs is
# mixed with DEFAULT_MIXED_GENERATED windows the model writes itself, whose held-out windows the budget is
# also measured on (SmolLM2, Old Testament: 2.8 % of the MLP parameters removed for +3.1 % on modern news),
# and which the neurons kept and the refit see too, whatever the rule (at --keep 0.9: +18.1 % on modern
# news where the Old Testament alone costs +21.4 %, docs/quality.md).
DEFAULT_PPL_INCREASE = 0.02
DEFAULT_MIXED_GENERATED = 32
DEFAULT_WINDOW = 512  # tokens per perplexity window
DEFAULT_ALIGN = 128  # the TensorE tile
# Layers whose MLPs' damage the layer-wise analysis measures at the output; the others' is a local proxy
# calibrated on them (layerwise/damage_proxy.py). Chosen for cost: the sweep grows as M·L, not L².
DEFAULT_REFERENCE_LAYERS = 8
FULL_RANK = "full"
METHODS = tuple(methods.METHODS)  # svd, whiten, fisher, nystrom
BUDGETS = ("uniform", "global", "sensitivity")
CALIBRATION_MODES = ("independent", "sequential")
FACTOR_DTYPES = ("float16", "float32")

# The ways of choosing ranks; exactly one drives a rewrite.
RANK_RULES = ("keep", "rank", "energy", "max_ppl_increase", "max_kl", "ranks_from")


@dataclass(frozen=True)
class RankOptions:
    """How each target's rank is chosen. Exactly one rule; when none is given, `keep` = DEFAULT_KEEP, or in a
    rewrite with calibration tokens the quality budget `max_ppl_increase` = DEFAULT_PPL_INCREASE
    (`by_default` says that no rule was given).

    keep:              the fraction of each matrix's parameters kept, block-aligned:
                       r = align·round(keep·K·N / ((K+N)·align)); with `budget` "global" or "sensitivity" the
                       same total is spent where the spectra or the measured damage say it costs least
    rank:              one rank everywhere (an int, or "full" for min(K, N)), factorized even where it saves
                       nothing, because it was asked for
    energy:            the smallest aligned rank holding this fraction of Σσ²
    max_ppl_increase:  as many parameters as possible while the calibration perplexity grows by at most this
                       fraction (0.1 = +10 %)
    max_kl:            the same, bounding the mean KL divergence to the dense model (nats)
    ranks_from:        the ranks of an earlier rewrite of the same model: its report (a JSON file), or a
                       mapping layer name → rank (None: dense)
    align:             ranks are multiples of this
    sensitivity_windows: calibration windows the quality budgets are measured on, an equal share from each
                       calibration source; a budget holds on each source's share
    sensitivity_from:  the report of an earlier rewrite of the model with a quality budget on the same
                       calibration: its measured sensitivities are reused instead of measured again
    reference_layers:  layer by layer, the layers (evenly spaced, the first and the last among them) whose MLPs'
                       damage is measured at the output; the others' is a local proxy calibrated on them.
                       0: every layer
    """

    keep: float | None = None
    rank: int | str | None = None
    energy: float | None = None
    max_ppl_increase: float | None = None
    max_kl: float | None = None
    ranks_from: str | os.PathLike | Mapping[str, int | None] | None = None
    budget: str = "uniform"
    align: int = DEFAULT_ALIGN
    sensitivity_windows: int = 8
    sensitivity_from: str | os.PathLike | None = None
    reference_layers: int = DEFAULT_REFERENCE_LAYERS
    by_default: bool = field(default=False, init=False, compare=False)

    def __post_init__(self):
        given = [rule for rule in RANK_RULES if getattr(self, rule) is not None]
        if not given:
            object.__setattr__(self, "keep", DEFAULT_KEEP)
            object.__setattr__(self, "by_default", self.budget == "uniform")
        elif len(given) > 1:
            raise OptionError("give one of " + ", ".join(f"{{{rule}}}" for rule in given) + ", not several",
                              **{rule: f"ranks.{rule}" for rule in given})
        if self.keep is not None and not 0.0 < self.keep <= 1.0:
            raise OptionError("{keep} must be in (0, 1] (the fraction of parameters kept), got " + str(self.keep),
                              keep="ranks.keep")
        if self.energy is not None and not 0.0 < self.energy <= 1.0:
            raise OptionError("{energy} must be in (0, 1], got " + str(self.energy), energy="ranks.energy")
        if self.rank is not None and self.rank != FULL_RANK and not (isinstance(self.rank, int) and self.rank >= 1):
            raise OptionError(f"{{rank}} must be a positive integer or {FULL_RANK!r}, got {self.rank!r}",
                              rank="ranks.rank")
        for name in ("max_ppl_increase", "max_kl"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise OptionError(f"{{{name}}} must be positive, got {value}", **{name: f"ranks.{name}"})
        if self.budget not in BUDGETS:
            raise OptionError(f"{{budget}} must be one of {', '.join(BUDGETS)}, got {self.budget!r}",
                              budget="ranks.budget")
        if self.budget != "uniform" and self.rule != "keep":
            raise OptionError(f"{{budget}} {self.budget} spends the parameters {{keep}} would keep: give {{keep}}, "
                              f"not {{{self.rule}}}", budget="ranks.budget", keep="ranks.keep",
                              **{self.rule: f"ranks.{self.rule}"})
        if self.align < 1:
            raise OptionError(f"{{align}} must be a positive integer, got {self.align}", align="ranks.align")
        if self.sensitivity_from is not None and not self.measures_damage:
            raise OptionError("{sensitivity_from} gives a quality budget the damage an earlier one measured: use it "
                              "with {budget} sensitivity, {max_ppl_increase} or {max_kl}",
                              sensitivity_from="ranks.sensitivity_from", budget="ranks.budget",
                              max_ppl_increase="ranks.max_ppl_increase", max_kl="ranks.max_kl")
        if self.sensitivity_windows < 1:
            raise OptionError(f"{{windows}} must be a positive integer, got {self.sensitivity_windows}",
                              windows="ranks.sensitivity_windows")
        if self.reference_layers < 0 or self.reference_layers == 1:
            raise OptionError("{reference_layers} must be 0 (every layer) or at least 2 (the first and the last "
                              f"layer), got {self.reference_layers}", reference_layers="ranks.reference_layers")

    @property
    def rule(self) -> str:
        """Which of RANK_RULES chooses the ranks."""
        return next(rule for rule in RANK_RULES if getattr(self, rule) is not None)

    @property
    def measures_damage(self) -> bool:
        """Whether the ranks come from the damage each one does on calibration windows (quality budgets)."""
        return bool(self.quality_budget)

    @property
    def damage_metric(self) -> str:
        """What a measured damage is: the log-loss increase ("ppl"), or the KL to the dense model ("kl")."""
        return "kl" if self.rule == "max_kl" else "ppl"

    @property
    def needs_spectra(self) -> bool:
        """Whether choosing the ranks needs every target's (weighted) spectrum first."""
        return self.rule == "energy" or self.budget != "uniform" or self.measures_damage

    @property
    def quality_budget(self) -> str:
        """The measured budget in words ("perplexity budget +10.0%"), or "" when the ranks are not measured."""
        if self.rule == "max_ppl_increase":
            return f"perplexity budget +{self.max_ppl_increase:.1%}"
        if self.rule == "max_kl":
            return f"KL budget {self.max_kl} nats"
        if self.budget == "sensitivity":
            return f"sensitivity budget keeping {self.keep:.1%} of the parameters"
        return ""

    def describe(self) -> str:
        if self.quality_budget:
            return f"{self.quality_budget}, align={self.align}"
        if self.rule == "keep":
            budget = "" if self.budget == "uniform" else f", {self.budget} budget"
            return f"keep={self.keep}{budget}, align={self.align}"
        if self.rule == "rank":
            return f"rank={self.rank}"
        if self.rule == "energy":
            return f"energy={self.energy}, align={self.align}"
        source = self.ranks_from if not isinstance(self.ranks_from, Mapping) else "a given plan"
        return f"ranks from {source}"


@dataclass(frozen=True)
class Selection:
    """Which linear layers are targets: a group (mlp, attention, all), regexes searched in node names and
    module paths (exclude wins over include), and the lm_head only on request (the paper leaves it alone)."""

    targets: str = "mlp"  # the paper's choice
    include: str | None = None
    exclude: str | None = None
    lm_head: bool = False

    def __post_init__(self):
        if self.targets not in TARGETS:
            raise OptionError(f"{{targets}} must be one of {', '.join(TARGETS)}, got {self.targets!r}",
                              targets="selection.targets")
        for name in ("include", "exclude"):
            pattern = getattr(self, name)
            if pattern is None:
                continue
            try:
                re.compile(pattern)
            except re.error as error:
                raise OptionError(f"{{{name}}} {pattern!r} is not a valid regular expression: {error}",
                                  **{name: f"selection.{name}"}) from None

    def describe(self) -> str:
        parts = [f"targets={self.targets}"]
        if self.include:
            parts.append(f"include={self.include!r}")
        if self.exclude:
            parts.append(f"exclude={self.exclude!r}")
        if self.lm_head:
            parts.append("lm_head")
        return ", ".join(parts)


@dataclass(frozen=True)
class FactorizationOptions:
    """method: svd (truncated SVD of W), whiten (SVD-LLM: minimise the layer's output error on the
    calibration data), fisher (also weigh each output direction by the loss's gradients), or nystrom
    (narrow each targeted MLP to the intermediate neurons it keeps, by `neuron_score`, and refit its output
    projection: onnx_nmm.decomposition.nystrom; other targets are whitened); None means nystrom with calibration data
    (whiten for an explicit rank or energy rule and for sequential calibration, which choose and fit ranks only), else
    svd. svd: how the inner SVD is computed (lowrank.SVD_METHODS);
    the randomized one uses power_iterations, oversample and seed (seed also drives fisher's sampling).
    factor_dtype: how U and V are stored — None: as the weight was (a quantized weight's factors quantized
    the same way, a float weight's in its dtype), or "float16" / "float32"."""

    method: str | None = None
    svd: str = "exact"
    power_iterations: int = 2
    oversample: int = 64
    seed: int = 0
    factor_dtype: str | None = None
    neuron_score: str = DEFAULT_SCORE

    def __post_init__(self):
        if self.neuron_score not in NEURON_SCORES:
            raise OptionError(f"{{neuron_score}} must be one of {', '.join(NEURON_SCORES)}, got {self.neuron_score!r}",
                              neuron_score="factorization.neuron_score")
        if self.method is not None and self.method not in METHODS:
            raise OptionError(f"{{method}} must be one of {', '.join(METHODS)}, got {self.method!r}",
                              method="factorization.method")
        if self.svd not in SVD_METHODS:
            raise OptionError(f"{{svd}} must be one of {', '.join(SVD_METHODS)}, got {self.svd!r}",
                              svd="factorization.svd")
        if self.factor_dtype is not None and self.factor_dtype not in FACTOR_DTYPES:
            raise OptionError(f"{{factor_dtype}} must be one of {', '.join(FACTOR_DTYPES)}, got {self.factor_dtype!r}",
                              factor_dtype="factorization.factor_dtype")
        for name in ("power_iterations", "oversample"):
            if getattr(self, name) < 0:
                raise OptionError(f"{{{name}}} must be ≥ 0, got {getattr(self, name)}",
                                  **{name: f"factorization.{name}"})

    @property
    def strategy(self) -> methods.Method:
        """What the method does to a layer and what it needs (resolved: RewriteOptions sets the default)."""
        assert self.method is not None, "RewriteOptions resolves the default method"
        return methods.method_named(self.method)

    def describe(self) -> str:
        inner = self.svd
        if self.svd == "randomized":
            inner = f"randomized(power_iterations={self.power_iterations}, oversample={self.oversample})"
        if self.method == "nystrom":
            return f"nystrom ({self.neuron_score} neuron scores), MLPs narrowed; other targets whitened, {inner} SVD"
        return f"{self.method}, {inner} SVD"


@dataclass(frozen=True)
class CalibrationOptions:
    """The data activation-aware SVD, Fisher weighting and the quality budgets learn from.

    source:          a text file (with `tokenizer`), an .npz holding input_ids [samples, seq_len], statistics
                     saved by an earlier rewrite (`save_statistics`), "random" (tests only), token ids
                     [samples, seq_len] as an array, "generated[:N]" or a GeneratedText (N windows sampled from
                     the model itself, onnx_nmm.calibration.generated_text), or a list of such token sources, mixed
    samples, seq_len: windows taken from a text, and their length in tokens
    spread:          take the windows evenly spaced over the whole text rather than from its start
    bos:             start each window of a text with the BOS token its tokenizer adds (when it adds one)
    batch:           windows per onnxruntime run
    mode:            independent: every layer fitted to the dense model's activations; sequential: each layer
                     fitted, in graph order, to the dense outputs from the inputs the already-compressed model
                     feeds it (narrowed MLPs: refitted so by the layer-wise rewrite alone, layerwise/sequential.py)
    statistics:      saved statistics used instead of gathering them (with `source` still giving the tokens
                     that sequential calibration and the quality budgets run on)
    save_statistics: keep the gathered statistics in this .npz
    mix_generated:   windows sampled from the model itself that a single text is mixed with when the rewrite
                     narrows MLPs (RewriteOptions); 0 takes the text alone
    """

    source: object = None
    tokenizer: str | os.PathLike | None = None
    samples: int = 128
    seq_len: int = 512
    spread: bool = False
    bos: bool = True
    batch: int = 1
    mode: str = "independent"
    statistics: str | os.PathLike | None = None
    save_statistics: str | os.PathLike | None = None
    mix_generated: int = DEFAULT_MIXED_GENERATED
    parsed_sources: tuple[CalibrationSource, ...] = field(default=(), init=False, repr=False, compare=False)

    @property
    def sources(self) -> tuple[CalibrationSource, ...]:
        """The sources, each as what it is (calibration.sources.calibration_source); none without a source."""
        return self.parsed_sources

    @property
    def is_one_text(self) -> bool:
        """Whether the source is a single text file (not token ids, statistics, random or generated windows)."""
        return len(self.sources) == 1 and isinstance(self.sources[0], TextFile)

    @property
    def has_tokens(self) -> bool:
        """Whether the source gives tokens to run the model on (not only statistics saved earlier)."""
        return any(not isinstance(source, StatisticsFile) for source in self.sources)

    def __post_init__(self):
        if self.source is None and self.statistics is None:
            raise OptionError("calibration needs data: give {source} (a text, token ids, or saved statistics) or "
                              "{statistics}", source="calibration.source", statistics="calibration.statistics")
        if isinstance(self.source, (list, tuple)):
            if not self.source:
                raise OptionError("{source} is an empty list", source="calibration.source")
            object.__setattr__(self, "source", tuple(parse_generated(s) or s for s in self.source))
        elif isinstance(self.source, str):
            object.__setattr__(self, "source", parse_generated(self.source) or self.source)
        object.__setattr__(self, "parsed_sources", () if self.source is None else calibration_sources(self.source))
        for name in ("samples", "seq_len", "batch"):
            if getattr(self, name) < 1:
                raise OptionError(f"{{{name}}} must be a positive integer, got {getattr(self, name)}",
                                  **{name: f"calibration.{name}"})
        if self.mix_generated < 0:
            raise OptionError(f"{{mix_generated}} must be 0 (the text alone) or more windows, got {self.mix_generated}",
                              mix_generated="calibration.mix_generated")
        if self.mode not in CALIBRATION_MODES:
            raise OptionError(f"{{mode}} must be one of {', '.join(CALIBRATION_MODES)}, got {self.mode!r}",
                              mode="calibration.mode")


@dataclass(frozen=True)
class RewriteOptions:
    """Everything a rewrite needs to know; RewriteOptions() is the uniform keep-0.8 plain-SVD rewrite of the
    MLPs. With calibration tokens and nothing else said, it narrows the MLPs (nystrom) as far as the perplexity
    on held-out calibration windows allows within DEFAULT_PPL_INCREASE. A single calibration text that narrows
    MLPs, whatever the rule, is mixed with `calibration.mix_generated` windows sampled from the model
    (`given_calibration` keeps what was given)."""

    ranks: RankOptions = field(default_factory=RankOptions)
    selection: Selection = field(default_factory=Selection)
    factorization: FactorizationOptions = field(default_factory=FactorizationOptions)
    calibration: CalibrationOptions | None = None
    fuse_mlp: bool = False
    check_answers: bool = True  # with a tokenizer: compare greedy answers to check prompts with the dense model's
    method_by_default: bool = field(default=False, init=False, compare=False)
    plan_by_default: bool = field(default=False, init=False, compare=False)
    given_calibration: CalibrationOptions | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "plan_by_default", self.ranks.by_default)
        object.__setattr__(self, "given_calibration", self.calibration)
        if self.factorization.method is None:
            object.__setattr__(self, "method_by_default", True)
            sequential = self.calibration is not None and self.calibration.mode == "sequential"
            ranks_only = self.ranks.rule in ("rank", "energy") or sequential  # choose or fit ranks, not widths
            method = "svd" if self.calibration is None else "whiten" if ranks_only else "nystrom"
            object.__setattr__(self, "factorization", replace(self.factorization, method=method))
        if self.ranks.by_default and self.calibration is not None and self.calibration.has_tokens:
            ranks = replace(self.ranks, keep=None, max_ppl_increase=DEFAULT_PPL_INCREASE)
            object.__setattr__(self, "ranks", ranks)
        if self.method == "nystrom" and self.calibration is not None and self.calibration.is_one_text \
                and self.calibration.mix_generated:
            given = self.calibration.source
            mixed = (*(given if isinstance(given, tuple) else (given,)),
                     GeneratedText(samples=self.calibration.mix_generated))
            object.__setattr__(self, "calibration", replace(self.calibration, source=mixed))
        method, calibration, ranks = self.method, self.calibration, self.ranks
        if self.strategy.calibrated and calibration is None:
            raise OptionError(f"{{method}} {method} learns from calibration data: give {{calibration}}",
                              method="factorization.method", calibration="calibration.source")
        if calibration is not None and calibration.mode == "sequential" and not self.strategy.fits_sequentially:
            raise OptionError("sequential calibration refits weighted factors or narrowed MLPs: use it with {method} "
                              "whiten, fisher or nystrom", method="factorization.method")
        if ranks.measures_damage and (calibration is None or calibration.source is None):
            raise OptionError("{rule} measures the damage on calibration windows: give {calibration}",
                              rule=f"ranks.{'budget' if ranks.budget == 'sensitivity' else ranks.rule}",
                              calibration="calibration.source")
        if method == "nystrom" and ranks.rule in ("rank", "energy"):
            raise OptionError(f"{{method}} nystrom narrows MLPs to a kept width, which {{{ranks.rule}}} does not "
                              "choose: give {keep} or a quality budget", method="factorization.method",
                              keep="ranks.keep", **{ranks.rule: f"ranks.{ranks.rule}"})
        if self.factorization.svd == "randomized" and ranks.rule == "energy":
            raise OptionError("{energy} needs every singular value: use it with {svd} exact",
                              energy="ranks.energy", svd="factorization.svd")

    @property
    def method(self) -> str:
        method = self.factorization.method
        assert method is not None, "__post_init__ resolves the default method"
        return method

    @property
    def strategy(self) -> methods.Method:
        """What the method does to a layer and what it needs."""
        return self.factorization.strategy

    def streamable(self) -> RewriteOptions:
        """These options as a streamed rewrite runs them. Narrowing MLPs streams layer by layer with every default
        kept (onnx_nmm.layerwise); a factorization streams one matrix at a time, which cannot measure a quality
        budget: a budget that is only the default becomes the uniform DEFAULT_KEEP (one asked for is refused)."""
        if self.strategy.narrows_mlps or not self.plan_by_default:
            return self
        ranks = RankOptions(keep=DEFAULT_KEEP, align=self.ranks.align,
                            sensitivity_windows=self.ranks.sensitivity_windows)
        return replace(self, ranks=ranks)

    @property
    def sequential(self) -> bool:
        return self.calibration is not None and self.calibration.mode == "sequential"

    @property
    def needs_statistics(self) -> bool:
        """Whether the inputs' Gram statistics are needed: by whitening and fisher, to report plain SVD's
        activation error, and to choose ranks from spectra before a sequential refit."""
        if self.calibration is None:
            return False
        return self.strategy.output_grams or not self.sequential or self.ranks.needs_spectra
