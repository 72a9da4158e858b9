"""Replace factorized linear layers by `ai.onnx_nmm::SvdMatMul` calls — or, for a weight stored quantized,
by the same quantized form twice.

    Y = X·W (+ b)                  →   Y = SvdMatMul(X, U, V (, b))      with  U·V ≈ W,  U [K, r], V [r, N]
    Y = MatMulNBits(X, W…)         →   Y = MatMulNBits(MatMulNBits(X, U…), V…) (+ b)
    Y = MatMul(X, Dequantize(W…))  →   Y = SvdMatMul(X, Dequantize(U…), Dequantize(V…) (, b))
    Y = MatMulInteger(DQL(X), W…)  →   H = MatMulInteger(DQL(X), U…);  Y = MatMulInteger(DQL(H), V…) (+ b)

The pass is pure graph surgery: the factors come computed (onnx_nmm.pipeline.factorize), quantized too when
they are to be stored so (onnx_nmm.quantization). Float U and V become initializers in W's float dtype (or
the one asked for), behind a Cast when the layer computes in another. The new node keeps the replaced
node's name and metadata (so module paths survive) and records the names of the nodes it replaced.
Weights, Transposes and Identities nobody reads any more are removed; a weight that another node still
reads (a tied embedding) stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_nmm.passes import svd_ops
from onnx_nmm.passes.linear_layers import LinearLayer
from onnx_nmm.passes.quantized_weights import INTEGER, MICROSOFT, NBITS, dequantized

# Node metadata of the two nodes a quantized layer becomes: which factor each computes, and the rank.
FACTOR_KEY, RANK_KEY = "onnx_nmm.svd_factor", "onnx_nmm.rank"


@dataclass
class QuantizedFactor:
    """A factor stored quantized: codes, scales, zero points (None: symmetric), and its node's attributes
    (MatMulNBits: K, N, bits, block_size; DequantizeLinear: axis)."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    attributes: dict

    def matrix(self, format: str, bits: int, block_size: int, k: int, n: int) -> np.ndarray:
        """The float32 factor [k, n] the stored arrays stand for."""
        return dequantized(format, self.codes, self.scales, self.zero_points, bits, block_size,
                           self.attributes.get("axis", 1), k, n)

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in (self.codes, self.scales, self.zero_points) if array is not None)


@dataclass
class FactorizedLayer:
    """A layer and the factors that replace its weight: float (stored in W's float dtype, or `storage`), or
    `quantized` in W's own format."""

    layer: LinearLayer
    u: np.ndarray  # [K, r]
    v: np.ndarray  # [r, N]
    align: int
    method: str
    storage: ir.DataType | None = None
    quantized: tuple[QuantizedFactor, QuantizedFactor] | None = None

    @property
    def rank(self) -> int:
        return self.u.shape[1]


class SvdFactorizationPass(ir.passes.InPlacePass):
    """Swap each given layer for an SvdMatMul node with its factors as new initializers.

    `factor_names` maps each layer's name to the names its U and V initializers were given.
    """

    def __init__(self, factorized: list[FactorizedLayer]):
        super().__init__()
        self.factorized = factorized
        self.factor_names: dict[str, tuple[str, str]] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        names = _NameAllocator(model.graph)
        made: dict[tuple[int, int], tuple] = {}  # the factors' initializers, once per shared weight (_made_once)
        for item in self.factorized:
            self.factor_names[item.layer.name] = _replace_layer(model, item, names, made)
        if self.factorized:
            RemoveUnusedNodesPass()(model)
            _drop_unread_weight_inputs(model.graph, [item.layer.weight.storage for item in self.factorized])
        return ir.passes.PassResult(model, modified=bool(self.factorized))


