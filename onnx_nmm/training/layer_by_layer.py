"""Fine-tuning one decoder layer at a time (`finetune`'s layer-by-layer path), for models that do not fit in
memory twice: the dense model and the rewritten one are cut at the same residual stream (layer_pairs.py) and
only one layer of each is read at a time.

For layer i, with X̃ᵢ the training windows' residual stream before it in the rewritten model tuned up to it
(X̃₀: the embedding's, nothing comes before the first layer), in files (layerwise.carried):

    targets  Yᵢ = the dense layer i on X̃ᵢ (onnxruntime)
    train    the rewritten layer i lowered to PyTorch, only its SVD factors and narrowed weights (what the
             whole-model fine-tuning trains), to lower  L = mean (f̃ᵢ(X̃ᵢ) − Yᵢ)² / m̄ᵢ  over a batch, where m̄ᵢ
             is the mean square of Yᵢ over every training window: a constant of the layer, so the minimum is the
             MSE's and one learning rate fits layers whose residual streams differ in scale
    forward  X̃ᵢ₊₁ = the tuned layer i on X̃ᵢ: the next layer's inputs, so each layer learns to undo what the
             tuned layers before it still get wrong

Each layer trains with `training.steps` steps (one whole-model step costs about as much as a step of every
layer) and, with a time budget, the time left shared evenly by the layers left. The head (final norm, lm_head)
is not trained.

Resumable: `work` (tuning_work.py) keeps the stream and each finished layer (its tuned weights in layer-NNNN.bin,
its summary in layer-NNNN.json, written last); the same call with the same model, windows and options takes up
after the last finished layer.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from onnx_nmm import __version__
from onnx_nmm.layerwise.carried import CarriedValues
from onnx_nmm.lowering import factor_parameters, lower, weights_as_parameters
from onnx_nmm.passes.svd_ops import DOMAIN
from onnx_nmm.progress import Progress
from onnx_nmm.training.factor_training import StepRecord, replace_factors, train_parameters
from onnx_nmm.training.layer_pairs import LayerPairs
from onnx_nmm.training.schedule import TrainingOptions
from onnx_nmm.training.tuning_work import TuningWork

LAYER_LOSS = "layer-mse"  # the loss FinetuneResult reports for this path
MIN_SECONDS = 1e-6  # the time budget of the layers left once it is spent: one step each (a step is always taken)


@dataclass
class LayerTuning:
    """How layer `layer` went: the relative error Σ‖f̃ᵢ(X̃ᵢ) − Yᵢ‖² / Σ‖Yᵢ‖² on the training windows, before and
    after, and its training."""

    layer: int
    error_before: float
    error_after: float
    steps: int
    seconds: float
    stopped_by: str
    trainable_parameters: int
    records: list[StepRecord] = field(default_factory=list)
    written: dict[str, list[int]] = field(default_factory=dict)  # initializer → [offset, length] in its .bin

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LayerTuning:
        values = json.loads(text)
        values["records"] = [StepRecord(**record) for record in values["records"]]
        return cls(**values)


def work_settings(options: TrainingOptions, teacher: str, device: str, windows: np.ndarray) -> str:
    """What a killed run must have shared with this one for its finished layers to be taken up."""
    digest = hashlib.sha256(np.ascontiguousarray(windows).tobytes()).hexdigest()
    return f"finetune layer by layer|{__version__}|{options!r}|{teacher}|{device}|{digest}"


def tune_layer_by_layer(pairs: LayerPairs, windows: np.ndarray, trained: list[str], options: TrainingOptions,
                        work: TuningWork, device: str, progress: Progress) -> list[LayerTuning]:
    """Tune every decoder layer of `pairs.compressed_source` in turn on the token `windows` [samples, S]: its
    factors and the `trained` narrowed weights it holds, written into the rewritten model as each layer finishes
    (their bytes in `work`); what each layer did, those a killed run finished included."""
    groups = [windows[start:start + options.batch] for start in range(0, len(windows), options.batch)]
    stream, targets = CarriedValues(work.folder / "stream"), CarriedValues(work.folder / "targets")
    done = _finished(work)
    for tuning in done:
        _point_at_file(pairs.compressed_source.model, work, tuning)
    started, resumed_seconds = time.perf_counter(), sum(tuning.seconds for tuning in done)
    with progress.phase("layer by layer: each layer tuned to the dense layer's outputs", total=pairs.layers) as phase:
        for tuning in done:
            phase.advance(detail=f"layer {tuning.layer + 1} resumed")
        for layer in range(len(done), pairs.layers):
            budget = options.time_budget
            if budget is not None:
                spent = resumed_seconds + time.perf_counter() - started  # this run's targets and forwards too
                budget = max(budget - spent, MIN_SECONDS) / (pairs.layers - layer)
            layer_options = replace(options, batch=1, time_budget=budget)  # a step: one group of `batch` windows
            if _trains_anything(pairs, layer, trained):
                tuning, tuned = _tune_layer(pairs, layer, groups, trained, layer_options, stream, targets, device,
                                            progress)
            else:  # a layer the rewrite kept dense: what it writes is the dense layer's already
                tuning, tuned = LayerTuning(layer, 0.0, 0.0, 0, 0.0, "steps", 0), {}
                _pass_through(pairs, layer, groups, stream, progress)
            _write_layer(pairs.compressed_source.model, work, tuning, tuned)
            del tuned
            done.append(tuning)
            for name in pairs.unread_after(layer):
                stream.drop(name)
            phase.advance(detail=f"layer {layer + 1}: relative error {tuning.error_before:.3g} → "
                                 f"{tuning.error_after:.3g}" if tuning.steps else f"layer {layer + 1}: kept dense")
    return done


def _tune_layer(pairs: LayerPairs, layer: int, groups: list[np.ndarray], trained: list[str],
                options: TrainingOptions, stream: CarriedValues, targets: CarriedValues, device: str,
                progress: Progress) -> tuple[LayerTuning, dict[str, torch.Tensor]]:
    """Layer `layer` tuned on `groups` of windows (its inputs in `stream`), as the module docstring says; its
    summary and its tuned tensors by initializer name. The tuned layer's outputs replace its inputs in `stream`."""
    segment = pairs.compressed.segments[layer]
    boundary = segment.boundary
    with progress.phase(f"layer {layer + 1} of {pairs.layers}: the dense layer's outputs", total=len(groups)) as phase:
        scale = _dense_targets(pairs, layer, groups, stream, targets, phase.advance)
    proto = pairs.compressed_proto(layer)
    held = {tensor.name for tensor in proto.graph.initializer}
    order = [value.name for value in proto.graph.input]
    module = lower(proto, consume=True)
    weights = weights_as_parameters(module, [name for name in trained if name in held])
    module.to(device)

    def inputs(index: int) -> list[torch.Tensor]:
        feeds = pairs.feeds(segment, groups[index], stream.of_batch(segment.carried_inputs, index))
        return [torch.from_numpy(np.array(feeds[name])).to(device) for name in order]  # a copy: files are read-only

    def target(index: int) -> torch.Tensor:
        return torch.from_numpy(np.array(targets.get(boundary, index))).to(device)

    def loss_of(batch: np.ndarray) -> torch.Tensor:
        (index,) = batch
        output = _outputs(module, inputs(index))[0]
        return torch.mean((output - target(index)) ** 2) / scale

    before = _relative_error(module, groups, inputs, target)
    description = f"layer {layer + 1} of {pairs.layers}: tuning to the dense layer's outputs (relative error " \
                  f"{before:.4g})"
    with progress.phase(description, total=options.steps) as phase:
        result = train_parameters(module, weights, len(groups), groups[0].size, loss_of, options,
                                  lambda record: phase.advance(detail=f"loss {record.loss:.4g}"), device)
    with progress.phase(f"layer {layer + 1} of {pairs.layers}: the tuned layer's outputs", total=len(groups)) as phase:
        after = _forward(module, segment.outputs, groups, inputs, target, stream if layer + 1 < pairs.layers else None,
                         phase.advance)
    targets.drop(boundary)
    last = result.records[-1]
    tuning = LayerTuning(layer, before, after, last.step, last.seconds, result.stopped_by,
                         result.trainable_parameters, result.records)
    return tuning, {name: tensor.detach().cpu() for name, tensor in (factor_parameters(module) | weights).items()}


