"""The import graph of ``pfctl``: layers point down only and nothing imports in a cycle.

DESIGN.md fixes the order: cli → api → training / sampling / data / verify → models → flow / config /
runtime / utils. Modules of one layer may import each other (without cycles); a module may import any
layer below its own. The graph is read from the source (``ast``), so imports inside functions count too:
a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pfctl

ROOT = Path(pfctl.__file__).parent

#: the rank of each top-level part of pfctl; lower ranks are lower layers
LAYERS: dict[str, int] = {
    "__init__": 0,  # the package root holds only ``__version__``
    "errors": 0,
    "utils": 0,
    "config": 0,
    "runtime": 0,
    "flow": 0,
    "models": 1,
    "training": 2,
    "sampling": 2,
    "data": 2,
    "verify": 2,
    "api": 3,
    "demo": 4,  # the whole pipeline on the embedded model, through the api
    "cli": 5,
    "__main__": 5,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The pfctl modules ``path`` imports (``from pfctl.a import b`` names ``pfctl.a.b`` if that is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("pfctl") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, name, modules) for name, path in files.items()}


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    assert part in LAYERS, f"{module}: add its part {part!r} to LAYERS"
    return LAYERS[part]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a cycle to break."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` importing its own submodules is how packages work, not a cycle."""
    return {
        m: {t for t in targets if not (t.startswith(m + ".") and (ROOT.parent / m.replace(".", "/")).is_dir())}
        for m, targets in graph.items()
    }


def test_no_import_from_a_higher_layer() -> None:
    graph = import_graph()
    upward = sorted(
        f"{m} -> {t}" for m, targets in graph.items() for t in targets if _layer(t) > _layer(m)
    )
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    cycles = _cycles(_package_edges(import_graph()))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_modules_and_functions_stay_small() -> None:
    """The package, and the checkout's benchmarks, scripts and tests."""
    checkout = Path(__file__).resolve().parents[2]
    folders = [ROOT, *(checkout / name for name in ("benchmarks", "scripts", "tests"))]
    too_long = []
    for path in (p for folder in folders for p in folder.rglob("*.py")):
        text, name = path.read_text(), path.relative_to(ROOT.parent if path.is_relative_to(ROOT) else checkout)
        if text.count("\n") > 800:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "over the size limits (modules 800 lines, functions 80):\n" + "\n".join(too_long)


def _public_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """A module's public functions and the public methods of its public classes."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            found += [m for m in node.body if isinstance(m, ast.FunctionDef)]
        elif isinstance(node, ast.FunctionDef):
            found.append(node)
    return [f for f in found if not f.name.startswith("_")]


def test_public_functions_are_type_hinted() -> None:
    """Every parameter (but ``self`` / ``cls``) and the return of every public function and method."""
    missing = []
    for path in ROOT.rglob("*.py"):
        for fn in _public_functions(ast.parse(path.read_text())):
            params = [a for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
            unhinted = [a.arg for a in params if a.annotation is None] + ["return"] * (fn.returns is None)
            if unhinted:
                missing.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {', '.join(unhinted)}")
    assert not missing, "public functions without type hints:\n" + "\n".join(missing)
