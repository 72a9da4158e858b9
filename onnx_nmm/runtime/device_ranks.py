"""The rank programs of a model split over N NeuronCores (`compile --tp N`), as neuronx-distributed traces them and
as `generate DIR --backend neuron` runs them.

    RankGraph(graph, rank's program)   what NxD traces, once per graph (trainium/rank_tracing.py): the step's
      (tokens, mask, positions,        inputs in, the logits out; the KV cache held as buffers, the same names in
       write_position) → logits        every graph, which NxD keeps on each rank's NeuronCore as shared state
    nxd/model.pt                       one NxDModel holding every graph's NEFF under the graph's name

    DeviceRanks(folder):  NxDModel.load ─ set_weights(each rank's weights, from its rank programs) ─ to_neuron
      └ runner(graph)(feeds): the same tokens for every rank (NxD replicates them), rank 0's logits back

NxD traces one program that every rank runs (SPMD), each rank with its own weights: rank 0's program is traced,
and each rank's weights are read from its own rank programs, named as RankGraph names them. A prefill reads an
empty cache (as the CPU path feeds it) and leaves the cache it writes in the state; a decode step reads the state
and updates it in place (NxD aliases a buffer reassigned in forward to its output). The cache never leaves the
NeuronCores.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from onnx_nmm.errors import NEURON_INDEX, NeuronSdkMissing
from onnx_nmm.passes.static_cache import CacheLayout
from onnx_nmm.runtime.rank_programs import RankPrograms

NXD_FOLDER, NXD_MODEL = "nxd", "model.pt"  # a tp folder's trace: its folder (the NEFFs under it), the NxDModel
STATE_NAME = "cache_{}"  # RankGraph's cache buffers, the layout's order: the name NxD shares the state by


class RankGraph(nn.Module):
    """One graph's program on one rank as NxD traces it: `program` (a lowered rank program, `names` its inputs'
    and outputs') called with the step's inputs, the cache (`layout`; each tensor of `shape` per past input)
    read from this module's buffers, or empty when `reads_cache` is unset (a prefill), and written back to them.
    Returns the logits.

    NxD's trace takes a forward with named parameters, the same for every graph it holds: the layout's
    positions and write position are left None where a graph has none. The program's weights are named after the
    graph (`programs.<graph>.`), as graphs of different shapes choose different kernels and so hold different
    weights; the cache buffers are not, so that every graph reads and writes the same state."""

    def __init__(self, graph: str, program: nn.Module, names: tuple[list[str], list[str]], layout: CacheLayout,
                 shapes: dict[str, tuple[int, ...]], reads_cache: bool):
        super().__init__()
        import torch

        self.graph, self.layout, self.reads_cache = graph, layout, reads_cache
        self.input_names, self.output_names = names
        self.programs = nn.ModuleDict({graph: program})
        self.past = [past for past, _ in layout.cache]
        for index, past in enumerate(self.past):  # not persistent: the state is no weight, NxD zeroes it
            self.register_buffer(STATE_NAME.format(index), torch.zeros(shapes[past]), persistent=False)

    def forward(self, tokens, mask, positions=None, write_position=None):
        import torch

        from onnx_nmm.lowering import call_lowered

        step = {"tokens": tokens, "mask": mask, "positions": positions, "write_position": write_position}
        given = {name: step[parameter] for parameter, name in _step_names(self.layout).items()}
        state = [getattr(self, STATE_NAME.format(index)) for index in range(len(self.past))]
        cache = dict(zip(self.past, state if self.reads_cache else [torch.zeros_like(tensor) for tensor in state]))
        outputs = call_lowered(self.programs[self.graph], *(given[name] if name in given else cache[name]
                                                            for name in self.input_names))
        named = dict(zip(self.output_names, outputs))
        for index, (_, present) in enumerate(self.layout.cache):
            setattr(self, STATE_NAME.format(index), named[present])  # reassigned, not copied into: NxD aliases it
        return outputs[0]


def rank_graph(graph: str, path: Path, layout: CacheLayout, shapes: dict[str, tuple[int, ...]], backend=None):
    """The rank program at `path` lowered (custom ops on `backend`) as a RankGraph of the graph `graph`; `shapes`:
    one rank's cache tensor per past input."""
    import onnx

    from onnx_nmm.lowering import lower

    proto = onnx.load(path, load_external_data=False)
    initializers = {tensor.name for tensor in proto.graph.initializer}
    inputs = [value.name for value in proto.graph.input if value.name not in initializers]
    outputs = [value.name for value in proto.graph.output]
    return RankGraph(graph, lower(path, backend), (inputs, outputs), layout, shapes, reads_cache=graph == "decode")


