"""The dense model and the one rewritten from it, both cut at the same residual stream between decoder layers
(onnx_nmm.layerwise.cut), for fine-tuning one layer at a time: layer i of each, and what it reads.

    boundaries   Bᵢ, the residual Add after layer i's MLP, found in the dense model (its MLPs are whole)
    dense        its segments, each an onnxruntime session when asked for: the targets
    compressed   the rewritten model's segments at the same Bᵢ (a rewrite keeps the residual stream's names):
                 what is lowered to PyTorch and trained, one layer's weights loaded at a time
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from onnx_nmm.errors import ModelError
from onnx_nmm.layerwise.cut import DecoderCut, Segment, cut_decoder, residual_boundary
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes import find_linear_layers
from onnx_nmm.passes.mlp_narrowing import find_mlps
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.graph_probe import first_step


@dataclass
class LayerPairs:
    dense_source: ModelSource
    compressed_source: ModelSource
    dense: DecoderCut
    compressed: DecoderCut
    causal_lm: CausalLm  # the compressed model's feeds for token ids (the dense model's inputs are the same)

    @classmethod
    def of(cls, dense: ModelSource, compressed: ModelSource) -> LayerPairs:
        """Both models cut after each decoder layer's MLP; refused when the rewritten model does not compute the
        dense one's residual stream under the same names."""
        dense_proto, compressed_proto = first_step(dense.graph_proto()), first_step(compressed.graph_proto())
        boundaries = _boundaries(dense, dense_proto)
        made = {output for node in compressed_proto.graph.node for output in node.output}
        missing = [name for name in boundaries if name not in made]
        if missing:
            raise ModelError(f"{compressed.label} computes no '{missing[0]}', the residual stream after a decoder "
                             f"layer of {dense.label}: give the dense model it was rewritten from as the {{teacher}}, "
                             "or fine-tune the whole model", teacher="teacher")
        return cls(dense, compressed, cut_decoder(dense_proto, boundaries, dense_proto.graph.output[0].name),
                   cut_decoder(compressed_proto, boundaries, compressed_proto.graph.output[0].name),
                   CausalLm.of_source(compressed))

    @property
    def layers(self) -> int:
        return self.compressed.layers

    def feeds(self, segment: Segment, tokens: np.ndarray, carried: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What `segment` reads for token ids [B, S]: the values carried to it and the model's own inputs."""
        model_feeds = self.causal_lm.feeds(tokens)
        missing = [name for name in segment.carried_inputs if name not in carried]
        if missing:
            raise ModelError(f"layer {segment.index} of the dense model reads '{missing[0]}', which the rewritten "
                             "model's layers do not carry: fine-tune the whole model")
        return {name: np.asarray(carried[name]) for name in segment.carried_inputs} | {
            name: model_feeds[name] for name in segment.graph_inputs}

    def dense_session(self, layer: int):
        return self.dense_source.session_of(self.dense.segments[layer].model)

    def compressed_proto(self, layer: int) -> onnx.ModelProto:
        """The rewritten model's layer `layer` as a model of its own, its weights (and no other layer's) loaded."""
        proto = onnx.ModelProto()
        proto.CopyFrom(self.compressed.segments[layer].model)
        onnx.load_external_data_for_model(proto, self.compressed_source.weights_folder)
        return proto

    def unread_after(self, layer: int) -> list[str]:
        """The values the rewritten model's segments up to `layer` made that no later segment reads."""
        segments = self.compressed.segments
        later = {name for segment in segments[layer + 1:] for name in segment.carried_inputs}
        return [name for segment in segments[:layer + 1] for name in segment.outputs if name not in later]


def _boundaries(dense: ModelSource, proto: onnx.ModelProto) -> list[str]:
    """Bᵢ of every decoder layer of the dense model: the residual Add after each MLP the first step computes."""
    mlps, _ = find_mlps(find_linear_layers(dense.model))
    made = {output for node in proto.graph.node for output in node.output}
    # the first step's site of each MLP (a merged decoder's two branches may name their values alike)
    sites = [name for name in dict.fromkeys(mlp.down.output.name or "" for mlp in mlps) if name in made]
    if not sites:
        raise ModelError(f"no MLP was found in {dense.label}: fine-tuning layer by layer cuts the decoder after each "
                         "layer's MLP; fine-tune the whole model")
    return [residual_boundary(name, proto) for name in sites]
