"""The `ai.onnx_nmm` custom ops and their model-local functions (DESIGN.md §3).

Every custom op ships with a FunctionProto whose body is its plain-ONNX decomposition, so any runtime
executes the rewritten model, while a backend that knows the op (the Neuron lowering) calls its fused
kernel instead. Functions cannot hold weights: U and V are graph initializers passed as inputs.

    SvdMatMul(X, U, V)            = MatMul(MatMul(X, U), V)
    SvdMatMul:bias(X, U, V, b)    = MatMul(MatMul(X, U), V) + b
    SvdGatedMLP(X, Ug, Vg, Uu, Vu, Ud, Vd)
                                  = MatMul(MatMul(act(X·Ug·Vg) * (X·Uu·Vu), Ud), Vd)
                                    with act the `activation` attribute:
                                    silu(g)      = g · Sigmoid(g)                                (Llama, Qwen)
                                    gelu(g)      = g/2 · (1 + Erf(g/√2))
                                    gelu_tanh(g) = g/2 · (1 + Tanh(√(2/π) · (g + 0.044715·g³)))  (Gemma)

The optional bias is a function *overload* (IR version 10): one body cannot test whether an input was
given, and a zero bias would cost an Add on every call. SvdGatedMLP has one overload per activation
(SiLU's is the default, ""), for the same reason.
"""

from __future__ import annotations

import numpy as np
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
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
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


def gated_mlp_overload(activation: str) -> str:
    return "" if activation == "silu" else activation


def svd_gated_mlp_function(opset: int, activation: str = "silu") -> ir.Function:
    """The function body of SvdGatedMLP gated by `activation` (one of GATED_ACTIVATIONS)."""
    x = ir.Value(name="X")
    factors = [ir.Value(name=name) for name in ("Ug", "Vg", "Uu", "Vu", "Ud", "Vd")]
    nodes: list[ir.Node] = []

    def op(op_type, *inputs, name, attributes=()):
        node = ir.Node("", op_type, list(inputs), list(attributes), num_outputs=1, name=name)
        nodes.append(node)
        return node.outputs[0]

    def constant(value: float, name: str):
        return op("Constant", name=name, attributes=[ir.AttrTensor("value", ir.tensor(np.array(value, np.float32)))])

    ug, vg, uu, vu, ud, vd = factors
    gate = op("MatMul", op("MatMul", x, ug, name="x_ug"), vg, name="gate")
    if activation == "silu":
        activated = op("Mul", gate, op("Sigmoid", gate, name="sigmoid"), name="silu")
    else:
        if activation == "gelu":
            inner = op("Erf", op("Mul", gate, constant(2 ** -0.5, "one_over_sqrt2"), name="scaled"), name="erf")
        else:
            cubed = op("Mul", op("Mul", gate, gate, name="squared"), gate, name="cubed")
            widened = op("Add", gate, op("Mul", cubed, constant(0.044715, "cubic"), name="cubic_term"), name="widened")
            inner = op("Tanh", op("Mul", widened, constant((2 / np.pi) ** 0.5, "sqrt_2_over_pi"), name="scaled"),
                       name="tanh")
        half = op("Mul", gate, constant(0.5, "half"), name="half_gate")
        activated = op("Mul", half, op("Add", inner, constant(1.0, "one"), name="one_plus"), name=activation)
    up = op("MatMul", op("MatMul", x, uu, name="x_uu"), vu, name="up")
    act = op("Mul", activated, up, name="act")
    output = op("MatMul", op("MatMul", act, ud, name="act_ud"), vd, name="down")
    output.name = "Y"
    graph = ir.Graph([x, *factors], [output], nodes=nodes, opset_imports={"": opset}, name=SVD_GATED_MLP)
    declared = [ir.Attr(name, ir.AttributeType.UNDEFINED, None) for name in SVD_GATED_MLP_ATTRIBUTES]
    return ir.Function(DOMAIN, SVD_GATED_MLP, gated_mlp_overload(activation), graph=graph, attributes=declared)


def register_svd_gated_mlp(model: ir.Model, activation: str = "silu") -> str:
    """Make sure `model` declares the domain and holds the function for `activation`; return its overload."""
    model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)
    model.ir_version = max(model.ir_version, MIN_IR_VERSION)
    overload = gated_mlp_overload(activation)
    key = (DOMAIN, SVD_GATED_MLP, overload)
    if key not in model.functions:
        model.functions[key] = svd_gated_mlp_function(model.opset_imports[""], activation)
    return overload


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