def _trains_anything(pairs: LayerPairs, layer: int, trained: list[str]) -> bool:
    """Whether the rewritten layer `layer` holds an SVD op or one of the `trained` narrowed weights."""
    graph = pairs.compressed.segments[layer].model.graph
    return any(node.domain == DOMAIN for node in graph.node) or bool(
        set(trained) & {tensor.name for tensor in graph.initializer})


def _pass_through(pairs: LayerPairs, layer: int, groups: list[np.ndarray], stream: CarriedValues,
                  progress: Progress) -> None:
    """The rewritten layer `layer` (onnxruntime) on every group: its outputs, the next layer's inputs, in
    `stream`."""
    if layer + 1 == pairs.layers:
        return
    segment = pairs.compressed.segments[layer]
    session = pairs.compressed_source.session_of(segment.model)
    with progress.phase(f"layer {layer + 1} of {pairs.layers}: kept dense, passed through", total=len(groups)) as phase:
        for index, tokens in enumerate(groups):
            feeds = pairs.feeds(segment, tokens, stream.of_batch(segment.carried_inputs, index))
            for name, value in zip(segment.outputs, session.run(segment.outputs, feeds)):
                stream.put(name, index, value)
            phase.advance()


def _dense_targets(pairs: LayerPairs, layer: int, groups: list[np.ndarray], stream: CarriedValues,
                   targets: CarriedValues, on_group) -> float:
    """Yᵢ of every group, in `targets`; their mean square m̄ᵢ."""
    segment, session = pairs.dense.segments[layer], pairs.dense_session(layer)
    squares, count = 0.0, 0
    for index, tokens in enumerate(groups):
        feeds = pairs.feeds(segment, tokens, stream.of_batch(segment.carried_inputs, index))
        (output,) = session.run([segment.boundary], feeds)
        targets.put(segment.boundary, index, output)
        squares += float(np.einsum("i,i->", output.reshape(-1), output.reshape(-1), dtype=np.float64))
        count += output.size
        on_group()
    return squares / count


