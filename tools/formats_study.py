"""docs/formats.md's study: SmolLM2 in the formats people deploy, rewritten, and measured.

    python tools/formats_study.py [--optimum-python .venv-optimum/bin/python] [--work out/formats]

The models, all with a KV cache:

    export           `onnx-nmm export` of the GGUF (dynamo)
    optimum past     optimum-onnx's text-generation-with-past export   } made by tools/format_fixtures.py in
    optimum merged   optimum's merged decoder (one If, shared weights)  } the optimum environment (--optimum-python)
    int4             the export quantized by onnxruntime's MatMulNBitsQuantizer (4 bits, blocks of 32)

and each rewritten: the MLPs whitened at --keep 0.9 and 0.8 (align 32, calibrated on the Old Testament),
the int4 model's factors written back as int4 MatMulNBits; and fisher at --keep 0.96 --budget sensitivity
on the int4 model, the setting docs/quality.md found within +10 %.

Each is measured for its bytes on disk, its perplexity on the held-out New Testament (16 windows of 512
tokens), and its decode speed in onnxruntime on CPU: a prefill of --context tokens, then --steps greedy
steps with the KV cache, every model in one process, alternating each round; medians of --rounds rounds.

Models already in --work are kept, so an interrupted study resumes; delete the folder to start afresh.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog, as_typed, write_section  # noqa: E402

KEEPS = (0.9, 0.8)
EVAL_WINDOWS = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimum-python", help="a Python with optimum-onnx (tools/format_fixtures.py); without "
                                                 "it, the optimum rows are left out")
    parser.add_argument("--work", default="out/formats")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--context", type=int, default=128, help="tokens of prompt before the decode steps")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/formats.md")
    args = parser.parse_args()
    study = Study(args)
    study.make_models()
    study.measure()
    study.write_page(Path(args.out))
    return 0


class Study:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.tokenizer, self.calibration, self.evaluation = (assets.smollm2_gguf(), assets.kjv_text("calibration"),
                                                             assets.kjv_text("evaluation"))
        self.commands = CommandLog()
        self.models: dict[str, Path] = {}  # row label → model
        self.made_by: dict[str, str] = {}  # row label → how, for the table

    def make_models(self) -> None:
        export = self.work / "smollm2-kv.onnx"
        self.commands.produce([export], "export", self.tokenizer, "-o", export, "--external-data", "yes")
        self.add("export", export, "`onnx-nmm export` (dynamo, KV cache)")
        if self.args.optimum_python:
            for kind in ("past", "merged"):
                self.add(f"optimum {kind}", self.optimum(kind),
                         f"optimum-onnx {'merged decoder' if kind == 'merged' else 'text-generation-with-past'}")
        int4 = self.quantized(export)
        self.add("int4", int4, "the export, onnxruntime's MatMulNBitsQuantizer (4 bits, block 32)")
        for name, source in (("export", export), ("int4", int4)):
            stats = self.work / f"{source.stem}-stats.npz"
            for keep in KEEPS:
                out = self.work / f"{source.stem}-whitened-k{keep}.onnx"
                calibration = (["--calib-stats", stats] if stats.exists() else
                               ["--calib-samples", self.args.calib_samples, "--save-calib-stats", stats])
                self.commands.produce([out], "rewrite", source, "-o", out, "--calib", self.calibration, "--tokenizer",
                                      self.tokenizer, "--seq-len", 512, *calibration, "--keep", keep, "--align", 32,
                                      "--report", out.with_suffix(".json"), "--quiet", "--force")
                self.add(f"{name}, whitened keep {keep}", out, f"`rewrite --keep {keep} --align 32` (whitened)")
        if "optimum merged" in self.models:
            out = self.work / "optimum-merged-whitened-k0.9.onnx"
            self.commands.produce([out], "rewrite", self.models["optimum merged"], "-o", out, "--calib",
                                  self.calibration, "--tokenizer", self.tokenizer, "--seq-len", 512, "--calib-samples",
                                  self.args.calib_samples, "--keep", 0.9, "--align", 32, "--quiet", "--force")
            self.add("optimum merged, whitened keep 0.9", out, "`rewrite --keep 0.9 --align 32` (whitened)")
        fisher = self.work / f"{int4.stem}-fisher-k0.96.onnx"
        self.commands.produce([fisher], "rewrite", int4, "-o", fisher, "--method", "fisher", "--calib",
                              self.calibration, "--tokenizer", self.tokenizer, "--seq-len", 512, "--calib-samples", 64,
                              "--keep", 0.96, "--budget", "sensitivity", "--align", 32, "--report",
                              fisher.with_suffix(".json"), "--quiet", "--force")
        self.add("int4, fisher keep 0.96 (sensitivity budget)", fisher,
                 "`rewrite --method fisher --keep 0.96 --budget sensitivity --align 32`")

    def add(self, label: str, path: Path, made_by: str) -> None:
        self.models[label], self.made_by[label] = path, made_by

    def optimum(self, kind: str) -> Path:
        """optimum's export of SmolLM2, made in the optimum environment by tools/format_fixtures.py."""
        path = self.work / f"optimum-{kind}" / "model.onnx"
        if not path.exists():
            command = [self.args.optimum_python, str(Path(__file__).with_name("format_fixtures.py")), "optimum",
                       "--checkpoint", str(self.tokenizer.resolve()), "--out", str(self.work.resolve())]
            print("$", " ".join(as_typed(part) for part in command), flush=True)
            # not the repository root: its kernels/ shadows a package
            subprocess.run(command, check=True, cwd=self.work)
        return path

    def quantized(self, source: Path) -> Path:
        return assets.int4_quantized(source, self.work / f"{source.stem}-int4.onnx")

    def measure(self) -> None:
        self.rows = {}
        for label, path in self.models.items():
            result = self.commands.perplexity(path, self.evaluation, self.tokenizer, EVAL_WINDOWS)
            self.rows[label] = {"perplexity": result["perplexity"], "bytes": _bytes_on_disk(path)}
        self.tokens_scored = result["tokens_scored"]
        for label, speed in decode_speed(self.models, self.prompt(), self.args).items():
            self.rows[label].update(speed)
        for label, row in self.rows.items():
            print(label, row, flush=True)

    def prompt(self) -> np.ndarray:
        from onnx_nmm import load_tokenizer

        text = self.evaluation.read_text(encoding="utf-8")[:20_000]
        return np.asarray(load_tokenizer(self.tokenizer).encode(text)[: self.args.context], np.int64)[None]

    def write_page(self, path: Path) -> None:
        dense = self.rows["export"]
        lines = [
            "## SmolLM2 in each format, rewritten",
            "",
            f"SmolLM2-135M-Instruct ([models.md](models.md)) with a KV cache in each format. Perplexity: onnxruntime "
            f"on CPU, the first {EVAL_WINDOWS} windows of 512 tokens of the held-out New Testament "
            f"({self.tokens_scored} tokens scored); rewrites calibrated on the Old Testament. Decode: a prefill of "
            f"{self.args.context} New Testament tokens, then {self.args.steps} greedy steps fed the cache, every "
            f"model in one process, alternating each round; median of {self.args.rounds} rounds, "
            f"{self.args.threads} threads. Bytes: the model file and its external data.",
            "",
            "| model | made by | bytes | perplexity | vs export | decode ms/token | tokens/s | vs export |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for label, row in self.rows.items():
            lines.append(f"| {label} | {self.made_by[label]} | {row['bytes'] / 1e6:,.0f} MB | "
                         f"{row['perplexity']:.3f} | "
                         f"{row['perplexity'] / dense['perplexity']:.2f}× | {row['ms_per_token']:.2f} | "
                         f"{1000 / row['ms_per_token']:.1f} | {dense['ms_per_token'] / row['ms_per_token']:.2f}× |")
        lines += ["", f"Measured on: {machine()}.", "", "### Commands", "",
                  "Generated by `python tools/formats_study.py` (it prints every command as it runs it):", "", "```",
                  *self.commands.lines, "```"]
        write_section(path, "formats-study", lines)
        print(f"wrote {path}")


def decode_speed(models: dict[str, Path], prompt: np.ndarray, args) -> dict[str, dict]:
    """Per model: the median decode time per token over rounds that alternate the models."""
    from onnx_nmm import Decoder

    decoders = {label: Decoder(path, threads=args.threads) for label, path in models.items()}
    times: dict[str, list[float]] = {label: [] for label in models}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for label, decoder in decoders.items():
            token = decoder.prefill(prompt).argmax(-1)
            start = time.perf_counter()
            for _ in range(args.steps):
                token = decoder.step(token).argmax(-1)
            if round_:
                times[label].append((time.perf_counter() - start) / args.steps)
    return {label: {"ms_per_token": 1000 * statistics.median(values)} for label, values in times.items()}


def _bytes_on_disk(path: Path) -> int:
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


if __name__ == "__main__":
    sys.exit(main())
