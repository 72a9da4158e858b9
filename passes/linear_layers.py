"""Find the linear layers of an exported graph: products of an activation with a constant weight.

Matched forms (all seen in real exports: docs/formats.md, docs/architectures.md):

    MatMul(X, W)                      W an initializer or Constant, stored [K, N]
    MatMul(X, Transpose(W))           dynamo with optimize=False, tied lm_head: W stored [N, K]
    MatMul(X, Identity(W)), Cast(W)   TorchScript dedup; a weight stored in another dtype
    MatMul(X, W) → Add(·, b)          b a constant [N]: folded in as the layer's bias
    W also a graph input              older exporters list every initializer as an input too
    Gemm(X, W, C, transA=0, transB)   GPT-2's Conv1D; alpha scales W, beta scales C
    MatMulNBits(X, codes, scales, …)  int4/int8 weights (onnxruntime-genai, most CPU models on the hub)
    MatMul(X, DequantizeLinear(Wq))   QDQ: a quantized weight dequantized on the way (quantized_weights.py)
    MatMulInteger(DQL(X), Wq) · s     onnxruntime's dynamic int8 quantization

A layer is `Y = X·W_eff + b` with W_eff = alpha·op(W) of shape K×N. Each form is a rule (passes/rules.py)
anchored at its product node: NBitsLayer, IntegerLayer, MatMulLayer (the QDQ form included) and GemmLayer; a
node none matches says why (`unmatched_products`). Products of two activations (the attention scores) never
match: the weight must be a constant. Subgraphs (If, Loop, Scan bodies) are scanned too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.passes import roles
from onnx_nmm.passes.quantized_weights import (
    DEQUANTIZE,
    QuantizedWeight,
    dequantize_linear_parts,
    integer_layer_parts,
    nbits_layer_parts,
    unsupported_quantized,
)
from onnx_nmm.passes.rules import Mismatch, first_match

# Ops allowed between a weight's storage and the MatMul that reads it.
_WEIGHT_PATH_OPS = ("Identity", "Transpose", "Cast", DEQUANTIZE)


@dataclass
class WeightSource:
    """Where W comes from: a stored constant, seen through Identity/Transpose/Cast nodes."""

    storage: ir.Value  # initializer, or output of a Constant node (the codes of a quantized weight)
    path: list[ir.Node] = field(default_factory=list)  # from storage towards the consumer
    transposed: bool = False  # storage is [N, K]
    cast_to: ir.DataType | None = None
    quantized: QuantizedWeight | None = None  # the weight is stored quantized (codes, scales, zero points)

    @property
    def tensor(self) -> ir.TensorProtocol:
        tensor = ir.convenience.get_const_tensor(self.storage)
        assert tensor is not None, "a weight's storage is a constant (_resolve_weight)"
        return tensor

    @property
    def name(self) -> str:
        return self.storage.name or "<unnamed>"

    @property
    def is_initializer(self) -> bool:
        return self.storage.is_initializer()

    @property
    def is_external(self) -> bool:
        return isinstance(self.tensor, ir.ExternalTensor)

    def other_consumers(self, layer_nodes: set[ir.Node]) -> list[ir.Node]:
        """Nodes outside this layer that also read the stored weight (e.g. a tied embedding's Gather)."""
        own = set(self.path) | layer_nodes
        return [use.node for use in self.storage.uses() if use.node not in own]


@dataclass
class LinearLayer:
    """One matched linear layer, Y = X·W_eff (+ bias), W_eff of shape K×N."""

    node: ir.Node  # the MatMul or Gemm
    weight: WeightSource
    k: int
    n: int
    output: ir.Value  # the value whose uses the rewrite takes over (the Add's, when a bias is folded)
    bias: ir.Value | None = None
    bias_node: ir.Node | None = None
    alpha: float = 1.0
    beta: float = 1.0
    module_path: str = ""
    group: str = roles.OTHER
    role: str = roles.OTHER
    shared_with: list[str] = field(default_factory=list)  # names of other consumers of the weight
    scope: str = ""  # the subgraph, when its node name alone would name two different layers
    quantizer: ir.Node | None = None  # MatMulInteger: the DynamicQuantizeLinear X passes through first
    chain: list[ir.Node] = field(default_factory=list)  # MatMulInteger: its Cast and rescaling Muls

    @property
    def name(self) -> str:
        """What names the layer as a target; layers of two subgraphs that read one weight share it."""
        return f"{self.scope}{self.node.name or self.module_path}"

    @property
    def x(self) -> ir.Value:
        """The activation input, read from the node: rewriting an upstream layer replaces that value."""
        x = (self.quantizer or self.node).inputs[0]
        assert x is not None, "a matched product has its input X"
        return x

    @property
    def nodes(self) -> list[ir.Node]:
        """The nodes the layer is made of (not a quantizer other layers may share)."""
        return [self.node, *self.chain] + ([self.bias_node] if self.bias_node is not None else [])

    @property
    def dtype(self) -> ir.DataType:
        """W's float dtype: its storage's, or its scales' when it is stored quantized (what float factors are
        stored in)."""
        return self.weight.quantized.float_dtype if self.weight.quantized else self.weight.tensor.dtype

    @property
    def parameters(self) -> int:
        return self.k * self.n

    def weight_matrix(self) -> np.ndarray:
        """W_eff [K, N] as float32 (float64 if stored so): dequantized, transpose and alpha applied."""
        if self.weight.quantized is not None:
            array = self.weight.quantized.dequantize(self.k, self.n)
        else:
            array = self.weight.tensor.numpy()
            array = array.astype(np.float64 if array.dtype == np.float64 else np.float32)
        if self.weight.transposed:
            array = array.T
        if self.alpha != 1.0:
            array = array * np.asarray(self.alpha, dtype=array.dtype)
        return np.ascontiguousarray(array)

    def bias_vector(self) -> np.ndarray | None:
        """The bias [N] with beta applied, or None."""
        if self.bias is None:
            return None
        constant = ir.convenience.get_const_tensor(self.bias)
        assert constant is not None, "a bias is a constant (_is_bias)"
        tensor = constant.numpy().reshape(-1)
        return tensor * np.asarray(self.beta, dtype=tensor.dtype) if self.beta != 1.0 else tensor


def find_linear_layers(model: ir.Model) -> list[LinearLayer]:
    """Every linear layer, in graph order, subgraphs (If, Loop and Scan bodies) included, with its role.

    The same layer in two subgraphs — a merged decoder's first-step and later-step branches, both reading one
    weight — is one target under one name, and neither node counts as another reader of the weight.
    """
    layers = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        layer = first_match(LINEAR_LAYER_RULES, node, model)
        if isinstance(layer, LinearLayer):
            assert node.graph is not None, "the iterator walks the nodes of graphs"
            _assign_role(layer, node.graph)
            layers.append(layer)
    _tell_apart(layers)
    sites: dict[str, set[ir.Node]] = {}
    for layer in layers:
        sites.setdefault(layer.name, set()).update(layer.nodes)
    by_node = {id(node): layer for layer in layers for node in [*layer.nodes, *layer.weight.path]}
    for layer in layers:
        others = layer.weight.other_consumers(sites[layer.name])
        layer.shared_with = [_consumer(other, by_node.get(id(other))) for other in others]
    return layers


def unmatched_products(model: ir.Model) -> list[tuple[ir.Node, str]]:
    """Every MatMul and Gemm no linear-layer rule reads, with the reason of the rule that came closest (the
    attention's products of two activations, a weight computed at run time, ...)."""
    unmatched = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == "" and node.op_type in ("MatMul", "Gemm"):
            found = first_match(LINEAR_LAYER_RULES, node, model)
            if isinstance(found, Mismatch):
                unmatched.append((node, found.reason))
    return unmatched


def _consumer(node: ir.Node, layer: LinearLayer | None) -> str:
    """What else reads a layer's weight, in words: another linear layer by its path and role, the embedding's
    lookup, or the node."""
    if layer is not None:
        return f"{layer.module_path or layer.name} ({layer.role})"
    if node.op_type == "Gather":
        return f"the embedding lookup {node.name or 'Gather'} (a tied embedding)"
    return f"the {node.op_type} node {node.name}" if node.name else f"a {node.op_type} node"


@dataclass
class UnreadLayer:
    """A product of an activation and a quantized constant in a form no rewrite reads."""

    node: ir.Node
    op: str
    module_path: str
    group: str


def find_unread_layers(model: ir.Model) -> list[UnreadLayer]:
    """The quantized linear layers of forms onnx-nmm does not read (quantized_weights.unsupported_quantized)."""
    unread = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        op = unsupported_quantized(node)
        if op is not None:
            path = roles.module_path(node)
            named = roles.classify(path)
            unread.append(UnreadLayer(node, op, path, named[0] if named is not None else roles.OTHER))
    return unread


def _tell_apart(layers: list[LinearLayer]) -> None:
    """Layers that share a node name but read different weights get their subgraph's name in front."""
    by_name: dict[str, list[LinearLayer]] = {}
    for layer in layers:
        by_name.setdefault(layer.name, []).append(layer)
    for same in by_name.values():
        if len({id(layer.weight.storage) for layer in same}) > 1:
            for layer in same:
                graph = layer.node.graph
                layer.scope = f"{graph.name}/" if graph is not None and graph.name else ""


class NBitsLayer:
    """Y = MatMulNBits(X, codes, scales, zero points, ..., bias)    Wᵀ's rows quantized in blocks along K
    (onnxruntime-genai's int4 and int8 models; quantized_weights.py); a following Add of a constant [N] is its bias
    when the op has none."""

    def match(self, node: ir.Node, model: ir.Model) -> LinearLayer | Mismatch:
        parts = nbits_layer_parts(node)
        if parts is None:
            return Mismatch("not a MatMulNBits with constant codes and scales")
        weight, k, n, bias = parts
        layer = LinearLayer(node=node, weight=WeightSource(storage=weight.codes, quantized=weight), k=k, n=n,
                            output=node.outputs[0], bias=bias)
        if bias is None:
            _fold_bias_add(layer)
        return layer


class IntegerLayer:
    """Y = Cast(MatMulInteger(DynamicQuantizeLinear(X), Wq)) · (x scale · w scale)    onnxruntime's dynamic int8
    quantization (quantized_weights.py), then an optional bias Add."""

    def match(self, node: ir.Node, model: ir.Model) -> LinearLayer | Mismatch:
        product = integer_layer_parts(node)
        if product is None:
            return Mismatch("not a MatMulInteger of a dynamically quantized X and constant codes")
        codes = ir.convenience.get_const_tensor(product.weight.codes)
        assert codes is not None, "integer_layer_parts found the codes constant"
        if len(codes.shape) != 2:
            return Mismatch("its codes are not a matrix", 1)
        k, n = codes.shape.numpy()
        layer = LinearLayer(node=node, weight=WeightSource(storage=product.weight.codes, quantized=product.weight),
                            k=k, n=n, output=product.output, quantizer=product.quantizer, chain=product.chain)
        _fold_bias_add(layer)
        return layer


class MatMulLayer:
    """Y = MatMul(X, W) (+ Add(·, b))    W a constant [K, N], seen through Identity, Transpose ([N, K] stored),
    Cast or DequantizeLinear (QDQ); b a constant [N]."""

    def match(self, node: ir.Node, model: ir.Model) -> LinearLayer | Mismatch:
        found = _product_with_weight(node, "MatMul")
        if isinstance(found, Mismatch):
            return found
        source, rows, cols = found
        k, n = (cols, rows) if source.transposed else (rows, cols)
        layer = LinearLayer(node=node, weight=source, k=k, n=n, output=node.outputs[0])
        _fold_bias_add(layer)
        return layer


class GemmLayer:
    """Y = Gemm(X, W, C, alpha, beta, transA=0, transB)    GPT-2's Conv1D: alpha scales W, beta scales C, a
    per-output bias."""

    def match(self, node: ir.Node, model: ir.Model) -> LinearLayer | Mismatch:
        found = _product_with_weight(node, "Gemm")
        if isinstance(found, Mismatch):
            return found
        source, rows, cols = found
        if _int_attribute(node, "transA", 0) != 0:
            return Mismatch("transA=1: it multiplies a transposed X", 3)
        if _int_attribute(node, "transB", 0):
            source.transposed = not source.transposed
        k, n = (cols, rows) if source.transposed else (rows, cols)
        layer = LinearLayer(node=node, weight=source, k=k, n=n, output=node.outputs[0],
                            alpha=_float_attribute(node, "alpha", 1.0), beta=_float_attribute(node, "beta", 1.0))
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            if not _is_bias(node.inputs[2], n):
                return Mismatch("its C is not a per-output bias", 3)
            layer.bias = node.inputs[2]
        return layer


LINEAR_LAYER_RULES = (NBitsLayer(), IntegerLayer(), MatMulLayer(), GemmLayer())


def _product_with_weight(node: ir.Node, op_type: str) -> tuple[WeightSource, int, int] | Mismatch:
    """A MatMul or Gemm of an activation and a stored matrix: where the matrix comes from, and its stored shape."""
    if node.domain != "" or node.op_type != op_type or len(node.inputs) < 2:
        return Mismatch(f"not a {op_type}")
    x, w = node.inputs[0], node.inputs[1]
    if x is None or w is None or x.shape is not None and len(x.shape) < 2:
        return Mismatch("its input is missing or a vector", 1)
    source = _resolve_weight(w)
    if isinstance(source, Mismatch):
        return source
    shape = source.tensor.shape
    if len(shape) != 2 or not all(isinstance(d, int) for d in shape.dims):
        return Mismatch("its weight is not a matrix of fixed size", 2)
    rows, cols = shape.dims
    return source, rows, cols


def _resolve_weight(value: ir.Value) -> WeightSource | Mismatch:
    """Follow Identity/Transpose/Cast/DequantizeLinear back to a stored constant, or say why W is not one."""
    path: list[ir.Node] = []
    transposed = permuted = False
    cast_to = quantized = None
    while True:
        if value.is_graph_input() and not value.is_initializer():
            # an initializer that older exporters also list as an input is a constant: the exporter's default,
            # which no caller overrides
            return Mismatch("its second operand is a graph input, not a stored weight", 1)
        if ir.convenience.get_const_tensor(value) is not None:
            if permuted:
                return Mismatch("its weight's Transpose is not a matrix transpose", 2)
            return WeightSource(storage=value, path=path[::-1], transposed=transposed, cast_to=cast_to,
                                quantized=quantized)
        producer = value.producer()
        if producer is None or producer.domain != "" or producer.op_type not in _WEIGHT_PATH_OPS:
            return Mismatch("its second operand is computed (a product of two activations), not a stored weight", 1)
        if quantized is not None and producer.op_type != "Identity":
            return Mismatch("its quantized codes are transposed or cast, so their scales' axis would not apply", 2)
        if producer.op_type == DEQUANTIZE:
            quantized = dequantize_linear_parts(producer)
            if quantized is None:
                return Mismatch("its weight's scales or zero points are computed, not constants", 2)
        elif producer.op_type == "Transpose":
            perm = producer.attributes.get("perm")
            permuted |= perm is not None and list(perm.as_ints()) != [1, 0]  # said if W turns out stored
            transposed = not transposed
        elif producer.op_type == "Cast" and cast_to is None:
            cast_to = ir.DataType(producer.attributes["to"].as_int())
        path.append(producer)
        if producer.inputs[0] is None:
            return Mismatch(f"its weight's {producer.op_type} has no input", 1)
        value = producer.inputs[0]


def _fold_bias_add(layer: LinearLayer) -> None:
    """MatMul → Add(constant [N]): the Add becomes part of the layer."""
    output, graph = layer.output, layer.node.graph
    assert graph is not None, "a matched product is a node of a graph"
    uses = list(output.uses())
    if len(uses) != 1 or output in graph.outputs:
        return
    add = uses[0].node
    if add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
        return
    other = add.inputs[1] if add.inputs[0] is output else add.inputs[0]
    if other is None or other is output or not _is_bias(other, layer.n):
        return
    layer.bias, layer.bias_node, layer.output = other, add, add.outputs[0]


def _is_bias(value: ir.Value, n: int) -> bool:
    """A constant broadcastable as a per-output-feature bias: shape [N] or [1, ..., 1, N]."""
    if value.is_graph_input():
        return False
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return False
    dims = list(tensor.shape.dims)
    return bool(dims) and dims[-1] == n and all(d == 1 for d in dims[:-1])


def _assign_role(layer: LinearLayer, graph: ir.Graph) -> None:
    layer.module_path = roles.module_path(layer.node)
    named = roles.classify(layer.module_path)
    if named is None and layer.weight.name:
        named = roles.classify(layer.weight.name.removesuffix(".weight"))
    if named is not None and named[1] != roles.OTHER:
        layer.group, layer.role = named
        return
    structural = roles.structural_mlp_role(layer.output, layer.x)
    if structural is not None:
        layer.group, layer.role = roles.MLP, structural
    elif roles.feeds_graph_output(layer.output, graph):
        layer.group, layer.role = roles.LM_HEAD, "lm_head"
    elif named is not None:
        layer.group, layer.role = named


def _int_attribute(node: ir.Node, name: str, default: int) -> int:
    attribute = node.attributes.get(name)
    return attribute.as_int() if attribute is not None else default


def _float_attribute(node: ir.Node, name: str, default: float) -> float:
    attribute = node.attributes.get(name)
    return attribute.as_float() if attribute is not None else default
