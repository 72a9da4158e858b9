"""Fuse each factorized MLP into one `ai.onnx_nmm` op: NeuronMM's fused SVD MLP, for every MLP form.

Three rules (passes.rules), each anchored at an MLP's output projection, each drawing its pattern in its
docstring: GatedMlp (Llama, Qwen, Gemma), SplitGateUpMlp (Phi-3's one gate_up projection) and UngatedMlp
(GPT-2, Phi, BERT). act is SiLU or GELU (erf or tanh) however the exporter spelled it (activation_match); the
fused op gets an `activation` attribute and its `ranks`. The fused op carries the same computation as its
function body, so onnxruntime still runs it; the Neuron lowering calls the fused kernel, which keeps the
activation on chip. Only MLPs whose intermediate values have no other reader are fused; what the fused op
replaces goes, with the shape computations that only served it. An MLP no rule matches is left alone with the
reason of the rule that came closest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.passes import activation_match, column_selection, roles, svd_ops
from onnx_nmm.passes.rules import Mismatch, closest, first_match

# Nodes that change the shape of a value but not its rows: the MLP computes the same on either side.
RESHAPES = ("Reshape", "Flatten", "Identity", "Squeeze", "Unsqueeze")


# Asked before an MLP is fused, with its name, the fused op and the shapes of its inputs after X: None to fuse
# it, or why it stays as it is (compile: where its projections run faster one by one).
FusionChoice = Callable[[str, str, list[tuple[int, ...]]], str | None]


@dataclass
class _Mlp:
    op_type: str  # svd_ops.SVD_GATED_MLP or svd_ops.SVD_MLP
    activation: str
    down: ir.Node
    inputs: list[ir.Value | None]  # the fused op's, None where _replace makes an initializer
    ranks: list[int]
    nodes: list[ir.Node]  # everything the fused op replaces
    made: list[np.ndarray] = field(default_factory=list)  # the initializers standing in for the None inputs


class FuseMlpPass(ir.passes.InPlacePass):
    """Replace each factorized MLP by one SvdGatedMLP or SvdMLP. `fused` lists their names; `unfused` says,
    for every MLP output projection left alone, why."""

    def __init__(self, choose: FusionChoice | None = None):
        super().__init__()
        self.choose = choose
        self.fused: list[str] = []
        self.unfused: dict[str, str] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused, self.unfused = [], {}
        for down in output_projections(model):
            where = roles.module_path(down) or down.name
            found = first_match(RULES, down, model) if down.op_type == svd_ops.SVD_MATMUL else Mismatch(
                "its output projection is not factorized")
            reader = _outside_reader(found) if isinstance(found, _Mlp) else None
            refused = self.choose(_mlp_name(found), found.op_type, _input_shapes(found)) \
                if isinstance(found, _Mlp) and reader is None and self.choose is not None else None
            if isinstance(found, Mismatch):
                self.unfused[where] = found.reason
            elif reader is not None:
                self.unfused[where] = f"{reader} outside the MLP reads a value inside it"
            elif refused is not None:
                self.unfused[where] = refused
            else:
                name = _replace(model, found)
                if name not in self.fused:  # the same MLP in another branch
                    self.fused.append(name)
        return ir.passes.PassResult(model, modified=bool(self.fused))


def _is_svd_matmul(node: ir.Node | None, bias: bool = False) -> bool:
    """A float SvdMatMul, with a bias input only if `bias` allows it."""
    if node is None or node.domain != svd_ops.DOMAIN or node.op_type != svd_ops.SVD_MATMUL:
        return False
    return (node.overload == "" and len(node.inputs) == 3) or (
        bias and node.overload == svd_ops.BIAS_OVERLOAD and len(node.inputs) == 4)


def output_projections(model: ir.Model) -> list[ir.Node]:
    """Where the rules are anchored: every MLP's down (or fc2) projection by its module path, factorized or not,
    in subgraphs too (each branch of a merged decoder holds its own MLPs)."""
    return [node for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node.op_type in _PROJECTIONS and _named_output_projection(node)]


def _named_output_projection(node: ir.Node) -> bool:
    named = roles.classify(roles.module_path(node))
    return named is not None and named[0] == roles.MLP and named[1] in ("down", "fc2")


NOT_ACT_GATE_TIMES_UP = Mismatch("the output projection's input is not act(gate) · up")


class GatedMlp:
    """Gate and up separate (Llama, Qwen, Gemma, Mistral):

        g = SvdMatMul(X, Ug, Vg);  u = SvdMatMul(X, Uu, Vu);  Y = SvdMatMul(act(g) * u, Ud, Vd)
      → Y = SvdGatedMLP(X, Ug, Vg, Uu, Vu, Ud, Vd)
    """

    def match(self, down: ir.Node, model: ir.Model) -> _Mlp | Mismatch:
        misses = []
        for product, activated, up_value in _act_times_up(down):
            up = up_value.producer()
            gate = _gate_of(activated, up) if up is not None and up.op_type in _PROJECTIONS else None
            if gate is None:
                continue
            recognized = activation_match.recognize(gate.outputs[0], activated)
            if recognized is None:
                misses.append(_unknown_activation(activated))
            elif not all(_is_svd_matmul(node) for node in (gate, up, down)):
                misses.append(Mismatch("its gate, up or down projection is not factorized (or has a bias)", 3))
            else:
                region, activation = recognized
                return _Mlp(svd_ops.SVD_GATED_MLP, activation, down,
                            [gate.inputs[0], *gate.inputs[1:], *up.inputs[1:], *down.inputs[1:]],
                            [_rank(gate), _rank(up), _rank(down)], [gate, *region, up, product, down])
        return closest(misses, NOT_ACT_GATE_TIMES_UP)


class SplitGateUpMlp:
    """Gate and up as two column selections of one projection's output (Phi-3's gate_up_proj):

        gu = SvdMatMul(X, U, V);  g, u = split(gu);  Y = SvdMatMul(act(g) * u, Ud, Vd)
      → Y = SvdGatedMLP(X, U, V[:, gate columns], U, V[:, up columns], Ud, Vd)     exact: a column split of V
    """

    def match(self, down: ir.Node, model: ir.Model) -> _Mlp | Mismatch:
        misses = []
        for product, activated, up_value in _act_times_up(down):
            selection = up_value.producer()
            projection = _selected_from(up_value)
            if selection is None or selection.op_type not in column_selection.SELECTIONS or projection is None \
                    or projection.op_type not in _PROJECTIONS:
                continue
            if not (_is_svd_matmul(projection) and _is_svd_matmul(down)):
                misses.append(Mismatch("its gate_up or down projection is not factorized (or has a bias)", 3))
                continue
            found = _split_columns(down, product, activated, up_value, projection, model)
            if isinstance(found, _Mlp):
                return found
            misses.append(found)
        return closest(misses, NOT_ACT_GATE_TIMES_UP)


def _split_columns(down, product, activated, up_value, projection, model) -> _Mlp | Mismatch:
    """The fused MLP with V's gate and up columns as two factors, when the selections can be read as two column
    sets of one size."""
    source, v, ud = projection.outputs[0], projection.inputs[2].const_value, down.inputs[1].const_value
    if v is None or ud is None:
        return Mismatch("its factors are not constants", 3)
    for g in _selections_of(source):
        recognized = activation_match.recognize(g, activated) if g is not up_value else None
        if recognized is None:
            continue
        region, activation = recognized
        selection = column_selection.selection_region(source, [g, up_value])
        columns = selection and column_selection.selected_columns(source, [g, up_value], selection, v.shape[1],
                                                                   model.opset_imports[""])
        if not columns or len(columns[0]) != len(columns[1]) or len(columns[0]) != ud.shape[0]:
            return Mismatch("gate and up come from one projection split in a way onnx-nmm cannot read as two "
                            "column sets", 3)
        u = projection.inputs[1]
        weights = v.numpy()
        return _Mlp(svd_ops.SVD_GATED_MLP, activation, down, [projection.inputs[0], u, None, u, None,
                                                              *down.inputs[1:]],
                    [_rank(projection), _rank(projection), _rank(down)],
                    [projection, *selection, *region, product, down],
                    made=[weights[:, columns[0]], weights[:, columns[1]]])
    return _unknown_activation(activated)


class UngatedMlp:
    """Two layers, reshapes between allowed when the graph's shapes show they keep the rows (GPT-2, Phi, BERT):

        h = SvdMatMul(X, U1, V1, b1);  Y = SvdMatMul(act(h), U2, V2, b2)
      → Y = SvdMLP(X, U1, V1, b1, U2, V2, b2)     zeros for a bias the layer did not have
    """

    def match(self, down: ir.Node, model: ir.Model) -> _Mlp | Mismatch:
        activated, reshapes_after = _through_reshapes(down.inputs[0])
        if activated.producer() is None:
            return Mismatch("a graph input feeds the output projection")
        upstream = _projections_upstream(activated.producer())
        if len(upstream) != 1:
            return Mismatch("no single projection feeds its activation")
        fc1 = upstream[0]
        if not (_is_svd_matmul(fc1, bias=True) and _is_svd_matmul(down, bias=True)):
            return Mismatch("its input projection is not factorized", 1)
        forms = [(recognized, before) for g, before in _reshaped_forms(fc1.outputs[0])
                 if (recognized := activation_match.recognize(g, activated)) is not None]
        if not forms:
            return Mismatch(f"its activation ({activated.producer().op_type} ...) is not one onnx-nmm fuses (SiLU, "
                            "GELU erf or tanh)", 2)
        for (region, activation), reshapes_before in forms:
            if _same_rows(fc1, down, reshapes_before + reshapes_after):
                biases = [fc1.inputs[3] if len(fc1.inputs) > 3 else None,
                          down.inputs[3] if len(down.inputs) > 3 else None]
                zeros = [np.zeros(node.inputs[2].shape[1], _dtype(node)) for node, bias in zip((fc1, down), biases)
                         if bias is None]
                return _Mlp(svd_ops.SVD_MLP, activation, down,
                            [fc1.inputs[0], fc1.inputs[1], fc1.inputs[2], biases[0], down.inputs[1], down.inputs[2],
                             biases[1]], [_rank(fc1), _rank(down)],
                            [fc1, *reshapes_before, *region, *reshapes_after, down], made=zeros)
        return Mismatch("reshapes between its projections, and no shapes in the graph to show they keep the rows", 3)


RULES = (GatedMlp(), SplitGateUpMlp(), UngatedMlp())  # tried in this order: the first that matches is used


def _act_times_up(down: ir.Node) -> list[tuple[ir.Node, ir.Value, ir.Value]]:
    """The Mul the down projection reads, where act(gate) · up would be computed, with its two inputs taken as
    (activated gate, up) both ways round; nothing when the down projection reads no Mul."""
    product = down.inputs[0].producer()
    if product is None or product.op_type != "Mul" or product.domain != "":
        return []
    return [(product, *pair) for pair in (product.inputs, product.inputs[::-1])]


def _unknown_activation(activated: ir.Value) -> Mismatch:
    producer = activated.producer()
    return Mismatch(f"gated by {producer.op_type if producer is not None else 'a graph input'}, an activation "
                    "onnx-nmm does not fuse (it fuses SiLU and GELU, erf or tanh)", 2)


def _selected_from(value: ir.Value) -> ir.Node | None:
    """The node whose output `value` selects from, through selection and reshape nodes."""
    node = value.producer()
    while node is not None and node.op_type in column_selection.SELECTIONS:
        node = node.inputs[0].producer()
    return node


def _selections_of(source: ir.Value) -> list[ir.Value]:
    """The values computed from `source` by selection and reshape nodes alone."""
    found, pending = [], [source]
    while pending:
        for use in pending.pop().uses():
            if use.node.op_type in column_selection.SELECTIONS and use.idx == 0:
                found.extend(use.node.outputs)
                pending.extend(use.node.outputs)
    return found


def _gate_of(activated: ir.Value, up: ir.Node) -> ir.Node | None:
    """The projection upstream of `activated` (through element-wise nodes) that reads up's input."""
    if activated.producer() is None:
        return None
    return next((node for node in _projections_upstream(activated.producer(), hops=12)
                 if node.inputs[0] is up.inputs[0] and node is not up), None)


