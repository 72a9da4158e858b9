"""Two models on the same inputs, the reference always in onnxruntime (`diff`, `diff_on_text`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from onnx_nmm.calibration.calibration_data import check_token_ids
from onnx_nmm.errors import ModelError, OptionError
from onnx_nmm.options import DEFAULT_WINDOW
from onnx_nmm.progress import Progress
from onnx_nmm.quality import metrics
from onnx_nmm.quality.evaluation import TextOptions
from onnx_nmm.quality.perplexity import TextComparison, compare_on_text, window_count
from onnx_nmm.runtime import compiled_folder
from onnx_nmm.runtime.backend_runner import Model, ModelRunner, check_backend
from onnx_nmm.runtime.static_cache import StaticDecoder

COMPILED_DECODE_STEPS = 4  # decode steps a compiled folder is compared on after its prompt


@dataclass(frozen=True)
class DiffOptions:
    """inputs: an .npz (keys = input names) or arrays; else random token ids [batch, seq_len] from `seed`,
    after an empty KV cache, or with `past_len` a decode step of seq_len tokens after a cache each model
    filled with its own prefill of past_len tokens. atol/rtol: an element fails when |a − b| > atol + rtol·|a|.
    backend: how the candidate runs (ort, or its PyTorch lowering with the custom ops as torch math or on the
    emulated NKI kernels for `target`)."""

    batch: int = 1
    seq_len: int = 32
    past_len: int = 0
    seed: int = 0
    inputs: str | os.PathLike | dict | None = None
    atol: float | None = None
    rtol: float | None = None
    backend: str = "ort"
    target: str = "trn2"

    def __post_init__(self):
        if self.batch < 1 or self.seq_len < 1 or self.past_len < 0:
            raise OptionError("{batch} and {seq_len} must be positive, {past_len} ≥ 0", batch="batch",
                              seq_len="seq_len", past_len="past_len")
        if self.past_len and self.inputs is not None:
            raise OptionError("{past_len} fills the cache with a prefill of random token ids: it does not go with "
                              "{inputs}", past_len="past_len", inputs="inputs")
        for name in ("atol", "rtol"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise OptionError(f"{{{name}}} must be ≥ 0, got {getattr(self, name)}", **{name: name})
        check_backend(self.backend, self.target)


@dataclass
class Diff:
    reference: str
    candidate: str
    backend: str
    inputs: dict[str, list[int]]  # input name → shape
    atol: float | None
    rtol: float | None
    outputs: list[metrics.OutputComparison] = field(default_factory=list)
    random_tokens: bool = False  # the inputs were random token ids, not text
    calibrated: bool = False  # the candidate is a calibrated rewrite (its metadata says what it was fitted to)

    @property
    def passed(self) -> bool:
        return not any(output.mismatched for output in self.outputs)

    @property
    def misleading_on_random_tokens(self) -> bool:
        """Logits that barely agree on random token ids: a calibrated rewrite often looks so there and is fine
        on text, which is what its calibration fitted it to."""
        return self.random_tokens and self.calibrated and any(output.cosine < 0.9 for output in self.outputs
                                                              if output.top1_agreement is not None)

    def to_dict(self) -> dict:
        return {"reference": self.reference, "candidate": self.candidate, "backend": self.backend,
                "inputs": self.inputs, "atol": self.atol, "rtol": self.rtol, "passed": self.passed,
                "outputs": [output.to_dict() for output in self.outputs]}


def diff(reference: Model, candidate: Model, options: DiffOptions | None = None) -> Diff:
    """Every output of `candidate` against `reference` on the same inputs: largest errors, cosine, and for
    logits top-1 agreement and mean KL. Raises ModelError when the two models do not take the same inputs
    or give outputs of different shapes. A compiled folder (`compile --max-context`, split over NeuronCores or not)
    as the candidate: its logits on a prompt of seq_len tokens and then COMPILED_DECODE_STEPS decode steps fed the
    reference's greedy tokens."""
    o = options or DiffOptions()
    if isinstance(candidate, (str, os.PathLike)) and compiled_folder.is_compiled_folder(candidate):
        return _diff_compiled(reference, candidate, o)
    expected_runner, actual_runner = ModelRunner(reference), ModelRunner(candidate, o.backend, o.target)
    _check_same_interface(expected_runner, actual_runner)
    if o.past_len:
        tokens = expected_runner.random_tokens(o.batch, o.past_len + o.seq_len, o.seed)
        inputs, expected = _after_prefill(expected_runner, tokens, o.past_len)
        _, actual = _after_prefill(actual_runner, tokens, o.past_len)
    else:
        inputs = expected_runner.inputs(o.inputs, o.batch, o.seq_len, o.seed)
        expected, actual = expected_runner(inputs), actual_runner(inputs)
    comparisons = []
    for name, array in expected.items():
        if array.shape != actual[name].shape:
            raise ModelError(f"output {name} is {list(array.shape)} in {expected_runner.label} but "
                             f"{list(actual[name].shape)} in {actual_runner.label}: the two models do not compute "
                             "the same thing; diff a model against its own rewrite")
        comparisons.append(metrics.compare(name, array, actual[name], o.atol, o.rtol))
    return Diff(expected_runner.label, actual_runner.label, o.backend,
                {name: list(array.shape) for name, array in inputs.items()}, o.atol, o.rtol, comparisons,
                random_tokens=o.inputs is None, calibrated=actual_runner.calibrated)


