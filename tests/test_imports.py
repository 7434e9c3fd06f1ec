"""The import rules of docs/design.md, checked on the source: no import cycle among scaffold's modules
(imports inside functions included), `config.py` imports nothing of scaffold, and every import runs from a
higher layer down to a lower one (or within a layer)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "scaffold"

# Lowest first; a module belongs to the layer of its longest matching prefix (docs/design.md, "Layers").
LAYERS = (
    ("base", ("scaffold", "scaffold.config", "scaffold.files", "scaffold.determinism", "scaffold.rundir")),
    ("kernels", ("scaffold.kernels",)),
    ("model and data", ("scaffold.model", "scaffold.data", "scaffold.distributed", "scaffold.loss")),
    ("step", ("scaffold.spatial", "scaffold.fsdp", "scaffold.metrics", "scaffold.step", "scaffold.checkpoint",
              "scaffold.stats", "scaffold.tracking")),
    ("plan", ("scaffold.plan",)),
    ("trainer", ("scaffold.trainer",)),
    ("job", ("scaffold.worker", "scaffold.report", "scaffold.help", "scaffold.cli")),
    ("entry points", ("scaffold.train", "scaffold.data.__main__", "scaffold.bench", "scaffold.predict")),
)


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the scaffold modules it imports anywhere in its source."""
    def target(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                t = target(name)
                if t is not None and t.startswith("scaffold") and t not in (mod, "scaffold"):
                    found.add(t)
        graph[mod] = found
    return graph


def layer(mod: str) -> int:
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if mod == p or mod.startswith(p + ".")), default=None)
    assert best is not None, f"{mod} is in no layer: add it to LAYERS and to docs/design.md"
    return best[1]


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_cycle():
    assert cycle(imports(modules())) is None


def test_the_schema_imports_nothing_of_scaffold():
    assert imports(modules())["scaffold.config"] == set()


def test_imports_run_down_the_layers():
    graph = imports(modules())
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a))
    assert upward == []


def test_the_checks_find_what_they_look_for():
    """The checks themselves: a planted cycle and an upward import are found."""
    graph = {"scaffold.config": {"scaffold.plan"}, "scaffold.plan": {"scaffold.config"}}
    assert cycle(graph) == ["scaffold.config", "scaffold.plan", "scaffold.config"]
    assert layer("scaffold.plan") > layer("scaffold.config") and layer("scaffold.kernels.conv.box") == 1
