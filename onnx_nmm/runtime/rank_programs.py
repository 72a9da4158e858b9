"""A graph compiled with `--tp N` is N rank programs joined by collectives (lowering/collective_converters.py). On
the CPU they run in one process, each in a thread of its own, in lock-step: a collective waits until every rank
has given its tensor, then hands each the sum (AllReduce, added in rank order, so every rank gets the same bits)
or the concatenation (AllGather).

    feeds ─┬ rank 0's program ─ AllReduce ─ ... ─ AllGather ─┬ logits (every rank's are the same: rank 0's)
           ├ rank 1's program ─    ╪      ─ ... ─    ╪     ─┤
           └ ...                                              └ KV cache: each rank's own heads, stacked [N, ...]

The KV cache of a rank program holds the rank's KV heads; the runner takes and gives the ranks' caches stacked
along a first axis of N, so a decoder carries them from step to step as one array each.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from onnx_nmm.errors import OptionError
from onnx_nmm.runtime.collective_ops import ALL_REDUCE

_COLLECTIVE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankPrograms:
    """The N programs of one graph, rank 0 first (the ONNX files of a compiled folder)."""

    paths: tuple[Path, ...]

    @property
    def tp(self) -> int:
        return len(self.paths)


class SimulatedGroup:
    """The collectives of `size` ranks running as threads of one process."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=_COLLECTIVE_TIMEOUT_S)
        self.slots: list = [None] * size

    def reset(self) -> None:
        """Ready for the next call after one that failed."""
        self.barrier.reset()

    def join_for(self, rank: int):
        """What rank `rank`'s collectives call (collective_converters.Join)."""
        return functools.partial(self._join, rank)

    def _join(self, rank: int, kind: str, tensor, axis: int):
        import torch

        self.slots[rank] = tensor
        self.barrier.wait()
        joined = functools.reduce(torch.add, self.slots) if kind == ALL_REDUCE else torch.cat(self.slots, dim=axis)
        self.barrier.wait()  # every rank has read the slots before any writes the next collective's
        return joined


class _OneKernelAtATime:
    """A kernel backend the ranks' threads share, taking turns: the NKI emulator runs one kernel at a time."""

    def __init__(self, backend):
        self.backend, self.lock = backend, threading.Lock()

    def run(self, *args, **kwargs):
        with self.lock:
            return self.backend.run(*args, **kwargs)


class RankProgramsRunner:
    """The rank programs of one graph lowered to PyTorch (`backend` "torch" or "emulator"), called as ModelRunner
    is: {input name: array} → {output name: array}, the cache inputs and outputs (`cache`: past → present) stacked
    over the ranks."""

    def __init__(self, programs: RankPrograms, cache: dict[str, str], backend: str = "torch", target: str = "trn2"):
        if backend not in ("torch", "emulator"):
            raise OptionError(f"a folder compiled with {{tp}} {programs.tp} runs its {programs.tp} rank programs "
                              "lowered to PyTorch, their collectives simulated in one process: choose the torch or "
                              f"emulator {{backend}}, not {backend!r}", tp="tp", backend="backend")
        from onnx_nmm.lowering import backend_named, lower
        from onnx_nmm.lowering.collective_converters import bind_collectives

        self.group = SimulatedGroup(programs.tp)
        kernels = _OneKernelAtATime(backend_named(backend, target))
        self.modules = []
        for rank, path in enumerate(programs.paths):
            module = lower(path, kernels)
            bind_collectives(module, self.group.join_for(rank))
            self.modules.append(module)
        graph = onnx.load(programs.paths[0], load_external_data=False).graph
        initializers = {tensor.name for tensor in graph.initializer}
        self.input_names = [value.name for value in graph.input if value.name not in initializers]
        self.output_names = [value.name for value in graph.output]
        logits = graph.output[0].type.tensor_type.shape.dim
        self.vocabulary = logits[-1].dim_value or None
        self.cache = cache
        self.label = str(programs.paths[0].parent)

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        stacked = set(self.cache)
        feeds = [{name: inputs[name][rank] if name in stacked else inputs[name] for name in self.input_names}
                 for rank in range(len(self.modules))]
        with ThreadPoolExecutor(len(self.modules)) as pool:
            futures = [pool.submit(self._run, rank, feeds[rank]) for rank in range(len(self.modules))]
            errors = [future.exception() for future in futures]
        failed = [error for error in errors if error is not None]
        if failed:  # the rank that failed, not the others it left waiting at a collective
            self.group.reset()
            raise next((error for error in failed if not isinstance(error, threading.BrokenBarrierError)), failed[0])
        results = [future.result() for future in futures]
        presents = set(self.cache.values())
        return {name: np.stack([result[name] for result in results]) if name in presents else results[0][name]
                for name in self.output_names}

    def _run(self, rank: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        from onnx_nmm.lowering import call_lowered

        try:
            result = call_lowered(self.modules[rank], *(torch.from_numpy(np.ascontiguousarray(feeds[name]))
                                                        for name in self.input_names))
        except BaseException:
            self.group.barrier.abort()  # the other ranks stop waiting for this one
            raise
        results = result if isinstance(result, (tuple, list)) else (result,)
        return {name: tensor.numpy() for name, tensor in zip(self.output_names, results)}
