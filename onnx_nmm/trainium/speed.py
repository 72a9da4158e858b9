"""The Trainium view, modelled: a prefill and a decode step of a causal LM priced layer by layer on one
NeuronCore, or split over several (tensor parallelism: trainium/tensor_parallel.py, the collectives joining them
in trainium/collectives.py), dense against rewritten, beside NeuronMM's end-to-end figures.

Every linear product is priced by the kernels' cost model (trace-only emulation of the kernel `compile`
would launch: dense_matmul, fused_xuv, fused_svd_mlp or fused_svd_ungated_mlp, in bfloat16). Everything else is priced
by a roofline on the same NeuronCore parameters (kernels/pricing/hardware.py), each op on its own:

    time = max(bytes / DMA bandwidth, TensorE FLOPs / TensorE peak, elementwise work / VectorE rate)

— the attention (QKᵀ and PV on TensorE, the softmax, the KV cache read and the new K, V written), the
MLP activations that run outside a fused kernel, RMS norms, residual adds, rotary embeddings and the
embedding gather. A roofline is a lower bound: no launch overhead, perfect overlap within an op, so the
non-linear share of a step is if anything too small. Everything is bfloat16 (2 bytes per element) and
batch 1, as in NeuronMM's end-to-end runs. Nothing here is measured.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from onnx_nmm.errors import OptionError
from onnx_nmm.kernels.pricing.hardware import TRAINIUM_TARGETS, instance
from onnx_nmm.passes import roles
from onnx_nmm.progress import Progress
from onnx_nmm.runtime import compiled_folder
from onnx_nmm.trainium import launch_costs, tensor_parallel
from onnx_nmm.trainium.collectives import ALL_GATHER, collective
from onnx_nmm.trainium.decoder_shape import DecoderShape, decoder_shape
from onnx_nmm.trainium.launch_costs import ELEMENT_BYTES, activation_cost

KERNEL, ROOFLINE, COLLECTIVE = "kernel cost model", "roofline", "collective model"
# What the parts of a step are called, in the order tables show them.
PARTS = ("attention projections", "MLP", "lm_head", "other linear", "attention core", "MLP activation",
         "norms, residuals, rotary, embedding")
_LINEAR_PART = {roles.ATTENTION: "attention projections", roles.MLP: "MLP", roles.LM_HEAD: "lm_head"}

# NeuronMM's end-to-end speed-ups on trn1 (measured by its authors: arXiv 2510.25977, §5.2).
PAPER_FIGURES = {
    "NeuronMM v3, average over 4 LLMs": 1.66,
    "NeuronMLP v4, average over 6 LLMs": 1.21,
    "its code's README: Llama-3.2-1B at keep 0.8, context 32, 64 tokens": 1.454,
}


@dataclass(frozen=True)
class TrainiumOptions:
    """target: "trn1" or "trn2"; prompt_lengths: prefills priced; contexts: KV-cache lengths a decode step
    is priced at; generation: (prompt tokens, new tokens) of the end-to-end figure — by default NeuronMM's
    code benchmark (a context of 32, a sequence of 64); tp: the NeuronCores of one instance the model is split
    over (tensor parallelism, as NxD Inference splits it)."""

    targets: ClassVar[tuple[str, ...]] = TRAINIUM_TARGETS
    target: str = "trn1"
    prompt_lengths: tuple[int, ...] = (128, 512)
    contexts: tuple[int, ...] = (128, 512, 2048)
    generation: tuple[int, int] = (32, 32)
    tp: int = 1

    def __post_init__(self):
        if self.target not in TRAINIUM_TARGETS:
            raise OptionError(f"{{target}} must be one of {', '.join(TRAINIUM_TARGETS)}, got {self.target!r}",
                              target="target")
        machine = instance(self.target)
        if not 1 <= self.tp <= machine.cores:
            raise OptionError(f"{{tp}} must be from 1 to {machine.cores}, the NeuronCores of a {machine.name}, "
                              f"got {self.tp}", tp="tp")
        counts = (*self.prompt_lengths, *self.contexts, *self.generation)
        if not self.prompt_lengths or not self.contexts or len(self.generation) != 2 or min(counts) < 1:
            raise OptionError("{prompt_lengths}, {contexts} and {generation} must be positive token counts",
                              prompt_lengths="prompt_lengths", contexts="contexts", generation="generation")


@dataclass
class Part:
    seconds: float = 0.0
    bytes: float = 0.0  # HBM traffic
    flops: float = 0.0
    how: str = ROOFLINE

    def add(self, seconds: float, bytes_: float, flops: float, times: int = 1) -> None:
        """Count an op `times` over (once per layer, say)."""
        self.seconds += times * seconds
        self.bytes += times * bytes_
        self.flops += times * flops


@dataclass
class PhaseCost:
    """One forward pass of `tokens` new tokens after a KV cache of `context`, part by part (modelled), on one
    rank; split over several, `splits` counts the products that took each way of splitting (by layer),
    `low_rank_saving_s` is what the factorized layers' cheapest splits save against splitting them as NxD splits
    the dense layers they stand for, and `rank_all_reduce_saving_s` the part of it the all-reduces of row-parallel
    layers save by summing X·U, r wide, instead of the output, N wide."""

    tokens: int
    context: int
    parts: dict[str, Part]
    low_rank_saving_s: float = 0.0
    rank_all_reduce_saving_s: float = 0.0
    splits: dict[str, int] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(part.seconds for part in self.parts.values())

    @property
    def kernel_share(self) -> float:
        """The fraction of the time priced by the kernels' cost model (the rest: by a roofline)."""
        return sum(part.seconds for part in self.parts.values() if part.how == KERNEL) / self.seconds

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "context": self.context, "seconds": self.seconds,
                "low_rank_saving_s": self.low_rank_saving_s, "rank_all_reduce_saving_s": self.rank_all_reduce_saving_s,
                "splits": self.splits,
                "parts": {name: asdict(part) for name, part in self.parts.items()}}


