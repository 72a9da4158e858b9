"""One layer's maths: its decomposition under the chosen method, its spectrum, and its factors at a rank.

    svd      W = P Σ Qᵀ                                  (lowrank)
    whiten   Sᵀ·W = P Σ Qᵀ,      G = XᵀX = S Sᵀ          (whitening; statistics from calibration)
    fisher   Sᵀ·W·T = P Σ Qᵀ,    G_out = T Tᵀ            (whitening, two-sided; fisher statistics)

With a group's sequential statistics the target is the least-squares map M_ls and the Gram the
compressed model's (onnx_nmm.decomposition.sequential). Every other rewrite step asks this class, so the plan, the
factorization and the sensitivity probe decompose a layer the same way.
"""

from __future__ import annotations

import time

import numpy as np
import onnx_ir as ir

from onnx_nmm.calibration.activation_stats import GramStatistics
from onnx_nmm.decomposition import fisher, lowrank, sequential, whitening
from onnx_nmm.errors import ExecutionError
from onnx_nmm.options import FactorizationOptions
from onnx_nmm.passes import FactorizedLayer, LinearLayer
from onnx_nmm.pipeline.report import LayerOutcome
from onnx_nmm.ranks.rank_plan import break_even_rank

# a layer's decomposition, plain or whitened: its spectrum, and its factors at any rank
LayerDecomposition = lowrank.Decomposition | whitening.WhitenedDecomposition


