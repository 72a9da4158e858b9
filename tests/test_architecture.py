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


def _outside(names: set[str], allowed: tuple[str, ...], watched: tuple[str, ...],
             exact: tuple[str, ...] = ()) -> set[str]:
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
CLI_MAY_IMPORT = ("onnx_nmm.cli", "onnx_nmm.options", "onnx_nmm.training.finetuning", "onnx_nmm.training.schedule",
                  "onnx_nmm.plots.report", "onnx_nmm.plots.bench",
                  "onnx_nmm.plots.finetune", "onnx_nmm.model_io", "onnx_nmm.kernels")


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


def test_the_top_level_holds_the_api_and_few_modules_besides():
    modules = sorted(path.stem for path in LIBRARY.glob("*.py"))
    assert len(modules) <= 15, f"onnx_nmm/ holds {len(modules)} modules: give the new one a subpackage ({modules})"


def test_the_kernels_folder_holds_its_modules_in_folders_by_role():
    """kernels/: the NKI kernels, the emulator, the pricing (cost model and planner), the bench (running, timing)."""
    assert sorted(path.name for path in (ROOT / "kernels").glob("*.py")) == ["__init__.py"]
    folders = sorted(path.parent.name for path in (ROOT / "kernels").glob("*/__init__.py"))
    assert folders == ["bench", "emulator", "nki_kernels", "pricing"]


# What each subpackage must never import: the layers above it (docs/architecture.md).
ABOVE = {
    "quality": ("decomposition", "generation", "ranks", "training", "trainium"),  # measurements run models on text
    "runtime": ("calibration", "decomposition", "generation", "ranks", "training", "trainium"),
    "decomposition": ("generation", "ranks", "training", "trainium"),
    "ranks": ("calibration", "generation", "training", "trainium"),
    "calibration": ("ranks", "training", "trainium"),
    "generation": ("decomposition", "ranks", "training", "trainium"),
    "training": ("ranks", "trainium"),
    "trainium": ("calibration", "generation", "training"),
}
EVERY_LAYER_ABOVE = ("pipeline", "scale", "plots", "cli")  # never imported by anything below the API


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_a_subpackage_imports_nothing_above_it(package):
    forbidden = tuple(f"onnx_nmm.{name}" for name in (*ABOVE[package], *EVERY_LAYER_ABOVE))
    for path in _python_files(LIBRARY / package):
        assert not {name for name in _imports(path) if name.startswith(forbidden)}, path.name


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = ("onnx_nmm", *relative.parts[1:]) if relative.parts[0] in ("onnx_nmm", "passes", "kernels") else ()
    if relative.parts[0] in ("passes", "kernels"):
        parts = ("onnx_nmm", *relative.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path) -> set[str]:
    """Every module a file imports, with `from package import module` named as the module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_module_imports_itself_round_a_circle():
    """Every module of the package (cli/, passes/ and kernels/ included); imports inside functions count too: a
    circle broken only by importing late is still a circle."""
    files = {_module_name(path): path for folder in (LIBRARY, ROOT / "passes", ROOT / "kernels")
             for path in _python_files(folder)}
    graph = {}
    for name, path in files.items():
        imported = set()
        for target in _imported_names(path):
            while target and target not in files:
                target = target.rpartition(".")[0]
            imported.add(target)
        graph[name] = imported - {name, "onnx_nmm", ""}
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("an import circle: " + " → ".join([*path[path.index(module):], module]))
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_the_kind_of_a_calibration_source_is_decided_in_one_function():
    """onnx_nmm.calibration.sources.calibration_source: nothing else looks at a source's suffix or spelling."""
    sources = LIBRARY / "calibration" / "sources.py"
    for path in _python_files(LIBRARY):
        if path != sources:
            text = path.read_text()
            assert 'endswith(".npz")' not in text and "== RANDOM" not in text, path.name


