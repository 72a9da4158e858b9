"""How a decoder splits over N NeuronCores (tensor parallelism), and what each way of splitting a linear product
costs one rank (modelled).

Dense layers split as NxD Inference splits them (models/llama/modeling_llama.py, modules/attention/gqa.py of
aws-neuron/neuronx-distributed-inference):

- q, k, v and gate, up (fc1) column-parallel: each rank holds N/tp output columns, no collective;
- o and down (fc2) row-parallel: each rank holds K/tp input rows, and an all-reduce of the hidden size per
  token sums the ranks' partial outputs;
- the attention by head, the KV cache with it: query heads padded with empty ones to a multiple of tp; KV
  heads replicated to one per rank when tp is a multiple of them (GQA.REPLICATE_TO_TP_DEGREE, the default),
  otherwise one per query head (GQA.CONVERT_TO_MHA);
- the lm_head column-parallel over the vocabulary, its logits all-gathered (gather_output, as without
  on-device sampling); the embedding split across the hidden size, each token's row all-gathered
  (ParallelEmbedding, shard_across_embedding);
- a width tp does not divide padded (pad=True), so each rank takes ⌈width/tp⌉.

A factorized layer X·U·V splits other ways too, and the cheapest at the phase's token count is taken: U whole
and V column-split (a column-parallel layer's way, no collective); U row-split (X·U's partial sums all-reduced
over the rank-r intermediate, r columns per token instead of N) then V column-split, or V whole where a
row-parallel layer's output must be whole, or V column-split and the result all-gathered. A factorized MLP
takes the fastest of its fused kernel split as its dense MLP splits and its projections each split its own way
(gate and up all-reduce their X·U in one collective). The first way listed for a product is how NxD splits the
dense layer it stands for: the low-rank splits' saving is measured against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx_nmm.errors import ModelError
from onnx_nmm.kernel_table import kernel_spec
from onnx_nmm.passes import roles, svd_ops
from onnx_nmm.trainium.collectives import ALL_GATHER, ALL_REDUCE, Collective, collective
from onnx_nmm.trainium.decoder_shape import DecoderShape, Factorized, FusedMlp, Linear, Product
from onnx_nmm.trainium.launch_costs import Cost, activation_cost, choose_mlp_kernel, kernel_cost

COLUMN_ROLES = ("q", "k", "v", "qkv", "gate", "up", "gate_up", "fc1")
ROW_ROLES = ("o", "down", "fc2")


@dataclass(frozen=True)
class Sharding:
    """What one of `tp` ranks holds of a decoder's attention: its query and KV heads, after NxD's padding and
    replication."""

    tp: int
    heads: int  # query heads of one rank
    kv_heads: int
    q_width: int  # query heads × head size, on one rank
    kv_width: int
    note: str = ""

    @classmethod
    def of(cls, shape: DecoderShape, tp: int) -> Sharding:
        """How NxD's get_shardable_head_counts shards `shape`'s heads over `tp` ranks."""
        if tp == 1:
            return cls(1, shape.heads, shape.kv_width // shape.head_dim, shape.q_width, shape.kv_width)
        heads, kv_heads = shape.q_width // shape.head_dim, shape.kv_width // shape.head_dim
        if heads * shape.head_dim != shape.q_width or kv_heads * shape.head_dim != shape.kv_width:
            raise ModelError(f"{shape.label}: attention widths {shape.q_width} and {shape.kv_width} are not whole "
                             f"heads of {shape.head_dim}, so they cannot be split by head")
        padded = math.ceil(heads / tp) * tp
        notes = [f"{heads} query heads padded to {padded}"] if padded != heads else []
        if kv_heads == heads:
            kv_padded = padded
        elif kv_heads >= tp and kv_heads % tp == 0:
            kv_padded = kv_heads
        elif tp % kv_heads == 0:
            kv_padded = tp
            notes.append(f"{kv_heads} KV heads replicated to one per NeuronCore")
        else:
            kv_padded = padded
            notes.append(f"{kv_heads} KV heads replicated to one per query head")
        note = f"tp {tp}: {padded // tp} query and {kv_padded // tp} KV heads per NeuronCore" + \
            (f" ({' and '.join(notes)}, as NxD Inference shards them)" if notes else "")
        return cls(tp, padded // tp, kv_padded // tp, padded // tp * shape.head_dim,
                   kv_padded // tp * shape.head_dim, note)

    def share(self, width: int) -> int:
        """One rank's part of a width split over the ranks (padded as NxD pads it)."""
        return math.ceil(width / self.tp)

    def columns(self, product: Linear | Factorized) -> int:
        """The output columns one rank computes of a column-parallel product."""
        if self.tp == 1:
            return product.n
        by_head = {"q": self.q_width, "k": self.kv_width, "v": self.kv_width,
                   "qkv": self.q_width + 2 * self.kv_width}
        return by_head.get(product.role, self.share(product.n))

    def rows(self, product: Linear | Factorized) -> int:
        """The input rows one rank holds of a row-parallel product."""
        if self.tp == 1:
            return product.k
        return self.q_width if product.role == "o" else self.share(product.k)