def _relative_error(module: nn.Module, groups: list[np.ndarray], inputs, target) -> float:
    """Σ‖f̃ᵢ(X̃ᵢ) − Yᵢ‖² / Σ‖Yᵢ‖² over every group."""
    error = energy = 0.0
    with torch.no_grad():
        for index in range(len(groups)):
            expected = target(index)
            error += float(torch.sum((_outputs(module, inputs(index))[0] - expected).double() ** 2))
            energy += float(torch.sum(expected.double() ** 2))
    return error / energy


def _forward(module: nn.Module, names: list[str], groups: list[np.ndarray], inputs, target,
             stream: CarriedValues | None, on_group) -> float:
    """The tuned layer on every group: its outputs into `stream` (the next layer's inputs; None: no next layer),
    and its relative error to the dense layer's."""
    error = energy = 0.0
    with torch.no_grad():
        for index in range(len(groups)):
            outputs, expected = _outputs(module, inputs(index)), target(index)
            error += float(torch.sum((outputs[0] - expected).double() ** 2))
            energy += float(torch.sum(expected.double() ** 2))
            if stream is not None:
                for name, value in zip(names, outputs):
                    stream.put(name, index, value.cpu().numpy())
            on_group()
    return error / energy


def _outputs(module: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnx2torch's internal deprecations, which say nothing about the model
        outputs = module(*inputs)
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _finished(work: TuningWork) -> list[LayerTuning]:
    """The layers a run finished, from layer 0 on, up to the first missing one."""
    done: list[LayerTuning] = []
    while (path := work.folder / f"layer-{len(done):04d}.json").is_file():
        done.append(LayerTuning.from_json(path.read_text()))
    return done


def _write_layer(model: ir.Model, work: TuningWork, tuning: LayerTuning, tuned: dict[str, torch.Tensor]) -> None:
    """The `tuned` tensors of `tuning`'s layer written into `model` in their initializers' dtypes, their bytes to
    the layer's file in `work` (the model reads them there: one layer's tuned weights are held at a time), then
    the layer's summary: the layer is finished."""
    replace_factors(model, tuned)
    data = bytearray()
    for name in tuned:
        raw = model.graph.initializers[name].const_value.tobytes()  # type: ignore[union-attr]
        tuning.written[name] = [len(data), len(raw)]
        data += raw
    work.write_bytes(_bytes_file(tuning.layer), bytes(data))
    _point_at_file(model, work, tuning)
    work.write_bytes(f"layer-{tuning.layer:04d}.json", tuning.to_json().encode())


def _point_at_file(model: ir.Model, work: TuningWork, tuning: LayerTuning) -> None:
    """The tuned initializers of `tuning`'s layer read from its file in `work`."""
    for name, (offset, length) in tuning.written.items():
        value = model.graph.initializers[name]
        tensor = value.const_value
        assert tensor is not None and isinstance(tensor.shape, ir.Shape), "a tuned weight is an initializer"
        value.const_value = ir.ExternalTensor(_bytes_file(tuning.layer), offset, length, tensor.dtype,
                                              shape=tensor.shape, name=name, base_dir=str(work.folder))


def _bytes_file(layer: int) -> str:
    return f"layer-{layer:04d}.bin"
