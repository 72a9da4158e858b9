"""Models the benchmarks share, exported once into out/bench/ (torch and transformers needed)."""

from __future__ import annotations

from pathlib import Path

from onnx_nmm import TinyShape, build_model, export_causal_lm
from onnx_nmm import describe_machine as machine  # noqa: F401 (the studies import it from here)

# Llama-3.2-1B's width (hidden 2048, intermediate 8192, 32 heads, 8 kv heads), fewer layers, and a
# 32k vocabulary instead of 128k so the benchmark model stays near 1.5 GB.
LLAMA_1B_WIDTH = TinyShape(hidden=2048, intermediate=8192, layers=4, heads=32, kv_heads=8, vocab=32000)


def llama_1b_width(folder: Path = Path("out/bench"), layers: int = 4) -> Path:
    """A random-weight Llama with Llama-3.2-1B's layer shapes, exported with external data."""
    path = folder / f"llama1b-width-{layers}l" / "model.onnx"
    if not path.exists():
        shape = TinyShape(**{**LLAMA_1B_WIDTH.__dict__, "layers": layers})
        print(f"exporting a Llama-3.2-1B-width model with {layers} layers to {path} ...", flush=True)
        export_causal_lm(build_model("llama", shape), path, "dynamo", external_data=True, batch=1, seq_len=8)
    return path
