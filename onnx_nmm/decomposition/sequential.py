"""Sequential (error-aware) calibration: fit each layer to what the dense model produced, from the inputs
the already-compressed model actually feeds it, layer by layer in graph order.

With X_d a layer's input in the dense model and X_c its input in the model whose earlier targets are
already factorized, the layer's factors solve

    min over rank-r M of ‖X_d·W − X_c·M‖_F
      = ‖X_c·(M − M_ls)‖_F² + const,   M_ls = G_c⁻¹ C W,   G_c = X_cᵀX_c,  C = X_cᵀX_d

(M_ls the least-squares fit; its residual is orthogonal to X_c). So the optimum is the whitened
truncation of M_ls under G_c — onnx_nmm.decomposition.whitening with W replaced by M_ls. When nothing before the layer
is compressed, X_c = X_d, M_ls = W, and this is plain whitening.

The least-squares step overfits the calibration set where it excites few directions, and a plain
ridge would pull the unexcited directions to zero. It is regularized towards the dense weight instead:

    M_ls = W + (G_c + λI)⁻¹ (C − G_c) W,     λ = RIDGE · mean(diag G_c)

— the correction the compressed inputs call for, shrunk where the calibration data say little.

Layers reading the same input (gate and up) form one group; each group costs one pass over the
calibration data through the compressed model pruned to the group's input, in onnxruntime. The dense
inputs of every group come from one pass of the dense model, kept in memory when they fit
DENSE_CACHE_BYTES (otherwise the dense model, pruned the same way, runs again for each group). The
compressed model is the working model itself, re-serialized each pass with its untouched weights still
in the original external data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from onnx_nmm.errors import DataError, ExecutionError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes import LinearLayer
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.graph_probe import expose, first_step, value_types


@dataclass
class GroupStatistics:
    """Second moments of one group's input over the calibration set, dense (d) and compressed (c)."""

    compressed: np.ndarray  # G_c = X_cᵀ X_c
    cross: np.ndarray  # C = X_cᵀ X_d
    dense: np.ndarray  # G_d = X_dᵀ X_d
    tokens: int


# Strength of the ridge towards W in the least-squares step, relative to the mean feature energy.
RIDGE = 1e-2


def least_squares_target(weight: np.ndarray, stats: GroupStatistics) -> np.ndarray:
    """M_ls = W + (G_c + λI)⁻¹ (C − G_c) W: the map from compressed inputs that best reproduces X_d·W,
    regularized towards W."""
    gram = stats.compressed
    ridge = RIDGE * float(np.mean(np.diag(gram)))
    correction = (stats.cross - gram) @ weight
    if ridge <= 0:  # no calibration energy at all: nothing to correct
        return weight
    factor = np.linalg.cholesky(gram + ridge * np.eye(len(gram)))  # positive definite: G_c ⪰ 0, λ > 0
    return weight + np.linalg.solve(factor.T, np.linalg.solve(factor, correction))


def sequential_loss(weight: np.ndarray, u: np.ndarray, v: np.ndarray, stats: GroupStatistics) -> float:
    """‖X_d·W − X_c·U·V‖_F / ‖X_d·W‖_F from the group's statistics."""
    m = u @ v
    dense = float(np.sum(weight * (stats.dense @ weight)))
    error = dense - 2 * float(np.sum(m * (stats.cross @ weight))) + float(np.sum(m * (stats.compressed @ m)))
    return math.sqrt(max(error, 0.0) / dense) if dense > 0 else 0.0


def layer_groups(layers: list[LinearLayer]) -> list[list[LinearLayer]]:
    """The layers grouped by the value they read, groups in graph order."""
    groups: dict[str, list[LinearLayer]] = {}
    for layer in layers:  # find_linear_layers lists layers in graph order
        groups.setdefault(layer.x.name, []).append(layer)
    return list(groups.values())


# Dense activations of all groups kept in memory up to this size (one dense pass instead of one per group).
DENSE_CACHE_BYTES = 4 * 2**30


def _token_rows(batch) -> int:
    """Token rows a batch contributes: token ids [B, S] give B·S; float activations [..., K] all but K."""
    array = np.asarray(batch)
    shape = array.shape[:-1] if np.issubdtype(array.dtype, np.floating) else array.shape
    return int(np.prod(shape))


class GroupObserver:
    """Runs the dense and the working (partly compressed) model on the calibration batches, pruned to
    one group's input, and returns that group's statistics."""

    def __init__(self, source: ModelSource, batches: Iterable, make_feeds: Callable | None = None):
        self.source = source
        self.batches = list(batches)
        self.make_feeds = make_feeds or CausalLm.of_source(source).feeds
        self.dense_proto = first_step(source.graph_proto())
        self.types = value_types(self.dense_proto)
        self.dense_cache: dict[str, list[np.ndarray]] = {}

    def prepare(self, widths: dict[str, int]) -> None:
        """Run the dense model once for all groups' inputs (name → width) if their activations fit memory."""
        rows = sum(_token_rows(batch) for batch in self.batches)
        if rows * sum(widths.values()) * 4 > DENSE_CACHE_BYTES:
            return
        names = list(widths)
        session = self._session(self.dense_proto, *names)
        self.dense_cache = {name: [] for name in names}
        for index, batch in enumerate(self.batches):
            for name, x in zip(names, session.run(names, self.make_feeds(batch))):
                self.dense_cache[name].append(self._rows(x, name, index))

    def observe(self, working: ir.Model, value: str) -> GroupStatistics:
        dense = None if value in self.dense_cache else self._session(self.dense_proto, value)
        compressed = self._session(first_step(ir.serde.serialize_model(working)), value)
        gram_c = cross = gram_d = None
        tokens = 0
        for index, batch in enumerate(self.batches):
            x_d = self.dense_cache[value][index] if dense is None else self._activation(dense, batch, value, index)
            x_c = self._activation(compressed, batch, value, index)
            products = (x_c.T @ x_c, x_c.T @ x_d, x_d.T @ x_d)
            if gram_c is None:
                gram_c, cross, gram_d = (p.astype(np.float64) for p in products)
            else:
                gram_c += products[0]
                cross += products[1]
                gram_d += products[2]
            tokens += len(x_d)
        if gram_c is None:
            raise DataError("the calibration set is empty")
        assert cross is not None and gram_d is not None, "the three sums start together"
        return GroupStatistics(gram_c, cross, gram_d, tokens)

    def _session(self, proto: onnx.ModelProto, *values: str):
        proto = onnx.ModelProto.FromString(proto.SerializeToString()) if proto is self.dense_proto else proto
        return self.source.session_of(expose(proto, list(values), self.types))

    def _activation(self, session, batch, value: str, index: int) -> np.ndarray:
        (x,) = session.run([value], self.make_feeds(batch))
        return self._rows(x, value, index)

    @staticmethod
    def _rows(x: np.ndarray, value: str, index: int) -> np.ndarray:
        x = x.reshape(-1, x.shape[-1]).astype(np.float32, copy=False)
        if not np.all(np.isfinite(x)):
            raise ExecutionError(f"calibration batch {index} gives non-finite activations at '{value}' (NaN or "
                                 "Inf): check the calibration data")
        return x