@dataclass
class ModelledModel:
    shape: DecoderShape
    prefill: dict[int, PhaseCost]  # prompt length → the prefill
    decode: dict[int, PhaseCost]  # context → one decode step
    generation_prefill_s: float
    generation_decode_s: float  # every step of the end-to-end generation, summed
    sharding: tensor_parallel.Sharding | None = None  # what one NeuronCore holds when split over several

    @property
    def label(self) -> str:
        return self.shape.label

    @property
    def weight_bytes(self) -> int:
        """Bytes of the linear weights in bfloat16 (what a decode step streams from HBM)."""
        return self.shape.linear_parameters * ELEMENT_BYTES

    def step_bytes(self, context: int) -> int:
        """What a decode step at `context` must read: the linear weights and the KV cache."""
        return self.weight_bytes + 2 * self.shape.layers * self.shape.kv_width * context * ELEMENT_BYTES

    @property
    def generation_s(self) -> float:
        return self.generation_prefill_s + self.generation_decode_s

    def to_dict(self) -> dict:
        return {"model": self.label, "layers": self.shape.layers, "products": self.shape.counts(),
                "weight_bytes_bf16": self.weight_bytes, "notes": list(self.shape.notes),
                **({"per_core": {"tp": self.sharding.tp, "query_heads": self.sharding.heads,
                                 "kv_heads": self.sharding.kv_heads}} if self.sharding else {}),
                "prefill": [phase.to_dict() for phase in self.prefill.values()],
                "decode": [phase.to_dict() for phase in self.decode.values()],
                "generation": {"prefill_s": self.generation_prefill_s, "decode_s": self.generation_decode_s,
                               "total_s": self.generation_s}}


