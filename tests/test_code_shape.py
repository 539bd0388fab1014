"""The shape rules the code base keeps: small modules and functions, layers without cycles,
and nothing that points outside the repository.

These read the source with ``ast`` (nothing is imported), so they run in a fraction of a second.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("loomray", "storage")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# Modules allowed past MAX_MODULE_LINES, each with the reason it stays whole.
LONG_MODULES: dict[str, str] = {}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _module_name(path: Path) -> str:
    """The name a module is imported under: ``storage/x.py`` is installed as ``loomray.storage.x``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "storage":
        parts.insert(0, "loomray")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """What ``module`` imports, at its top level or inside any function, outside ``if TYPE_CHECKING``.

    A function-local import is counted: it closes a cycle as surely as a top-level one, only later.
    ``from a import b`` yields ``a.b`` (resolved later to the submodule ``a.b`` or the package ``a``).
    """
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit_node(stmt)
            else:
                visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
        else:
            visit(node)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> modules whose import it starts (a parent package already being imported is no edge)."""
    trees = {_module_name(p): (p, ast.parse(p.read_text())) for p in _sources()}
    known = set(trees)
    graph: dict[str, set[str]] = {}
    for name, (path, tree) in trees.items():
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges = set()
        for imported in _imports(tree, name, path.name == "__init__.py"):
            parts = imported.split(".")
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            target = next((m for m in reversed(prefixes) if m in known), None)
            if target is None:
                continue
            # importing a.b.c also runs a and a.b, unless they are the importer's own parents (already running);
            # a name taken from a parent package (not a submodule) needs that package's body done: an edge.
            edges.update(m for m in prefixes if m in known and m not in ancestors)
            if target in ancestors:
                edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def test_modules_stay_small():
    over = {str(p.relative_to(ROOT)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert set(over) <= set(LONG_MODULES), f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_functions_stay_short():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_import_reader_sees_what_a_cycle_is_made_of():
    tree = ast.parse("from . import b\nif TYPE_CHECKING:\n    import c\nfrom .d import E\n"
                     "def f():\n    from loomray.g import h")
    assert _imports(tree, "loomray.a", False) == {"loomray.b", "loomray.d.E", "loomray.g.h"}


@pytest.mark.parametrize("layer, forbidden", [
    # The storage layer imports itself relatively, so it never runs loomray's own package body.
    ("loomray.storage", ("loomray", "storage", "ray")),
    ("loomray.loop", ("ray", "loomray.storage", "storage", "boto3", "s3fs")),
    ("loomray.journal", ("ray",)),
    ("loomray.session", ("ray",)),
])
def test_layers_import_downwards_only(layer, forbidden):
    for path in _sources():
        name = _module_name(path)
        if name != layer and not name.startswith(layer + "."):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for imported in names:
                assert not any(imported == f or imported.startswith(f + ".") for f in forbidden), \
                    f"{name} imports {imported}"


def test_nothing_imports_storage_by_its_source_folder_name():
    """``storage/`` is installed as ``loomray.storage``; importing it as ``storage`` too (from the project
    root on ``sys.path``) would make a second copy of every class, and a user's own ``storage`` would win."""
    files = [*_sources(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "examples").rglob("*.py"),
             *(ROOT / "bench").rglob("*.py"), *(ROOT / "cluster").rglob("*.py")]
    hits = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            hits += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "storage" or n.startswith("storage.")]
    assert not hits, "imports of the old top-level name: " + ", ".join(hits)


_OUTSIDE = re.compile(r"\.\./shared|\bAPI\.md\b|\bDESIGN\.md\b|\bSTYLE\.md\b|\bseeds?/|\bseed \d{3}\b")


def test_nothing_points_outside_the_repository():
    files = [*_sources(), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md", *(ROOT / "cluster").rglob("*.md"),
             *(ROOT / "examples").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if _OUTSIDE.search(line)]
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


#: Ray internals still imported, each with its reason in docs/choices.md ("No ray._private ... import").
RAY_INTERNALS_ALLOWED = {("loomray/cli/demo_steps.py", "ray._private.worker")}


def test_no_private_ray_imports():
    files = [*_sources(), *(ROOT / "examples").rglob("*.py"), *(ROOT / "bench").rglob("*.py"),
             *(ROOT / "cluster").rglob("*.py")]
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found |= {(str(path.relative_to(ROOT)), n) for n in names if re.match(r"ray\._(private|common)\b", n)}
    assert found == RAY_INTERNALS_ALLOWED


def test_relative_doc_links_resolve():
    broken = []
    for doc in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "cluster").rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, "links to missing files: " + ", ".join(broken)
