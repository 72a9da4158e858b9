"""How the trained weights are trained (`TrainingOptions`): the step and time budgets, AdamW's learning rate and
its schedule (a linear warm-up, then a cosine decay to a tenth), windows per step, the loss."""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx_nmm.errors import OptionError

LOSSES = ("next-token", "distill")
FINAL_LR_FRACTION = 0.1
MAX_WARMUP_STEPS = 10


@dataclass(frozen=True)
class TrainingOptions:
    """How the factors are trained: a step budget and an optional time budget (the first to run out ends
    training), AdamW's peak learning rate, windows per step, the loss (and the distillation temperature),
    adapters of a rank instead of the factors themselves, gradient clipping, and the seed of the window
    order and the adapters."""

    steps: int = 200
    time_budget: float | None = None  # seconds of training; None: the step budget alone
    learning_rate: float = 1e-4
    batch: int = 2
    loss: str | None = None  # None: FinetuneOptions decides (distillation with a teacher, else next-token)
    temperature: float = 1.0  # distillation only
    adapter_rank: int | None = None  # train adapters of this rank on U and V instead of U and V themselves
    max_grad_norm: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.loss is not None and self.loss not in LOSSES:
            raise OptionError(f"{{loss}} must be one of {', '.join(LOSSES)}, got {self.loss!r}", loss="training.loss")
        for name in ("steps", "batch", "adapter_rank"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise OptionError(f"{{{name}}} must be a positive integer, got {value}", **{name: f"training.{name}"})
        for name in ("learning_rate", "temperature", "time_budget", "max_grad_norm"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise OptionError(f"{{{name}}} must be positive, got {value}", **{name: f"training.{name}"})

    @property
    def warmup_steps(self) -> int:
        return max(1, min(MAX_WARMUP_STEPS, self.steps // 10))

    def learning_rate_at(self, step: int, seconds: float) -> float:
        spent = step / self.steps
        if self.time_budget is not None:
            spent = max(spent, seconds / self.time_budget)
        decay = FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(spent, 1.0)))
        return self.learning_rate * min(1.0, (step + 1) / self.warmup_steps) * decay
