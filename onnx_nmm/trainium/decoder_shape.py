"""What a decoder's speed on Trainium depends on: its linear products and its attention widths, no weights.

A `DecoderShape` lists every linear product one forward pass runs — dense (X·W), factorized (X·U·V, one
`fused_xuv` launch), a fused SVD MLP (one `fused_svd_mlp` or `fused_svd_ungated_mlp` launch) or a dense
MLP (one `dense_gated_mlp` or `dense_ungated_mlp` launch, or its projections one by one, whichever is
faster) — each with its role and decoder layer, and the widths the rest of the pass works on (hidden,
query and KV widths, head size, vocabulary). It comes from an ONNX model (`decoder_shape`: the products as
`compile` would run them, MLPs fused as it fuses them) or from a Hugging Face config
(`decoder_shape_of_config`: a model nobody exported, at any size); `factorized` turns a shape into its
rewrite by the keep rule, shapes only (no SVD).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import onnx_ir as ir

from onnx_nmm.errors import ModelError
from onnx_nmm.kernel_table import kernel_spec
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import DEFAULT_ALIGN, RankOptions, Selection
from onnx_nmm.passes import find_linear_layers, reason_to_skip, roles, svd_ops
from onnx_nmm.passes.dense_mlp_fusion import fuse_every_mlp
from onnx_nmm.ranks.rank_plan import Dense, block_aligned_rank, worth_factorizing
from onnx_nmm.runtime.causal_lm import CausalLm

ASSUMED_HEAD_DIM = 64  # a cache-free graph does not say; it only sizes the softmax, a sliver of a step
_LAYER_INDEX = re.compile(r"(?:^|[./])(\d+)(?:[./]|$)")


@dataclass(frozen=True)
class Linear:
    """X [M, K] · W [K, N]: one dense_matmul launch."""

    name: str
    group: str
    role: str
    block: int | None  # the decoder layer it belongs to (None: the lm_head, or a path without one)
    k: int
    n: int

    @property
    def parameters(self) -> int:
        return self.k * self.n

    @property
    def module_path(self) -> str:
        return self.name


@dataclass(frozen=True)
class Factorized:
    """X [M, K] · U [K, r] · V [r, N]: one fused_xuv launch."""

    name: str
    group: str
    role: str
    block: int | None
    k: int
    rank: int
    n: int

    @property
    def parameters(self) -> int:
        return self.rank * (self.k + self.n)

    op = svd_ops.SVD_MATMUL

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.k, self.rank, self.n


@dataclass(frozen=True)
class FusedMlp:
    """act(X·Ug·Vg) * (X·Uu·Vu) · Ud·Vd, one fused_svd_mlp launch, the gating inside it; or, not gated,
    act(X·U1·V1 + b1) · U2·V2, one fused_svd_ungated_mlp launch."""

    name: str
    block: int | None
    hidden: int
    intermediate: int
    ranks: tuple[int, ...]  # gate, up, down; or fc1, fc2
    group: str = roles.MLP

    @property
    def gated(self) -> bool:
        return len(self.ranks) == 3

    @property
    def role(self) -> str:
        return "gated_mlp" if self.gated else "mlp"

    @property
    def parameters(self) -> int:
        return sum(self.ranks) * (self.hidden + self.intermediate)

    @property
    def op(self) -> str:
        return svd_ops.SVD_GATED_MLP if self.gated else svd_ops.SVD_MLP

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.hidden, self.intermediate, *self.ranks


@dataclass(frozen=True)
class DenseMlp:
    """act(X·Wg) * (X·Wu) · Wd, or not gated act(X·W1 + b1) · W2: one dense_gated_mlp or dense_ungated_mlp launch,
    or its projections as dense_matmul launches with the activation between, whichever is faster. A narrowed
    MLP (--method nystrom) is one of these, of smaller width."""

    name: str
    block: int | None
    hidden: int
    intermediate: int
    gated: bool = True
    group: str = roles.MLP

    @property
    def role(self) -> str:
        return "gated_mlp" if self.gated else "mlp"

    @property
    def parameters(self) -> int:
        return (3 if self.gated else 2) * self.hidden * self.intermediate

    @property
    def op(self) -> str:
        return svd_ops.GATED_MLP if self.gated else svd_ops.MLP

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.hidden, self.intermediate


Product = Linear | Factorized | FusedMlp | DenseMlp


@dataclass(frozen=True)
class DecoderShape:
    label: str
    layers: int
    hidden: int
    q_width: int  # query heads × head size (the attention output projection's K)
    kv_width: int  # key/value heads × head size (one of K or V per token and layer)
    head_dim: int
    vocab: int
    products: tuple[Product, ...]  # every linear product of one forward pass, the lm_head included
    activations: tuple[tuple[int, bool], ...]  # (width, gated) of each MLP activation run outside a kernel
    notes: tuple[str, ...] = ()

    @property
    def heads(self) -> int:
        return max(self.q_width // self.head_dim, 1)

    @property
    def linear_parameters(self) -> int:
        return sum(product.parameters for product in self.products)

    def counts(self) -> dict[str, int]:
        """How many products of each kind ("dense", "factorized", "fused MLP", "dense MLP")."""
        kinds = {Linear: "dense", Factorized: "factorized", FusedMlp: "fused MLP", DenseMlp: "dense MLP"}
        counts = dict.fromkeys(kinds.values(), 0)
        for product in self.products:
            counts[kinds[type(product)]] += 1
        return counts


def decoder_shape(model, fuse_mlp: bool = True) -> DecoderShape:
    """The shape of an ONNX causal LM as `compile` would run it when `fuse_mlp` (as it does by default): every
    MLP compile's own fusion passes fuse is one product, a FusedMlp when factorized and a DenseMlp when dense or
    narrowed; an MLP they leave alone stays its projections. Layers of a merged decoder's two branches count once.
    Raises ModelError when the graph has no attention output projection to size the attention by."""
    source = ModelSource.of(model)
    if fuse_mlp:
        fuse_every_mlp(source.model)  # compile's own fusion: what it cannot fuse stays separate here too
    layers = find_linear_layers(source.model)
    products: dict[str, Product] = {}
    for layer in layers:
        products.setdefault(layer.name, Linear(layer.name, layer.group, layer.role, _block(layer.module_path),
                                               layer.k, layer.n))
    for node in _custom_nodes(source.model.graph):
        product = _custom_product(node)
        products.setdefault(product.name, product)
    shape = _assemble(source.label, list(products.values()), CausalLm.of_source(source))
    if any(layer.weight.quantized for layer in layers):
        shape = replace(shape, notes=(*shape.notes, "quantized weights priced as bfloat16, as the kernels take them"))
    return shape


def decoder_shape_of_config(config: str | os.PathLike | dict, label: str | None = None) -> DecoderShape:
    """The shape of a Llama-family decoder (Llama, Mistral, Qwen2/3, SmolLM: q/k/v/o, SiLU-gated MLP) from
    its Hugging Face config (a dict, a config.json, or the folder holding it), all products dense."""
    values: dict = config if isinstance(config, dict) else {}
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            values, label = json.loads(path.read_text()), label or str(path)
        except (OSError, json.JSONDecodeError) as error:
            raise ModelError(f"cannot read a Hugging Face config from {path}: {error}") from None
    try:
        hidden, layers = int(values["hidden_size"]), int(values["num_hidden_layers"])
        heads = int(values["num_attention_heads"])
        head_dim = int(values.get("head_dim") or hidden // heads)
        kv_width = int(values.get("num_key_value_heads", heads)) * head_dim
        intermediate, vocab = int(values["intermediate_size"]), int(values["vocab_size"])
    except KeyError as error:
        raise ModelError(f"the config of {label or 'the model'} has no {error.args[0]}: onnx-nmm reads Llama-family "
                         "configs (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size)"
                         ) from None
    q_width = heads * head_dim
    products: list[Product] = []
    for block in range(layers):
        for role, k, n in (("q", hidden, q_width), ("k", hidden, kv_width), ("v", hidden, kv_width),
                           ("o", q_width, hidden)):
            products.append(Linear(f"layers.{block}.self_attn.{role}_proj", roles.ATTENTION, role, block, k, n))
        products.append(DenseMlp(f"layers.{block}.mlp", block, hidden, intermediate))
    products.append(Linear("lm_head", roles.LM_HEAD, "lm_head", None, hidden, vocab))
    return DecoderShape(label or values.get("_name_or_path") or "the config", layers, hidden, q_width, kv_width,
                        head_dim, vocab, tuple(products), ())


def factorized(shape: DecoderShape, keep: float, targets: str = Selection.targets, align: int = DEFAULT_ALIGN,
               fuse_mlp: bool = True) -> DecoderShape:
    """`shape` with the dense products a rewrite's `Selection(targets)` picks ("mlp", "attention", "all"; never
    the lm_head) at the rank keeping `keep` of their parameters, block-aligned; an MLP whose projections are all
    factorized is one fused SVD MLP when `fuse_mlp`, as compile fuses it. Only shapes change: this is the model a
    rewrite would give, not one."""
    selection, _ = Selection(targets=targets), RankOptions(keep=keep, align=align)  # refused as a rewrite would

    def at_keep(product: Linear) -> Linear | Factorized:
        if reason_to_skip(product, selection) is not None:
            return product
        rank = worth_factorizing(block_aligned_rank(product.k, product.n, keep, align), product.k, product.n, align)
        return product if isinstance(rank, Dense) else \
            Factorized(product.name, product.group, product.role, product.block, product.k, rank, product.n)

    products: list[Product] = []
    activations = list(shape.activations)
    for product in shape.products:
        if isinstance(product, Linear):
            products.append(at_keep(product))
        elif not isinstance(product, DenseMlp):
            products.append(product)
        else:
            parts = [at_keep(part) for part in _projections(product)]
            ranks = [part.rank for part in parts if isinstance(part, Factorized)]
            if not ranks:
                products.append(product)  # a dense MLP nothing factorizes stays one
            elif fuse_mlp and len(ranks) == len(parts):
                products.append(FusedMlp(product.name, product.block, product.hidden, product.intermediate,
                                         tuple(ranks)))
            else:
                products += parts
                activations.append((product.intermediate, product.gated))  # run between the projections
    return replace(shape, label=f"{shape.label} at keep {keep:g} of {targets}", products=tuple(products),
                   activations=tuple(activations))


def _projections(mlp: DenseMlp) -> list[Linear]:
    """A dense MLP's projections, each a dense product."""
    h, i = mlp.hidden, mlp.intermediate
    inputs, output = (("gate", "up"), "down") if mlp.gated else (("fc1",), "fc2")
    return [*(Linear(f"{mlp.name}.{role}_proj", roles.MLP, role, mlp.block, h, i) for role in inputs),
            Linear(f"{mlp.name}.{output}_proj", roles.MLP, output, mlp.block, i, h)]


