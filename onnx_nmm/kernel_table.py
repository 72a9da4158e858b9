"""Which NKI kernel runs each `ai.onnx_nmm` op, on which shapes: the one table every user of the kernels reads.

The lowering's kernel backends launch an op's kernel from it (emulator and Neuron), `compile` plans and prices
each node of a graph with it, and the Trainium estimate behind `bench --target` prices a decoder's products
with it. An op's inputs are X, then the kernel's weights, then (for some ops) an output bias that is added after
the kernel, in the model's dtype. The kernels take X as [tokens, features].

    op            kernel                  weights                  dims
    SvdMatMul     fused_xuv               U, V (+ bias)            K, rank, N
    SvdGatedMLP   fused_svd_mlp           Ug, Vg, Uu, Vu, Ud, Vd   H, I, rank_gate, rank_up, rank_down
    SvdMLP        fused_svd_ungated_mlp   U1, V1, B1, U2, V2 (+ B2) H, I, rank_1, rank_2
    GatedMLP      dense_gated_mlp         Wg, Wu, Wd               H, I
    MLP           dense_ungated_mlp       W1, B1, W2 (+ B2)        H, I

Each op's `projections` are the dense products of the same layer with its original weights: what `compile`
and the estimate price it against. An MLP op's separate launches are its projections one launch each, the
alternative to its fused kernel (trainium/launch_costs.choose_mlp_kernel picks the faster): fused_xuv on each
of a factorized MLP's `factors`, dense_matmul on each of a dense MLP's projections (above 128 tokens the last
one as dense_matmul_lhsT, on the activation handed over transposed:
kernels.nki_kernels.gated_activation.leaves_transposed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from onnx_nmm.passes import svd_ops

Shape = tuple[int, ...]


@dataclass(frozen=True)
class KernelSpec:
    """How one `ai.onnx_nmm` op runs as one kernel launch."""

    op: str
    kernel: str  # its name in onnx_nmm.kernels
    weights: int  # the op's inputs after X that the kernel takes; one more, if present, is the output bias
    dim_names: tuple[str, ...]  # the sizes the kernel is planned by, after the tokens, in its planner's order
    dims_of: Callable[[Sequence[Shape]], tuple[int, ...]]  # those sizes, from the shapes of the kernel's weights
    operands: Callable[..., tuple[Shape, ...]]  # (tokens, *dims) → the shapes of X and the kernel's weights
    projections: Callable[..., tuple[tuple[int, int], ...]]  # (*dims) → (K, N) of each dense product it replaces
    # a factorized MLP's projections as (K, rank, N) each, which run as fused_xuv launches when not fused
    factors: Callable[..., tuple[tuple[int, int, int], ...]] = lambda *dims: ()
    gated: bool = False  # an activation gates a second projection (the dense layer launches it on its own)
    activation: bool = True  # takes the op's `activation` attribute
    dense_op: str | None = None  # an MLP op: the op of the same MLP with dense weights (its best dense path)

    def dims(self, weight_shapes: Sequence[Shape | None]) -> dict[str, int]:
        """The op's sizes by name, from the shapes of its inputs after X (an output bias may follow)."""
        shapes = [shape for shape in list(weight_shapes)[:self.weights] if shape is not None]
        if len(shapes) < self.weights:
            raise ValueError(f"{self.op} takes {self.weights} weights of known shape after X, got {len(shapes)}")
        return self.named(self.dims_of(shapes))

    def named(self, sizes: Sequence[int]) -> dict[str, int]:
        """Sizes given in the order of `dim_names`, by name."""
        return dict(zip(self.dim_names, sizes, strict=True))

    def shapes(self, tokens: int, dims: dict[str, int]) -> tuple[Shape, ...]:
        """The shapes the kernel is launched on at `tokens` rows: X, then its weights."""
        return self.operands(tokens, *dims.values())

    def dense_products(self, tokens: int, dims: dict[str, int]) -> list[tuple[Shape, Shape]]:
        """The (X, W) shapes of each dense product the op stands for, at `tokens` rows."""
        return [((tokens, k), (k, n)) for k, n in self.projections(*dims.values())]

    def separate_launches(self, tokens: int, dims: dict[str, int]) -> list[tuple[str, tuple[Shape, ...]]]:
        """An MLP op's projections as one launch each (fused_xuv for factors, dense_matmul for weights): the kernel
        and the shapes it is launched on at `tokens` rows. The activation between them is not a launch here."""
        from onnx_nmm.kernels.nki_kernels.gated_activation import leaves_transposed

        factors = self.factors(*dims.values())
        if not factors:
            *first, (x, w) = self.dense_products(tokens, dims)
            # above one tile of tokens the activation hands the last projection its input transposed
            last = ("dense_matmul_lhsT", (x[::-1], w)) if leaves_transposed(tokens) else ("dense_matmul", (x, w))
            return [*(("dense_matmul", shapes) for shapes in first), last]
        xuv = KERNEL_TABLE[svd_ops.SVD_MATMUL]
        return [(xuv.kernel, xuv.operands(tokens, k, rank, n)) for k, rank, n in factors]

    def plan(self, tokens: int, dims: dict[str, int], target: str, dtype: str = "bfloat16"):
        """The kernel's blocking at `tokens` rows (ValueError when none fits the target's SBUF)."""
        from onnx_nmm.kernels.pricing.blocking import plan_blocks

        return plan_blocks(self.kernel, (tokens, *dims.values()), dtype, target)

    def split(self, inputs: Sequence) -> tuple[list, object | None]:
        """The op's inputs after X as (the kernel's weights, the output bias or None)."""
        inputs = list(inputs)
        return inputs[:self.weights], (inputs[self.weights] if len(inputs) > self.weights else None)

    def matrices(self, weight_shapes: Sequence[Shape | None]) -> list[Shape | None]:
        """The shapes of the weights that must be 2-D initializers (the kernel's biases are vectors)."""
        vectors = [len(shape) == 1 for shape in self.operands(1, *([1] * len(self.dim_names)))[1:]]
        return [shape for shape, vector in zip(list(weight_shapes)[:self.weights], vectors) if not vector]


