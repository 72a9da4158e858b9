"""Fuse each factorized MLP into one `ai.onnx_nmm` op: NeuronMM's fused SVD MLP, for every MLP form.

Gated (Llama, Qwen, Gemma):
    g  = SvdMatMul(X, Ug, Vg)                  gate
    u  = SvdMatMul(X, Uu, Vu)                  up (reads the same X)
    a  = Mul(act(g), u)
    Y  = SvdMatMul(a, Ud, Vd)                  down
  → Y  = SvdGatedMLP(X, Ug, Vg, Uu, Vu, Ud, Vd)

Gated with one gate_up projection (Phi-3), its output split in two (gate columns, up columns):
    gu = SvdMatMul(X, U, V);  g, u = split(gu);  ... as above
  → Y  = SvdGatedMLP(X, U, V[:, gate columns], U, V[:, up columns], Ud, Vd)     exact: a column split of V

Not gated (GPT-2, Phi, BERT), reshapes between allowed (they keep the rows):
    h  = SvdMatMul(X, U1, V1, b1)              fc1
    Y  = SvdMatMul(act(h), U2, V2, b2)         fc2
  → Y  = SvdMLP(X, U1, V1, b1, U2, V2, b2)     zeros for a bias the layer did not have

act is SiLU or GELU (erf or tanh) however the exporter spelled it (activation_match); the fused op gets an
`activation` attribute and its `ranks`. The fused op carries the same computation as its function body, so
onnxruntime still runs it; the Neuron lowering calls the fused kernel, which keeps the activation on chip.
Only MLPs whose intermediate values have no other reader are fused; what the fused op replaces goes, with
the shape computations that only served it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_nmm.passes import activation_match, column_selection, roles, svd_ops

# Nodes that change the shape of a value but not its rows: the MLP computes the same on either side.
RESHAPES = ("Reshape", "Flatten", "Identity", "Squeeze", "Unsqueeze")


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

    def __init__(self):
        super().__init__()
        self.fused: list[str] = []
        self.unfused: dict[str, str] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused, self.unfused = [], {}
        downs = [node for node in ir.traversal.RecursiveGraphIterator(model.graph) if _is_mlp_output_projection(node)]
        for down in downs:  # subgraphs too: each branch of a merged decoder holds its own MLPs
            mlp = _match(down, model) if down.op_type == svd_ops.SVD_MATMUL else None
            reader = _outside_reader(mlp) if mlp is not None else None
            if mlp is not None and reader is None:
                name = _replace(model, mlp)
                if name not in self.fused:  # the same MLP in another branch
                    self.fused.append(name)
            elif mlp is not None:
                self.unfused[roles.module_path(down) or down.name] = f"{reader} outside the MLP reads a value inside it"
            else:
                self.unfused[roles.module_path(down) or down.name] = _why_not_fused(down, model)
        return ir.passes.PassResult(model, modified=bool(self.fused))


def _is_svd_matmul(node: ir.Node | None, bias: bool = False) -> bool:
    """A float SvdMatMul, with a bias input only if `bias` allows it."""
    if node is None or node.domain != svd_ops.DOMAIN or node.op_type != svd_ops.SVD_MATMUL:
        return False
    return (node.overload == "" and len(node.inputs) == 3) or (
        bias and node.overload == svd_ops.BIAS_OVERLOAD and len(node.inputs) == 4)


def _is_mlp_output_projection(node: ir.Node) -> bool:
    """A down (or fc2) projection by its module path, factorized or not."""
    if node.op_type not in ("MatMul", "Gemm", svd_ops.SVD_MATMUL):
        return False
    named = roles.classify(roles.module_path(node))
    return named is not None and named[0] == roles.MLP and named[1] in ("down", "fc2")


def _match(down: ir.Node, model: ir.Model) -> _Mlp | None:
    mlp = _match_gated(down, model) if _is_svd_matmul(down) else None
    return mlp if mlp is not None else _match_ungated(down)


# -- gated ---------------------------------------------------------------------------------------------------
def _match_gated(down: ir.Node, model: ir.Model) -> _Mlp | None:
    product = down.inputs[0].producer()
    if product is None or product.op_type != "Mul" or product.domain != "":
        return None
    for activated, up_value in (product.inputs, product.inputs[::-1]):
        up = up_value.producer()
        if _is_svd_matmul(up):
            mlp = _separate_gate_and_up(down, product, activated, up)
        else:
            mlp = _split_gate_up(down, product, activated, up_value, model)
        if mlp is not None:
            return mlp
    return None


def _separate_gate_and_up(down, product, activated, up) -> _Mlp | None:
    gate = _gate_of(activated, up)
    if not _is_svd_matmul(gate):
        return None
    recognized = activation_match.recognize(gate.outputs[0], activated)
    if recognized is None:
        return None
    region, activation = recognized
    return _Mlp(svd_ops.SVD_GATED_MLP, activation, down,
                [gate.inputs[0], *gate.inputs[1:], *up.inputs[1:], *down.inputs[1:]],
                [_rank(gate), _rank(up), _rank(down)], [gate, *region, up, product, down])


def _split_gate_up(down, product, activated, up_value, model) -> _Mlp | None:
    """Gate and up as two column selections of one projection's output (Phi-3's gate_up_proj)."""
    projection = _selected_from(up_value)
    if not _is_svd_matmul(projection):
        return None
    source, v, ud = projection.outputs[0], projection.inputs[2].const_value, down.inputs[1].const_value
    if v is None or ud is None:
        return None
    for g in _selections_of(source):
        recognized = activation_match.recognize(g, activated) if g is not up_value else None
        if recognized is None:
            continue
        region, activation = recognized
        selection = column_selection.selection_region(source, [g, up_value])
        columns = selection and column_selection.selected_columns(source, [g, up_value], selection, v.shape[1],
                                                                   model.opset_imports[""])
        if not columns or len(columns[0]) != len(columns[1]) or len(columns[0]) != ud.shape[0]:
            return None
        u = projection.inputs[1]
        weights = v.numpy()
        return _Mlp(svd_ops.SVD_GATED_MLP, activation, down, [projection.inputs[0], u, None, u, None,
                                                              *down.inputs[1:]],
                    [_rank(projection), _rank(projection), _rank(down)],
                    [projection, *selection, *region, product, down],
                    made=[weights[:, columns[0]], weights[:, columns[1]]])
    return None


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


# -- not gated -----------------------------------------------------------------------------------------------
def _match_ungated(down: ir.Node) -> _Mlp | None:
    if not _is_svd_matmul(down, bias=True):
        return None
    activated, reshapes_after = _through_reshapes(down.inputs[0])
    upstream = _projections_upstream(activated.producer()) if activated.producer() is not None else []
    if len(upstream) != 1 or not _is_svd_matmul(upstream[0], bias=True):
        return None
    fc1 = upstream[0]
    for g, reshapes_before in _reshaped_forms(fc1.outputs[0]):
        recognized = activation_match.recognize(g, activated)
        if recognized is not None and _same_rows(fc1, down, reshapes_before + reshapes_after):
            region, activation = recognized
            biases = [fc1.inputs[3] if len(fc1.inputs) > 3 else None, down.inputs[3] if len(down.inputs) > 3 else None]
            zeros = [np.zeros(node.inputs[2].shape[1], _dtype(node)) for node, bias in zip((fc1, down), biases)
                     if bias is None]
            return _Mlp(svd_ops.SVD_MLP, activation, down,
                        [fc1.inputs[0], fc1.inputs[1], fc1.inputs[2], biases[0], down.inputs[1], down.inputs[2],
                         biases[1]], [_rank(fc1), _rank(down)],
                        [fc1, *reshapes_before, *region, *reshapes_after, down], made=zeros)
    return None


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


# -- why not -------------------------------------------------------------------------------------------------
def _why_not_fused(down: ir.Node, model: ir.Model) -> str:
    """Why an MLP's output projection was not fused, in the terms of what the graph shows."""
    if down.op_type != svd_ops.SVD_MATMUL:
        return "its output projection is not factorized"
    activated, _ = _through_reshapes(down.inputs[0])
    product = activated.producer()
    if product is None:
        return "a graph input feeds the output projection"
    upstream = _projections_upstream(product)
    if product.op_type == "Mul" and len(upstream) != 1:
        for activated, up_value in (product.inputs, product.inputs[::-1]):
            gate = _gate_of(activated, up_value.producer()) if up_value.producer() is not None else None
            if gate is None:
                continue
            if activation_match.recognize(gate.outputs[0], activated) is None:
                return (f"gated by {activated.producer().op_type}, an activation onnx-nmm does not fuse (it fuses "
                        "SiLU and GELU, erf or tanh)")
            if not all(_is_svd_matmul(node) for node in (gate, up_value.producer(), down)):
                return "its gate, up or down projection is not factorized (or has a bias)"
            return "an intermediate value has another reader"
        return "the output projection's input is not act(gate) · up"
    if len(upstream) != 1:
        return "no single projection feeds its activation"
    if any(use.node.op_type in ("Slice", "Split") for use in upstream[0].outputs[0].uses()):
        return "gate and up come from one projection split in a way onnx-nmm cannot read as two column sets"
    if not _is_svd_matmul(upstream[0], bias=True):
        return "its input projection is not factorized"
    if not _same_rows(upstream[0], down, _through_reshapes(down.inputs[0])[1]):
        return "reshapes between its projections, and no shapes in the graph to show they keep the rows"
    return (f"its activation ({product.op_type} ...) is not one onnx-nmm fuses (SiLU, GELU erf or tanh), or an "
            "intermediate value has another reader")


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