def _custom_nodes(graph: ir.Graph):
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.domain == svd_ops.DOMAIN:
            yield node


def _custom_product(node: ir.Node) -> Product:
    """A custom op as the product it computes, its sizes read as the kernel table reads them."""
    spec = kernel_spec(node.op_type)
    weights = [tuple(value.shape.numpy()) if value is not None and value.shape is not None and value.shape.is_static()
               else None for value in node.inputs[1:]]
    sizes = tuple(spec.dims(weights).values())
    key, path = _factor_key(node), roles.module_path(node)
    if node.op_type in svd_ops.MLP_OPS:
        return FusedMlp(key, _block(path), sizes[0], sizes[1], sizes[2:])
    if node.op_type in svd_ops.DENSE_MLP_OPS:
        return DenseMlp(key, _block(path), sizes[0], sizes[1], spec.gated)
    group, role = roles.classify(path) or (roles.OTHER, roles.OTHER)
    return Factorized(key, group, role, _block(path), *sizes)


def _factor_key(node: ir.Node) -> str:
    """The node's factors, which name it once however many branches of a merged decoder compute it."""
    return "+".join(value.name or "" for value in node.inputs[1:] if value is not None)


def _block(path: str) -> int | None:
    match = _LAYER_INDEX.search(path)
    return int(match.group(1)) if match else None


