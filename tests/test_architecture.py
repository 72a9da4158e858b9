"""The layers keep to their jobs (docs/architecture.md): kernels/ knows nothing of ONNX; passes/ knows graphs,
not files, flags or the rest of onnx_nmm; the library speaks of options, not flags; the CLI and the tools
reach the library through its public API."""

import ast
import re
from pathlib import Path

import pytest

import onnx_nmm

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "onnx_nmm"


def _python_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names if node.module == "onnx_nmm")
    return names


def _outside(names: set[str], allowed: tuple[str, ...], watched: tuple[str, ...], exact: tuple[str, ...] = ()) -> set[str]:
    """The imports of a `watched` package that are neither one of the `allowed` modules (or below them) nor one
    of the `exact` names."""
    return {name for name in names if name.startswith(watched) and name not in exact
            and not any(name == ok or name.startswith(ok + ".") for ok in allowed)}


PUBLIC = ("onnx_nmm", "onnx_nmm.__version__", *(f"onnx_nmm.{name}" for name in onnx_nmm.__all__))


@pytest.mark.parametrize("path", _python_files(ROOT / "kernels"), ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_know_nothing_of_onnx(path):
    assert not _outside(_imports(path), ("onnx_nmm.kernels",), ("onnx", "onnxruntime", "onnx_ir", "onnx_nmm"))


@pytest.mark.parametrize("path", _python_files(ROOT / "passes"), ids=lambda p: str(p.relative_to(ROOT)))
def test_passes_know_graphs_and_nothing_else_of_the_project(path):
    imports = _imports(path)
    assert not _outside(imports, ("onnx_nmm.passes",), ("onnx_nmm",))
    assert not imports & {"argparse", "pathlib", "os", "onnxruntime", "torch"}


# What the CLI may use besides the top-level API: its own modules, the option constants for flag choices,
# the plotting helpers, JSON writing, and the kernels' benchmark (`bench-kernels` is a shell over it).
CLI_MAY_IMPORT = ("onnx_nmm.cli", "onnx_nmm.options", "onnx_nmm.finetuning", "onnx_nmm.report_plot", "onnx_nmm.bench_plot",
                  "onnx_nmm.finetune_plot", "onnx_nmm.model_io", "onnx_nmm.kernels")


@pytest.mark.parametrize("path", _python_files(LIBRARY / "cli"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_cli_calls_the_public_api(path):
    assert not _outside(_imports(path), CLI_MAY_IMPORT, ("onnx_nmm",), exact=PUBLIC)


@pytest.mark.parametrize("path", _python_files(ROOT / "tools"), ids=lambda p: str(p.relative_to(ROOT)))
def test_tools_use_the_public_api_or_the_cli(path):
    assert not _outside(_imports(path), ("onnx_nmm.kernels",), ("onnx_nmm",), exact=PUBLIC)


def _library_messages(path: Path):
    """The string constants of every `raise` in a file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for part in ast.walk(node.exc):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    yield part.value


@pytest.mark.parametrize("path", [p for p in _python_files(LIBRARY) if "cli" not in p.parts and p.name != "__main__.py"]
                         + _python_files(ROOT / "passes"), ids=lambda p: str(p.relative_to(ROOT)))
def test_library_errors_name_options_not_flags(path):
    flags = [message for message in _library_messages(path)
             if re.search(r"(^|\s)--[a-z]", message) and "pip install" not in message]
    assert not flags, f"{path.name} raises errors that name command-line flags: {flags}"
    assert "onnx_nmm.cli" not in str(_imports(path))
