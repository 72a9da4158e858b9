"""Fuse each factorized MLP into one `ai.onnx_nmm` op: NeuronMM's fused SVD MLP, for every MLP form.

The MLP rules (mlp_rules: GatedMlp for Llama, Qwen, Gemma; SplitGateUpMlp for Phi-3's one gate_up projection;
UngatedMlp for GPT-2, Phi, BERT), asked about the model's factorized projections (SvdMatMul) and its linear
layers, find each MLP at its output projection; act is SiLU or GELU (erf or tanh) however the exporter spelled
it (activation_match). The fused op gets an `activation` attribute and its `ranks`, and carries the same
computation as its function body, so onnxruntime still runs it; the Neuron lowering calls the fused kernel,
which keeps the activation on chip. Only MLPs whose every projection is factorized and whose intermediate
values have no other reader are fused; what the fused op replaces goes, with the shape computations that only
served it. An MLP no rule matches is left alone with the reason of the rule that came closest.

    gated          Y = SvdGatedMLP(X, Ug, Vg, Uu, Vu, Ud, Vd)
    split gate_up  Y = SvdGatedMLP(X, U, V[:, gate columns], U, V[:, up columns], Ud, Vd)   exact: V split
    ungated        Y = SvdMLP(X, U1, V1, b1, U2, V2, b2)     zeros for a bias the layer did not have
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.passes import roles, svd_ops
from onnx_nmm.passes.linear_layers import find_linear_layers
from onnx_nmm.passes.mlp_rules.mlp import GATED, SPLIT_GATE_UP, Mlp, outside_reader
from onnx_nmm.passes.mlp_rules.rule_set import GATED_MLP, RULES, SPLIT_GATE_UP_MLP, UNGATED_MLP, by_output
from onnx_nmm.passes.mlp_rules.shared import ROWS_UNKNOWN, Activation, keeps_rows
from onnx_nmm.passes.rules import Mismatch, first_match

# Asked before an MLP is fused, with its name, the fused op and the shapes of its inputs after X: None to fuse
# it, or why it stays as it is (compile: where its projections run faster one by one).
FusionChoice = Callable[[str, str, list[tuple[int, ...]]], str | None]

NOT_FACTORIZED = {GATED: "its gate, up or down projection is not factorized (or has a bias)",
                  SPLIT_GATE_UP: "its gate_up or down projection is not factorized (or has a bias)"}


@dataclass
class FactorizedLayer:
    """An SvdMatMul node as a projection the MLP rules ask about: X·U·V (+ b), U [K, r], V [r, N]."""

    node: ir.Node

    @property
    def x(self) -> ir.Value:
        x = self.node.inputs[0]
        assert x is not None, "an SvdMatMul always has its input X"
        return x

    @property
    def output(self) -> ir.Value:
        return self.node.outputs[0]

    @property
    def nodes(self) -> list[ir.Node]:
        return [self.node]

    @property
    def k(self) -> int:
        return _dimension(self.node.inputs[1], 0)

    @property
    def n(self) -> int:
        return _dimension(self.node.inputs[2], 1)

    @property
    def module_path(self) -> str:
        return roles.module_path(self.node)

    @property
    def role(self) -> str:
        named = roles.classify(self.module_path)
        return named[1] if named is not None else roles.OTHER

    @property
    def name(self) -> str:
        return self.node.name or self.module_path

    def factorized(self, bias: bool = False) -> bool:
        """A float SvdMatMul, with a bias input only if `bias` allows it."""
        node = self.node
        return (node.overload == "" and len(node.inputs) == 3) or (
            bias and node.overload == svd_ops.BIAS_OVERLOAD and len(node.inputs) == 4)


def _dimension(factor: ir.Value | None, axis: int) -> int:
    """A dimension of U or V: initializers, of known shape (svd_factorization makes them)."""
    dimension = factor.shape[axis] if factor is not None and factor.shape is not None else None
    assert isinstance(dimension, int), "an SvdMatMul's factors have known shapes"
    return dimension


@dataclass
class _Fused:
    op_type: str  # svd_ops.SVD_GATED_MLP or svd_ops.SVD_MLP
    activation: str
    down: ir.Node
    inputs: list[ir.Value | None]  # the fused op's, None where _replace makes an initializer
    ranks: list[int]
    nodes: list[ir.Node]  # everything the fused op replaces
    made: list[np.ndarray] = field(default_factory=list)  # the initializers standing in for the None inputs


@dataclass
class MlpFusion(ir.passes.PassResult):
    """The names of the MLPs fused, and for each one left alone (by its output projection's module path, or
    its own) why."""

    fused: list[str] = field(default_factory=list)
    unfused: dict[str, str] = field(default_factory=dict)


class FuseMlpPass(ir.passes.InPlacePass):
    """Replace each factorized MLP by one SvdGatedMLP or SvdMLP (those `choose` accepts)."""

    def __init__(self, choose: FusionChoice | None = None):
        super().__init__()
        self.choose = choose

    def call(self, model: ir.Model) -> MlpFusion:
        fused: list[str] = []
        unfused: dict[str, str] = {}
        projections = factorized_projections(model)
        for down in output_projections(model):
            where = roles.module_path(down) or down.name or down.op_type
            found = fused_form(projections(down.outputs[0]), projections, model)
            reader = _outside_reader(found) if isinstance(found, _Fused) else None
            refused = self.choose(_mlp_name(found), found.op_type, _input_shapes(found)) \
                if isinstance(found, _Fused) and reader is None and self.choose is not None else None
            if isinstance(found, Mismatch):
                unfused[where] = found.reason
            elif reader is not None:
                unfused[where] = f"{reader} outside the MLP reads a value inside it"
            elif refused is not None:
                unfused[where] = refused
            else:
                name = _replace(model, found)
                if name not in fused:  # the same MLP in another branch
                    fused.append(name)
        return MlpFusion(model, modified=bool(fused), fused=fused, unfused=unfused)


def factorized_projections(model: ir.Model):
    """The projections the rules ask about in a factorized model: its SvdMatMul nodes and its linear layers."""
    factorized = [FactorizedLayer(node) for node in ir.traversal.RecursiveGraphIterator(model.graph)
                  if node.domain == svd_ops.DOMAIN and node.op_type == svd_ops.SVD_MATMUL]
    return by_output([*factorized, *find_linear_layers(model)])


def output_projections(model: ir.Model) -> list[ir.Node]:
    """Where the rules are anchored: every MLP's down (or fc2) projection by its module path, factorized or not,
    in subgraphs too (each branch of a merged decoder holds its own MLPs)."""
    return [node for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node.op_type in _PROJECTIONS and _named_output_projection(node)]


def _named_output_projection(node: ir.Node) -> bool:
    named = roles.classify(roles.module_path(node))
    return named is not None and named[0] == roles.MLP and named[1] in ("down", "fc2")


def fused_form(down, projections, model: ir.Model) -> _Fused | Mismatch:
    """The fused op the MLP at `down` (the projection computing an output projection's output) becomes, or why
    it does not."""
    if not isinstance(down, FactorizedLayer):
        return Mismatch("its output projection is not factorized")
    mlp = first_match(RULES, down, projections)
    if isinstance(mlp, Mismatch):
        return mlp
    if mlp.form == GATED:
        return _factorized(mlp, NOT_FACTORIZED[GATED]) or _gated(mlp, GATED_MLP.activation(mlp))
    if mlp.form == SPLIT_GATE_UP:
        return _factorized(mlp, NOT_FACTORIZED[SPLIT_GATE_UP]) or _split(
            mlp, SPLIT_GATE_UP_MLP.activation(mlp, model.opset_imports[""]))
    return _factorized(mlp, "its input projection is not factorized", bias=True) or _ungated(
        mlp, UNGATED_MLP.activation(mlp))


def _factorized(mlp: Mlp, reason: str, bias: bool = False) -> Mismatch | None:
    if all(isinstance(layer, FactorizedLayer) and layer.factorized(bias) for layer in mlp.layers):
        return None
    return Mismatch(reason, 1)


def _gated(mlp: Mlp, activation: Activation | Mismatch) -> _Fused | Mismatch:
    if isinstance(activation, Mismatch):
        return activation
    if not keeps_rows(mlp):
        return ROWS_UNKNOWN
    gate, up = (layer.node for layer in activation.inputs)
    down = mlp.down.node
    return _Fused(svd_ops.SVD_GATED_MLP, activation.name, down, [gate.inputs[0], *gate.inputs[1:], *up.inputs[1:],
                                                                 *down.inputs[1:]],
                  [_rank(gate), _rank(up), _rank(down)], _between(mlp, activation))


def _split(mlp: Mlp, activation: Activation | Mismatch) -> _Fused | Mismatch:
    if isinstance(activation, Mismatch):
        return activation
    if not keeps_rows(mlp):
        return ROWS_UNKNOWN
    projection, down = mlp.projections[0].node, mlp.down.node
    v = projection.inputs[2].const_value
    if v is None or down.inputs[1].const_value is None:
        return Mismatch("its factors are not constants", 3)
    weights = v.numpy()
    u = projection.inputs[1]
    return _Fused(svd_ops.SVD_GATED_MLP, activation.name, down, [projection.inputs[0], u, None, u, None,
                                                                 *down.inputs[1:]],
                  [_rank(projection), _rank(projection), _rank(down)], _between(mlp, activation),
                  made=[weights[:, activation.columns[0]], weights[:, activation.columns[1]]])


def _ungated(mlp: Mlp, activation: Activation | Mismatch) -> _Fused | Mismatch:
    if isinstance(activation, Mismatch):
        return activation
    if not keeps_rows(mlp):
        return ROWS_UNKNOWN
    fc1, down = mlp.projections[0].node, mlp.down.node
    biases = [fc1.inputs[3] if len(fc1.inputs) > 3 else None, down.inputs[3] if len(down.inputs) > 3 else None]
    zeros = [np.zeros(node.inputs[2].shape[1], _dtype(node)) for node, bias in zip((fc1, down), biases)
             if bias is None]
    return _Fused(svd_ops.SVD_MLP, activation.name, down,
                  [fc1.inputs[0], fc1.inputs[1], fc1.inputs[2], biases[0], down.inputs[1], down.inputs[2], biases[1]],
                  [_rank(fc1), _rank(down)], _between(mlp, activation), made=zeros)


def _between(mlp: Mlp, activation: Activation) -> list[ir.Node]:
    """Every node from the MLP's projections to its output projection, each once."""
    nodes = [node for layer in mlp.layers for node in layer.nodes] + mlp.region + activation.nodes
    return list({id(node): node for node in nodes}.values())


# -- replacing -----------------------------------------------------------------------------------------------
def _outside_reader(mlp: _Fused) -> str | None:
    """What, outside the MLP, reads a value its nodes compute (other than its output); None if nothing does,
    and then mlp.nodes gains the shape computations that served the MLP alone."""
    graph = mlp.down.graph
    assert graph is not None, "the output projection is a node of the model"
    kept = {id(value) for value in mlp.inputs if value is not None}
    nodes = {id(node): node for node in mlp.nodes}
    grown = True
    while grown:  # the producers feeding removed nodes alone go too (Shape, Gather, Concat of a Reshape)
        grown = False
        for node in list(nodes.values()):
            for value in node.inputs:
                producer = value.producer() if value is not None and id(value) not in kept else None
                if producer is not None and id(producer) not in nodes and _feeds_only(producer, nodes, graph):
                    nodes[id(producer)] = producer
                    grown = True
    inside = [value for node in nodes.values() for value in node.outputs if value is not mlp.down.outputs[0]]
    reader = outside_reader(inside, set(nodes), graph)
    if reader is not None:
        return reader
    order = {id(node): i for i, node in enumerate(graph)}
    mlp.nodes = sorted(nodes.values(), key=lambda node: order[id(node)])
    return None


def _feeds_only(node: ir.Node, nodes: dict[int, ir.Node], graph: ir.Graph) -> bool:
    return node.graph is graph and all(
        value not in graph.outputs and all(id(use.node) in nodes for use in value.uses()) for value in node.outputs)


def _replace(model: ir.Model, mlp: _Fused) -> str:
    overload = svd_ops.register_mlp_op(model, mlp.op_type, mlp.activation)
    name = _mlp_name(mlp)
    made = iter(mlp.made)
    inputs = [value if value is not None else _initializer(model, f"{name}.{svd_ops.MLP_OP_INPUTS[mlp.op_type][i]}",
                                                             next(made))
              for i, value in enumerate(mlp.inputs)]
    metadata = dict(mlp.down.metadata_props)
    metadata[svd_ops.ORIGINAL_NODE_KEY] = ",".join(
        node.metadata_props.get(svd_ops.ORIGINAL_NODE_KEY, node.name or node.op_type) for node in mlp.nodes)
    fused = ir.Node(svd_ops.DOMAIN, mlp.op_type, inputs,
                    [ir.AttrString("activation", mlp.activation), ir.AttrInt64s("ranks", mlp.ranks)],
                    overload=overload, num_outputs=1, name=name, metadata_props=metadata)
    replaced = [value for node in mlp.nodes for value in node.inputs if value is not None and value.is_initializer()]
    assert mlp.down.graph is not None, "the output projection is a node of the model"
    ir.convenience.replace_nodes_and_values(mlp.down.graph, mlp.down, old_nodes=mlp.nodes, new_nodes=[fused],
                                            old_values=[mlp.down.outputs[0]], new_values=fused.outputs)
    for value in replaced:  # a gate_up's whole V, now held as its two halves
        if not value.uses() and value.name is not None and value.name in model.graph.initializers:
            del model.graph.initializers[value.name]
    return name


def _input_shapes(mlp: _Fused) -> list[tuple[int, ...]]:
    """The fused op's inputs after X, the factors _replace will make included (initializers: known shapes)."""
    made = iter(mlp.made)
    return [tuple(value.shape.numpy()) if value is not None and value.shape is not None else next(made).shape
            for value in mlp.inputs[1:]]


def _initializer(model: ir.Model, name: str, array: np.ndarray) -> ir.Value:
    if name in model.graph.initializers:  # the same MLP in another branch of a merged decoder
        return model.graph.initializers[name]
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    model.graph.register_initializer(value)
    return value


def _rank(node: ir.Node) -> int:
    return node.attributes["rank"].as_int()


def _dtype(node: ir.Node) -> np.dtype:
    v = node.inputs[2]
    assert v is not None and v.const_value is not None, "an SvdMatMul's V is an initializer"
    return v.const_value.dtype.numpy()  # V's element type, without reading V


def _mlp_name(mlp: _Fused) -> str:
    """The MLP's module path ("model.layers.0.mlp"), from the down projection's."""
    path = roles.module_path(mlp.down)
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    return parent or f"{mlp.down.name}.mlp"


_PROJECTIONS = ("MatMul", "Gemm", svd_ops.SVD_MATMUL)
