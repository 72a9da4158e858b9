"""Fine-tune what a rewrite compressed and put it back into the same graph (`finetune`): the SVD factors,
and the narrowed MLP weights of a nystrom rewrite.

    read the training windows (and held-out text) ─ perplexity before (onnxruntime)
    ─ whole:          lower to PyTorch ─ train the factors and narrowed weights only on the logits' loss
                      (factor_training) ─ write them into the ONNX graph
      layer by layer: each decoder layer in turn trained to the dense layer's outputs (layer_by_layer), for a
                      model that does not fit in memory twice (fits)
    ─ perplexity after (onnxruntime, the tuned model)

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
from onnx_nmm.training.fits import too_large_to_finetune_whole
from onnx_nmm.training.layer_pairs import LayerPairs
from onnx_nmm.training.schedule import TrainingOptions
from onnx_nmm.training.tuning_work import TuningWork

if TYPE_CHECKING:
    from onnx_nmm.training.factor_training import TrainingResult
    from onnx_nmm.training.layer_by_layer import LayerTuning

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
    weights come back to the CPU to be written into the graph.

    layer_by_layer: tune one decoder layer at a time to the dense layer's outputs (layer_by_layer.py), never
    holding the model twice; None: when the whole model would not fit in memory (fits.py). output: where the
    tuned model will be written; layer by layer keeps its finished layers in `<output>.partial/`, where the same
    call takes up after a kill (None: a temporary folder, removed when the result is saved)."""

    training: TrainingOptions = field(default_factory=TrainingOptions)
    teacher: Model | None = None
    evaluation: TextOptions | None = None
    threads: int | None = None
    checkpoints: dict[int, str | os.PathLike] = field(default_factory=dict)
    device: str = DEFAULT_DEVICE
    layer_by_layer: bool | None = None
    output: str | os.PathLike | None = None

    def __post_init__(self):
        check_device(self.device)
        if self.layer_by_layer and self.training.loss == "next-token":
            raise OptionError("{layer_by_layer} tunes each layer to the dense layer's outputs: the next-token "
                              "{loss} has no target inside the model; fine-tune the whole model for it",
                              layer_by_layer="layer_by_layer", loss="training.loss")
        if self.layer_by_layer and self.checkpoints:
            raise OptionError("{checkpoints} are steps of one training, and {layer_by_layer} trains each layer in "
                              "turn: fine-tune the whole model for them", checkpoints="checkpoints",
                              layer_by_layer="layer_by_layer")
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
    layers: list[LayerTuning] = field(default_factory=list)  # layer by layer: how each layer went
    work: TuningWork | None = None  # layer by layer: where the tuned weights are, until saved

    @property
    def loss_rose(self) -> bool:
        """The last tenth's mean loss well above the first tenth's (of any layer's, layer by layer): the learning
        rate was too high, and the tuned model is likely worse than its input."""
        from onnx_nmm.training.factor_training import TrainingResult

        runs = [TrainingResult(layer.records) for layer in self.layers if layer.records] or [self.training]
        return any(run.mean_loss(first=False) > LOSS_ROSE * run.mean_loss(first=True) for run in runs)

    def save(self, path: str | os.PathLike, overwrite_input: bool = False) -> Path:
        """Write the tuned model atomically, as the input was written (external data or not); the layer-by-layer
        work folder, whose files held the tuned weights, goes once they are written."""
        start = time.perf_counter()
        if self.work is not None and not self.source_used_external_data:
            _read_into_memory(self.model, self.work.folder)  # the model's one file holds every weight
        written = save_derived(self.model, path, self.source_path, self.source_used_external_data,
                               overwrite_input=overwrite_input)
        if self.work is not None:
            self.work.remove()
        self.seconds["writing"] = time.perf_counter() - start
        return written

    def to_dict(self, options: FinetuneOptions) -> dict:
        training = options.training
        return {"loss": self.loss, "teacher": self.teacher, "training_data": self.data,
                "options": asdict(training) | {"loss": self.loss, "warmup_steps": training.warmup_steps},
                **self.training.to_dict(),
                "seconds_by_phase": self.seconds,
                "perplexity_before": self.before.to_dict() if self.before else None,
                "perplexity_after": self.after.to_dict() if self.after else None,
                **({"layers": [{"layer": layer.layer, "relative_error_before": layer.error_before,
                                "relative_error_after": layer.error_after, "steps": layer.steps,
                                "seconds": layer.seconds, "stopped_by": layer.stopped_by} for layer in self.layers]}
                   if self.layers else {})}