def _same_rows(fc1: ir.Node, fc2: ir.Node, reshapes: list[ir.Node]) -> bool:
    """Whether fc2's output has the shape of the fused op's (x's leading dimensions): with reshapes between the
    projections, only when the graph's shapes say so."""
    x, a = fc1.inputs[0].shape, fc2.inputs[0].shape
    return not reshapes or (x is not None and a is not None and tuple(x)[:-1] == tuple(a)[:-1])


def _through_reshapes(value: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """The value upstream of `value` past reshaping nodes, and those nodes."""
    passed = []
    while value.producer() is not None and value.producer().op_type in RESHAPES:
        passed.append(value.producer())
        value = value.producer().inputs[0]
    return value, passed


def _reshaped_forms(value: ir.Value) -> list[tuple[ir.Value, list[ir.Node]]]:
    """`value` and each value reshaped from it alone, with the reshaping nodes on the way."""
    forms, pending = [], [(value, [])]
    while pending:
        current, passed = pending.pop()
        forms.append((current, passed))
        pending.extend((use.node.outputs[0], [*passed, use.node]) for use in current.uses()
                       if use.node.op_type in RESHAPES and use.idx == 0)
    return forms


# -- replacing -----------------------------------------------------------------------------------------------
def _outside_reader(mlp: _Mlp) -> str | None:
    """What, outside the MLP, reads a value its nodes compute (other than its output); None if nothing does,
    and then mlp.nodes gains the shape computations that served the MLP alone."""
    graph = mlp.down.graph
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
    for value in inside:
        if value in graph.outputs:
            return "a graph output"
        reader = next((use.node for use in value.uses() if id(use.node) not in nodes), None)
        if reader is not None:
            return f"{'an' if reader.op_type[0] in 'AEIOU' else 'a'} {reader.op_type} node"
    order = {id(node): i for i, node in enumerate(graph)}
    mlp.nodes = sorted(nodes.values(), key=lambda node: order[id(node)])
    return None


def _feeds_only(node: ir.Node, nodes: dict[int, ir.Node], graph: ir.Graph) -> bool:
    return node.graph is graph and all(
        value not in graph.outputs and all(id(use.node) in nodes for use in value.uses()) for value in node.outputs)


def _replace(model: ir.Model, mlp: _Mlp) -> str:
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
    ir.convenience.replace_nodes_and_values(mlp.down.graph, mlp.down, old_nodes=mlp.nodes, new_nodes=[fused],
                                            old_values=[mlp.down.outputs[0]], new_values=fused.outputs)
    for value in replaced:  # a gate_up's whole V, now held as its two halves
        if not value.uses() and value.name in model.graph.initializers:
            del model.graph.initializers[value.name]
    return name


def _input_shapes(mlp: _Mlp) -> list[tuple[int, ...]]:
    """The fused op's inputs after X, the factors _replace will make included."""
    made = iter(mlp.made)
    return [tuple(value.shape) if value is not None and value.shape is not None else next(made).shape
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
    return node.inputs[2].const_value.dtype.numpy()  # V's element type, without reading V


def _mlp_name(mlp: _Mlp) -> str:
    """The MLP's module path ("model.layers.0.mlp"), from the down projection's."""
    path = roles.module_path(mlp.down)
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    return parent or f"{mlp.down.name}.mlp"


def _projections_upstream(node: ir.Node, hops: int = 8) -> list[ir.Node]:
    """The linear projections within `hops` nodes upstream of `node`, through anything else."""
    found, frontier, seen = [], [node], {id(node)}
    for _ in range(hops):
        producers = [value.producer() for current in frontier for value in current.inputs if value is not None]
        frontier = []
        for producer in producers:
            if producer is None or id(producer) in seen:
                continue
            seen.add(id(producer))
            (found if producer.op_type in _PROJECTIONS else frontier).append(producer)
    return found


_PROJECTIONS = ("MatMul", "Gemm", svd_ops.SVD_MATMUL)
