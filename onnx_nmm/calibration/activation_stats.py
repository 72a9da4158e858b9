"""Second-moment statistics of linear-layer inputs, gathered by running the model in onnxruntime.

For each distinct input X (tokens × K) of the target layers — gate and up read the same X and share
one — accumulate the Gram matrix G = XᵀX in float64, batch by batch:

    G  +=  float64(X_bᵀ X_b)          X_b: one batch's activations, never kept

The per-batch products run inside onnxruntime. The graph is augmented, for each input, with the
upper blocks of its Gram matrix — X is split into column blocks X_a of ~512 and Gemm(X_a, X_b,
transA=1) computes X_aᵀX_b for a ≤ b only, since G is symmetric — and its outputs are replaced by
those blocks; every node the blocks do not depend on is pruned (onnxruntime would still run the
lm_head otherwise). Neither the activations nor the logits leave the runtime. The augmented graph is
built on the model's protobuf without loading its weights; onnxruntime reads the external data from
the original folder, so calibration never copies a multi-GB model (model_source.ModelSource).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from onnx_nmm.errors import DataError, ExecutionError, ModelError
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.graph_probe import first_step, prune, value_types

if TYPE_CHECKING:
    from onnx_nmm.model_source import ModelSource

_STATS_MARKER = "__onnx_nmm_gram_statistics__"


@dataclass
class GramStatistics:
    """G = XᵀX per layer-input value name (float64), and how many token rows went into each; with
    `--method fisher` also the output-gradient Gram of each layer, by layer name (float32:
    onnx_nmm.decomposition.fisher).
    `windows`: the ids of the calibration windows they came from (empty in files saved before they were kept),
    so a quality budget on loaded statistics can refuse to be measured on one of them."""

    grams: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: int = 0
    description: str = ""
    output_grams: dict[str, np.ndarray] = field(default_factory=dict)
    windows: tuple[str, ...] = ()

    def gram(self, value_name: str) -> np.ndarray:
        if value_name not in self.grams:
            raise DataError(f"the calibration statistics have no entry for '{value_name}': they were gathered on "
                            "another model or for other targets; gather them again")
        return self.grams[value_name]

    def output_gram(self, layer_name: str) -> np.ndarray:
        if layer_name not in self.output_grams:
            raise DataError(f"the calibration statistics have no output-gradient Gram for '{layer_name}': "
                            "a fisher rewrite gathers them (from a calibration text or token ids) and keeps them "
                            "with {save}", save="calibration.save_statistics")
        return self.output_grams[layer_name]

    def save(self, path: str | os.PathLike) -> None:
        """Store as .npz (written to a temporary file, then renamed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.partial.npz")
        np.savez(staged, allow_pickle=False,  # numbers and strings only: np.load reads them without pickles
                 **{_STATS_MARKER: np.array([self.tokens]), "__description__": np.array(self.description),
                    "__windows__": np.array(self.windows, dtype=str)},
                 **{f"gram:{name}": gram for name, gram in self.grams.items()},
                 **{f"output_gram:{name}": gram for name, gram in self.output_grams.items()})
        staged.replace(path)

    @staticmethod
    def is_statistics_file(path: str | os.PathLike) -> bool:
        try:
            with np.load(path) as archive:
                return _STATS_MARKER in archive.files
        except Exception:
            return False

    @classmethod
    def load(cls, path: str | os.PathLike) -> GramStatistics:
        with np.load(path) as archive:
            def entries(prefix):
                return {key.removeprefix(prefix): archive[key] for key in archive.files if key.startswith(prefix)}

            windows = tuple(str(w) for w in archive["__windows__"]) if "__windows__" in archive.files else ()
            return cls(grams=entries("gram:"), tokens=int(archive[_STATS_MARKER][0]),
                       description=str(archive["__description__"]), output_grams=entries("output_gram:"),
                       windows=windows)


# Column blocks of X for the symmetric Gram: big enough for efficient GEMMs, small enough that
# skipping the blocks below the diagonal saves work (a third of it at K = 1536).
GRAM_BLOCK = 512


def collect_gram_matrices(source: ModelSource, inputs: dict[str, int], batches: Iterable, description: str = "",
                          make_feeds: Callable | None = None,
                          on_batch: Callable[[int], None] | None = None) -> GramStatistics:
    """Run the original model of `source` on every batch; accumulate XᵀX for each input value name → its
    width K.

    `make_feeds(batch)` turns a batch into the model's feeds (default: token ids [B, S] of a causal LM,
    causal_lm.CausalLm). `on_batch(rows)` hears about each finished batch with its number of rows (tokens).
    Raises ExecutionError if onnxruntime fails or an activation is not finite.
    """
    plan = GramPlan(inputs)
    make_feeds = make_feeds or CausalLm.of_source(source).feeds
    session = source.session_of(gram_graph(first_step(source.graph_proto()), plan))
    return accumulated_grams(session, plan, (make_feeds(batch) for batch in batches), description, on_batch)


def accumulated_grams(session, plan: GramPlan, feeds: Iterable[dict], description: str = "",
                      on_batch: Callable[[int], None] | None = None,
                      on_outputs: Callable[[int, list[np.ndarray]], None] | None = None) -> GramStatistics:
    """Σ XᵀX of `plan`'s inputs over the runs of `session` (a gram_graph) on each of `feeds`; the graph's kept
    outputs of each run go to `on_outputs(index, outputs)`."""
    grams: dict[str, np.ndarray] | None = None  # summed in place: one float64 Gram, not per-block sums beside it
    tokens = 0
    for index, feed in enumerate(feeds):
        try:
            blocks = session.run(None, feed)
            blocks, rows, kept = blocks[:plan.block_count], blocks[plan.block_count], blocks[plan.block_count + 1:]
        except Exception as error:
            raise ExecutionError(f"onnxruntime failed on calibration batch {index}: "
                                 f"{str(error).splitlines()[0]}") from None
        bad = plan.non_finite_input(blocks)
        if bad is not None:
            raise ExecutionError(f"calibration batch {index} gives non-finite activations at '{bad}' (NaN or Inf): "
                                 "the model overflows on these inputs; check the calibration data, or run in float32")
        if grams is None:
            grams = plan.zeros()
        plan.add(grams, blocks)  # fp32 within a batch, float64 across batches
        tokens += int(rows)
        if on_outputs is not None:
            on_outputs(index, kept)
        if on_batch is not None:
            on_batch(int(rows))
    if grams is None or tokens == 0:
        raise DataError("the calibration set is empty")
    return GramStatistics(grams, tokens, description)


class GramPlan:
    """Which column blocks each input is split into, and which block products the graph outputs."""

    def __init__(self, inputs: dict[str, int]):
        self.inputs = inputs
        self.edges = {name: np.linspace(0, width, max(1, round(width / GRAM_BLOCK)) + 1).astype(int)
                      for name, width in inputs.items()}

    @property
    def block_count(self) -> int:
        """The graph outputs the Gram blocks take."""
        return sum(len(self.products(name)) for name in self.inputs)

    def products(self, name: str) -> list[tuple[int, int]]:
        blocks = len(self.edges[name]) - 1
        return [(a, b) for a in range(blocks) for b in range(a, blocks)]

    def non_finite_input(self, blocks: list[np.ndarray]) -> str | None:
        """The first input whose Gram diagonal (Σx² per feature) is not finite: NaN or Inf in X shows there."""
        position = 0
        for name in self.inputs:
            for a, b in self.products(name):
                if a == b and not np.all(np.isfinite(np.diagonal(blocks[position]))):
                    return name
                position += 1
        return None

    def zeros(self) -> dict[str, np.ndarray]:
        """A float64 Gram of zeros per input."""
        return {name: np.zeros((width, width), np.float64) for name, width in self.inputs.items()}

    def add(self, grams: dict[str, np.ndarray], blocks: list[np.ndarray]) -> None:
        """Adds one run's upper blocks, in graph-output order, to the full symmetric `grams` in place."""
        position = 0
        for name in self.inputs:
            edges, gram = self.edges[name], grams[name]
            for a, b in self.products(name):
                block = blocks[position]
                position += 1
                rows, columns = slice(edges[a], edges[a + 1]), slice(edges[b], edges[b + 1])
                if a != b:
                    gram[rows, columns] += block
                gram[columns, rows] += block.T

    def assemble(self, blocks: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The upper blocks of one run as full symmetric float64 Gram matrices."""
        grams = self.zeros()
        self.add(grams, blocks)
        return grams


def gram_graph(proto: onnx.ModelProto, plan: GramPlan, kept_outputs: int = 0) -> onnx.ModelProto:
    """`proto` (changed in place) whose outputs are the Gram blocks X_aᵀX_b (float32) of every planned input,
    then the number of rows, then its first `kept_outputs` outputs; nodes none of these need are pruned."""
    graph = proto.graph
    kept = list(graph.output)[:kept_outputs]
    types = value_types(proto)
    known = {value.name for value in proto.graph.input} | {node_output for node in proto.graph.node
                                                            for node_output in node.output}
    helper, numpy_helper = onnx.helper, onnx.numpy_helper
    outputs: list[onnx.ValueInfoProto] = []
    nodes: list[onnx.NodeProto] = []
    for index, (name, width) in enumerate(plan.inputs.items()):
        if name not in known:
            raise ModelError(f"cannot observe '{name}': no node of the model computes it")
        prefix = f"onnx_nmm_gram_{index}"
        rows = _float_rows(graph, nodes, name, width, prefix, types.get(name))
        edges = plan.edges[name]
        blocks = [rows]
        if len(edges) > 2:
            graph.initializer.append(numpy_helper.from_array(np.diff(edges).astype(np.int64), f"{prefix}_split"))
            blocks = [f"{prefix}_block_{a}" for a in range(len(edges) - 1)]
            nodes.append(helper.make_node("Split", [rows, f"{prefix}_split"], blocks, axis=1))
        for a, b in plan.products(name):
            output = f"{prefix}_{a}_{b}"
            nodes.append(helper.make_node("Gemm", [blocks[a], blocks[b]], [output], transA=1))
            outputs.append(helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT,
                                                         [int(edges[a + 1] - edges[a]), int(edges[b + 1] - edges[b])]))
        if index == 0:
            nodes += [helper.make_node("Shape", [rows], [f"{prefix}_row_shape"], start=0, end=1),
                      helper.make_node("Squeeze", [f"{prefix}_row_shape"], ["onnx_nmm_gram_row_count"])]
    graph.node.extend(nodes)
    del graph.output[:]
    graph.output.extend(outputs)
    graph.output.append(helper.make_tensor_value_info("onnx_nmm_gram_row_count", onnx.TensorProto.INT64, []))
    graph.output.extend(kept)
    prune(graph)
    return proto


def activation_graph(proto: onnx.ModelProto, name: str, width: int) -> onnx.ModelProto:
    """`proto` (changed in place) whose one output is the value `name` as float32 rows [tokens, `width`]; nodes it
    does not need are pruned. Where a Gram (`width`² entries) is larger than the rows, as a few held-out windows'
    activation at an 8B MLP's width, the rows are what to keep."""
    graph = proto.graph
    if name not in {output for node in graph.node for output in node.output}:
        raise ModelError(f"cannot observe '{name}': no node of the model computes it")
    nodes: list[onnx.NodeProto] = []
    rows = _float_rows(graph, nodes, name, width, "onnx_nmm_activation", value_types(proto).get(name))
    graph.node.extend(nodes)
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info(rows, onnx.TensorProto.FLOAT, [None, width]))
    prune(graph)
    return proto


def _float_rows(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], name: str, width: int, prefix: str,
                value_type: int | None) -> str:
    """The value `name` as float32 rows [tokens, `width`]: its shape an initializer of `graph`, the Reshape (and a
    Cast unless it is float32 already) appended to `nodes`; the rows' name."""
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1, width], np.int64), f"{prefix}_shape"))
    rows = f"{prefix}_rows"
    nodes.append(onnx.helper.make_node("Reshape", [name, f"{prefix}_shape"], [rows]))
    if value_type != onnx.TensorProto.FLOAT:  # fp16/bf16 (or, past a contrib op, unknown): in fp32
        nodes.append(onnx.helper.make_node("Cast", [rows], [f"{rows}_fp32"], to=onnx.TensorProto.FLOAT))
        rows = f"{rows}_fp32"
    return rows
