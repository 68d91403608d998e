"""The package's shape: no import circles, schedule names compared only in their own files,
and the pure parts free of torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from pipetrain.schedules import names

PACKAGE = Path(__file__).resolve().parent.parent / "pipetrain"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def executed_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Modules a file imports when it runs (imports under ``if TYPE_CHECKING`` excluded)."""
    found: set[str] = set()
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    base = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                source = f"{anchor}.{source}" if source else anchor
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        imported = executed_imports(tree, module, path.name == "__init__.py")
        graph[module] = {name for name in imported if name in files and name != module}
    return graph


def test_no_module_imports_itself_through_others() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circle = [*path[path.index(target) :], target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_schedule_names_are_compared_only_in_their_own_files() -> None:
    quoted = "|".join(re.escape(name) for name in names())
    comparison = re.compile(rf"""(==|!=|\bin)\s*\(?[^#\n]*["']({quoted})["']""")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "builtin":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if comparison.search(line):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_pure_parts_import_no_torch() -> None:
    pure = [
        "pipetrain.schedules",
        "pipetrain.simulation",
        "pipetrain.timeline",
        "pipetrain.planning",
        "pipetrain.profiler",
        "pipetrain.units",
        "pipetrain.checks",
    ]
    code = (
        "import sys; import " + ", ".join(pure) + "; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