def test_the_repository_explains_itself():
    """No file points into the team's notes outside the repository: the docs are docs/design.md and its
    neighbours."""
    outside = ("DESIGN" + ".md", "ASSETS" + ".md", "research" + "/", "../" + "shared")
    files = [path for folder in ("onnx_nmm", "passes", "kernels", "tests", "tools", "docs")
             for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".md") and path.is_file()]
    for path in [*files, ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]:
        named = [name for name in outside if name in path.read_text()]
        assert not named, f"{path.relative_to(ROOT)} names {named}"


def _compared_strings(path: Path) -> set[str]:
    """The string constants a file's code compares with (==, !=, in, not in)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                constants = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                found.update(c.value for c in constants if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return found


def test_a_methods_name_is_read_in_one_module_besides_the_options_and_the_cli():
    """onnx_nmm.decomposition.methods says what each method does and needs; every step asks it."""
    from onnx_nmm.options import METHODS

    allowed = {LIBRARY / "options.py", LIBRARY / "decomposition" / "methods.py"}
    for path in [*_python_files(LIBRARY), *_python_files(ROOT / "passes")]:
        if path not in allowed and "cli" not in path.parts:
            assert not _compared_strings(path) & set(METHODS), path.relative_to(ROOT)


def test_the_option_walks_the_architecture_page_quotes_are_the_ones_the_tool_prints(export):
    """docs/architecture.md quotes tools/option_readers.py; a change of who reads an option changes the page."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import option_readers
    finally:
        sys.path.remove(str(ROOT / "tools"))
    page = (ROOT / "docs" / "architecture.md").read_text()
    quoted = page.split("<!-- option-readers -->")[1].split("<!-- /option-readers -->")[0]
    assert [line.removeprefix("- ") for line in quoted.strip().splitlines()] == \
        option_readers.readers(export("llama", "dynamo"))


MACHINE_PATH = re.compile(r"(?<![\w.~-])/(tmp|work|home|root|Users|mnt)/")


def test_no_file_names_a_path_of_one_machine():
    """Commands and citations are written as a user would type them: relative paths, a file's own folder."""
    files = [path for folder in ("onnx_nmm", "passes", "kernels", "tests", "tools", "docs")
             for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".md") and path.is_file()]
    for path in [*files, ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]:
        named = MACHINE_PATH.search(path.read_text())
        assert named is None or path == Path(__file__), f"{path.relative_to(ROOT)} names {named.group(0)}…"


def _code_names(path: Path) -> set[str]:
    """The identifiers and string constants of a file's code, its docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name)
    return names


def test_one_table_says_which_kernel_runs_each_custom_op():
    """onnx_nmm.kernel_table covers every ai.onnx_nmm op, and no other library file names one of its kernels or
    their planners: the lowering's backends, compile's plan and the Trainium estimate all read the table."""
    from onnx_nmm.kernel_table import KERNEL_TABLE
    from onnx_nmm.passes import svd_ops

    assert set(KERNEL_TABLE) == {svd_ops.SVD_MATMUL, *svd_ops.MLP_OPS, *svd_ops.DENSE_MLP_OPS}
    table_only = {spec.kernel for spec in KERNEL_TABLE.values()} | {
        "plan_xuv", "plan_mlp", "plan_ungated_mlp", "plan_dense_mlp", "plan_blocks"}
    for path in _python_files(LIBRARY):
        if path.name != "kernel_table.py" and "cli" not in path.parts:
            assert not _code_names(path) & table_only, path.relative_to(ROOT)


def test_the_type_checker_covers_every_module_of_onnx_nmm():
    """mypy (make lint) checks the whole onnx_nmm/ and passes/ folders, as pyproject.toml says: no module of them is
    left out, none has its errors ignored."""
    import tomllib

    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert {"onnx_nmm", "passes"} <= set(mypy["files"]), "mypy checks the onnx_nmm/ and passes/ folders, not lists"
    assert "exclude" not in mypy, f"mypy leaves out {mypy.get('exclude')}"
    ignored = [override["module"] for override in mypy.get("overrides", []) if override.get("ignore_errors")]
    assert not ignored, f"mypy ignores the errors of {ignored}"
