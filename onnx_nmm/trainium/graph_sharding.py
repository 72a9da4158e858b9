"""One rank's program of a static graph split over `tp` NeuronCores (`compile --tp`): the graph, every linear layer
holding the rank's share of its weights, and a collective (lowering/collective_converters.py) where the ranks'
values join.

    layer                          the rank holds                         then
    q, k, v (MatMul, Gemm)         its query or KV heads' columns          -
    gate, up, fc1                  its part of the intermediate's columns  -
    o                              its query heads' rows                   AllReduce of the output (hidden wide)
    down, fc2                      its part of the intermediate's rows     AllReduce of the output
    lm_head                        its part of the vocabulary's columns    AllGather of the logits
    embedding (Gather)             its part of the hidden size's columns   AllGather of the embeddings
    SvdMatMul (X·U·V)              the cheapest split tensor_parallel.py prices at the graph's tokens:
                                     column-parallel: U whole, V's columns; or U's rows of X's columns, X·U
                                     all-reduced (r wide), V's columns
                                     row-parallel: U's rows, V whole, output all-reduced; or X·U all-reduced
                                     (r wide), then V whole, or V's columns and the output all-gathered
    SvdGatedMLP, GatedMLP,         its part of the intermediate: the gate and up (fc1) V or W columns, the down
    SvdMLP, MLP                      (fc2) U or W rows                     AllReduce of the output
    a bias after a join            on rank 0 only (zeros elsewhere), so it is added once

Between the split layers and the joins the values hold the rank's heads or intermediate columns; their shapes,
and the Reshape and Expand targets that spell them, come from shape_propagation.py. The KV cache inputs and
outputs hold the rank's KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_nmm.errors import ModelError
from onnx_nmm.passes import find_linear_layers, roles, svd_ops
from onnx_nmm.passes.linear_layers import LinearLayer
from onnx_nmm.runtime.collective_ops import ALL_GATHER, ALL_REDUCE, DOMAIN, DOMAIN_VERSION
from onnx_nmm.trainium.decoder_shape import Factorized
from onnx_nmm.trainium.rank_shares import RankShares
from onnx_nmm.trainium.shape_propagation import LocalShapes, Probe, RepeatKv
from onnx_nmm.trainium.tensor_parallel import COLUMN_ROLES, ROW_ROLES, Sharding, cheapest, splits

SPLIT_ROLES = ("q", "k", "v", "gate", "up", "fc1", "o", "down", "fc2", roles.LM_HEAD)


@dataclass(frozen=True)
class Join:
    """A collective in a rank program: which, after which layer, how wide a token's share is."""

    op: str
    after: str
    width: int

    def to_dict(self) -> dict:
        return {"op": self.op, "after": self.after, "width_per_token": self.width, "node": f"{self.after}.{self.op}"}


@dataclass(frozen=True)
class RankProgram:
    model: ir.Model
    joins: tuple[Join, ...]
    splits: dict[str, str]  # layer → how it was split


def rank_program(model: ir.Model, rank: int, shares: RankShares, probe: Probe, cache_inputs: list[str], tokens: int,
                 target: str, token_input: str) -> RankProgram:
    """Rank `rank`'s program of `model` (a clone is changed; `probe`: the whole graph's shapes on onnxruntime), its
    factorized layers split as tensor_parallel prices them at `tokens` rows on `target`."""
    model = model.clone()
    splitter = _Splitter(model, rank, shares, probe, tokens, target)
    for name in cache_inputs:
        value = next(value for value in model.graph.inputs if value.name == name)
        batch, _, positions, head_dim = probe.shapes[name]
        splitter.local.set(value, (batch, shares.local_kv_heads, positions, head_dim))
    layers = {id(layer.node): layer for layer in find_linear_layers(model)}
    for node in list(model.graph):
        if id(node) in layers:
            splitter.linear(layers[id(node)])
        elif node.domain == svd_ops.DOMAIN and node.op_type == svd_ops.SVD_MATMUL:
            splitter.factorized(node)
        elif node.domain == svd_ops.DOMAIN and node.op_type in (*svd_ops.MLP_OPS, *svd_ops.DENSE_MLP_OPS):
            splitter.mlp(node)
        elif _is_embedding(node, token_input):
            splitter.embedding(node)
        elif splitter.local.follow(node):
            splitter.constant_target(node)
    splitter.finish()
    return RankProgram(model, tuple(splitter.joins), splitter.splits)


