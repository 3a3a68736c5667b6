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


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def _layers() -> dict[str, int]:
    """`docs/architecture.md`'s layer table: top-level package (or module) name -> layer number."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in cells[1].replace("`", "").split(","):
                layers[name.strip()] = int(cells[0])
    return layers


def _top(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _resolve(name: str, sources: dict) -> str | None:
    """The megarl module an imported name lives in (``a.b.C`` -> ``a.b``), None when none does."""
    while name and name not in sources:
        name = name.rpartition(".")[0]
    return name or None


def test_every_package_has_a_layer():
    layers = _layers()
    assert layers, "docs/architecture.md has no layer table"
    missing = sorted({_top(m) for m in _sources() if m != "megarl"} - set(layers))
    assert missing == [], f"packages missing from docs/architecture.md's layer table: {missing}"


def _package_table() -> list[str]:
    """`docs/architecture.md`'s package table: its first column, ``config/`` -> ``config``,
    ``cli.py`` -> ``cli``."""
    section = ARCHITECTURE.read_text().split("## Packages", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            names.append(cells[0].strip("`").removesuffix("/").removesuffix(".py"))
    return names


def test_package_table_lists_every_package_once():
    """Every package and top-level module of megarl/ has one row; no row names one that is gone."""
    rows = _package_table()
    assert rows, "docs/architecture.md has no package table"
    actual = {_top(m) for m in _sources() if m != "megarl"}
    repeated = sorted({r for r in rows if rows.count(r) > 1})
    problems = {"missing": sorted(actual - set(rows)), "gone": sorted(set(rows) - actual), "repeated": repeated}
    assert problems == {"missing": [], "gone": [], "repeated": []}, f"docs/architecture.md's package table: {problems}"


def test_every_import_runs_down_the_layers():
    """Function-local imports count: an import inside a function to dodge a circle is a circle."""
    layers, sources = _layers(), _sources()
    upward = []
    for module, (tree, pkg) in sorted(sources.items()):
        if module == "megarl":
            continue
        for name in sorted(_imports(tree, module, pkg, False)):
            target = _resolve(name, sources)
            if target is None or target == "megarl" or _top(target) == _top(module):
                continue
            if layers.get(_top(target), 99) >= layers.get(_top(module), -1):
                upward.append(f"{module} -> {target}")
    assert upward == [], "imports against docs/architecture.md's layers:\n" + "\n".join(sorted(set(upward)))


def test_no_import_circle_counting_imports_inside_functions():
    sources = _sources()
    graph = {}
    for module, (tree, pkg) in sources.items():
        targets = {_resolve(n, sources) for n in _imports(tree, module, pkg, False)}
        graph[module] = {t for t in targets if t and t != module and t != "megarl"}
    # Tarjan's strongly connected components: every component of more than one module is a circle.
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    assert circles == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_files_and_functions_within_the_style_guides_sizes():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == [], "over the style guide's sizes:\n" + "\n".join(too_long)


def test_test_files_have_unique_names():
    """pytest (rootdir import mode, no ``__init__.py`` under tests/) imports every test file as a
    top-level module named by its file name, so two test files of one name anywhere under tests/
    stop a run that collects both (``bash tools/test.sh -m slow``: "import file mismatch"), while
    CI's phases, which collect tests/unit and tests/integration apart, never show it."""
    seen: dict[str, list[str]] = {}
    for path in sorted((PACKAGE.parent / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert repeated == {}, f"test files sharing a name: {repeated}"


SAME_NAME_BY_NECESSITY = {"__init__.py", "sitecustomize.py"}  # Python finds these by their file name


def test_module_file_names_are_unique():
    """A file name says what the module holds, once: two ``engines.py`` in two packages make every
    traceback, log line and ``grep`` ambiguous."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in SAME_NAME_BY_NECESSITY:
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert repeated == {}, f"modules in megarl/ sharing a file name: {repeated}"


def _is_setter(node: ast.AST) -> bool:
    """``@name.setter`` / ``.deleter``: Python shows the getter's docstring for the property."""
    return any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter")
               for d in getattr(node, "decorator_list", []))


def test_every_public_name_has_a_docstring():
    """Module-level functions and classes without a leading underscore, and their public methods."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE.parent)
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            if not ast.get_docstring(node):
                missing.append(f"{name}:{node.lineno} {node.name}")
            for member in node.body if isinstance(node, ast.ClassDef) else []:
                if (isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and not member.name.startswith("_")
                        and not _is_setter(member) and not ast.get_docstring(member)):
                    missing.append(f"{name}:{member.lineno} {node.name}.{member.name}")
    assert missing == [], f"{len(missing)} public names without a docstring:\n" + "\n".join(missing)


def test_test_folders_are_named_after_packages():
    """A test lives under the package it tests: every folder of tests/unit and tests/integration
    is named after a package of megarl/."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    folders = {f"{kind}/{d.name}": d.name for kind in ("unit", "integration")
               for d in (PACKAGE.parent / "tests" / kind).iterdir() if d.is_dir() and d.name != "__pycache__"}
    assert sorted(f for f, name in folders.items() if name not in packages) == []
