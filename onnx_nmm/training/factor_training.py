"""Fine-tune what a rewrite compressed in PyTorch, everything else frozen, and write it back.

The rewritten graph lowered to PyTorch (onnx_nmm.lowering) has the factors U, V of every SvdMatMul and
SvdGatedMLP as its parameters, and the narrowed weights of a nystrom rewrite's MLPs when they are given
(`weights`); the other dense weights are buffers. AdamW trains the factors themselves, or low-rank adapters
on them (factor_adapters, merged back afterwards; narrowed weights are trained themselves), on windows of
token ids x₁..x_S with one of two losses:

    next-token   L = −1/(B(S−1)) Σ_b Σ_{t<S} log q(x_{t+1} | x_≤t)
    distill      L = T²/(BS) Σ_b Σ_t KL( softmax(z_t / T) ‖ softmax(y_t / T) )

q is the student's next-token distribution, y its logits, z the dense teacher's logits on the same window;
the T² keeps the gradient's scale independent of the temperature T (Hinton et al., 2015).

Each step takes the next `batch` windows of a shuffled cycle through the data, clips the gradient to a
global norm, and uses the learning rate

    lr(step, p) = lr · min(1, (step + 1) / warmup) · (0.1 + 0.9 · ½(1 + cos πp)),   warmup = clamp(steps/10, 1, 10)

where p ∈ [0, 1] is the part of the budget spent — the larger of step/steps and seconds/time_budget — so the
decay ends where training does, whichever budget runs out first. Training stops before a step that would
overrun the time budget at the mean step time so far (at least one step is always taken).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx_ir as ir
import torch
import torch.nn.functional as F
from torch import nn

from onnx_nmm.errors import DataError, ModelError, OptionError, TrainingDiverged
from onnx_nmm.lowering import CausalLmInputs, factor_parameters
from onnx_nmm.quality.perplexity import LogitsFn
from onnx_nmm.training.factor_adapters import add_adapters, merge_adapters
from onnx_nmm.training.schedule import TrainingOptions


@dataclass
class StepRecord:
    """One optimizer step: the loss at the parameters it started from."""

    step: int  # 1-based
    loss: float
    learning_rate: float
    seconds: float  # since training started, at the end of this step
    tokens: int  # seen so far


@dataclass
class TrainingResult:
    records: list[StepRecord] = field(default_factory=list)
    stopped_by: str = "steps"  # or "time"
    trainable_parameters: int = 0

    @property
    def losses(self) -> list[float]:
        return [record.loss for record in self.records]

    def mean_loss(self, first: bool, fraction: float = 0.1) -> float:
        """Mean loss of the first (or last) `fraction` of the steps, at least one step."""
        count = max(1, round(fraction * len(self.records)))
        chosen = self.losses[:count] if first else self.losses[-count:]
        return float(np.mean(chosen))

    def to_dict(self) -> dict:
        last = self.records[-1]
        return {"steps": last.step, "tokens": last.tokens, "seconds": last.seconds, "stopped_by": self.stopped_by,
                "trainable_parameters": self.trainable_parameters,
                "loss_first_tenth": self.mean_loss(first=True), "loss_last_tenth": self.mean_loss(first=False),
                "records": [asdict(record) for record in self.records]}


def train_factors(module: nn.Module, windows: np.ndarray, inputs: CausalLmInputs, options: TrainingOptions,
                  teacher: LogitsFn | None = None, on_step: Callable[[StepRecord], None] | None = None,
                  weights: dict[str, nn.Parameter] | None = None, device: str = "cpu") -> TrainingResult:
    """Train the factors of the lowered `module`, and the narrowed `weights` (lowering.weights_as_parameters),
    in place on `windows` [samples, S] of token ids, on the torch `device` (the module is moved there; each
    batch and the teacher's logits go there).

    `teacher` (token ids [B, S] → logits [B, S, vocab]) is needed for the distillation loss. On return the
    module holds the tuned factors (adapters merged) and weights, on `device`, and no parameter requires a
    gradient.
    """
    if options.loss is None:
        raise ValueError("choose the loss first (FinetuneOptions chooses it from the teacher)")
    if options.loss == "distill" and teacher is None:
        raise OptionError("the distillation loss needs the dense model's logits: give the {teacher}", teacher="teacher")
    check_windows(windows, options)

    def loss_of(batch: np.ndarray) -> torch.Tensor:
        return _loss(module, inputs, windows[batch], options, teacher, device)

    return train_parameters(module, weights or {}, len(windows), windows.shape[1], loss_of, options, on_step, device)


def train_parameters(module: nn.Module, weights: dict[str, nn.Parameter], samples: int, tokens_per_sample: int,
                     loss_of: Callable[[np.ndarray], torch.Tensor], options: TrainingOptions,
                     on_step: Callable[[StepRecord], None] | None = None, device: str = "cpu") -> TrainingResult:
    """The loop of the module docstring: the factors of the lowered `module` (or adapters on them) and `weights`
    trained in place on `device` to lower `loss_of(sample indices)`, `options.batch` of the `samples` at a time.
    On return the module holds the tuned factors (adapters merged) and weights, and no parameter requires a
    gradient."""
    module.to(device)  # in place: the Parameters of `weights` are the ones that move
    factors = factor_parameters(module)
    _check_trainable(factors | weights)
    torch.manual_seed(options.seed)
    adapters = add_adapters(module, options.adapter_rank, options.seed) if options.adapter_rank and factors else None
    if adapters:
        for adapter in adapters.values():
            adapter.to(device)
    trainable = ([p for adapter in adapters.values() for p in adapter.parameters()] if adapters
                 else list(factors.values())) + list(weights.values())
    for parameter in trainable:
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=options.learning_rate, weight_decay=0.0)
    result = TrainingResult(trainable_parameters=sum(p.numel() for p in trainable))
    batches = _shuffled_batches(np.arange(samples), options.batch, options.seed)
    start, tokens_seen = time.perf_counter(), 0
    while len(result.records) < options.steps:
        seconds = time.perf_counter() - start
        if _would_overrun(options.time_budget, seconds, len(result.records)):
            result.stopped_by = "time"
            break
        learning_rate = options.learning_rate_at(len(result.records), seconds)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        batch = next(batches)
        loss = loss_of(batch)
        if not torch.isfinite(loss):
            raise TrainingDiverged(f"the loss became {loss.item()} at step {len(result.records) + 1}; nothing was "
                                   "written: lower the {learning_rate}", learning_rate="training.learning_rate")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(trainable, options.max_grad_norm)
        optimizer.step()
        tokens_seen += len(batch) * tokens_per_sample
        record = StepRecord(len(result.records) + 1, loss.item(), learning_rate, time.perf_counter() - start,
                            tokens_seen)
        result.records.append(record)
        if on_step is not None:
            on_step(record)
    for parameter in trainable:
        parameter.requires_grad_(False)
    if adapters:
        merge_adapters(module, adapters)
    return result


def check_windows(windows: np.ndarray, options: TrainingOptions) -> None:
    """Raise DataError unless `windows` [samples, S] can fill a batch of `options`."""
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise DataError(f"training windows must be [samples, ≥ 2 tokens], got shape {list(windows.shape)}")
    if options.batch > len(windows):
        raise DataError(f"a batch of {options.batch} windows needs at least as many training windows; "
                        f"there are {len(windows)}: lower the {{batch}} or give more text", batch="training.batch")


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean −log q(x_{t+1} | x_≤t) over every position that has a next token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T² · mean over positions of KL(softmax(teacher/T) ‖ softmax(student/T))."""
    log_q = F.log_softmax(logits.flatten(0, 1).float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.flatten(0, 1).float() / temperature, dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * temperature**2


def replace_factors(model: ir.Model, factors: dict[str, torch.Tensor]) -> None:
    """Overwrite the factor initializers of `model` with `factors`, each in its initializer's dtype.

    Raises TrainingDiverged, changing nothing, if any factor holds NaN or Inf once stored in that dtype.
    """
    stored = {}
    for name, factor in factors.items():
        value = model.graph.initializers.get(name)
        if value is None or value.const_value is None or tuple(value.const_value.shape) != tuple(factor.shape):
            raise ValueError(f"factor {name} {tuple(factor.shape)} matches no initializer of the model")
        dtype = value.const_value.dtype
        array = np.ascontiguousarray(factor.detach().cpu().numpy().astype(dtype.numpy()))
        if not np.isfinite(array.astype(np.float32)).all():
            raise TrainingDiverged(f"factor {name} holds NaN or Inf after training (stored as {dtype.name}); nothing "
                                   "was written: lower the {learning_rate}", learning_rate="training.learning_rate")
        stored[name] = ir.tensor(array, dtype=dtype, name=name)
    for name, tensor in stored.items():
        model.graph.initializers[name].const_value = tensor


def _check_trainable(parameters: dict[str, nn.Parameter]) -> None:
    if not parameters:
        raise ModelError("the model has no SVD factors or narrowed weights to fine-tune; rewrite it first")
    wrong = sorted({str(factor.dtype) for factor in parameters.values() if factor.dtype != torch.float32})
    if wrong:
        raise ModelError(f"fine-tuning trains float32 factors and weights; this model's are {', '.join(wrong)}: "
                         "rewrite the float32 export and fine-tune that")


def _loss(module: nn.Module, inputs: CausalLmInputs, batch: np.ndarray, options: TrainingOptions,
          teacher: LogitsFn | None, device: str) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnx2torch's internal deprecations, which say nothing about the model
        logits = module(*(tensor.to(device) for tensor in inputs(batch)))
    logits = logits[0] if isinstance(logits, (tuple, list)) else logits
    if options.loss == "next-token":
        return next_token_loss(logits, torch.from_numpy(batch).to(device))
    assert teacher is not None, "the distillation loss is checked to have a teacher"
    return distillation_loss(logits, torch.from_numpy(np.asarray(teacher(batch))).to(device), options.temperature)


def _shuffled_batches(windows: np.ndarray, batch: int, seed: int) -> Iterator[np.ndarray]:
    """`batch` windows at a time from an endless sequence of shuffled passes over `windows`."""
    rng = np.random.default_rng(seed)
    order = np.empty(0, dtype=np.int64)
    while True:
        while len(order) < batch:
            order = np.concatenate([order, rng.permutation(len(windows))])
        yield windows[order[:batch]]
        order = order[batch:]


def _would_overrun(time_budget: float | None, seconds: float, steps_done: int) -> bool:
    return time_budget is not None and steps_done > 0 and seconds + seconds / steps_done > time_budget