def _diff_compiled(reference: Model, folder: str | os.PathLike, o: DiffOptions) -> Diff:
    """The folder's static graphs (its rank programs in lock-step, when split) against the reference model with its
    own cache: the prompt's logits, then each decode step's."""
    if o.inputs is not None or o.past_len or o.batch != 1:
        raise OptionError("a compiled folder is compared on a prompt of {seq_len} random tokens and the decode steps "
                          "after it: leave out {inputs}, {past_len} and {batch}", seq_len="seq_len", inputs="inputs",
                          past_len="past_len", batch="batch")
    expected_runner, (_, graphs) = ModelRunner(reference), compiled_folder.read(folder)
    graphs.check_fits(o.seq_len, COMPILED_DECODE_STEPS)
    compiled = StaticDecoder(graphs, o.backend, o.target)
    model, logits = expected_runner.causal_lm, expected_runner.output_names[0]
    tokens = expected_runner.random_tokens(1, o.seq_len, o.seed)
    outputs = expected_runner(model.feeds(tokens))
    expected, actual = [outputs[logits]], [compiled.prompt_logits(tokens)]
    steps_expected: list[np.ndarray] = []
    steps_actual: list[np.ndarray] = []
    for _ in range(COMPILED_DECODE_STEPS):
        token = expected[-1][:, -1].argmax(-1).reshape(1, 1) if not steps_expected else \
            steps_expected[-1].argmax(-1).reshape(1, 1)
        outputs = expected_runner(model.feeds(token, model.cache_after(outputs)))
        steps_expected.append(outputs[logits][:, -1])
        steps_actual.append(compiled.step(token))
    comparisons = [metrics.compare(f"{logits} (prompt of {o.seq_len})", expected[0], actual[0], o.atol, o.rtol),
                   metrics.compare(f"{logits} ({COMPILED_DECODE_STEPS} decode steps)", np.stack(steps_expected, 1),
                                   np.stack(steps_actual, 1), o.atol, o.rtol)]
    return Diff(expected_runner.label, str(folder), o.backend, {model.tokens.name if model.tokens else "tokens":
                                                                 list(tokens.shape)}, o.atol, o.rtol, comparisons,
                random_tokens=True, calibrated=expected_runner.calibrated)


def _after_prefill(runner: ModelRunner, tokens: np.ndarray, past: int) -> tuple[dict, dict]:
    """(feeds, outputs) of a decode step over tokens[:, past:], after the model's own prefill of the rest."""
    model = runner.causal_lm
    if runner.first_step_only:
        raise ModelError(f"the {runner.backend} backend runs a merged decoder's first step only (its later-step "
                         "branch is not lowered): compare decode steps with the ort backend")
    if not model.has_cache:
        raise ModelError(f"{runner.label} has no KV cache, so there is no decode step to compare; leave out "
                         "{past_len}", past_len="past_len")
    cache = model.cache_after(runner(model.feeds(tokens[:, :past])))
    feeds = model.feeds(tokens[:, past:], cache)
    return feeds, runner(feeds)


@dataclass
class TextDiff:
    reference: str
    candidate: str
    backend: str
    text: str
    comparison: TextComparison

    def to_dict(self) -> dict:
        return {"reference": self.reference, "candidate": self.candidate, "backend": self.backend, "text": self.text,
                **self.comparison.to_dict()}


def diff_on_text(reference: Model, candidate: Model, text: TextOptions, backend: str = "ort", target: str = "trn2",
                 progress: Progress | None = None) -> TextDiff:
    """Both perplexities, top-1 agreement and KL at every scored position of the windows of a real text."""
    progress = progress or Progress()
    check_backend(backend, target)
    text.check()
    expected_runner, actual_runner = ModelRunner(reference), ModelRunner(candidate, backend, target)
    _check_same_interface(expected_runner, actual_runner)
    tokens, windows = text.read(DEFAULT_WINDOW)
    for runner in (expected_runner, actual_runner):
        check_token_ids(tokens, runner.vocabulary, text.label, runner.label)
    with progress.phase("scoring windows", total=window_count(len(tokens), windows)) as phase:
        comparison = compare_on_text(expected_runner.logits, actual_runner.logits, tokens, windows,
                                     on_window=phase.advance)
    return TextDiff(expected_runner.label, actual_runner.label, backend, text.label, comparison)


def _check_same_interface(reference: ModelRunner, candidate: ModelRunner) -> None:
    """Both models take the same inputs and give the same outputs, by name."""
    for kind, ours, theirs in (("inputs", reference.input_names, candidate.input_names),
                               ("outputs", reference.output_names, candidate.output_names)):
        if sorted(ours) != sorted(theirs):
            only = [f"{name!r} only in {label}" for names, others, label in
                    ((ours, theirs, reference.label), (theirs, ours, candidate.label)) for name in names
                    if name not in others]
            shown = "; ".join(only[:3]) + (f"; and {len(only) - 3} more" if len(only) > 3 else "")
            raise ModelError(f"{reference.label} and {candidate.label} differ in {len(only)} of their {kind} ({shown}):"
                             " the two models do not compute the same thing; diff a model against its own rewrite")