def _read_into_memory(model: ir.Model, folder: Path) -> None:
    """The initializers `model` reads from files in `folder`, held in memory instead."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and Path(tensor.base_dir).resolve() == folder.resolve():
            value.const_value = ir.tensor(tensor.numpy(), dtype=tensor.dtype, name=value.name)


# The last tenth's mean loss over the first tenth's that is taken as divergence: a margin, because single
# batches differ in difficulty (on Qwen2.5-0.5B, lr 1e-4 took the distillation loss from 0.39 to 1.3 in
# eight steps).
LOSS_ROSE = 1.5


def finetune(model: Model, data: TrainingData, options: FinetuneOptions | None = None,
             progress: Progress | None = None) -> FinetuneResult:
    """Train the factors and narrowed weights of the rewritten `model` on `data`, the whole model at once or one
    layer at a time (`options.layer_by_layer`); the tuned model (same graph) and how it went."""
    from onnx_nmm.training.factor_training import check_windows

    options, progress = options or FinetuneOptions(), progress or Progress()
    data.check()  # a bad text or tokenizer is said before the model loads
    if options.evaluation is not None:
        options.evaluation.check()
    source = ModelSource.of(model)
    generated_only = all(isinstance(s, GeneratedText) for s in calibration_sources(data.text))
    if generated_only and data.prompts is None and data.prompted and data.tokenizer is not None:
        data = replace(data, prompts=recorded_calibration_text(source.model))  # the default data: both kinds
        data.check()
    narrowed = _trained_weights(source)
    vocabulary = vocabulary_size(source.model.graph)
    options = _with_teacher(options, source)
    layer_by_layer = options.layer_by_layer
    if layer_by_layer is None:
        layer_by_layer = too_large_to_finetune_whole(source) is not None
    if layer_by_layer:
        options = replace(options, layer_by_layer=True)  # checked again: a loss or checkpoints it cannot do
    teacher = dense = None
    if options.training.loss == "distill" and options.teacher is not None:
        # layer by layer reads the dense model one layer at a time; whole, onnxruntime runs all of it
        dense = ModelSource.of(options.teacher) if layer_by_layer else None
        teacher = None if layer_by_layer else ModelRunner(options.teacher)
    teacher_vocabulary = (teacher.vocabulary if teacher is not None
                          else vocabulary_size(dense.model.graph) if dense is not None else None)
    if None not in (vocabulary, teacher_vocabulary) and vocabulary != teacher_vocabulary:
        label = teacher.label if teacher is not None else dense.label if dense is not None else ""
        raise ModelError(f"the teacher {label} predicts {teacher_vocabulary} tokens, {source.label} "
                         f"{vocabulary}: give the dense model this one was rewritten from")
    pairs = LayerPairs.of(dense, source) if dense is not None else None  # a model that cannot be cut: said now
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
    if pairs is not None:
        result = _tune_layer_by_layer(pairs, windows, narrowed, options, phases, progress)
    else:
        result = _tune_whole(source, teacher, windows, narrowed, options, phases, progress)
        del teacher  # its onnxruntime session
    result.before = before
    if evaluation is not None:
        if result.work is not None:  # onnxruntime reads external weights from one folder, the input's
            _read_into_memory(result.model, result.work.folder)
        with phases("perplexity after"):
            result.after = _perplexity(ModelRunner(source.model), eval_tokens, eval_windows, progress,
                                       "perplexity after")
    return result


def _tune_whole(source: ModelSource, teacher: ModelRunner | None, windows: TokenWindows, narrowed: list[str],
                options: FinetuneOptions, phases: _Phases, progress: Progress) -> FinetuneResult:
    """The whole rewritten model lowered to PyTorch and trained on the loss of its logits."""
    from onnx_nmm.lowering import CausalLmInputs, factor_parameters, lower, weights_as_parameters
    from onnx_nmm.training.factor_training import replace_factors, train_factors

    with phases("lowering"), progress.phase("lowering to PyTorch"):
        module = lower(first_step(source.full_proto()), consume=True)
        weights = weights_as_parameters(module, narrowed)
    with phases("training"), progress.phase(f"training ({options.training.loss} loss)",
                                            total=options.training.steps) as phase:
        on_step = _advancing_and_saving(phase, options.checkpoints, source, module, weights)
        training = train_factors(module, windows.tokens, CausalLmInputs(source), options.training,
                                 teacher.logits if teacher is not None else None, on_step=on_step, weights=weights,
                                 device=options.device)
    with phases("writing the factors"), progress.phase("writing the factors into the graph"):
        replace_factors(source.model, factor_parameters(module) | weights)
        del module
    return FinetuneResult(source.model, training, windows.description, options.training.loss,
                          None if teacher is None else teacher.label, seconds=phases.seconds,
                          source_path=source.path, source_used_external_data=source.used_external_data)


def _tune_layer_by_layer(pairs: LayerPairs, windows: TokenWindows, narrowed: list[str], options: FinetuneOptions,
                         phases: _Phases, progress: Progress) -> FinetuneResult:
    """Each decoder layer tuned in turn to the dense layer's outputs (layer_by_layer.py)."""
    from onnx_nmm.training.layer_by_layer import LAYER_LOSS, tune_layer_by_layer, work_settings

    source = pairs.compressed_source
    work = TuningWork.open(source, options.output, work_settings(options.training, pairs.dense_source.label,
                                                                 options.device, windows.tokens))
    with phases("training layer by layer"):
        try:
            layers = tune_layer_by_layer(pairs, windows.tokens, narrowed, options.training, work, options.device,
                                         progress)
        except Exception:
            work.remove_if_empty()  # refused before a layer was finished: nothing to take up
            raise
    return FinetuneResult(source.model, _one_run(layers), windows.description, LAYER_LOSS, pairs.dense_source.label,
                          seconds=phases.seconds, source_path=source.path,
                          source_used_external_data=source.used_external_data, layers=layers, work=work)


