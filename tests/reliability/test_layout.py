"""The package's import rule, read from the source (every import statement, top level or inside a
function):

    seq2seq_fast.ops      imports nothing of ours above it (no nn, no seq2seq)
    seq2seq_fast.nn       imports ops (and itself), never seq2seq
    seq2seq_fast.seq2seq  imports nn and ops (and itself)
    nothing in the package imports the benchmarks (``bench``), and no benchmark code ships in it
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "seq2seq_fast"
LAYERS = ("ops", "nn", "seq2seq")
# What each layer may import of ours. Top-level modules (_C, _triton, __init__) are not layers.
ALLOWED = {
    "ops": {"ops", "_C", "_triton"},
    "nn": {"ops", "nn"},
    "seq2seq": {"ops", "nn", "seq2seq"},
}


def _imported_modules(path: Path, package_dir: Path = PACKAGE) -> list[str]:
    """Absolute module names imported by ``path`` (relative imports resolved as if
    ``package_dir`` were the ``seq2seq_fast`` folder)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return _imports_in(tree, path, package_dir)


def _imports_in(tree: ast.AST, path: Path, package_dir: Path = PACKAGE) -> list[str]:
    package_parts = ["seq2seq_fast", *path.relative_to(package_dir).parent.parts]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            # "from seq2seq_fast import nn" imports the submodule seq2seq_fast.nn
            if module == "seq2seq_fast":
                names += [f"seq2seq_fast.{alias.name}" for alias in node.names]
    return names


def _layer_files(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


def test_layers_exist():
    for layer in LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file(), layer


def test_parser_sees_nested_and_relative_imports(tmp_path):
    # The rule below is only as good as the parser: make sure it sees what it must.
    # A sample file laid out as seq2seq_fast/ops/sample.py, outside the source tree.
    sample = tmp_path / "ops" / "sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "def f():\n    from seq2seq_fast.seq2seq import models\n"
        "from ..nn import attention\nimport bench.harness\n"
    )
    found = _imported_modules(sample, package_dir=tmp_path)
    assert "seq2seq_fast.seq2seq" in found
    assert "seq2seq_fast.nn" in found
    assert "bench.harness" in found


@pytest.mark.parametrize("layer", LAYERS)
def test_import_rule(layer):
    offences = []
    for path in _layer_files(layer):
        for module in _imported_modules(path):
            parts = module.split(".")
            if parts[0] == "bench":
                offences.append(f"{path.relative_to(PACKAGE)} imports {module}")
            if parts[0] != "seq2seq_fast" or len(parts) < 2:
                continue
            if parts[1] not in ALLOWED[layer]:
                offences.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not offences, "import rule broken:\n" + "\n".join(offences)


def test_no_benchmark_code_in_package():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module in _imported_modules(path):
            if module.split(".")[0] in ("bench", "pytest_benchmark"):
                offences.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not (PACKAGE / "bench.py").exists()
    assert not offences, "\n".join(offences)


def _runtime_imports(path: Path) -> list[str]:
    """The modules ``path`` imports at run time: every import statement except those under
    ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = [ast.Pass()]
    return _imports_in(tree, path)


@pytest.mark.parametrize("folder", ["ops", "seq2seq/data"])
def test_no_import_circle_within_a_package(folder):
    """No two modules of ops/ or seq2seq/data/ import each other, directly or around a circle,
    not even inside a function (the data <-> vocab circle of issue 35)."""
    files = sorted((PACKAGE / folder).glob("*.py"))
    prefix = "seq2seq_fast." + folder.replace("/", ".") + "."
    names = {prefix + p.stem for p in files if p.stem != "__init__"}
    edges = {
        prefix + p.stem: {m for m in _runtime_imports(p) if m in names and m != prefix + p.stem}
        for p in files
        if p.stem != "__init__"
    }
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            pytest.fail(f"import circle: {' -> '.join([*path[path.index(module) :], module])}")
        if module in done:
            return
        for target in sorted(edges.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])
