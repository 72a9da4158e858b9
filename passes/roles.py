"""What a linear layer is for: q/k/v/o, gate/up/down, fc1/fc2, lm_head — from names, then structure.

Exporters keep the PyTorch module path in different places: the dynamo exporter in node metadata
(`pkg.torch.onnx.name_scopes`, a list of nested scopes), the TorchScript exporter in the node name
(`/model/layers.0/mlp/gate_proj/MatMul`). The last path component names the projection and its parent
says whether it sits in attention or in the MLP (GPT-2 has a `c_proj` in both). When names say
nothing, the graph's structure still identifies the SwiGLU triple and the head feeding the logits.
"""

from __future__ import annotations

import ast
import re

import onnx_ir as ir

ATTENTION, MLP, LM_HEAD, OTHER = "attention", "mlp", "lm_head", "other"
GROUPS = (ATTENTION, MLP, LM_HEAD, OTHER)

_ATTENTION_PARENT = re.compile(r"(attn|attention)", re.IGNORECASE)
_MLP_PARENT = re.compile(r"(mlp|feed_forward|ffn|feedforward|ff)$", re.IGNORECASE)

# Last module-path component → role, per group. Roles are the names the report shows.
_ATTENTION_ROLES = {
    "q": ("q_proj", "query", "wq", "q", "to_q"),
    "k": ("k_proj", "key", "wk", "k", "to_k"),
    "v": ("v_proj", "value", "wv", "v", "to_v"),
    "qkv": ("qkv_proj", "c_attn", "query_key_value", "wqkv", "qkv", "in_proj"),
    "o": ("o_proj", "out_proj", "dense", "wo", "c_proj", "o", "to_out"),
}
_MLP_ROLES = {
    "gate": ("gate_proj", "w1", "gate"),
    "up": ("up_proj", "w3", "up"),
    "gate_up": ("gate_up_proj",),
    "down": ("down_proj", "w2", "down"),
    "fc1": ("c_fc", "fc1", "fc_in", "dense_h_to_4h", "fc"),
    "fc2": ("c_proj", "fc2", "fc_out", "dense_4h_to_h", "proj"),
}
_LM_HEAD_NAMES = ("lm_head", "embed_out", "output_layer")
# Names unambiguous enough to decide the group without a telling parent.
_UNAMBIGUOUS = {
    **{name: (ATTENTION, role) for role, names in _ATTENTION_ROLES.items() for name in names
       if name.endswith("_proj") or name in ("query_key_value", "c_attn")},
    **{name: (MLP, role) for role, names in _MLP_ROLES.items() for name in names
       if name.endswith("_proj") or name.startswith("dense_") or name in ("c_fc", "fc1", "fc2")},
    **{name: (LM_HEAD, "lm_head") for name in _LM_HEAD_NAMES},
}
# The unambiguous table must not claim a name both parents use (GPT-2's c_proj, say).
for _ambiguous in set(sum(_ATTENTION_ROLES.values(), ())) & set(sum(_MLP_ROLES.values(), ())):
    _UNAMBIGUOUS.pop(_ambiguous, None)

_ACTIVATIONS = {"Sigmoid", "Relu", "Gelu", "Tanh", "Erf", "Softplus", "HardSigmoid", "Elu", "Selu"}


def module_path(node: ir.Node) -> str:
    """The PyTorch module path a node came from ("model.layers.0.mlp.gate_proj"), or its name."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            entries = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            entries = []
        path = ""
        for entry in entries:  # nested scopes extend each other; the trailing op name does not
            if entry and (not path or entry.startswith(path + ".")):
                path = entry
        if path:
            return path
    name = node.name or ""
    if name.startswith("/") and name.count("/") >= 2:  # TorchScript: /model/layers.0/mlp/gate_proj/MatMul
        return ".".join(part for part in name.split("/")[1:-1] if part)
    return name


def classify(path: str) -> tuple[str, str] | None:
    """(group, role) from a module path, or None when the names say nothing."""
    parts = [part for part in path.split(".") if part]
    if not parts:
        return None
    leaf = parts[-1].lower()
    parent = parts[-2] if len(parts) > 1 else ""
    if _ATTENTION_PARENT.search(parent):
        return _lookup(leaf, _ATTENTION_ROLES, ATTENTION)
    if _MLP_PARENT.search(parent):
        return _lookup(leaf, _MLP_ROLES, MLP)
    return _UNAMBIGUOUS.get(leaf)


def feeds_graph_output(value: ir.Value, graph: ir.Graph, hops: int = 3) -> bool:
    """True if `value` reaches a graph output through at most `hops` shape-only ops (the logits)."""
    if value in graph.outputs:
        return True
    if hops == 0:
        return False
    return any(feeds_graph_output(use.node.outputs[0], graph, hops - 1)
               for use in value.uses() if use.node.op_type in ("Reshape", "Identity", "Cast", "Squeeze"))


def structural_mlp_role(output: ir.Value, x: ir.Value) -> str | None:
    """gate / up / down of a gated MLP, recognised from the dataflow around the layer.

    gate: its output goes through an activation (SiLU appears as Sigmoid + Mul) and then multiplies
    another projection's output; up: its output multiplies an activation of another projection;
    down: its input is such a product.
    """
    consumers = [use.node for use in output.uses()]
    if any(node.op_type in _ACTIVATIONS for node in consumers):
        return "gate"
    for node in consumers:
        if node.op_type == "Mul" and any(_is_activation_output(other) for other in node.inputs if other is not output):
            return "up"
    producer = x.producer()
    if producer is not None and producer.op_type == "Mul" and any(_is_activation_output(v) for v in producer.inputs):
        return "down"
    return None


def _is_activation_output(value: ir.Value | None) -> bool:
    producer = value.producer() if value is not None else None
    if producer is None:
        return False
    if producer.op_type in _ACTIVATIONS:
        return True
    # SiLU exported as x * sigmoid(x)
    return producer.op_type == "Mul" and any(
        v is not None and (sigmoid := v.producer()) is not None and sigmoid.op_type == "Sigmoid"
        for v in producer.inputs)


def _lookup(leaf: str, table: dict[str, tuple[str, ...]], group: str) -> tuple[str, str]:
    for role, names in table.items():
        if leaf in names:
            return group, role
    return group, OTHER
