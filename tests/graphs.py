"""Small hand-built ONNX graphs, one per way a linear layer can appear (and ways it must not match)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 20


def weight(k: int, n: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((k, n)) / np.sqrt(k)).astype(dtype)


def model(nodes, initializers, inputs=None, outputs=None, k: int = 16, extra_inputs=()) -> onnx.ModelProto:
    """A graph with input X [batch, seq, K] and output Y (unknown shape)."""
    inputs = inputs or [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "seq", k])]
    if outputs is None:  # same rank as X, last dimension left symbolic
        rank = len(inputs[0].type.tensor_type.shape.dim)
        outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [f"d{i}" for i in range(rank)])]
    graph = helper.make_graph(nodes, "g", list(inputs) + list(extra_inputs), outputs,
                              [numpy_helper.from_array(array, name) for name, array in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)


def matmul(k=16, n=24) -> onnx.ModelProto:
    return model([helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")], {"W": weight(k, n)}, k=k)


def matmul_transposed(k=16, n=24) -> onnx.ModelProto:
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0], name="t"),
             helper.make_node("MatMul", ["X", "Wt"], ["Y"], name="mm")]
    return model(nodes, {"W": weight(n, k)}, k=k)


def matmul_identity_cast(k=16, n=24) -> onnx.ModelProto:
    """W stored in fp16, read through Identity and Cast to fp32."""
    nodes = [helper.make_node("Identity", ["W"], ["Wi"], name="id"),
             helper.make_node("Cast", ["Wi"], ["Wc"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("MatMul", ["X", "Wc"], ["Y"], name="mm")]
    return model(nodes, {"W": weight(k, n, dtype=np.float16)}, k=k)


def matmul_bias(k=16, n=24, bias_first=False) -> onnx.ModelProto:
    add_inputs = ["b", "XW"] if bias_first else ["XW", "b"]
    nodes = [helper.make_node("MatMul", ["X", "W"], ["XW"], name="mm"),
             helper.make_node("Add", add_inputs, ["Y"], name="add")]
    bias = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    return model(nodes, {"W": weight(k, n), "b": bias}, k=k)


def gemm(k=16, n=24, trans_b=1, alpha=0.5, beta=2.0, bias=True, trans_a=0) -> onnx.ModelProto:
    """Gemm on a 2-D input, W stored [N, K] when trans_b (X stored [K, rows] when trans_a)."""
    w = weight(k, n)
    stored = w.T.copy() if trans_b else w
    initializers = {"W": stored}
    inputs = ["X", "W"]
    if bias:
        initializers["C"] = np.random.default_rng(4).standard_normal(n).astype(np.float32)
        inputs.append("C")
    node = helper.make_node("Gemm", inputs, ["Y"], transA=trans_a, transB=trans_b, alpha=alpha, beta=beta,
                            name="gemm")
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [k, "rows"] if trans_a else ["rows", k])
    return model([node], initializers, inputs=[x], k=k)


def constant_weight(k=16, n=24) -> onnx.ModelProto:
    nodes = [helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(weight(k, n)), name="const"),
             helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")]
    return model(nodes, {}, k=k)


def activation_product(k=16) -> onnx.ModelProto:
    """Attention-score-like X·Xᵀ: no constant, must not match."""
    nodes = [helper.make_node("Transpose", ["X"], ["Xt"], perm=[0, 2, 1], name="t"),
             helper.make_node("MatMul", ["X", "Xt"], ["Y"], name="scores")]
    return model(nodes, {}, k=k)


def weight_as_graph_input(k=16, n=24) -> onnx.ModelProto:
    """W an initializer that is also a graph input, as older exporters list every initializer."""
    w = helper.make_tensor_value_info("W", TensorProto.FLOAT, [k, n])
    return model([helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")], {"W": weight(k, n)}, k=k,
                 extra_inputs=[w])


def vector_input(k=16, n=24) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [k])
    return model([helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")], {"W": weight(k, n)}, inputs=[x], k=k)


def no_linear_layers(k=16) -> onnx.ModelProto:
    return model([helper.make_node("Relu", ["X"], ["Y"], name="relu")], {}, k=k)


def swiglu_mlp(hidden=32, intermediate=64, names=True) -> onnx.ModelProto:
    """A Llama MLP: down(silu(gate(x)) * up(x)); `names=False` hides the module names."""
    def name(text):
        return text if names else f"n{abs(hash(text)) % 1000}"
    nodes = [
        helper.make_node("MatMul", ["X", "Wg"], ["g"], name=name("/mlp/gate_proj/MatMul")),
        helper.make_node("Sigmoid", ["g"], ["sg"], name="sig"),
        helper.make_node("Mul", ["g", "sg"], ["silu"], name="silu"),
        helper.make_node("MatMul", ["X", "Wu"], ["u"], name=name("/mlp/up_proj/MatMul")),
        helper.make_node("Mul", ["silu", "u"], ["act"], name="mul"),
        helper.make_node("MatMul", ["act", "Wd"], ["Y"], name=name("/mlp/down_proj/MatMul")),
    ]
    initializers = {"Wg": weight(hidden, intermediate, 1), "Wu": weight(hidden, intermediate, 2),
                    "Wd": weight(intermediate, hidden, 3)}
    return model(nodes, initializers, k=hidden)


def scan_body(k=16, n=16) -> onnx.ModelProto:
    """Two linear layers inside a Scan over the batch: one weight the body's own, one from the outer graph."""
    step = [helper.make_tensor_value_info("x_t", TensorProto.FLOAT, ["seq", k])]
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x_t", "W_body"], ["h_t"], name="inner_mm"),
         helper.make_node("MatMul", ["h_t", "W_outer"], ["y_t"], name="outer_mm")],
        "body", step, [helper.make_tensor_value_info("y_t", TensorProto.FLOAT, ["seq", n])],
        [numpy_helper.from_array(weight(k, n, seed=1), "W_body")])
    scan = helper.make_node("Scan", ["X"], ["Y"], num_scan_inputs=1, body=body, name="scan")
    return model([scan], {"W_outer": weight(n, n, seed=2)}, k=k)


def loop_body(k=16) -> onnx.ModelProto:
    """A linear layer applied twice by a Loop carrying the state through it."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "W"], ["h_w"], name="loop_mm"),
         helper.make_node("Tanh", ["h_w"], ["h_next"], name="tanh"),
         helper.make_node("Identity", ["cond"], ["cond_out"], name="keep_going")],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("h", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_next", TensorProto.FLOAT, None)])
    loop = helper.make_node("Loop", ["trips", "", "X"], ["Y"], body=body, name="loop")
    return model([loop], {"W": weight(k, k), "trips": np.array(2, np.int64)}, k=k)