def _replace_layer(model: ir.Model, item: FactorizedLayer, names: "_NameAllocator",
                   made: dict[tuple[int, int], tuple]) -> tuple[str, str]:
    """Swap one layer for its SvdMatMul; the names of the U and V initializers. The factors are initializers
    of the main graph, which subgraph nodes read from the outer scope; a layer whose weight and factors another
    site already got reads the same ones."""
    layer = item.layer
    graph = model.graph
    base = layer.weight.name.removesuffix(".weight") if layer.weight.is_initializer else layer.name
    if item.quantized is not None and layer.weight.quantized.format == NBITS:
        return _replace_with_nbits(model, item, base, names, made)
    if item.quantized is not None and layer.weight.quantized.format == INTEGER:
        return _replace_with_integer(model, item, base, names, made)
    u, v = _made_once(made, item, lambda: _factor_initializers(graph, item, base, names))
    factor_names = (u.name, v.name)
    new_nodes: list[ir.Node] = []
    if item.quantized is not None:  # QDQ: the factors dequantized on the way, as the weight was
        u, v = (_dequantize(value, factor, new_nodes) for value, factor in zip((u, v), item.quantized))
    else:
        compute = layer.weight.cast_to or layer.dtype
        if u.dtype != compute:
            u, v = (_cast(value, compute, new_nodes) for value in (u, v))
    bias = _bias_value(graph, layer, names)
    overload = svd_ops.register_svd_matmul(model, with_bias=bias is not None)
    metadata = dict(layer.node.metadata_props)
    metadata[svd_ops.ORIGINAL_NODE_KEY] = ",".join(node.name or node.op_type for node in layer.nodes)
    call = svd_ops.svd_matmul_node(
        layer.x, u, v, bias, rank=item.rank, align=item.align, method=item.method,
        original_weight=layer.weight.name, overload=overload, name=layer.node.name or f"{base}.svd",
        metadata=metadata,
    )
    new_nodes.append(call)
    ir.convenience.replace_nodes_and_values(
        layer.node.graph, layer.node, old_nodes=layer.nodes, new_nodes=new_nodes,
        old_values=[layer.output], new_values=call.outputs,
    )
    return factor_names


def _made_once(made: dict, item: FactorizedLayer, make):
    """The initializers of `item`'s factors, made by `make` at the first site that needs them: every site of a
    shared weight (a merged decoder's branches) reads the same ones."""
    key = (id(item.layer.weight.storage), id(item.u))
    if key not in made:
        made[key] = make()
    return made[key]


def _factor_initializers(graph: ir.Graph, item: FactorizedLayer, base: str,
                         names: "_NameAllocator") -> tuple[ir.Value, ir.Value]:
    """U and V as initializers: float in the storage dtype, or a quantized factor's codes (its scales and zero
    points beside them, found by `_dequantize` under the codes' name)."""
    if item.quantized is None:
        dtype = item.storage or item.layer.dtype
        return (_initializer(graph, names.fresh(f"{base}.svd_u"), item.u, dtype),
                _initializer(graph, names.fresh(f"{base}.svd_v"), item.v, dtype))
    return tuple(values[0] for values in _quantized_factor_initializers(graph, item, base, names))


def _quantized_factor_initializers(graph: ir.Graph, item: FactorizedLayer, base: str, names: "_NameAllocator"
                                   ) -> tuple[list[ir.Value], list[ir.Value]]:
    """[codes, scales(, zero points)] of U, then of V."""
    return tuple(_quantized_initializers(graph, names.fresh(f"{base}.svd_{which}"), factor)
                 for which, factor in zip("uv", item.quantized))


def _quantized_initializers(graph: ir.Graph, name: str, factor: QuantizedFactor) -> list[ir.Value]:
    """[codes, scales(, zero points)] of a quantized factor, registered as initializers (or found, if they are)."""
    arrays = [("", factor.codes), ("_scales", factor.scales), ("_zero_points", factor.zero_points)]
    values = []
    for suffix, array in arrays:
        if array is None:
            continue
        if name + suffix in graph.initializers:
            values.append(graph.initializers[name + suffix])
        else:
            values.append(_initializer(graph, name + suffix, array, ir.DataType.from_numpy(array.dtype)))
    return values


def _dequantize(codes: ir.Value, factor: QuantizedFactor, nodes: list[ir.Node]) -> ir.Value:
    graph = codes.graph
    inputs = [graph.initializers[codes.name + suffix] for suffix in ("", "_scales", "_zero_points")
              if codes.name + suffix in graph.initializers]
    node = ir.Node("", "DequantizeLinear", inputs, [ir.AttrInt64("axis", factor.attributes["axis"])], num_outputs=1,
                   name=f"{codes.name}.dequantize")
    node.outputs[0].name = f"{codes.name}.dequantized"
    nodes.append(node)
    return node.outputs[0]


def _replace_with_nbits(model: ir.Model, item: FactorizedLayer, base: str, names: "_NameAllocator",
                        made: dict) -> tuple[str, str]:
    """MatMulNBits(X, W…) → MatMulNBits(MatMulNBits(X, U…), V…) (+ bias): the same kernels, two smaller codes."""
    layer, graph = item.layer, model.graph
    stored = _made_once(made, item, lambda: _quantized_factor_initializers(graph, item, base, names))
    metadata = dict(layer.node.metadata_props)
    metadata[svd_ops.ORIGINAL_NODE_KEY] = ",".join(node.name or node.op_type for node in layer.nodes)
    nodes, value = [], layer.x
    for which, factor, values in zip("uv", item.quantized, stored):
        attributes = [ir.AttrInt64(key, value) for key, value in factor.attributes.items() if isinstance(value, int)]
        node = ir.Node(MICROSOFT, NBITS, [value, *values], attributes, num_outputs=1,
                       name=f"{layer.node.name or base}.svd_{which}",
                       metadata_props={**metadata, FACTOR_KEY: which, RANK_KEY: str(item.rank)})
        nodes.append(node)
        value = node.outputs[0]
    bias = _bias_value(graph, layer, names)
    if bias is not None:
        nodes.append(ir.Node("", "Add", [value, bias], num_outputs=1, name=f"{layer.node.name or base}.bias"))
        value = nodes[-1].outputs[0]
    model.opset_imports.setdefault(MICROSOFT, 1)
    ir.convenience.replace_nodes_and_values(layer.node.graph, layer.node, old_nodes=layer.nodes, new_nodes=nodes,
                                            old_values=[layer.output], new_values=[value])
    return stored[0][0].name, stored[1][0].name


