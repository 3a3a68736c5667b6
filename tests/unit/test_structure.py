"""Package structure: production code does not depend on the test helpers, and megarl's modules
import each other without a cycle at import time (a cycle makes import order decide what works)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megarl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, module: str, is_package: bool, top_level_only: bool) -> set[str]:
    """megarl modules named by the import statements (``from a import b``: ``a.b`` when that is a module)."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in out if name == "megarl" or name.startswith("megarl.")}


def _sources() -> dict[str, tuple[ast.AST, bool]]:
    return {_module_name(p): (ast.parse(p.read_text(), str(p)), p.name == "__init__.py")
            for p in PACKAGE.rglob("*.py")}


def test_production_code_does_not_import_the_test_helpers():
    offenders = {module: sorted(i for i in _imports(tree, module, pkg, False) if i.startswith("megarl.testing"))
                 for module, (tree, pkg) in _sources().items() if not module.startswith("megarl.testing")}
    assert {m: i for m, i in offenders.items() if i} == {}


def test_no_import_cycle_at_import_time():
    sources = _sources()
    # A package importing its own submodules (the registry pattern: the package defines the registry,
    # then imports the modules that register into it) is not a cycle: the names they import exist by then.
    graph = {m: {i for i in _imports(tree, m, pkg, True) if i in sources and i != m and not i.startswith(m + ".")}
             for m, (tree, pkg) in sources.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert cycles == []