@dataclass(frozen=True)
class Split:
    """One way to run a product on every rank: what one rank's launches cost and the collectives joining them."""

    how: str
    cost: Cost
    collectives: tuple[Collective, ...] = ()
    # the all-reduce summing a row-parallel layer's partial products: of its output, N wide, or of X·U, r wide
    partial_sums: Collective | None = None

    @property
    def seconds(self) -> float:
        return self.cost[0] + self.collective_seconds

    @property
    def collective_seconds(self) -> float:
        return sum(c.seconds for c in self.collectives)


def splits(product: Product, sharding: Sharding, tokens: int, target: str) -> list[Split]:
    """Every way `product` runs over `sharding`'s ranks at `tokens` rows, the way NxD splits its dense layer
    first; at tp 1, the one way it runs on one NeuronCore."""
    at = _Pricing(sharding, tokens, target)
    if isinstance(product, (Linear, Factorized)):
        return at.linear(product)
    mlp = choose_mlp_kernel(product.op, kernel_spec(product.op).named((product.hidden, sharding.share(
        product.intermediate), *product.sizes[2:])), tokens, target)
    inputs, output = ("gate_proj and up_proj", "down_proj") if product.gated else ("fc1", "fc2")
    kernel, sums = mlp.ways[mlp.way][0], at.all_reduce(output, product.hidden)
    ways = [Split(f"{kernel}, {inputs} column-, {output} row-parallel" if sharding.tp > 1 else kernel, mlp.cost,
                  sums, _first(sums))]
    if isinstance(product, FusedMlp) and sharding.tp > 1:
        ways += at.projections(product)
    return ways


def layer_name(product: Product) -> str:
    """What a product is called where its split is shown: "MLP", or the layer as a Llama names it (o_proj)."""
    if not isinstance(product, (Linear, Factorized)):
        return "MLP"
    return product.role if product.role in ("fc1", "fc2", roles.LM_HEAD) else f"{product.role}_proj"


def cheapest(ways: list[Split]) -> Split:
    """The fastest way (a tie goes to the one listed first)."""
    return min(ways, key=lambda split: split.seconds)


