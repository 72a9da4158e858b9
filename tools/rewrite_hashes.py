"""The SHA-256 of the files a fixed set of rewrites writes: run before and after a change that must not change
any output (a move, a redesign), and compare.

    python tools/rewrite_hashes.py [--work out/rewrite-hashes] > before.txt
    ... change the code ...
    python tools/rewrite_hashes.py [--work out/rewrite-hashes] | diff before.txt -

The rewrites cover every method, the default quality budget and a sensitivity budget, sequential calibration,
fused MLPs and a streamed rewrite, on tiny random-weight exports (exported once into the work folder). Then
every architecture the tests export, by the dynamo and the TorchScript exporter: factorized without and with
fused MLPs, narrowed (nystrom) without and with, each model with its report (what was fused, narrowed or left
alone, and why), and the shapes `compile` would run (`decoder_shape`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

import onnx_nmm
from onnx_nmm import (
    CalibrationOptions,
    FactorizationOptions,
    RankOptions,
    RewriteOptions,
    Selection,
    StreamOptions,
)

RANDOM = dict(source="random", samples=6, seq_len=32)
# Those of onnx_nmm.export, which tests/test_architectures.py runs end to end.
ARCHITECTURES = ("llama", "qwen3", "mistral", "gpt2", "llama-tied", "qwen2", "gemma", "gemma2", "gemma3", "phi3", "phi",
                 "olmo", "olmo2", "granite")
EXPORTERS = ("dynamo", "torchscript")


def rewrites() -> dict[str, RewriteOptions]:
    """Each rewrite by name: the options it runs with."""
    calibrated = CalibrationOptions(**RANDOM)
    return {
        "svd-keep-0.8": RewriteOptions(),
        "svd-rank-32-all": RewriteOptions(ranks=RankOptions(rank=32), selection=Selection(targets="all")),
        "whiten-keep-0.7": RewriteOptions(ranks=RankOptions(keep=0.7), calibration=calibrated,
                                          factorization=FactorizationOptions(method="whiten")),
        "fisher-keep-0.7": RewriteOptions(ranks=RankOptions(keep=0.7), calibration=calibrated,
                                          factorization=FactorizationOptions(method="fisher")),
        "nystrom-keep-0.8": RewriteOptions(ranks=RankOptions(keep=0.8), calibration=calibrated,
                                           factorization=FactorizationOptions(method="nystrom")),
        "default-budget": RewriteOptions(calibration=CalibrationOptions(**{**RANDOM, "samples": 12})),
        "whiten-sensitivity-budget": RewriteOptions(
            ranks=RankOptions(keep=0.8, budget="sensitivity", sensitivity_windows=2), calibration=calibrated,
            factorization=FactorizationOptions(method="whiten")),
        "whiten-sequential": RewriteOptions(ranks=RankOptions(keep=0.8), calibration=CalibrationOptions(
            **RANDOM, mode="sequential"), factorization=FactorizationOptions(method="whiten")),
        "whiten-fused": RewriteOptions(ranks=RankOptions(keep=0.8), calibration=calibrated, fuse_mlp=True,
                                       factorization=FactorizationOptions(method="whiten")),
    }


def architecture_rewrites() -> dict[str, RewriteOptions]:
    """The rewrites run on every architecture: what recognizes an MLP decides each one's output."""
    narrowed = dict(ranks=RankOptions(keep=0.8), calibration=CalibrationOptions(**RANDOM),
                    factorization=FactorizationOptions(method="nystrom"))
    return {
        "svd-keep-0.5": RewriteOptions(ranks=RankOptions(keep=0.5, align=32)),
        "svd-keep-0.5-fused": RewriteOptions(ranks=RankOptions(keep=0.5, align=32), fuse_mlp=True),
        "nystrom-keep-0.8": RewriteOptions(**narrowed),
        "nystrom-keep-0.8-fused": RewriteOptions(**narrowed, fuse_mlp=True),
    }


def report_digest(report: onnx_nmm.RewriteReport) -> str:
    """The SHA-256 of a rewrite's report, its timings (every "seconds") left out."""
    return hashlib.sha256(json.dumps(_untimed(report.to_dict()), sort_keys=True, default=str).encode()).hexdigest()


def _untimed(described):
    if isinstance(described, dict):
        return {key: _untimed(value) for key, value in described.items() if key != "seconds"}
    if isinstance(described, list):
        return [_untimed(value) for value in described]
    return described


def digest(path: Path) -> str:
    """The SHA-256 of a model file and of its external data (if any)."""
    hashed = hashlib.sha256(path.read_bytes())
    data = onnx_nmm.external_data_path(path)
    if data.exists():
        hashed.update(data.read_bytes())
    return hashed.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("out/rewrite-hashes"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "llama.onnx"
    if not model.exists():
        onnx_nmm.export_causal_lm(onnx_nmm.build_model("llama"), model, "dynamo", cache=True)
    for name, options in rewrites().items():
        output = args.work / f"{name}.onnx"
        output.unlink(missing_ok=True)
        onnx_nmm.rewrite(model, options).save(output)
        print(name, digest(output), flush=True)
    streamed = args.work / "whiten-streamed.onnx"
    streamed.unlink(missing_ok=True)
    onnx_nmm.rewrite_streamed(model, streamed, RewriteOptions(
        ranks=RankOptions(keep=0.8), calibration=CalibrationOptions(**RANDOM),
        factorization=FactorizationOptions(method="whiten")), StreamOptions(threads=1, resume=False))
    print("whiten-streamed", digest(streamed), flush=True)
    for architecture in ARCHITECTURES:
        for exporter in EXPORTERS:
            source = args.work / f"{architecture}-{exporter}.onnx"
            if not source.exists():
                onnx_nmm.export_causal_lm(onnx_nmm.build_model(architecture), source, exporter)
            shape = dataclasses.replace(onnx_nmm.decoder_shape(source), label=source.name)  # not the work folder
            shape_digest = hashlib.sha256(repr(shape).encode()).hexdigest()
            print(f"{architecture}-{exporter} decoder_shape", shape_digest, flush=True)
            for name, options in architecture_rewrites().items():
                output = args.work / f"{architecture}-{exporter}-{name}.onnx"
                output.unlink(missing_ok=True)
                result = onnx_nmm.rewrite(source, options)
                result.save(output)
                print(f"{architecture}-{exporter} {name}", digest(output), report_digest(result.report), flush=True)


if __name__ == "__main__":
    main()