def _replace_with_integer(model: ir.Model, item: FactorizedLayer, base: str, names: "_NameAllocator",
                          made: dict) -> tuple[str, str]:
    """A dynamically quantized product twice: X's own quantization feeds U's, H is quantized on the way to V's."""
    layer, graph = item.layer, model.graph
    stored = _made_once(made, item, lambda: _quantized_factor_initializers(graph, item, base, names))
    name = layer.node.name or base
    nodes: list[ir.Node] = []

    def node(op_type, inputs, label, **integers):
        nodes.append(ir.Node("", op_type, inputs, [ir.AttrInt64(key, value) for key, value in integers.items()],
                             num_outputs=3 if op_type == "DynamicQuantizeLinear" else 1, name=f"{name}.{label}"))
        return nodes[-1].outputs

    quantized_x, x_scale, x_zero_point = layer.quantizer.outputs
    value = None
    for which, (codes, scales, zero_points) in zip("uv", stored):
        if which == "v":
            quantized_x, x_scale, x_zero_point = node("DynamicQuantizeLinear", [value], "svd_h_quantized")
        (product,) = node(INTEGER, [quantized_x, codes, x_zero_point, zero_points], f"svd_{which}")
        (widened,) = node("Cast", [product], f"svd_{which}_cast", to=layer.dtype.value)
        (scale,) = node("Mul", [x_scale, scales], f"svd_{which}_scales")
        (value,) = node("Mul", [widened, scale], f"svd_{which}_rescaled")
    bias = _bias_value(graph, layer, names)
    if bias is not None:
        (value,) = node("Add", [value, bias], "bias")
    ir.convenience.replace_nodes_and_values(layer.node.graph, layer.node, old_nodes=layer.nodes, new_nodes=nodes,
                                            old_values=[layer.output], new_values=[value])
    return stored[0][0].name, stored[1][0].name


def _drop_unread_weight_inputs(graph: ir.Graph, weights: list[ir.Value]) -> None:
    """A replaced weight that an older exporter also listed as a graph input would stay a required input
    once its initializer goes: drop both when nothing reads it any more."""
    for weight in weights:
        if weight in graph.inputs and not list(weight.uses()):
            graph.inputs.remove(weight)
            graph.initializers.pop(weight.name, None)


def _initializer(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    stored = np.ascontiguousarray(array.astype(dtype.numpy()))
    value = ir.Value(name=name, shape=ir.Shape(stored.shape), type=ir.TensorType(dtype),
                     const_value=ir.tensor(stored, dtype=dtype, name=name))
    graph.register_initializer(value)
    return value


def _cast(value: ir.Value, to: ir.DataType, nodes: list[ir.Node]) -> ir.Value:
    node = ir.Node("", "Cast", [value], [ir.AttrInt64("to", to.value)], num_outputs=1, name=f"{value.name}.cast")
    node.outputs[0].name = f"{value.name}.cast"
    nodes.append(node)
    return node.outputs[0]


def _bias_value(graph: ir.Graph, layer: LinearLayer, names: "_NameAllocator") -> ir.Value | None:
    """The bias input: the original constant, or a new one when Gemm's beta had to be applied."""
    if layer.bias is None or layer.beta == 1.0:
        return layer.bias
    bias = layer.bias_vector()
    return _initializer(graph, names.fresh(f"{layer.name}.svd_bias"), bias, ir.convenience.get_const_tensor(layer.bias).dtype)


class _NameAllocator:
    """Initializer names that do not clash with anything in the graph."""

    def __init__(self, graph: ir.Graph):
        self.taken = set(graph.initializers) | {v.name for v in graph.inputs} | {
            out.name for node in graph for out in node.outputs}

    def fresh(self, wanted: str) -> str:
        name, suffix = wanted, 1
        while name in self.taken:
            name, suffix = f"{wanted}.{suffix}", suffix + 1
        self.taken.add(name)
        return name
