"""The `ai.onnx_nmm` custom ops and their model-local functions (docs/design.md §1).

Every custom op ships with a FunctionProto whose body is its plain-ONNX decomposition, so any runtime
executes the rewritten model, while a backend that knows the op (the Neuron lowering) calls its fused
kernel instead. Functions cannot hold weights: U and V are graph initializers passed as inputs.

    SvdMatMul(X, U, V)            = MatMul(MatMul(X, U), V)
    SvdMatMul:bias(X, U, V, b)    = MatMul(MatMul(X, U), V) + b
    SvdGatedMLP(X, Ug, Vg, Uu, Vu, Ud, Vd)
                                  = MatMul(MatMul(act(X·Ug·Vg) * (X·Uu·Vu), Ud), Vd)
    SvdMLP(X, U1, V1, b1, U2, V2, b2)
                                  = MatMul(MatMul(act(X·U1·V1 + b1), U2), V2) + b2      (GPT-2, Phi, BERT)
    GatedMLP(X, Wg, Wu, Wd)       = MatMul(act(X·Wg) * (X·Wu), Wd)                      a dense MLP (narrowed by
    MLP(X, W1, b1, W2, b2)        = MatMul(act(X·W1 + b1), W2) + b2                     nystrom, or left whole)
                                    with act the `activation` attribute:
                                    silu(g)      = g · Sigmoid(g)                                (Llama, Qwen)
                                    gelu(g)      = g/2 · (1 + Erf(g/√2))
                                    gelu_tanh(g) = g/2 · (1 + Tanh(√(2/π) · (g + 0.044715·g³)))  (Gemma, GPT-2)

The optional bias is a function *overload* (IR version 10): one body cannot test whether an input was
given, and a zero bias would cost an Add on every call. The MLP ops have one overload per activation
(for SvdGatedMLP, SiLU's is the default, ""), for the same reason. SvdMLP's biases are always given (zeros
where the layer had none): non-gated MLPs nearly always have them.
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
SVD_MLP = "SvdMLP"
MLP_OPS = (SVD_GATED_MLP, SVD_MLP)
# Dense MLPs, fused for the Trainium kernels that compute them in one launch (kernels/nki_kernels/dense_mlp.py).
GATED_MLP = "GatedMLP"
MLP = "MLP"
DENSE_MLP_OPS = (GATED_MLP, MLP)
GATED_OPS = (SVD_GATED_MLP, GATED_MLP)
# The MLP ops' inputs by name, in order.
MLP_OP_INPUTS = {SVD_GATED_MLP: ("X", "Ug", "Vg", "Uu", "Vu", "Ud", "Vd"),
                 SVD_MLP: ("X", "U1", "V1", "b1", "U2", "V2", "b2"),
                 GATED_MLP: ("X", "Wg", "Wu", "Wd"), MLP: ("X", "W1", "b1", "W2", "b2")}

# Attributes every SvdMatMul carries: what a reader needs to know about the factorization.
SVD_MATMUL_ATTRIBUTES = ("rank", "align", "method", "original_weight")
# SvdGatedMLP: the activation, and the rank of each projection (gate, up, down).
SVD_GATED_MLP_ATTRIBUTES = ("activation", "ranks")
# SvdMLP: the same, its ranks (fc1, fc2).
SVD_MLP_ATTRIBUTES = SVD_GATED_MLP_ATTRIBUTES
# GatedMLP and MLP: the activation.
DENSE_MLP_ATTRIBUTES = ("activation",)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
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


class _Body:
    """The nodes of a function body, built one op at a time."""

    def __init__(self):
        self.nodes: list[ir.Node] = []

    def op(self, op_type, *inputs, name, attributes=()):
        node = ir.Node("", op_type, list(inputs), list(attributes), num_outputs=1, name=name)
        self.nodes.append(node)
        return node.outputs[0]

    def constant(self, value: float, name: str):
        return self.op("Constant", name=name,
                       attributes=[ir.AttrTensor("value", ir.tensor(np.array(value, np.float32)))])

    def low_rank(self, x, u, v, name):
        return self.op("MatMul", self.op("MatMul", x, u, name=f"{name}_u"), v, name=name)

    def activated(self, g, activation: str):
        """act(g) for `activation`, one of ACTIVATIONS."""
        if activation == "silu":
            return self.op("Mul", g, self.op("Sigmoid", g, name="sigmoid"), name="silu")
        if activation == "gelu":
            scaled = self.op("Mul", g, self.constant(2 ** -0.5, "one_over_sqrt2"), name="scaled")
            inner = self.op("Erf", scaled, name="erf")
        else:
            cubed = self.op("Mul", self.op("Mul", g, g, name="squared"), g, name="cubed")
            cubic = self.op("Mul", cubed, self.constant(0.044715, "cubic"), name="cubic_term")
            widened = self.op("Add", g, cubic, name="widened")
            scaled = self.op("Mul", widened, self.constant((2 / np.pi) ** 0.5, "sqrt_2_over_pi"), name="scaled")
            inner = self.op("Tanh", scaled, name="tanh")
        half = self.op("Mul", g, self.constant(0.5, "half"), name="half_g")
        return self.op("Mul", half, self.op("Add", inner, self.constant(1.0, "one"), name="one_plus"), name=activation)

    def function(self, name: str, overload: str, inputs, output, opset: int, attributes) -> ir.Function:
        output.name = "Y"
        graph = ir.Graph(inputs, [output], nodes=self.nodes, opset_imports={"": opset}, name=name)
        declared = [ir.Attr(attribute, ir.AttributeType.UNDEFINED, None) for attribute in attributes]
        return ir.Function(DOMAIN, name, overload, graph=graph, attributes=declared)


def svd_gated_mlp_function(opset: int, activation: str = "silu") -> ir.Function:
    """The function body of SvdGatedMLP gated by `activation` (one of ACTIVATIONS)."""
    x, ug, vg, uu, vu, ud, vd = inputs = [ir.Value(name=name) for name in MLP_OP_INPUTS[SVD_GATED_MLP]]
    body = _Body()
    activated = body.activated(body.low_rank(x, ug, vg, "gate"), activation)
    act = body.op("Mul", activated, body.low_rank(x, uu, vu, "up"), name="act")
    return body.function(SVD_GATED_MLP, gated_mlp_overload(activation), inputs,
                         body.low_rank(act, ud, vd, "down"), opset, SVD_GATED_MLP_ATTRIBUTES)


def svd_mlp_function(opset: int, activation: str) -> ir.Function:
    """The function body of SvdMLP with `activation` (one of ACTIVATIONS)."""
    x, u1, v1, b1, u2, v2, b2 = inputs = [ir.Value(name=name) for name in MLP_OP_INPUTS[SVD_MLP]]
    body = _Body()
    hidden = body.op("Add", body.low_rank(x, u1, v1, "fc1"), b1, name="fc1_bias")
    output = body.op("Add", body.low_rank(body.activated(hidden, activation), u2, v2, "fc2"), b2, name="fc2_bias")
    return body.function(SVD_MLP, activation, inputs, output, opset, SVD_MLP_ATTRIBUTES)


def gated_mlp_function(opset: int, activation: str = "silu") -> ir.Function:
    """The function body of the dense GatedMLP gated by `activation`."""
    x, wg, wu, wd = inputs = [ir.Value(name=name) for name in MLP_OP_INPUTS[GATED_MLP]]
    body = _Body()
    activated = body.activated(body.op("MatMul", x, wg, name="gate"), activation)
    act = body.op("Mul", activated, body.op("MatMul", x, wu, name="up"), name="act")
    return body.function(GATED_MLP, gated_mlp_overload(activation), inputs, body.op("MatMul", act, wd, name="down"),
                         opset, DENSE_MLP_ATTRIBUTES)


def mlp_function(opset: int, activation: str) -> ir.Function:
    """The function body of the dense, not gated MLP with `activation`."""
    x, w1, b1, w2, b2 = inputs = [ir.Value(name=name) for name in MLP_OP_INPUTS[MLP]]
    body = _Body()
    hidden = body.op("Add", body.op("MatMul", x, w1, name="fc1"), b1, name="fc1_bias")
    output = body.op("Add", body.op("MatMul", body.activated(hidden, activation), w2, name="fc2"), b2, name="fc2_bias")
    return body.function(MLP, activation, inputs, output, opset, DENSE_MLP_ATTRIBUTES)


_MLP_FUNCTIONS = {SVD_GATED_MLP: svd_gated_mlp_function, SVD_MLP: svd_mlp_function, GATED_MLP: gated_mlp_function,
                  MLP: mlp_function}


def register_mlp_op(model: ir.Model, op_type: str, activation: str) -> str:
    """Make sure `model` declares the domain and holds the function of `op_type` (SvdGatedMLP, SvdMLP, GatedMLP
    or MLP) for `activation`; return its overload."""
    model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)
    model.ir_version = max(model.ir_version, MIN_IR_VERSION)
    overload = gated_mlp_overload(activation) if op_type in GATED_OPS else activation
    key = (DOMAIN, op_type, overload)
    if key not in model.functions:
        model.functions[key] = _MLP_FUNCTIONS[op_type](model.opset_imports[""], activation)
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
