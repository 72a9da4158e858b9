"""Fine-tune what a rewrite compressed and put it back into the same graph (`finetune`): the SVD factors,
and the narrowed MLP weights of a nystrom rewrite.

    read the training windows (and held-out text) ─ perplexity before (onnxruntime)
    ─ lower to PyTorch ─ train the factors and narrowed weights only (factor_training) ─ write them into the
    ONNX graph ─ perplexity after (onnxruntime, the tuned model)

Only those initializers change, each in its dtype; the result saves like a rewrite's.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnx_nmm.calibration.calibration_data import (
    TokenWindows,
    check_token_ids,
    check_token_sources,
    joined_windows,
    token_windows,
)
from onnx_nmm.calibration.generated_text import generated_windows
from onnx_nmm.calibration.sources import GeneratedText, calibration_sources
from onnx_nmm.errors import ModelError, OptionError
from onnx_nmm.model_io import save_derived
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes.mlp_narrowing import NARROWED_KEY
from onnx_nmm.passes.svd_ops import DOMAIN
from onnx_nmm.progress import Progress
from onnx_nmm.quality.evaluation import TextOptions
from onnx_nmm.quality.perplexity import PerplexityResult, Windows, perplexity, window_count
from onnx_nmm.runtime.backend_runner import Model, ModelRunner
from onnx_nmm.runtime.causal_lm import vocabulary_size
from onnx_nmm.runtime.graph_probe import first_step
from onnx_nmm.teacher import recorded_calibration_text, recorded_dense_model
from onnx_nmm.training.device import DEFAULT_DEVICE, check_device
from onnx_nmm.training.schedule import TrainingOptions

if TYPE_CHECKING:
    from onnx_nmm.training.factor_training import TrainingResult

DEFAULT_TRAINING_TEXT = "generated:32"  # and DEFAULT_PROMPTED more that continue calibration passages
DEFAULT_PROMPTED = 32
PROMPT_TOKENS = 32


@dataclass(frozen=True)
class TrainingData:
    """text: a UTF-8 file (with `tokenizer`), an .npz with input_ids [samples, seq_len], token ids as such
    an array, "generated[:N]" or a GeneratedText (windows sampled from the dense model: the default, as
    text the model writes itself teaches no corpus's style), or a list of these, mixed; cut into windows of
    `seq_len` tokens (an .npz or array sets its own), the first `samples` of each text; each window of a
    text starts with the BOS token its tokenizer adds (when it adds one), unless not `bos`.

    prompts: a text whose passages of PROMPT_TOKENS tokens (spread over it) the dense model continues into
    `prompted` more generated windows: the calibration domain's openings in the model's own words. When the
    text is generated only and no prompts are given, finetune takes the calibration text the rewrite recorded;
    `prompted` 0 turns them off."""

    text: object = DEFAULT_TRAINING_TEXT
    tokenizer: str | os.PathLike | None = None
    seq_len: int = 256
    samples: int | None = None
    bos: bool = True
    prompts: str | os.PathLike | None = None
    prompted: int = DEFAULT_PROMPTED

    def __post_init__(self):
        if self.seq_len < 2:
            raise OptionError(f"{{seq_len}} must be at least 2, got {self.seq_len}", seq_len="data.seq_len")
        if self.samples is not None and self.samples < 1:
            raise OptionError(f"{{samples}} must be a positive integer, got {self.samples}", samples="data.samples")
        if self.prompted < 0:
            raise OptionError(f"{{prompted}} must be 0 (no prompted windows) or more, got {self.prompted}",
                              prompted="data.prompted")

    def check(self) -> None:
        """The texts and token files are there (a text not empty, with a tokenizer that is one): said before a
        model loads, not after."""
        prompts = calibration_sources(self.prompts) if self.prompts is not None and self.prompted else ()
        check_token_sources([*calibration_sources(self.text), *prompts], self.tokenizer, "data.tokenizer")

    def windows(self, dense_model=None, progress: Progress | None = None) -> TokenWindows:
        """The training windows; generated ones sampled from `dense_model` (unless they name a generator), which
        `progress` hears."""
        parts = []
        sources = list(calibration_sources(self.text))
        for source in sources:
            if not isinstance(source, GeneratedText):
                parts.append(token_windows(source, self.tokenizer, self.samples, self.seq_len,
                                           tokenizer_option="data.tokenizer", bos=self.bos))
            else:
                parts.append(self._generated(source, dense_model, progress))
        if self.prompts is not None and self.prompted:
            # sampled by the generator the other generated windows name, if any
            generator = next((source.generator for source in sources if isinstance(source, GeneratedText)), None)
            prompts = token_windows(self.prompts, self.tokenizer, self.prompted, PROMPT_TOKENS, spread=True,
                                    tokenizer_option="data.tokenizer", bos=self.bos)
            parts.append(self._generated(GeneratedText(samples=self.prompted, generator=generator), dense_model,
                                         progress, prompts))
        return joined_windows(parts)

    def _generated(self, source: GeneratedText, dense_model, progress: Progress | None,
                   prompts: TokenWindows | None = None) -> TokenWindows:
        if dense_model is None and source.generator is None:
            raise OptionError("generated training text is sampled from the dense model: give the {teacher}",
                              teacher="teacher")
        description = f"sampling training text ({source.describe(self.seq_len)})"
        with (progress or Progress()).phase(description, total=source.batches()) as phase:
            return generated_windows(source, dense_model, self.seq_len, self.tokenizer, on_batch=phase.advance,
                                     prompts=prompts)


@dataclass(frozen=True)
class FinetuneOptions:
    """training: the loop's options; its loss, unless given, is distillation from the `teacher` — the dense
    model the rewrite started from, by default the one the rewrite recorded (onnx_nmm.teacher). evaluation:
    held-out text scored before and after (its window defaults to the training windows' length). threads:
    PyTorch's CPU threads. checkpoints: step → path, where the model trained so far is also written when
    training reaches that step (a steps-against-quality curve from one run). device: the torch device the
    lowered model, the batches and the teacher's logits train on ("cpu", "cuda", "cuda:1", ...); the trained
    weights come back to the CPU to be written into the graph."""

    training: TrainingOptions = field(default_factory=TrainingOptions)
    teacher: Model | None = None
    evaluation: TextOptions | None = None
    threads: int | None = None
    checkpoints: dict[int, str | os.PathLike] = field(default_factory=dict)
    device: str = DEFAULT_DEVICE

    def __post_init__(self):
        check_device(self.device)
        if self.training.loss is None and self.teacher is not None:
            object.__setattr__(self, "training", replace(self.training, loss="distill"))
        if self.threads is not None and self.threads < 1:
            raise OptionError(f"{{threads}} must be a positive integer, got {self.threads}", threads="threads")
        if self.checkpoints and self.training.adapter_rank is not None:
            raise OptionError("{checkpoints} write the trained weights as they are, and adapters are merged into "
                              "them only at the end: train without {adapter_rank}", checkpoints="checkpoints",
                              adapter_rank="training.adapter_rank")


@dataclass
class FinetuneResult:
    model: ir.Model  # the same graph, the tuned factors in it
    training: TrainingResult
    data: str  # where the training windows came from
    loss: str | None = None  # the loss trained: "distill" or "next-token"
    teacher: str | None = None  # the dense model distilled from (a path, or "the in-memory model")
    before: PerplexityResult | None = None  # on the held-out text, in onnxruntime
    after: PerplexityResult | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase
    source_path: Path | None = None
    source_used_external_data: bool = False

    @property
    def loss_rose(self) -> bool:
        """The last tenth's mean loss well above the first tenth's: the learning rate was too high, and the
        tuned model is likely worse than its input."""
        return self.training.mean_loss(first=False) > LOSS_ROSE * self.training.mean_loss(first=True)

    def save(self, path: str | os.PathLike, overwrite_input: bool = False) -> Path:
        """Write the tuned model atomically, as the input was written (external data or not)."""
        start = time.perf_counter()
        written = save_derived(self.model, path, self.source_path, self.source_used_external_data,
                               overwrite_input=overwrite_input)
        self.seconds["writing"] = time.perf_counter() - start
        return written

    def to_dict(self, options: FinetuneOptions) -> dict:
        training = replace(options.training, loss=self.loss)
        return {"loss": self.loss, "teacher": self.teacher, "training_data": self.data,
                "options": asdict(training) | {"warmup_steps": training.warmup_steps}, **self.training.to_dict(),
                "seconds_by_phase": self.seconds,
                "perplexity_before": self.before.to_dict() if self.before else None,
                "perplexity_after": self.after.to_dict() if self.after else None}


# The last tenth's mean loss over the first tenth's that is taken as divergence: a margin, because single
# batches differ in difficulty (on Qwen2.5-0.5B, lr 1e-4 took the distillation loss from 0.39 to 1.3 in
# eight steps).
LOSS_ROSE = 1.5


def finetune(model: Model, data: TrainingData, options: FinetuneOptions | None = None,
             progress: Progress | None = None) -> FinetuneResult:
    """Train the factors and narrowed weights of the rewritten `model` on `data`; the tuned model (same graph)
    and how it went."""
    from onnx_nmm.lowering import CausalLmInputs
    from onnx_nmm.training.factor_training import check_windows, replace_factors

    options, progress = options or FinetuneOptions(), progress or Progress()
    data.check()  # a bad text or tokenizer is said before the model loads
    if options.evaluation is not None:
        options.evaluation.check()
    source = ModelSource.of(model)
    generated_only = all(isinstance(s, GeneratedText) for s in calibration_sources(data.text))
    if generated_only and data.prompts is None and data.prompted and data.tokenizer is not None:
        data = replace(data, prompts=recorded_calibration_text(source.model))  # the default data: both kinds
        data.check()
    narrowed = narrowed_weights(source.model)
    custom = any(node.domain == DOMAIN for node in ir.traversal.RecursiveGraphIterator(source.model.graph))
    if not narrowed and not custom:
        if any(".narrowed" in name for name in source.model.graph.initializers):
            raise ModelError(f"the narrowed weights of {source.label} are stored quantized (or in float16), and "
                             "fine-tuning trains float32 weights: narrow the float32 export to fine-tune")
        if any(".svd_" in name for name in source.model.graph.initializers):
            raise ModelError(f"the factors of {source.label} are written quantized, and fine-tuning trains float "
                             "factors: rewrite it with {factor_dtype} float32 (or float16) to fine-tune",
                             factor_dtype="factorization.factor_dtype")
        raise ModelError(f"{source.label} has no {DOMAIN} SVD ops and no narrowed MLPs, so nothing to fine-tune; "
                         "rewrite it first")
    vocabulary = vocabulary_size(source.model.graph)
    options = _with_teacher(options, source)
    teacher = None
    if options.training.loss == "distill" and options.teacher is not None:
        teacher = ModelRunner(options.teacher)
    if teacher is not None and None not in (vocabulary, teacher.vocabulary) and vocabulary != teacher.vocabulary:
        raise ModelError(f"the teacher {teacher.label} predicts {teacher.vocabulary} tokens, {source.label} "
                         f"{vocabulary}: give the dense model this one was rewritten from")
    phases = _Phases()
    with phases("reading data"):
        windows = data.windows(options.teacher or recorded_dense_model(source.model), progress)
        check_windows(windows.tokens, options.training)
        check_token_ids(windows.tokens, vocabulary, windows.description, source.label)
        evaluation = options.evaluation
        if evaluation is not None:
            eval_tokens, eval_windows = evaluation.read(windows.tokens.shape[1])
            check_token_ids(eval_tokens, vocabulary, evaluation.label, source.label)
    if options.threads:
        import torch

        torch.set_num_threads(options.threads)
    before = None
    if evaluation is not None:
        with phases("perplexity before"):
            before = _perplexity(ModelRunner(source), eval_tokens, eval_windows, progress, "perplexity before")
    with phases("lowering"), progress.phase("lowering to PyTorch"):
        from onnx_nmm.lowering import factor_parameters, lower, weights_as_parameters

        module = lower(first_step(source.full_proto()), consume=True)
        weights = weights_as_parameters(module, narrowed)
    with phases("training"), progress.phase(f"training ({options.training.loss} loss)",
                                            total=options.training.steps) as phase:
        from onnx_nmm.training.factor_training import train_factors

        on_step = _advancing_and_saving(phase, options.checkpoints, source, module, weights)
        training = train_factors(module, windows.tokens, CausalLmInputs(source), options.training,
                                 teacher.logits if teacher is not None else None, on_step=on_step, weights=weights,
                                 device=options.device)
    result = FinetuneResult(source.model, training, windows.description, options.training.loss,
                            None if teacher is None else teacher.label, before=before, seconds=phases.seconds,
                            source_path=source.path, source_used_external_data=source.used_external_data)
    del teacher  # its onnxruntime session
    with phases("writing the factors"), progress.phase("writing the factors into the graph"):
        replace_factors(source.model, factor_parameters(module) | weights)
        del module
    if evaluation is not None:
        with phases("perplexity after"):
            result.after = _perplexity(ModelRunner(source.model), eval_tokens, eval_windows, progress,
                                       "perplexity after")
    return result


def _advancing_and_saving(phase, checkpoints: dict, source: ModelSource, module, weights: dict):
    """What each training step calls: the progress advances, and at a checkpoint's step the weights trained so
    far are written into the graph and the model saved there."""
    from onnx_nmm.lowering import factor_parameters
    from onnx_nmm.training.factor_training import replace_factors

    def on_step(record) -> None:
        phase.advance(detail=f"loss {record.loss:.4f}")
        if record.step in checkpoints:
            replace_factors(source.model, factor_parameters(module) | weights)
            save_derived(source.model, checkpoints[record.step], source.path, source.used_external_data)

    return on_step


def narrowed_weights(model: ir.Model) -> list[str]:
    """The float32 weight initializers of a nystrom rewrite's narrowed MLPs, which fine-tuning trains."""
    names = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        weight = node.inputs[1] if NARROWED_KEY in node.metadata_props and node.op_type == "MatMul" else None
        if weight is not None and weight.is_initializer() and weight.name and weight.const_value is not None \
                and weight.const_value.dtype == ir.DataType.FLOAT and weight.name not in names:
            names.append(weight.name)
    return names


def _with_teacher(options: FinetuneOptions, source: ModelSource) -> FinetuneOptions:
    """`options` with the loss decided: distillation from the given teacher, else from the dense model the
    rewrite recorded; next-token only when asked for."""
    if options.teacher is None and options.training.loss != "next-token":
        recorded = recorded_dense_model(source.model)
        if recorded is None:
            raise OptionError(f"fine-tuning distils from the dense model {source.label} was rewritten from, and it "
                              "names none that is still there: give the {teacher}, or choose {loss} next-token "
                              "(which learns the training text's style as well)", teacher="teacher",
                              loss="training.loss")
        options = replace(options, teacher=str(recorded))
    if options.training.loss is None:
        options = replace(options, training=replace(options.training, loss="distill"))
    return options


def _perplexity(runner: ModelRunner, tokens: np.ndarray, windows: Windows, progress: Progress, label: str):
    with progress.phase(label, total=window_count(len(tokens), windows)) as phase:
        return perplexity(runner.logits, tokens, windows, on_window=phase.advance)


class _Phases:
    """Wall seconds of each named phase, in order."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