KERNEL_TABLE: dict[str, KernelSpec] = {spec.op: spec for spec in (
    KernelSpec(svd_ops.SVD_MATMUL, "fused_xuv", 2, ("K", "rank", "N"),
               dims_of=lambda w: (w[0][0], w[0][1], w[1][1]),
               operands=lambda m, k, r, n: ((m, k), (k, r), (r, n)),
               projections=lambda k, r, n: ((k, n),), activation=False),
    KernelSpec(svd_ops.SVD_GATED_MLP, "fused_svd_mlp", 6, ("H", "I", "rank_gate", "rank_up", "rank_down"),
               dims_of=lambda w: (w[0][0], w[1][1], w[0][1], w[2][1], w[4][1]),
               operands=lambda m, h, i, rg, ru, rd: ((m, h), (h, rg), (rg, i), (h, ru), (ru, i), (i, rd), (rd, h)),
               projections=lambda h, i, *ranks: ((h, i), (h, i), (i, h)), gated=True,
               factors=lambda h, i, rg, ru, rd: ((h, rg, i), (h, ru, i), (i, rd, h)), dense_op=svd_ops.GATED_MLP),
    KernelSpec(svd_ops.SVD_MLP, "fused_svd_ungated_mlp", 5, ("H", "I", "rank_1", "rank_2"),
               dims_of=lambda w: (w[0][0], w[1][1], w[0][1], w[3][1]),
               operands=lambda m, h, i, r1, r2: ((m, h), (h, r1), (r1, i), (i,), (i, r2), (r2, h)),
               projections=lambda h, i, *ranks: ((h, i), (i, h)),
               factors=lambda h, i, r1, r2: ((h, r1, i), (i, r2, h)), dense_op=svd_ops.MLP),
    KernelSpec(svd_ops.GATED_MLP, "dense_gated_mlp", 3, ("H", "I"),
               dims_of=lambda w: (w[0][0], w[0][1]),
               operands=lambda m, h, i: ((m, h), (h, i), (h, i), (i, h)),
               projections=lambda h, i: ((h, i), (h, i), (i, h)), gated=True, dense_op=svd_ops.GATED_MLP),
    KernelSpec(svd_ops.MLP, "dense_ungated_mlp", 3, ("H", "I"),
               dims_of=lambda w: (w[0][0], w[0][1]),
               operands=lambda m, h, i: ((m, h), (h, i), (i,), (i, h)),
               projections=lambda h, i: ((h, i), (i, h)), dense_op=svd_ops.MLP),
)}


def kernel_spec(op: str) -> KernelSpec:
    """The table's entry for an `ai.onnx_nmm` op type (KeyError naming the ops it knows)."""
    try:
        return KERNEL_TABLE[op]
    except KeyError:
        raise KeyError(f"no kernel runs ai.onnx_nmm::{op}; the table knows {', '.join(KERNEL_TABLE)}") from None