class Factorizer:
    """Decomposes layers under `options` with `statistics` (None for plain SVD), their factors `align`-ed.

    `decompositions` holds full exact decompositions worth keeping (the sensitivity probe makes them); a
    layer found there is not decomposed again.
    """

    def __init__(self, options: FactorizationOptions, statistics: GramStatistics | None, align: int):
        self.options, self.statistics, self.align = options, statistics, align
        self.strategy = options.strategy
        self.decompositions: dict[str, LayerDecomposition] = {}

    @property
    def method(self) -> str:
        """How layers are factorized, as the report names it (a nystrom rewrite whitens what it does not narrow)."""
        return self.strategy.factorizes_as

    @property
    def weighted(self) -> bool:
        return self.strategy.weighted

    @property
    def _calibration(self) -> GramStatistics:
        """The statistics a weighted method decomposes with."""
        assert self.statistics is not None, "a weighted method is given calibration statistics"
        return self.statistics

    def decompose(self, layer: LinearLayer, rank: int | None = None) -> LayerDecomposition:
        """The layer's decomposition: exact and complete when `rank` is None, else enough for that rank."""
        if layer.name in self.decompositions:
            return self.decompositions[layer.name]
        weight = self._weight(layer)
        svd = self.options.svd if rank is not None else "exact"
        return self._decompose(layer, weight, rank, svd)

    def spectrum(self, layer: LinearLayer) -> lowrank.RankedFactors:
        """Every singular value of the layer's (weighted) weight: what energy and budget rules choose by."""
        if layer.name in self.decompositions:
            return self.decompositions[layer.name]
        weight = self._weight(layer)
        if not self.weighted:
            return lowrank.spectrum(weight)
        return whitening.weighted_spectrum(weight, self._calibration.gram(layer.x.name), self._output_gram(layer))

    def predicted_kl(self, spectrum: lowrank.RankedFactors, rank: int) -> float:
        """Fisher only: the mean KL per token a truncation to `rank` adds."""
        return fisher.predicted_kl(spectrum.truncated_energy(rank), self._calibration.tokens)

    def factorize(self, layer: LinearLayer, rank: int,
                  group: sequential.GroupStatistics | None = None) -> tuple[LayerOutcome, FactorizedLayer]:
        """Factors of `layer` at `rank` and the report row; with `group` (sequential calibration) fitted to the
        dense outputs from the compressed model's inputs, otherwise to W itself."""
        start = time.perf_counter()
        weight = self._weight(layer)
        if group is None:
            decomposition = self.decompose(layer, rank)
        else:
            target = sequential.least_squares_target(weight.astype(np.float64), group)
            decomposition = whitening.whitened_decomposition(target, group.compressed, self.options.svd, rank,
                                                             output_gram=self._output_gram(layer), **self._randomized())
        u, v = decomposition.factors(rank, dtype=np.float64)
        if not (np.all(np.isfinite(u)) and np.all(np.isfinite(v))):
            raise ExecutionError(f"factorizing {layer.name} gave non-finite factors; nothing was written "
                                 "(please report this with the model)")
        factors = FactorizedLayer(layer=layer, u=u, v=v, align=self.align, storage=self.storage_dtype(),
                                  method=f"{self.method}/{self.options.svd}", quantized=self._quantized(layer, u, v))
        outcome = LayerOutcome.of(layer, "factorized", rank=rank, parameters_after=rank * (layer.k + layer.n),
                                  relative_error=decomposition.relative_error(rank), bytes_after=_bytes(factors))
        self._measure(outcome, layer, weight, decomposition, u, v, group)
        if factors.quantized is not None:
            stored = _stored_product(layer, factors)
            outcome.stored_error = float(np.linalg.norm(weight - stored) / max(np.linalg.norm(weight), 1e-30))
        if layer.shared_with:  # a tied embedding keeps reading W: it stays, beside its factors
            outcome.parameters_after += layer.parameters
            outcome.reason = f"its weight stays for {', '.join(layer.shared_with)}"
        elif rank >= break_even_rank(layer.k, layer.n):
            outcome.reason = "explicit rank saves nothing"
        outcome.seconds = time.perf_counter() - start
        return outcome, factors

    def storage_dtype(self) -> ir.DataType | None:
        """The float dtype asked for the factors, if any."""
        factor_dtype = self.options.factor_dtype
        if factor_dtype is None:
            return None
        return {"float16": ir.DataType.FLOAT16, "float32": ir.DataType.FLOAT}[factor_dtype]  # checked by the options

    def _quantized(self, layer: LinearLayer, u: np.ndarray, v: np.ndarray):
        """U and V quantized as the weight is, unless a float dtype is asked for (or the weight is float)."""
        if layer.weight.quantized is None or self.options.factor_dtype is not None:
            return None
        from onnx_nmm.decomposition.quantization import quantize_like

        return quantize_like(layer.weight.quantized, u), quantize_like(layer.weight.quantized, v)

    def _measure(self, outcome: LayerOutcome, layer: LinearLayer, weight: np.ndarray, decomposition, u, v,
                 group: sequential.GroupStatistics | None) -> None:
        """The report's error columns: in weight space, on the calibration activations, against plain SVD."""
        rank = outcome.rank
        assert rank is not None, "a factorized layer's row has its rank"
        if group is not None:
            outcome.relative_error = float(np.linalg.norm(weight - u @ v) / max(np.linalg.norm(weight), 1e-30))
            outcome.whitened_loss = sequential.sequential_loss(weight, u, v, group)
            outcome.conditioning = decomposition.conditioning
        elif isinstance(decomposition, whitening.WhitenedDecomposition):
            outcome.whitened_loss = decomposition.whitened_loss(rank)
            outcome.conditioning = decomposition.conditioning
            if decomposition.conditioning != "cholesky":
                cause = whitening.deficiency(self._calibration.gram(layer.x.name), self._calibration.tokens)
                outcome.conditioning += f" ({cause})"
            if decomposition.two_sided:
                outcome.predicted_kl = self.predicted_kl(decomposition, rank)
        if isinstance(decomposition, whitening.WhitenedDecomposition):
            outcome.plain_svd_error = lowrank.optimal_relative_error(weight, rank)
        elif self.statistics is not None and layer.x.name in self.statistics.grams:
            outcome.whitened_loss = whitening.activation_loss(self.statistics.grams[layer.x.name], weight, u, v)

    def _decompose(self, layer: LinearLayer, weight: np.ndarray, rank: int | None, svd: str) -> LayerDecomposition:
        if not self.weighted:
            return lowrank.decompose(weight, svd, rank_hint=rank, **self._randomized())
        return whitening.whitened_decomposition(weight, self._calibration.gram(layer.x.name), svd, rank_hint=rank,
                                                output_gram=self._output_gram(layer), **self._randomized())

    def _randomized(self) -> dict[str, int]:
        """How the randomized SVD runs (the exact one ignores it)."""
        o = self.options
        return {"power_iterations": o.power_iterations, "oversample": o.oversample, "seed": o.seed}

    def _output_gram(self, layer: LinearLayer) -> np.ndarray | None:
        return self._calibration.output_gram(layer.name) if self.strategy.output_grams else None

    @staticmethod
    def _weight(layer: LinearLayer) -> np.ndarray:
        """W [K, N], its external data unmapped right after (mapped pages count towards RSS)."""
        weight = layer.weight_matrix()
        tensor = layer.weight.tensor
        if isinstance(tensor, ir.ExternalTensor):
            tensor.release()
        return weight


def _bytes(factors: FactorizedLayer) -> int:
    """Bytes of the factors as stored."""
    if factors.quantized is not None:
        return sum(factor.nbytes for factor in factors.quantized)
    dtype = factors.storage or factors.layer.dtype
    return int((factors.u.size + factors.v.size) * dtype.itemsize)


def _stored_product(layer: LinearLayer, factors: FactorizedLayer) -> np.ndarray:
    """U·V with both factors as stored (dequantized)."""
    weight, (k, n), rank = layer.weight.quantized, (layer.k, layer.n), factors.rank
    u, v = (factor.matrix(weight.format, weight.bits, weight.block_size, rows, columns)
            for factor, (rows, columns) in zip(factors.quantized, ((k, rank), (rank, n))))
    return u.astype(np.float64) @ v.astype(np.float64)
