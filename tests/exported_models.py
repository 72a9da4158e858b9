"""Real exported graphs for the tests, cached on disk across test sessions and xdist workers.

Each model is a tiny random-weight transformers model (noise on every parameter, see
onnx_nmm.export) exported with one of the three exporters. The cache key holds the torch and
transformers versions, so an upgrade re-exports.
"""

from __future__ import annotations

import os
from pathlib import Path

from filelock import FileLock

# Bump when onnx_nmm.export changes what it writes (2: module paths without the old wrapper's "inner.";
# 3: sequence axes declared from length 1; 4: positions per batch row).
EXPORT_FORMAT = 4
CACHE = Path(os.environ.get("ONNX_NMM_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "test-models"))


def exported_model(architecture: str, exporter: str, external_data: bool = False, seed: int = 0,
                   cache: bool = False, opset: int | None = None, positions: bool = True) -> Path:
    """The path of `architecture` exported with `exporter` (see onnx_nmm.export), with a KV cache if `cache`
    (without a position_ids input unless `positions`), at `opset` (None: the exporter's default), exporting on
    first use."""
    import torch
    import transformers

    from onnx_nmm import build_model, export_causal_lm

    key = (f"{architecture}-{exporter}{f'-opset{opset}' if opset else ''}{'-kv' if cache else ''}"
           f"{'' if positions else '-without-positions'}"
           f"{'-external' if external_data else ''}-s{seed}"
           f"-e{EXPORT_FORMAT}"
           f"-torch{torch.__version__}-tf{transformers.__version__}")
    folder = CACHE / key
    path = folder / "model.onnx"
    with FileLock(str(CACHE / f"{key}.lock")):
        if not path.exists():
            staging = CACHE / f"{key}.partial"
            if staging.exists():
                for leftover in staging.iterdir():
                    leftover.unlink()
            export_causal_lm(build_model(architecture, seed=seed), staging / "model.onnx", exporter,
                             external_data=external_data, cache=cache, opset=opset, positions=positions)
            staging.rename(folder)
    return path
