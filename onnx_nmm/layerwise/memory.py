"""Whether a model is too large for the in-memory rewrite on this machine, which then rewrites it layer by
layer. The in-memory default (MLPs narrowed within a measured budget) holds the model, its full-width probe
lowered to PyTorch, the proto and the float64 statistics at once: Qwen2.5-0.5B (2.5 GB of float32 weights) was
killed at 24.3 GB, so it is taken to need IN_MEMORY_FACTOR × the weights in float32."""

from __future__ import annotations

import os
from pathlib import Path

import onnx_ir as ir

from onnx_nmm.calibration.calibration_data import check_source_files
from onnx_nmm.model_io import load_model
from onnx_nmm.options import RewriteOptions
from onnx_nmm.ranks.rank_plan import check_report_files

IN_MEMORY_FACTOR = 12
GB = 2**30


def float32_weight_bytes(model: ir.Model) -> int:
    """What the model's weights take in float32: a 4-bit code (two to a byte) or a bf16 value as four bytes."""
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None:
            continue
        per_byte = 2 if tensor.dtype in (ir.DataType.UINT8, ir.DataType.INT8, ir.DataType.UINT4,
                                         ir.DataType.INT4) else 1 / tensor.dtype.itemsize
        total += int(tensor.nbytes * per_byte * 4)
    return total


def memory_shortfall(needed: int) -> tuple[int, int] | None:
    """(`needed`, the memory available) when `needed` bytes are more than this machine has available, else None."""
    available = available_memory()
    return None if needed <= available else (needed, available)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo; elsewhere the machine's physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def too_large_for_memory(model_path: str | os.PathLike, options: RewriteOptions) -> str | None:
    """Why the in-memory rewrite of the model at `model_path` with `options` would not fit (one line), or None if
    it fits or does not narrow MLPs (only narrowing runs layer by layer). A missing calibration file or report
    is refused first, before the model loads, as the rewrite refuses it."""
    if not options.strategy.narrows_mlps or not Path(model_path).is_file():
        return None  # a missing model is said by the rewrite
    check_source_files(options.calibration)
    check_report_files(options.ranks)
    weights = float32_weight_bytes(load_model(Path(model_path)))
    shortfall = memory_shortfall(IN_MEMORY_FACTOR * weights)
    if shortfall is None:
        return None
    needed, available = shortfall
    return (f"{Path(model_path).name} holds {weights / GB:.1f} GB of weights in float32; rewriting it in memory "
            f"needs about {needed / GB:.0f} GB and this machine has {available / GB:.0f} GB available: "
            "rewriting it one layer at a time (docs/scale.md)")