@dataclass
class TrainiumEstimate:
    paper_figures: ClassVar[dict[str, float]] = PAPER_FIGURES
    options: TrainiumOptions
    models: list[ModelledModel] = field(default_factory=list)

    def decode_parts(self, context: int) -> list[str]:
        """The parts any model's decode step at `context` has: those of PARTS in their order, then the
        collectives."""
        names = dict.fromkeys(name for model in self.models for name in model.decode[context].parts)
        return [name for name in PARTS if name in names] + [name for name in names if name not in PARTS]

    def prefill_speedup(self, model: ModelledModel, length: int) -> float:
        return self.models[0].prefill[length].seconds / model.prefill[length].seconds

    def decode_speedup(self, model: ModelledModel, context: int) -> float:
        return self.models[0].decode[context].seconds / model.decode[context].seconds

    def ideal_decode_speedup(self, model: ModelledModel, context: int) -> float:
        """The ratio of bytes a decode step reads, the first model's over `model`'s."""
        return self.models[0].step_bytes(context) / model.step_bytes(context)

    def generation_speedups(self, model: ModelledModel) -> dict[str, float]:
        """The end-to-end generation against the first model's: prefill, decode and the whole."""
        first = self.models[0]
        return {"prefill": first.generation_prefill_s / model.generation_prefill_s,
                "decode": first.generation_decode_s / model.generation_decode_s,
                "end to end": first.generation_s / model.generation_s}

    def to_dict(self) -> dict:
        prompt, new = self.options.generation
        return {"note": "modelled on onnx-nmm's Trainium cost model and roofline, not measured",
                "target": self.options.target, "tp": self.options.tp, "instance": instance(self.options.target).name,
                "dtype": "bfloat16", "batch": 1,
                "generation": {"prompt_tokens": prompt, "new_tokens": new}, "paper_end_to_end": PAPER_FIGURES,
                "models": [{**model.to_dict(), "speedup": {
                    "prefill": {str(n): self.prefill_speedup(model, n) for n in self.options.prompt_lengths},
                    "decode": {str(c): self.decode_speedup(model, c) for c in self.options.contexts},
                    "ideal_decode": {str(c): self.ideal_decode_speedup(model, c) for c in self.options.contexts},
                    "generation": self.generation_speedups(model)}} for model in self.models]}


def estimate_trainium(models: Sequence, options: TrainiumOptions = TrainiumOptions(),
                      progress: Progress | None = None) -> TrainiumEstimate:
    """Price every model (a path, an in-memory model, or a DecoderShape) on `options.target`; ratios are
    against the first. ONNX models are taken as `compile` would run them (gated MLPs fused)."""
    progress = progress or Progress()
    estimate = TrainiumEstimate(options)
    with progress.phase(f"pricing on {options.target} (modelled)", total=len(models)) as phase:
        for model in models:
            if isinstance(model, (str, os.PathLike)) and compiled_folder.is_compiled_folder(model):
                modelled = _modelled_compiled(Path(model), options)
            else:
                modelled = _modelled(model if isinstance(model, DecoderShape) else decoder_shape(model), options)
            estimate.models.append(modelled)
            phase.advance(detail=modelled.label)
    return estimate


def price(shape: DecoderShape, tokens: int, context: int, target: str, tp: int = 1) -> PhaseCost:
    """One forward pass of `tokens` new tokens after `context` cached ones, part by part (modelled), on one of
    `tp` NeuronCores the model is split over: every linear product the cheapest way it splits, each collective a
    part of its own; norms and residuals on the whole hidden state, as every rank computes them."""
    parts = {name: Part() for name in PARTS}
    sharding = tensor_parallel.Sharding.of(shape, tp)
    saving, all_reduce_saving, taken = 0.0, 0.0, Counter[str]()
    for product in shape.products:
        ways = tensor_parallel.splits(product, sharding, tokens, target)
        chosen = tensor_parallel.cheapest(ways)
        saving += ways[0].seconds - chosen.seconds
        if ways[0].partial_sums and chosen.partial_sums:
            all_reduce_saving += ways[0].partial_sums.seconds - chosen.partial_sums.seconds
        if tp > 1:
            taken[f"{tensor_parallel.layer_name(product)}: {chosen.how}"] += 1
        part = parts[_LINEAR_PART.get(product.group, "other linear")]
        part.how = KERNEL
        part.add(*chosen.cost)
        for joined in chosen.collectives:
            parts.setdefault(joined.label, Part(how=COLLECTIVE)).add(joined.seconds, joined.sent_bytes, 0.0)
    roofline = functools.partial(launch_costs.roofline, target=target)
    h, q, kv, layers = shape.hidden, sharding.q_width, sharding.kv_width, shape.layers
    keys = tokens * context + tokens * (tokens + 1) // 2  # (query, key) pairs under the causal mask
    attention = roofline(bytes_=ELEMENT_BYTES * (2 * kv * (context + tokens) + 2 * kv * tokens + 2 * q * tokens),
                         tensor_flops=4 * q * keys, elementwise=3 * sharding.heads * keys)
    parts["attention core"].add(*attention, times=layers)
    for width, gated in shape.activations:
        parts["MLP activation"].add(*activation_cost(sharding.share(width), gated, tokens, target))
    norm = roofline(bytes_=ELEMENT_BYTES * 2 * tokens * h, elementwise=4 * tokens * h)
    residual = roofline(bytes_=ELEMENT_BYTES * 3 * tokens * h, elementwise=tokens * h)
    rotary = roofline(bytes_=ELEMENT_BYTES * 2 * tokens * (q + kv), elementwise=3 * tokens * (q + kv))
    rest = parts["norms, residuals, rotary, embedding"]
    for op, times in ((norm, 2 * layers + 1), (residual, 2 * layers), (rotary, layers)):
        rest.add(*op, times=times)
    rest.add(*roofline(bytes_=ELEMENT_BYTES * 2 * tokens * sharding.share(h)))  # the embedding gather: a row in, out
    if tp > 1:  # each rank gathers its columns of the embedding, then the ranks gather the rows
        row = collective(ALL_GATHER, "embedding", h, tokens, tp, target)
        parts[row.label] = Part(row.seconds, row.sent_bytes, 0.0, COLLECTIVE)
    return PhaseCost(tokens, context, {name: part for name, part in parts.items() if part.seconds}, saving,
                     all_reduce_saving, dict(taken))


