"""The `ai.onnx_nmm` custom ops and their model-local functions (DESIGN.md §3).

Every custom op ships with a FunctionProto whose body is its plain-ONNX decomposition, so any runtime
executes the rewritten model, while a backend that knows the op (the Neuron lowering) calls its fused
kernel instead. Functions cannot hold weights: U and V are graph initializers passed as inputs.

    SvdMatMul(X, U, V)            = MatMul(MatMul(X, U), V)
    SvdMatMul:bias(X, U, V, b)    = MatMul(MatMul(X, U), V) + b
    SvdGatedMLP(X, Ug, Vg, Uu, Vu, Ud, Vd)
                                  = MatMul(MatMul(silu(X·Ug·Vg) * (X·Uu·Vu), Ud), Vd)
                                    with silu(g) = g · Sigmoid(g)

The optional bias is a function *overload* (IR version 10): one body cannot test whether an input was
given, and a zero bias would cost an Add on every call.
"""

from __future__ import annotations

import onnx_ir as ir

DOMAIN = "ai.onnx_nmm"
DOMAIN_VERSION = 1
SVD_MATMUL = "SvdMatMul"
BIAS_OVERLOAD = "bias"
# Function overloads need IR version 10 (onnx 1.16).
MIN_IR_VERSION = 10

SVD_GATED_MLP = "SvdGatedMLP"

# Attributes every SvdMatMul carries: what a reader needs to know about the factorization.
SVD_MATMUL_ATTRIBUTES = ("rank", "align", "method", "original_weight")
# SvdGatedMLP: the activation, and the rank of each projection (gate, up, down).
SVD_GATED_MLP_ATTRIBUTES = ("activation", "ranks")
GATED_ACTIVATIONS = ("silu",)
# Node metadata key holding the name of the node the op replaced.
ORIGINAL_NODE_KEY = "onnx_nmm.original_node"


def svd_matmul_function(opset: int, with_bias: bool) -> ir.Function:
    """The function body of SvdMatMul (or its `bias` overload) for a model at default `opset`."""
    x, u, v = ir.Value(name="X"), ir.Value(name="U"), ir.Value(name="V")
    inputs = [x, u, v]
    first = ir.Node("", "MatMul", [x, u], num_outputs=1, name="x_u")
    second = ir.Node("", "MatMul", [first.outputs[0], v], num_outputs=1, name="x_u_v")
    nodes = [first, second]
    output = second.outputs[0]
    if with_bias:
        bias = ir.Value(name="bias")
        inputs.append(bias)
        add = ir.Node("", "Add", [output, bias], num_outputs=1, name="add_bias")
        nodes.append(add)
        output = add.outputs[0]
    output.name = "Y"
    graph = ir.Graph(inputs, [output], nodes=nodes, opset_imports={"": opset}, name=SVD_MATMUL)
    declared = [ir.Attr(name, ir.AttributeType.UNDEFINED, None) for name in SVD_MATMUL_ATTRIBUTES]
    return ir.Function(DOMAIN, SVD_MATMUL, BIAS_OVERLOAD if with_bias else "", graph=graph, attributes=declared)


def register_svd_matmul(model: ir.Model, with_bias: bool) -> str:
    """Make sure `model` declares the domain and holds the function; return the overload to call."""
    model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)
    model.ir_version = max(model.ir_version, MIN_IR_VERSION)
    overload = BIAS_OVERLOAD if with_bias else ""
    key = (DOMAIN, SVD_MATMUL, overload)
    if key not in model.functions:
        model.functions[key] = svd_matmul_function(model.opset_imports[""], with_bias)
    return overload


def svd_gated_mlp_function(opset: int) -> ir.Function:
    """The function body of SvdGatedMLP (SiLU gating, as in Llama, Qwen and Mistral)."""
    x = ir.Value(name="X")
    factors = [ir.Value(name=name) for name in ("Ug", "Vg", "Uu", "Vu", "Ud", "Vd")]
    nodes: list[ir.Node] = []

    def op(op_type, *inputs, name):
        node = ir.Node("", op_type, list(inputs), num_outputs=1, name=name)
        nodes.append(node)
        return node.outputs[0]

    ug, vg, uu, vu, ud, vd = factors
    gate = op("MatMul", op("MatMul", x, ug, name="x_ug"), vg, name="gate")
    silu = op("Mul", gate, op("Sigmoid", gate, name="sigmoid"), name="silu")
    up = op("MatMul", op("MatMul", x, uu, name="x_uu"), vu, name="up")
    act = op("Mul", silu, up, name="act")
    output = op("MatMul", op("MatMul", act, ud, name="act_ud"), vd, name="down")
    output.name = "Y"
    graph = ir.Graph([x, *factors], [output], nodes=nodes, opset_imports={"": opset}, name=SVD_GATED_MLP)
    declared = [ir.Attr(name, ir.AttributeType.UNDEFINED, None) for name in SVD_GATED_MLP_ATTRIBUTES]
    return ir.Function(DOMAIN, SVD_GATED_MLP, "", graph=graph, attributes=declared)


def register_svd_gated_mlp(model: ir.Model) -> None:
    model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)
    model.ir_version = max(model.ir_version, MIN_IR_VERSION)
    key = (DOMAIN, SVD_GATED_MLP, "")
    if key not in model.functions:
        model.functions[key] = svd_gated_mlp_function(model.opset_imports[""])


def svd_matmul_node(x: ir.Value, u: ir.Value, v: ir.Value, bias: ir.Value | None, *, rank: int, align: int,
                    method: str, original_weight: str, overload: str, name: str,
                    metadata: dict[str, str]) -> ir.Node:
    """An SvdMatMul call; its output must then take over the uses of the replaced layer's output."""
    inputs = [x, u, v] + ([bias] if bias is not None else [])
    attributes = [
        ir.AttrInt64("rank", rank),
        ir.AttrInt64("align", align),
        ir.AttrString("method", method),
        ir.AttrString("original_weight", original_weight),
    ]
    return ir.Node(DOMAIN, SVD_MATMUL, inputs, attributes, overload=overload, num_outputs=1, name=name,
                   metadata_props=dict(metadata))
