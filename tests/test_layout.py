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


def executed_imports(
    tree: ast.Module, module: str, is_package: bool, typing: bool = False
) -> set[str]:
    """Modules a file imports when it runs (with ``typing``, those under ``if
    TYPE_CHECKING`` too)."""
    found: set[str] = set()
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if typing:
            break
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


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        imported = executed_imports(tree, module, path.name == "__init__.py", typing)
        graph[module] = {name for name in imported if name in files and name != module}
    return graph


# the documented order of the packages (docs/architecture.md): each may import those
# before it, never one after it; the root helpers come first
ORDER = [
    ("units", "checks", "jsonfile", "allocation"),
    ("schedules",),
    ("timeline",),
    ("simulation",),
    ("model",),
    ("profiler",),
    ("planning",),
    ("data",),
    ("distributed",),
    ("checkpoint",),
    ("runtime.rank",),
    ("runtime",),
    ("app",),
]
LEVEL = {name: level for level, names in enumerate(ORDER) for name in names}


def package_of(module: str) -> str | None:
    """The package (of :data:`ORDER`) ``module`` belongs to; ``None`` for the root itself."""
    parts = module.split(".")[1:]
    if parts[:2] == ["runtime", "rank"]:
        return "runtime.rank"
    return parts[0] if parts and parts[0] not in ("__main__",) else None


def test_every_import_follows_the_documented_package_order() -> None:
    """Lazy and type-only imports included: an arrow against the order is a loop waiting."""
    against = []
    for module, targets in sorted(import_graph(typing=True).items()):
        source = package_of(module)
        if source is None:
            continue
        assert source in LEVEL, f"{module} is in no package of the documented order"
        for target in sorted(targets):
            destination = package_of(target)
            if destination is not None and LEVEL[destination] > LEVEL[source]:
                against.append(f"{module} -> {target}")
    assert against == []


def test_the_distributed_package_knows_nothing_of_training() -> None:
    training = {"model", "profiler", "planning", "checkpoint", "runtime", "runtime.rank", "app"}
    reached = {
        f"{module} -> {target}"
        for module, targets in import_graph(typing=True).items()
        if package_of(module) == "distributed"
        for target in targets
        if package_of(target) in training
    }
    assert reached == set()


def test_the_checkpoint_package_does_not_import_the_pipeline() -> None:
    checkpoint = [
        (module, targets)
        for module, targets in import_graph(typing=True).items()
        if package_of(module) == "checkpoint"
    ]
    assert checkpoint and all(
        not any(target.startswith("pipetrain.runtime") for target in targets)
        for _, targets in checkpoint
    )


def test_the_update_cycle_is_reached_only_inside_the_rank_package() -> None:
    reach = re.compile(r"\.updater\.|\.normalizer\.|\b_accumulated|\._updater\b|\._normalizer\b")
    outside = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in PACKAGE.rglob("*.py")
        if "rank" not in path.relative_to(PACKAGE).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if reach.search(line)
    ]
    assert outside == []


def test_the_runtime_stays_small_at_its_top_level() -> None:
    top = sorted(p.name for p in (PACKAGE / "runtime").glob("*.py"))
    assert len(top) <= 12, top


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
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip() == "[]"


def _imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "torch" for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def test_the_map_says_which_packages_import_torch() -> None:
    """docs/architecture.md's package table: a package marked "no" has no file importing
    torch, one marked "yes" has some, and one listing files names exactly those that do."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    doc = doc[doc.index("## Packages") : doc.index("## Modules")]
    rows = re.findall(r"^\| (`[^|]+`) \| [^|]+ \| ([^|]+) \|$", doc, re.M)
    assert len(rows) >= 10
    for packages, claim in rows:
        for name in re.findall(r"`([^`]+)`", packages):
            path = PACKAGE / name.rstrip("/")
            files = [path] if path.suffix == ".py" else sorted(path.glob("*.py"))
            if name == "runtime/":  # its rank/ subpackage has a row of its own
                files = sorted(path.glob("*.py"))
            importing = {f.name for f in files if _imports_torch(f)}
            if claim.startswith("no"):
                assert importing == set(), f"{name} is marked free of torch: {importing}"
            elif claim.strip() == "yes":
                assert importing, f"{name} is marked as importing torch but no file does"
            else:
                listed = set(re.findall(r"`([^`]+\.py)`", claim))
                assert importing == listed, f"{name}: the map lists {listed}, the code {importing}"


def test_the_pipeline_facade_stays_narrow() -> None:
    """The front door takes at most 15 settings in at most 60 lines, in a module of at most
    300 lines: the rest belongs in the settings objects and the rank's machinery."""
    path = PACKAGE / "runtime" / "pipeline.py"
    source = path.read_text()
    assert len(source.splitlines()) <= 300
    tree = ast.parse(source)
    init = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    arguments = init.args
    assert len(arguments.args) - 1 + len(arguments.kwonlyargs) <= 15  # self left out
    assert init.end_lineno is not None and init.end_lineno - init.lineno + 1 <= 60


def test_a_training_run_imports_checkpointing_and_sharding_only_when_used() -> None:
    """torch.distributed.checkpoint and FSDP take seconds to import on every worker: a run
    that neither saves nor shards does without them."""
    code = (
        "import sys; import pipetrain.app.train_job, pipetrain.runtime; "
        "print(sorted(m for m in ('torch.distributed.checkpoint', 'torch.distributed.fsdp') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip() == "[]"


def test_no_unit_test_bounds_wall_clock_time() -> None:
    """A busy machine runs everything several times slower: a test's only time bound is its
    own timeout, never an assertion on how long something took."""
    clock = r"(monotonic|perf_counter|time\.time)\(\) *- *\w+"
    timed = re.compile(rf"assert .*({clock}|\b(elapsed|took|duration)\w*) *<")
    offenders = [
        f"{path.name}:{number}"
        for path in sorted((PACKAGE.parent / "tests").glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if timed.search(line)
    ]
    assert offenders == []
