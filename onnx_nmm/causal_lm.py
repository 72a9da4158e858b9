"""What onnx-nmm reads off a causal LM's graph: its vocabulary, and the inputs it takes for token ids."""

from __future__ import annotations

import onnx_ir as ir


def vocabulary_size(graph: ir.Graph) -> int | None:
    """The token vocabulary: the logits' last dimension when it is static, else the rows of the embedding
    table (a Gather on a graph input reading a 2-D constant); None when neither says."""
    for output in graph.outputs:
        if output.shape is not None and len(output.shape) and isinstance(output.shape[-1], int) and output.shape[-1] > 1:
            return output.shape[-1]
    inputs = set(graph.inputs)
    for node in graph:
        if node.op_type == "Gather" and len(node.inputs) == 2 and node.inputs[1] in inputs:
            table = node.inputs[0]
            if table is not None and table.const_value is not None and len(table.const_value.shape) == 2:
                return table.const_value.shape[0]
    return None