def _one_run(layers: list[LayerTuning]) -> TrainingResult:
    """The layers' steps one after the other, as one run: steps, seconds and tokens counted on from the layer
    before."""
    from onnx_nmm.training.factor_training import StepRecord, TrainingResult

    run = TrainingResult(stopped_by="time" if any(layer.stopped_by == "time" for layer in layers) else "steps",
                         trainable_parameters=sum(layer.trainable_parameters for layer in layers))
    for layer in layers:
        last = run.records[-1] if run.records else StepRecord(0, 0.0, 0.0, 0.0, 0)
        run.records += [replace(record, step=last.step + record.step, seconds=last.seconds + record.seconds,
                                tokens=last.tokens + record.tokens) for record in layer.records]
    return run


def _trained_weights(source: ModelSource) -> list[str]:
    """The narrowed weights of `source` that fine-tuning trains (besides its SVD factors); refused when it has
    neither, or only in a form that cannot be trained."""
    narrowed = narrowed_weights(source.model)
    custom = any(node.domain == DOMAIN for node in ir.traversal.RecursiveGraphIterator(source.model.graph))
    if narrowed or custom:
        return narrowed
    if any(".narrowed" in name for name in source.model.graph.initializers):
        raise ModelError(f"the narrowed weights of {source.label} are stored quantized (or in float16), and "
                         "fine-tuning trains float32 weights: narrow the float32 export to fine-tune")
    if any(".svd_" in name for name in source.model.graph.initializers):
        raise ModelError(f"the factors of {source.label} are written quantized, and fine-tuning trains float "
                         "factors: rewrite it with {factor_dtype} float32 (or float16) to fine-tune",
                         factor_dtype="factorization.factor_dtype")
    raise ModelError(f"{source.label} has no {DOMAIN} SVD ops and no narrowed MLPs, so nothing to fine-tune; "
                     "rewrite it first")


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