def _assemble(label: str, products: list[Product], lm: CausalLm) -> DecoderShape:
    linear = [p for p in products if isinstance(p, (Linear, Factorized))]

    def first(role: str) -> Linear | Factorized | None:
        return next((p for p in linear if p.role == role), None)

    output, key, head = first("o"), first("k"), first("lm_head")
    if output is None:
        raise ModelError(f"{label} has no attention output projection (o_proj, out_proj, c_proj, ...) that onnx-nmm "
                         "recognises, so the attention cannot be sized")
    cache_dims = [entry.input.shape for entry in lm.cache if all(isinstance(d, int) for d in entry.input.shape[1::2])]
    notes = []
    if cache_dims:
        kv_heads, head_dim = cache_dims[0][1], cache_dims[0][3]
        kv_width, layers = kv_heads * head_dim, len(lm.cache) // 2
    else:
        head_dim = ASSUMED_HEAD_DIM
        kv_width = key.n if key is not None else output.k
        layers = sum(1 for p in linear if p.role == "o")
        notes.append(f"no KV cache in the graph: head size assumed {ASSUMED_HEAD_DIM}, "
                     "KV width from the key projection")
    activations = tuple((p.k, p.role == "down") for p in linear if p.group == roles.MLP and p.role in ("down", "fc2"))
    vocab = head.n if head is not None else (lm.vocabulary or 0)
    return DecoderShape(label, layers, output.n, output.k, kv_width, head_dim, vocab, tuple(products), activations,
                        tuple(notes))