@dataclass(frozen=True)
class _Pricing:
    """Launches and collectives of one rank at `tokens` rows."""

    sharding: Sharding
    tokens: int
    target: str

    def matmul(self, k: int, n: int) -> Cost:
        return kernel_cost("dense_matmul", ((self.tokens, k), (k, n)), self.target)

    def xuv(self, k: int, rank: int, n: int) -> Cost:
        xuv = kernel_spec(svd_ops.SVD_MATMUL)
        return kernel_cost(xuv.kernel, xuv.operands(self.tokens, k, rank, n), self.target)

    def all_reduce(self, what: str, width: int) -> tuple[Collective, ...]:
        return self._collective(ALL_REDUCE, what, width)

    def all_gather(self, what: str, width: int) -> tuple[Collective, ...]:
        return self._collective(ALL_GATHER, what, width)

    def _collective(self, kind: str, what: str, width: int) -> tuple[Collective, ...]:
        if self.sharding.tp == 1:
            return ()
        return (collective(kind, what, width, self.tokens, self.sharding.tp, self.target),)

    def linear(self, product: Linear | Factorized) -> list[Split]:
        """A dense or factorized product at its place: column- or row-parallel by its role, the lm_head over the
        vocabulary, anything else whole on every rank."""
        tp = self.sharding.tp
        if product.role in ROW_ROLES and tp > 1:
            return self.row(product)
        if (product.role in COLUMN_ROLES or product.role == roles.LM_HEAD) and tp > 1:
            gathered = self.all_gather("lm_head logits", tp * self.sharding.columns(product)) \
                if product.role == roles.LM_HEAD else ()
            return [Split(split.how, split.cost, split.collectives + gathered) for split in self.column(product)]
        whole = self.xuv(product.k, product.rank, product.n) if isinstance(product, Factorized) \
            else self.matmul(product.k, product.n)
        return [Split("whole on every rank" if tp > 1 else "one NeuronCore", whole)]

    def column(self, product: Linear | Factorized) -> list[Split]:
        n = self.sharding.columns(product)
        if not isinstance(product, Factorized):
            return [Split("column-parallel", self.matmul(product.k, n))]
        return [Split("U whole, V column-split", self.xuv(product.k, product.rank, n)),
                Split("U row-split, X·U all-reduced, V column-split",
                      self._low_rank(self.sharding.share(product.k), product.rank, n),
                      self.all_reduce(f"{layer_name(product)}'s X·U", product.rank))]

    def row(self, product: Linear | Factorized) -> list[Split]:
        k, what = self.sharding.rows(product), layer_name(product)
        output = self.all_reduce(what, product.n)
        if not isinstance(product, Factorized):
            return [Split("row-parallel", self.matmul(k, product.n), output, _first(output))]
        low_rank = self.all_reduce(f"{what}'s X·U", product.rank)
        return [Split("U row-split, V whole, output all-reduced", self.xuv(k, product.rank, product.n), output,
                      _first(output)),
                Split("U row-split, X·U all-reduced, V whole", self._low_rank(k, product.rank, product.n), low_rank,
                      _first(low_rank)),
                Split("U row-split, X·U all-reduced, V column-split, output all-gathered",
                      self._low_rank(k, product.rank, self.sharding.share(product.n)),
                      low_rank + self.all_gather(what, product.n), _first(low_rank))]

    def _low_rank(self, k: int, rank: int, n: int) -> Cost:
        """X·U on the rank's k rows of U, then (after the all-reduce) the rank-r intermediate times n columns of V:
        two launches."""
        return _sum(self.matmul(k, rank), self.matmul(rank, n))

    def projections(self, mlp: FusedMlp) -> list[Split]:
        """A factorized MLP as its projections, each launched on its own with the activation between: the inputs
        (gate and up, or fc1) with U whole, or with U row-split and their X·U all-reduced in one collective;
        the output projection each of its row-parallel ways."""
        spec = kernel_spec(mlp.op)
        *inputs, output = (Factorized(f"{mlp.name}.{role}", roles.MLP, role, mlp.block, k, rank, n)
                           for role, (k, rank, n) in zip(("gate", "up", "down") if mlp.gated else ("fc1", "fc2"),
                                                         spec.factors(*mlp.sizes)))
        activation = activation_cost(self.sharding.share(mlp.intermediate), mlp.gated, self.tokens, self.target)
        whole = _sum(*(self.xuv(p.k, p.rank, self.sharding.columns(p)) for p in inputs))
        names = " and ".join(layer_name(p) for p in inputs)
        row_split = (_sum(*(self._low_rank(self.sharding.share(p.k), p.rank, self.sharding.columns(p))
                            for p in inputs)),
                     self.all_reduce(f"{names}'s X·U", sum(p.rank for p in inputs)))
        ways = []
        for how, cost, collectives in (("U whole", whole, ()), ("U row-split", *row_split)):
            for out in self.row(output):
                ways.append(Split(f"projections: {names} {how}; {layer_name(output)} {out.how}",
                                  _sum(cost, activation, out.cost), collectives + out.collectives,
                                  out.partial_sums))
        return ways




def _first(collectives: tuple[Collective, ...]) -> Collective | None:
    return collectives[0] if collectives else None


def _sum(*costs: Cost) -> Cost:
    seconds, bytes_, flops = (sum(values) for values in zip(*costs))
    return seconds, bytes_, flops
