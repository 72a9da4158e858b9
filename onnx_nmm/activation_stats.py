"""Second-moment statistics of linear-layer inputs, gathered by running the model in onnxruntime.

For each distinct input X (tokens × K) of the target layers — gate and up read the same X and share
one — accumulate the Gram matrix G = XᵀX in float64, batch by batch:

    G  +=  float64(X_bᵀ X_b)          X_b: one batch's activations, never kept

The per-batch products run inside onnxruntime: the graph is augmented with Reshape → MatMul(Xᵀ, X)
for each input and its outputs are replaced by those K×K matrices, so neither the activations nor
the logits leave the runtime (and nothing after the last target, the lm_head included, runs). The
augmented graph is built on the model's protobuf without loading its weights; onnxruntime reads the
external data from the original folder, so calibration never copies a multi-GB model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnx_nmm import ort_runner
from onnx_nmm.errors import UserError

_STATS_MARKER = "__onnx_nmm_gram_statistics__"


@dataclass
class GramStatistics:
    """G = XᵀX per layer-input value name, and how many token rows went into each."""

    grams: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: int = 0
    description: str = ""

    def gram(self, value_name: str) -> np.ndarray:
        if value_name not in self.grams:
            raise UserError(f"the calibration statistics have no entry for '{value_name}': they were gathered on "
                            "another model or for other targets; gather them again")
        return self.grams[value_name]

    def save(self, path: str | os.PathLike) -> None:
        """Store as .npz (written to a temporary file, then renamed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.partial.npz")
        np.savez(staged, **{_STATS_MARKER: np.array([self.tokens]), "__description__": np.array(self.description)},
                 **{f"gram:{name}": gram for name, gram in self.grams.items()})
        staged.replace(path)

    @staticmethod
    def is_statistics_file(path: str | os.PathLike) -> bool:
        try:
            with np.load(path) as archive:
                return _STATS_MARKER in archive.files
        except Exception:
            return False

    @classmethod
    def load(cls, path: str | os.PathLike) -> "GramStatistics":
        with np.load(path) as archive:
            grams = {key.removeprefix("gram:"): archive[key] for key in archive.files if key.startswith("gram:")}
            return cls(grams=grams, tokens=int(archive[_STATS_MARKER][0]), description=str(archive["__description__"]))


def collect_gram_matrices(model_path: str | os.PathLike, inputs: dict[str, int], batches: Iterable,
                          description: str = "", make_feeds: Callable = ort_runner.token_inputs,
                          on_batch: Callable[[int], None] | None = None) -> GramStatistics:
    """Run the model on every batch; accumulate XᵀX for each input value name → its width K.

    `make_feeds(session, batch)` turns a batch into the model's feeds (default: token ids [B, S] of a
    causal LM). `on_batch(rows)` hears about each finished batch with its number of rows (tokens).
    Raises UserError if an activation is not finite.
    """
    session, rows_output = _gram_session(Path(model_path), inputs)
    names = list(inputs)
    stats = GramStatistics(description=description)
    for index, batch in enumerate(batches):
        try:
            *products, rows = session.run([*_gram_outputs(names), rows_output], make_feeds(session, batch))
        except Exception as error:
            raise UserError(f"onnxruntime failed on calibration batch {index}: {str(error).splitlines()[0]}") from None
        for name, product in zip(names, products):
            if not np.all(np.isfinite(product)):
                raise UserError(f"calibration batch {index} gives non-finite activations at '{name}' (NaN or Inf): the "
                                "model overflows on these inputs; check the calibration data, or run in float32")
            if name in stats.grams:
                stats.grams[name] += product  # fp32 within a batch, float64 across batches
            else:
                stats.grams[name] = product.astype(np.float64)
        stats.tokens += int(rows)
        if on_batch is not None:
            on_batch(int(rows))
    if stats.tokens == 0:
        raise UserError("the calibration set is empty")
    return stats


def _gram_outputs(names: list[str]) -> list[str]:
    return [f"onnx_nmm_gram_{index}" for index in range(len(names))]


def _gram_session(model_path: Path, inputs: dict[str, int]):
    """An onnxruntime session whose outputs are X_bᵀX_b (float32) for every named value, plus the
    number of rows; the original outputs are dropped, so nothing after the last target runs."""
    proto = onnx.load(str(model_path), load_external_data=False)
    graph = proto.graph
    types = _value_types(proto)
    del graph.output[:]
    helper = onnx.helper
    rows_output = "onnx_nmm_gram_rows"
    for index, ((name, width), output) in enumerate(zip(inputs.items(), _gram_outputs(list(inputs)))):
        if name not in types:
            raise UserError(f"cannot observe '{name}': the model declares no type for it")
        shape = f"onnx_nmm_gram_shape_{index}"
        graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1, width], np.int64), shape))
        flat = f"{output}_rows"
        nodes = [helper.make_node("Reshape", [name, shape], [flat])]
        if types[name] != onnx.TensorProto.FLOAT:  # fp16/bf16 activations: square them in fp32
            nodes.append(helper.make_node("Cast", [flat], [f"{flat}_fp32"], to=onnx.TensorProto.FLOAT))
            flat = f"{flat}_fp32"
        nodes += [helper.make_node("Transpose", [flat], [f"{flat}_t"], perm=[1, 0]),
                  helper.make_node("MatMul", [f"{flat}_t", flat], [output])]
        if index == 0:
            nodes += [helper.make_node("Shape", [flat], [f"{flat}_shape"], start=0, end=1),
                      helper.make_node("Squeeze", [f"{flat}_shape"], [rows_output])]
        graph.node.extend(nodes)
        graph.output.append(helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, [width, width]))
    graph.output.append(helper.make_tensor_value_info(rows_output, onnx.TensorProto.INT64, []))
    config = {"session.model_external_initializers_file_folder_path": str(model_path.parent.resolve())}
    return ort_runner.create_session(proto.SerializeToString(), extra_config=config, label=model_path), rows_output


def _value_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value, with shape inference filling in what the exporter left out."""
    types = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:
        inferred = proto
    graph = inferred.graph
    for info in list(graph.value_info) + list(graph.input) + list(graph.output):
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            types[info.name] = info.type.tensor_type.elem_type
    return types
