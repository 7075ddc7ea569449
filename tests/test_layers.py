"""The package's imports follow its layer order and form no cycle (docs/architecture.md).

Every import counts, those inside functions too: a function-level import hides a cycle from the
interpreter, not from this test.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "deltafin"

# Lowest first: a module may import from its own layer and the layers below it, never above.
LAYERS = [
    ["errors", "units"],
    ["files"],
    ["settings", "config", "tokenizer"],
    ["kernels"],
    ["model"],
    ["checkpoint"],
    ["io"],
    ["runtime", "dist"],  # dist: a model split across ranks, under the api that builds it
    ["api", "startup", ""],  # "": the package itself (deltafin/__init__.py exports api)
    ["serve", "chat", "bench", "gpu_figures", "inspect", "profile", "routing_stats", "sensitivity"],
    ["cli", "__main__"],
]
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["deltafin", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The package's modules that `name` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in modules:
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found.update(subs)
            if len(subs) < len(node.names):  # names defined by the module itself
                found.add(target)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    assert top in LAYER_OF, f"{module}: not in the layer order; add its package to LAYERS"
    return LAYER_OF[top]


def test_every_module_has_a_layer():
    for module in _graph():
        _layer(module)


def test_no_import_reaches_up():
    upward = sorted(f"{a} -> {b}" for a, targets in _graph().items() for b in targets if _layer(b) > _layer(a))
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = _graph()
    done: set[str] = set()
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append(" -> ".join(path[path.index(node):] + [node]))
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, path + [node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_check_sees_what_it_must(tmp_path, monkeypatch):
    """The two rules fail where they should: a planted upward import and a planted cycle."""
    pkg = tmp_path / "deltafin"
    for rel, text in {"__init__.py": "", "errors.py": "from .cli import main\n",
                      "cli.py": "def f():\n    from . import errors\n",
                      "kernels/__init__.py": "", "kernels/a.py": "from ..model import b\n",
                      "model/__init__.py": "", "model/b.py": "x = 1\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    with_errors = []
    for check in (test_no_import_reaches_up, test_no_import_cycles):
        try:
            check()
        except AssertionError as e:
            with_errors.append(str(e))
    assert len(with_errors) == 2
    assert "deltafin.kernels.a -> deltafin.model.b" in with_errors[0]
    assert "deltafin.errors -> deltafin.cli" in with_errors[0]
    assert "deltafin.cli -> deltafin.errors -> deltafin.cli" in with_errors[1]