def _modelled(shape: DecoderShape, options: TrainiumOptions) -> ModelledModel:
    target, tp = options.target, options.tp
    prefill = {length: price(shape, length, 0, target, tp) for length in options.prompt_lengths}
    decode = {context: price(shape, 1, context, target, tp) for context in options.contexts}
    prompt, new = options.generation
    generation_prefill = price(shape, prompt, 0, target, tp).seconds
    generation_decode = sum(price(shape, 1, context, target, tp).seconds
                            for context in range(prompt, prompt + new - 1))
    sharding = tensor_parallel.Sharding.of(shape, tp)
    if tp > 1:
        shape = replace(shape, notes=(*shape.notes, sharding.note))
    return ModelledModel(shape, prefill, decode, generation_prefill, generation_decode, sharding)


def _modelled_compiled(folder: Path, options: TrainiumOptions) -> ModelledModel:
    """A folder `compile --max-context` wrote, priced as it runs: a prompt padded to the smallest bucket that
    holds it, on that bucket's graph; every decode step over the whole cache of max_context positions (the static
    step attends to all of them, masked); each graph with the MLP kernels it chose."""
    if options.tp > 1:
        raise OptionError(f"{folder} is priced as compiled, on one NeuronCore; {{tp}} splits models and configs "
                          "over several", tp="tp")
    manifest, graphs = compiled_folder.read(folder)
    if manifest.get("tp", 1) > 1:
        raise OptionError(f"{folder} holds rank programs for {manifest['tp']} NeuronCores, which are not priced as "
                          f"compiled yet: price the model it was compiled from with {{tp}} {manifest['tp']}", tp="tp")
    target = options.target
    too_long = [context for context in options.contexts if context >= graphs.max_context]
    if too_long:
        raise OptionError(f"{folder} holds a cache of {graphs.max_context} positions; {{contexts}} "
                          f"{', '.join(map(str, too_long))} do not fit it", contexts="contexts")
    shapes: dict[int, DecoderShape] = {}

    def prefill(tokens: int) -> PhaseCost:
        bucket = graphs.bucket_for(tokens)
        if bucket not in shapes:
            shapes[bucket] = decoder_shape(graphs.prefill[bucket], fuse_mlp=False)  # fused as compiled
        return price(shapes[bucket], bucket, 0, target)

    notes = [f"compiled: prompts padded to a bucket ({', '.join(map(str, graphs.buckets))}), every decode step "
             f"over the whole cache of {graphs.max_context} positions"]
    if manifest["target"] != target:
        notes.append(f"its MLP kernels were chosen for {manifest['target']}")
    decode_shape = decoder_shape(graphs.decode, fuse_mlp=False)
    shape = replace(decode_shape, label=str(folder), notes=(*decode_shape.notes, *notes))
    step = price(decode_shape, 1, graphs.max_context - 1, target)
    prompt, new = options.generation
    graphs.check_fits(prompt, new)
    return ModelledModel(shape, {length: prefill(length) for length in options.prompt_lengths},
                         {context: step for context in options.contexts}, prefill(prompt).seconds,
                         (new - 1) * step.seconds)