def pricing_sharding(shares: RankShares) -> Sharding:
    """The split as tensor_parallel prices it."""
    return Sharding(shares.tp, shares.local_heads, shares.local_kv_heads, shares.local_heads * shares.head_dim,
                    shares.local_kv_heads * shares.head_dim)


class _Splitter:
    def __init__(self, model: ir.Model, rank: int, shares: RankShares, probe: Probe, tokens: int, target: str):
        self.model, self.graph, self.rank, self.shares = model, model.graph, rank, shares
        self.tokens, self.target = tokens, target
        copies = shares.heads // shares.kv_heads
        local_copies = shares.local_heads // shares.local_kv_heads
        self.local = LocalShapes(probe, RepeatKv(shares.kv_heads, copies, local_copies)
                                 if local_copies != copies else None)
        self.joins: list[Join] = []
        self.splits: dict[str, str] = {}
        model.opset_imports[DOMAIN] = DOMAIN_VERSION

    # -- the layers --------------------------------------------------------------------------------------------

    def linear(self, layer: LinearLayer) -> None:
        name = layer.module_path or layer.name
        _refuse_fused_projection(layer.role, name)
        if layer.role not in SPLIT_ROLES:
            self._refuse_changed(layer.node, name)
            return
        if layer.weight.quantized is not None:
            raise ModelError(f"{name}: quantized weights are not split over ranks yet; {{tp}} takes a float model",
                             tp="tp")
        weight, dtype = layer.weight_matrix(), self._dtype(layer.x)
        bias = layer.bias_vector()
        gemm = layer.node.op_type == "Gemm"
        if layer.role in ROW_ROLES:
            rows = self._rows(layer.role, layer.x, name, layer.k)
            self._set_weight(layer.node, 1, weight[rows], dtype, f"rows{self.rank}")
            if gemm:
                self._gemm_plain(layer.node)
                if bias is not None:
                    self._set_weight(layer.node, 2, bias * (self.rank == 0), dtype, f"rank{self.rank}")
            self._join(ALL_REDUCE, layer.node.outputs[0], name, layer.n)
            self.splits[name] = "row-parallel, output all-reduced"
            return
        self._refuse_changed(layer.node, name)
        columns = self._columns(layer.role, layer.n)
        self._set_weight(layer.node, 1, weight[:, columns], dtype, f"columns{self.rank}")
        if gemm:
            self._gemm_plain(layer.node)
        if bias is not None:
            bias_node, index = (layer.node, 2) if gemm else (layer.bias_node, _other_input(layer.bias_node,
                                                                                             layer.node.outputs[0]))
            assert bias_node is not None
            self._set_weight(bias_node, index, bias[columns], dtype, f"columns{self.rank}")
        self._set_last(layer.node.outputs[0], len(columns))
        if layer.role == roles.LM_HEAD:
            self._join(ALL_GATHER, layer.output, name, layer.n)
            self.splits[name] = "column-parallel over the vocabulary, logits all-gathered"
        else:
            self.splits[name] = "column-parallel"

    def factorized(self, node: ir.Node) -> None:
        x, u, v, *bias = node.inputs
        assert x is not None and u is not None and v is not None
        name = roles.module_path(node) or node.name or ""
        group, role = roles.classify(name) or (roles.OTHER, roles.OTHER)
        k, rank, n = (*_array(u).shape, _array(v).shape[1])
        _refuse_fused_projection(role, name)
        if role not in (*COLUMN_ROLES, *ROW_ROLES):
            self._refuse_changed(node, name)
            return
        product = Factorized(name, group, role, None, k, rank, n)
        how = cheapest(splits(product, pricing_sharding(self.shares), self.tokens, self.target)).how
        self.splits[name] = how
        dtype = self._dtype(x)
        b = _array(bias[0]) if bias and bias[0] is not None else None
        if role in COLUMN_ROLES:
            self._refuse_changed(node, name)
            columns = self._columns(role, n)
            if how.startswith("U whole"):
                self._set_weight(node, 2, _array(v)[:, columns], dtype, f"columns{self.rank}")
                if b is not None:
                    self._set_weight(node, 3, b[columns], dtype, f"columns{self.rank}")
                self._set_last(node.outputs[0], len(columns))
                return
            rows = self.shares.even(k, self.rank)
            bounds = [self._constant(np.array(values, np.int64), f"{name}.x_part.{what}")
                      for what, values in (("starts", [rows[0]]), ("ends", [rows[-1] + 1]), ("axes", [-1]))]
            x_part = self._add(f"{name}.x_part", "Slice", [x, *bounds], node, self.local.full(x))
            self._set_last(x_part, len(rows))
            result = self._low_rank(node, x_part, _array(u)[rows], _array(v)[:, columns],
                                    b[columns] if b is not None else None, name, rank)
            self._set_last(result, len(columns))
            return
        rows = self._rows(role, x, name, k)
        if how.startswith("U row-split, V whole, output"):
            self._set_weight(node, 1, _array(u)[rows], dtype, f"rows{self.rank}")
            if b is not None:
                self._set_weight(node, 3, b * (self.rank == 0), dtype, f"rank{self.rank}")
            self._join(ALL_REDUCE, node.outputs[0], name, n)
            return
        columns = self.shares.even(n, self.rank) if "V column-split" in how else np.arange(n)
        result = self._low_rank(node, x, _array(u)[rows], _array(v)[:, columns], b[columns] if b is not None else None,
                                name, rank)
        if "V column-split" in how:
            self._set_last(result, len(columns))
            self._join(ALL_GATHER, result, name, n)

    def mlp(self, node: ir.Node) -> None:
        x = node.inputs[0]
        assert x is not None
        self._refuse_changed(node, node.name or "")
        names = svd_ops.MLP_OP_INPUTS[node.op_type]
        arrays = {name: _array(value) for name, value in zip(names[1:], node.inputs[1:]) if value is not None}
        inputs_side = {"Vg", "Vu", "V1", "Wg", "Wu", "W1", "b1"}
        output_side = {"Ud", "U2", "Wd", "W2"}
        width = next(arrays[name].shape[-1] for name in ("Vg", "V1", "Wg", "W1") if name in arrays)
        hidden = self.local.probe.shapes[node.outputs[0].name or ""][-1]
        columns, dtype = self.shares.even(width, self.rank), self._dtype(x)
        for index, name in enumerate(names):
            if name in inputs_side:
                self._set_weight(node, index, arrays[name][..., columns], dtype, f"columns{self.rank}")
            elif name in output_side:
                self._set_weight(node, index, arrays[name][columns], dtype, f"rows{self.rank}")
            elif name == "b2":
                self._set_weight(node, index, arrays[name] * (self.rank == 0), dtype, f"rank{self.rank}")
        path = node.name or roles.module_path(node)  # a fused MLP is named after its module
        self._join(ALL_REDUCE, node.outputs[0], path, hidden)
        self.splits[path] = f"{node.op_type}: its intermediate split, output all-reduced"

    def embedding(self, node: ir.Node) -> None:
        table = _array(node.inputs[0])
        columns = self.shares.even(table.shape[1], self.rank)
        self._set_weight(node, 0, table[:, columns], table.dtype, f"columns{self.rank}")
        self._set_last(node.outputs[0], len(columns))
        name = roles.module_path(node) or node.name or "embedding"
        self._join(ALL_GATHER, node.outputs[0], name, table.shape[1])
        self.splits[name] = "embedding split across the hidden size, rows all-gathered"

    # -- graph surgery -------------------------------------------------------------------------------------------

    def constant_target(self, node: ir.Node) -> None:
        """A Reshape or Expand whose output changed takes the rank's shape as its constant target."""
        shape = self.local.shape(node.outputs[0])
        node.replace_input_with(1, self._constant(np.array(shape, np.int64), f"{node.name}.rank_shape"))

    def finish(self) -> None:
        """Each value the split changed says the rank's shape; unused weights and nodes go."""
        values = [*self.graph.inputs, *(value for node in self.graph for value in node.outputs)]
        for value in values:
            if self.local.changed(value):
                if value.dtype is None:
                    value.dtype = ir.DataType.from_numpy(self._dtype(value))
                value.shape = ir.Shape(self.local.shape(value))
        self.graph.sort()
        RemoveUnusedNodesPass()(self.model)

    def _low_rank(self, node: ir.Node, x: ir.Value, u: np.ndarray, v: np.ndarray, bias: np.ndarray | None,
                  name: str, rank: int) -> ir.Value:
        """`node` (X·U·V) as X·U, all-reduced (rank wide), then ·V (+ bias): on the rank's U rows and V columns; the
        result, read instead of the node's output."""
        dtype, out = self._dtype(x), node.outputs[0]
        full = self.local.probe.shapes[out.name or ""]
        xu = self._add(f"{name}.xu", "MatMul", [x, self._weight(u, dtype, f"{name}.U.rows{self.rank}")], node,
                       full[:-1] + (rank,))
        joined = self._join(ALL_REDUCE, xu, f"{name}'s X·U", rank)
        v_part = self._weight(v, dtype, f"{name}.V.rank{self.rank}")
        result = self._add(f"{name}.xuv", "MatMul", [joined, v_part], xu.producer(), full)
        if bias is not None:
            bias_part = self._weight(bias, dtype, f"{name}.bias.rank{self.rank}")
            result = self._add(f"{name}.xuv_bias", "Add", [result, bias_part], result.producer(), full)
        self._replace(out, result)
        self.graph.remove(node, safe=True)
        return result

    def _join(self, op: str, value: ir.Value, after: str, width: int) -> ir.Value:
        """A collective on `value`, read instead of it from then on."""
        users = list(value.uses())
        attributes = [ir.AttrInt64("axis", -1)] if op == ALL_GATHER else []
        node = ir.Node(DOMAIN, op, [value], attributes, name=f"{after}.{op}")
        producer = value.producer()
        assert producer is not None, "a collective joins what a layer computed"
        self.graph.insert_after(producer, node)
        joined = node.outputs[0]
        joined.name = f"{value.name}.{op.lower()}"
        joined.dtype = ir.DataType.from_numpy(self._dtype(value))
        joined.shape = ir.Shape(self.local.probe.shapes[value.name or ""])
        self._known(joined, self.local.probe.shapes[value.name or ""], value)
        for use in users:
            use.node.replace_input_with(use.idx, joined)
        if value.is_graph_output():
            self._replace_output(value, joined)
        self.joins.append(Join(op, after, width))
        return joined

    def _replace(self, old: ir.Value, new: ir.Value) -> None:
        if old.is_graph_output():
            self._replace_output(old, new)
        old.replace_all_uses_with(new)

    def _replace_output(self, old: ir.Value, new: ir.Value) -> None:
        index = list(self.graph.outputs).index(old)
        name, part = old.name or "", f"{old.name}.rank_part"
        self.local.rename(name, part)
        self.local.rename(new.name or "", name)
        old.name, new.name = part, name
        self.graph.outputs[index] = new

    def _add(self, name: str, op: str, inputs: list[ir.Value], after: ir.Node | None,
             full: tuple[int, ...]) -> ir.Value:
        """A new node `name` after `after`; its output's shape in the whole model is `full`."""
        node = ir.Node("", op, inputs, name=name)
        assert after is not None
        self.graph.insert_after(after, node)
        output = node.outputs[0]
        output.name = node.name
        self._known(output, full, inputs[0])
        output.dtype = ir.DataType.from_numpy(self._dtype(output))
        return output

    def _known(self, value: ir.Value, full: tuple[int, ...], like: ir.Value) -> None:
        self.local.probe.shapes[value.name or ""] = tuple(full)
        self.local.probe.dtypes[value.name or ""] = self.local.probe.dtypes.get(like.name or "", np.dtype(np.float32))

    def _set_weight(self, node: ir.Node, index: int, array: np.ndarray, dtype, suffix: str) -> None:
        old = node.inputs[index]
        name = f"{old.name if old is not None else node.name}.{suffix}"
        node.replace_input_with(index, self._weight(array, dtype, name))

    def _weight(self, array: np.ndarray, dtype, name: str) -> ir.Value:
        tensor = ir.tensor(np.ascontiguousarray(array, dtype=dtype), name=name)
        value = ir.Value(name=name, shape=ir.Shape(tensor.shape.numpy()), type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        if name in self.graph.initializers:
            return self.graph.initializers[name]
        self.graph.register_initializer(value)
        return value

    def _constant(self, array: np.ndarray, name: str) -> ir.Value:
        return self._weight(array, array.dtype, name)

    def _gemm_plain(self, node: ir.Node) -> None:
        """A Gemm whose W is now W_eff [K, N] (alpha and the transpose applied) and C the bias with beta applied."""
        for attribute, value in (("alpha", 1.0), ("beta", 1.0)):
            node.attributes[attribute] = ir.AttrFloat32(attribute, value)
        node.attributes["transB"] = ir.AttrInt64("transB", 0)

    def _set_last(self, value: ir.Value, width: int) -> None:
        full = self.local.probe.shapes[value.name or ""]
        self.local.set(value, full[:-1] + (width,))

    def _columns(self, role: str, n: int) -> np.ndarray:
        if role == "q":
            return self.shares.query_columns(self.rank)
        if role in ("k", "v"):
            return self.shares.kv_columns(self.rank)
        return self.shares.even(n, self.rank)

    def _rows(self, role: str, x: ir.Value, name: str, k: int) -> np.ndarray:
        rows = self.shares.query_columns(self.rank) if role == "o" else self.shares.even(k, self.rank)
        if self.local.shape(x)[-1] != len(rows):
            raise ModelError(f"cannot split {name} row-parallel: its input holds {self.local.shape(x)[-1]} of {k} "
                             f"columns on a rank, not the {len(rows)} its split gives it")
        return rows

    def _refuse_changed(self, node: ir.Node, name: str) -> None:
        """A layer that takes its input whole must not read a value the split changed."""
        changed = [value.name for value in node.inputs if value is not None and self.local.changed(value)]
        if changed:
            raise ModelError(f"cannot split {name} over the ranks: it reads {changed[0]}, which holds one rank's "
                             "share there")

    def _dtype(self, value: ir.Value) -> np.dtype:
        return self.local.probe.dtypes.get(value.name or "", np.dtype(np.float32))


def _refuse_fused_projection(role: str, name: str) -> None:
    if role in ("qkv", "gate_up"):
        raise ModelError(f"{name} computes {' and '.join(role.split('_')) if role == 'gate_up' else 'q, k and v'} in "
                         "one projection, which {tp} does not split yet (NxD splits each part by its heads or columns)",
                         tp="tp")


def _array(value: ir.Value | None) -> np.ndarray:
    if value is None or value.const_value is None:
        raise ModelError(f"{value.name if value is not None else 'an input'} is not a constant weight, so it cannot be "
                         "split over the ranks")
    return value.const_value.numpy()


def _other_input(node: ir.Node | None, value: ir.Value) -> int:
    assert node is not None
    return 1 if node.inputs[0] is value else 0


def _is_embedding(node: ir.Node, token_input: str) -> bool:
    """A Gather of token ids from a constant [vocabulary, hidden] table."""
    if node.op_type != "Gather" or node.domain != "" or len(node.inputs) < 2:
        return False
    table, ids = node.inputs[0], node.inputs[1]
    axis = node.attributes.get("axis")
    return (table is not None and table.const_value is not None and len(table.const_value.shape) == 2
            and ids is not None and ids.name == token_input and (axis is None or axis.as_int() == 0))
