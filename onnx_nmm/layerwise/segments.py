"""A decoder cut into segments (cut.py), each one an onnxruntime session: dense, with its MLP narrowed, or
cut down to the Gram of its MLP's intermediate activation. Only one segment's weights are read at a time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from onnx_nmm.calibration.activation_stats import GramPlan, activation_graph, gram_graph
from onnx_nmm.errors import ModelError
from onnx_nmm.layerwise.cut import DecoderCut, Segment, cut_decoder, residual_boundary
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes.mlp_narrowing import NarrowMlpPass
from onnx_nmm.passes.mlp_rules.mlp import Mlp
from onnx_nmm.pipeline.narrow import mlp_keeping
from onnx_nmm.pipeline.targets import Targets, find_targets
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.graph_probe import first_step


@dataclass
class LayerSegments:
    """`source`'s decoder as segments, and layer i's MLP in the whole model (`mlps[i]`)."""

    source: ModelSource
    cut: DecoderCut
    mlps: list[Mlp]
    causal_lm: CausalLm
    options: RewriteOptions

    @classmethod
    def of(cls, source: ModelSource, targets: Targets, options: RewriteOptions) -> LayerSegments:
        """Cut at the residual stream after each targeted MLP; every decoder layer must have one."""
        proto = first_step(source.graph_proto())
        made = {output for node in proto.graph.node for output in node.output}
        # the first step's site of each MLP (a merged decoder's two branches may name their values alike)
        sites = {mlp.down.output.name: mlp for mlp in reversed(targets.mlps) if mlp.down.output.name in made}
        mlps = list(sites.values())[::-1]
        if not mlps:
            raise ModelError("no MLP to narrow was found: the layer-wise rewrite narrows MLPs")
        boundaries = [residual_boundary(mlp.down.output.name or "", proto) for mlp in mlps]
        logits = proto.graph.output[0].name
        return cls(source, cut_decoder(proto, boundaries, logits), mlps, CausalLm.of_source(source), options)

    @property
    def layers(self) -> int:
        return self.cut.layers

    def unread_after(self, layer: int) -> list[str]:
        """The values segments up to `layer` made that no later segment reads."""
        later = {name for segment in self.cut.segments[layer + 1:] for name in segment.carried_inputs}
        return [name for segment in self.cut.segments[:layer + 1] for name in segment.outputs if name not in later]

    def feeds(self, segment: Segment, tokens: np.ndarray, carried: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What `segment` reads for token ids [B, S]: the values carried to it and the model's own inputs."""
        model_feeds = self.causal_lm.feeds(tokens)
        return {name: np.asarray(carried[name]) for name in segment.carried_inputs} | {
            name: model_feeds[name] for name in segment.graph_inputs}

    def session(self, segment: Segment):
        return self.source.session_of(segment.model)

    def narrowed_session(self, layer: int, kept: np.ndarray, refit: np.ndarray):
        """Layer `layer`'s segment with its MLP keeping the neurons `kept`, its output projection `refit`."""
        model = ir.serde.deserialize_model(self.cut.segments[layer].model)
        ir.external_data.set_base_dir(model.graph, self.source.weights_folder)
        (mlp,) = [found for found in find_targets(model, self.options).mlps
                  if found.down.name == self.mlps[layer].down.name]
        NarrowMlpPass([mlp_keeping(mlp, kept, refit)])(model)
        return self.source.session_of(ir.to_proto(model))

    def gram_session(self, layer: int) -> tuple[object, GramPlan]:
        """Layer `layer`'s segment computing the Gram hᵀh of its MLP's intermediate activation h, then its own
        outputs (asked for by name, they are all it computes)."""
        mlp, segment = self.mlps[layer], self.cut.segments[layer]
        plan = GramPlan({mlp.down.x.name or "": mlp.width})
        proto = onnx.ModelProto()
        proto.CopyFrom(segment.model)
        return self.source.session_of(gram_graph(proto, plan, len(segment.outputs))), plan

    def activation_session(self, layer: int):
        """Layer `layer`'s segment computing its MLP's intermediate activation h alone, as float32 rows."""
        mlp = self.mlps[layer]
        proto = onnx.ModelProto()
        proto.CopyFrom(self.cut.segments[layer].model)
        return self.source.session_of(activation_graph(proto, mlp.down.x.name or "", mlp.width))
