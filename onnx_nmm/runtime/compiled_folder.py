"""A compiled folder, as `compile --max-context` writes it and `generate DIR` reads it:

    manifest.json        what was compiled: buckets, the cache and which input aliases which output, every graph
                         with the kernel of each custom op and MLP and their modelled times
    prefill_<N>.onnx     a prefill of N tokens per bucket ─┐ static shapes, the graphs Neuron traces; each reads
    decode.onnx          one decode step                  ─┘ its weights from weights.data, where a weight the
    weights.data                                            graphs share is written once
    <graph>/model.pt     the Neuron trace of a graph, and its NEFF under <graph>/compiler/ (with the Neuron SDK)

The graphs are plain ONNX: onnxruntime runs them, and the PyTorch lowering (generate's torch and emulator
backends) runs exactly the programs the trace is made from.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path

import onnx
import onnx_ir as ir

from onnx_nmm.errors import ModelError
from onnx_nmm.passes.static_cache import CacheLayout
from onnx_nmm.runtime.backend_runner import Model
from onnx_nmm.runtime.rank_programs import RankPrograms
from onnx_nmm.runtime.static_cache import StaticCache

MANIFEST, WEIGHTS = "manifest.json", "weights.data"
# The tokenizer files compile copies from beside the model, so that `generate DIR` needs no --tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "config.json")
_EXTERNAL_BYTES = 1024  # smaller tensors (shapes, positions) stay in their graph


def is_compiled_folder(path) -> bool:
    """A folder `compile --max-context` wrote (its manifest lists the graphs of a static cache)."""
    return _manifest(Path(path)) is not None


def _manifest(folder: Path) -> dict | None:
    """The folder's manifest, if it is one of a static cache."""
    path = folder / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    return manifest if "cache" in manifest else None


def write_graphs(folder: Path, graphs: dict[str, ir.Model] | Iterable[tuple[str, ir.Model]]) -> None:
    """Each graph as folder/<name>.onnx; their weights in folder/weights.data, each weight once however many
    graphs read it (the same name and bytes). One graph's proto is in memory at a time (and given as pairs made
    one at a time, one graph)."""
    written: dict[tuple[str, int], tuple[int, int]] = {}
    with open(folder / WEIGHTS, "wb") as data:
        for name, model in graphs.items() if isinstance(graphs, dict) else graphs:
            proto = ir.to_proto(model)
            for tensor in proto.graph.initializer:
                raw = tensor.raw_data
                if len(raw) < _EXTERNAL_BYTES:
                    continue
                key = (tensor.name, zlib.crc32(raw))
                if key not in written:
                    written[key] = (data.tell(), len(raw))
                    data.write(raw)
                offset, length = written[key]
                onnx.external_data_helper.set_external_data(tensor, WEIGHTS, offset, length)
                tensor.data_location = onnx.TensorProto.EXTERNAL
                tensor.ClearField("raw_data")
            onnx.save(proto, folder / f"{name}.onnx")


def copy_tokenizer(model: Path | None, folder: Path) -> None:
    """The tokenizer files beside the model at `model`, so that `generate DIR` finds them as it does beside a
    model."""
    if model is None:
        return
    for name in TOKENIZER_FILES:
        if (model.parent / name).is_file():
            shutil.copy2(model.parent / name, folder / name)


def read(folder) -> tuple[dict, StaticCache]:
    """The manifest of a compiled folder, and its graphs as a StaticCache (by path: each is loaded when run)."""
    folder = Path(folder)
    manifest = _manifest(folder)
    if manifest is None:
        raise ModelError(f"{folder} is not a folder compile wrote for generating (no {MANIFEST} with a cache): "
                         "compile the model with {max_context} first", max_context="max_context")
    cache = manifest["cache"]
    layout = CacheLayout(cache["tokens"], cache["mask"], cache["positions"],
                         tuple((entry["input"], entry["aliases_output"]) for entry in cache["tensors"]),
                         cache["write_position"])
    graphs: dict[str, Path | RankPrograms] = {
        graph["name"]: RankPrograms(tuple(folder / file for file in graph["ranks"])) if "ranks" in graph
        else folder / graph["file"] for graph in manifest["graphs"]}
    files = [path for graph in graphs.values()
             for path in (graph.paths if isinstance(graph, RankPrograms) else (graph,))]
    missing = [path.name for path in (*files, folder / WEIGHTS) if not path.is_file()]
    if missing:
        raise ModelError(f"{folder} lacks {', '.join(missing)}: compile it again")
    tp = manifest.get("tp", 1)
    stacked = (tp,) if tp > 1 else ()
    prefill: dict[int, Model | RankPrograms] = {graph["tokens"]: graphs[graph["name"]] for graph in manifest["graphs"]
                                                if graph["kind"] == "prefill"}
    traced = {graph["name"]: folder / graph["torchscript"] for graph in manifest["graphs"] if "torchscript" in graph}
    state = {graph["name"]: graph["cache_state"] for graph in manifest["graphs"] if "cache_state" in graph}
    return manifest, StaticCache(manifest["model"], layout,
                                 {entry["input"]: (*stacked, *entry["shape"]) for entry in cache["tensors"]},
                                 manifest["max_context"], prefill, graphs["decode"], traced, state)


def cache_manifest(graphs: StaticCache) -> dict:
    """The manifest's "cache": which inputs are the tokens, mask and positions, the decode step's input saying
    where it writes (null: its attention writes at the end of the mask), and each cache tensor with its shape
    and the output that holds the same buffer after a step."""
    layout = graphs.layout
    return {"tokens": layout.tokens, "mask": layout.mask, "positions": layout.positions,
            "write_position": layout.write_position, "max_context": graphs.max_context,
            "tensors": [{"input": past, "aliases_output": present, "shape": list(graphs.cache_shapes[past][-4:]),
                         "dtype": "float32"} for past, present in layout.cache]}