def step_inputs(layout: CacheLayout, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """RankGraph's inputs, by its parameter names, from a graph's feeds (by the graph's input names); the cache
    feeds are not among them."""
    return {parameter: feeds[name] for parameter, name in _step_names(layout).items() if name in feeds}


def _step_names(layout: CacheLayout) -> dict[str, str]:
    """RankGraph's parameter → the graph's input it stands for, for the inputs the layout has."""
    names = {"tokens": layout.tokens, "mask": layout.mask, "positions": layout.positions,
             "write_position": layout.write_position}
    return {parameter: name for parameter, name in names.items() if name is not None}


def rank_weights(graphs: dict[str, RankPrograms], layout: CacheLayout,
                 shapes: dict[str, tuple[int, ...]]) -> list[dict]:
    """Every rank's weights, as NxDModel.set_weights takes them: per rank, the weights of each graph's rank
    program named as the traced RankGraph names them."""
    tp = next(iter(graphs.values())).tp
    weights: list[dict] = [{} for _ in range(tp)]
    for name, programs in graphs.items():
        for rank, path in enumerate(programs.paths):
            weights[rank].update(rank_graph(name, path, layout, shapes).state_dict())
    return weights


class DeviceRanks:
    """The traced NxDModel of a tp folder (`trace`: its nxd/model.pt), loaded onto the NeuronCores with every
    rank's weights from the folder's rank programs (`graphs`: by graph name; `shapes`: one rank's cache)."""

    def __init__(self, trace: Path, graphs: dict[str, RankPrograms], layout: CacheLayout,
                 shapes: dict[str, tuple[int, ...]]):
        import importlib.util

        if importlib.util.find_spec("neuronx_distributed") is None:
            raise NeuronSdkMissing(f"{trace.parent.parent} was traced over {next(iter(graphs.values())).tp} "
                                   "NeuronCores, which run it with neuronx-distributed, not installed here: on a "
                                   f"Trainium machine, pip install --extra-index-url {NEURON_INDEX} "
                                   "neuronx-distributed; here, the torch {backend} runs its rank programs on the CPU",
                                   backend="backend")
        from neuronx_distributed import NxDModel

        self.layout, self.graphs = layout, graphs
        self.model = NxDModel.load(str(trace))
        self.model.set_weights(rank_weights(graphs, layout, shapes))
        self.model.to_neuron()

    def runner(self, graph: str) -> DeviceRankRunner:
        return DeviceRankRunner(self, graph)


class DeviceRankRunner:
    """One graph of DeviceRanks called as ModelRunner is: {input name: array} → {the logits' name: array}. The
    cache stays on the NeuronCores (`holds_cache`): its feeds are not read, and it is not given back."""

    holds_cache = True

    def __init__(self, ranks: DeviceRanks, graph: str):
        import onnx

        self.ranks, self.graph = ranks, graph
        proto = onnx.load(ranks.graphs[graph].paths[0], load_external_data=False).graph
        self.output_names = [value.name for value in proto.output]
        self.vocabulary = proto.output[0].type.tensor_type.shape.dim[-1].dim_value or None

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        given = {name: torch.from_numpy(np.ascontiguousarray(array))
                 for name, array in step_inputs(self.ranks.layout, inputs).items()}
        logits = self.ranks.model(**given, model_name=self.graph)  # every rank gets the same inputs
        return {self.output_names[0]: logits.numpy()}
