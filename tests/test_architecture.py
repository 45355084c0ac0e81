"""The layering docs/design.md describes, checked: who may import whom, no import cycles, torch-free layers.

The import graph is read from the source (every `import`, at module level or inside a function), so a lazy
import that closes a cycle or crosses a layer is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import REPO

ROOT = REPO / "moeflow"

# Layer of each package or module (longest prefix wins) and the layers it may import. Lower layers never import
# higher ones; docs/design.md, "Layers".
LAYERS = {
    "moeflow.core": "core",
    "moeflow.plan": "plan", "moeflow.sim": "plan",
    "moeflow.data": "data",
    "moeflow.models": "models",
    "moeflow.ep": "ep",
    "moeflow.parallel": "parallel",
    "moeflow.config": "app", "moeflow.train": "app", "moeflow.convert": "app", "moeflow.cli": "app",
    "moeflow.__main__": "app", "moeflow": "app",
}
MAY_IMPORT = {
    "core": {"core"},
    "plan": {"core", "plan"},
    "data": {"core", "data"},
    "models": {"core", "models"},
    "ep": {"core", "ep"},
    "parallel": {"core", "models", "ep", "parallel"},
    "app": {"core", "plan", "data", "models", "ep", "parallel", "app"},
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise AssertionError(f"{module} has no layer in tests/test_architecture.py LAYERS")


def module_files() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: moeflow modules it imports anywhere in its source}."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:  # `from pkg import module` imports the module
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_moeflow_modules():
    assert cycles(import_graph()) == []


def test_every_import_points_down_the_layers():
    bad = [f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})"
           for src, targets in import_graph().items() for dst in sorted(targets)
           if layer_of(dst) not in MAY_IMPORT[layer_of(src)]]
    assert bad == []


@pytest.mark.parametrize("packages, forbidden, torch_free", [
    (["moeflow.models"], ("moeflow.parallel", "moeflow.train", "moeflow.ep"), False),
    (["moeflow.core"], ("moeflow.plan", "moeflow.sim", "moeflow.data", "moeflow.models", "moeflow.ep",
                        "moeflow.parallel", "moeflow.train"), True),
    (["moeflow.plan", "moeflow.sim"],
     ("moeflow.parallel", "moeflow.train", "moeflow.ep", "moeflow.models.transformer"), True),
    (["moeflow.data"], ("moeflow.plan", "moeflow.models", "moeflow.ep", "moeflow.parallel", "moeflow.train"), False),
])
def test_importing_a_lower_layer_loads_nothing_above_it(packages, forbidden, torch_free):
    """In a fresh interpreter: import every module of the packages, then look at sys.modules."""
    names = [m for m in module_files() if any(m == p or m.startswith(p + ".") for p in packages)]
    # hf_live imports transformers lazily (only when swapping live blocks); importing the module is enough.
    code = ("import sys, importlib\n"
            f"for m in {names!r}: importlib.import_module(m)\n"
            f"bad = sorted(m for m in sys.modules if m.startswith({forbidden!r}))\n"
            "print(repr((bad, 'torch' in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, has_torch = eval(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing {packages} loaded {loaded}"
    if torch_free:
        assert not has_torch, f"importing {packages} loaded torch"
