"""No import cycle inside ``birder_hf``: module-level and function-level imports both count.

A cycle means neither module can be read (or loaded) without the other; function-level imports that close one only
hide it until the function runs. The graph is parsed from the source with ``ast`` (nothing is imported).
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "birder_hf"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Every ``birder_hf`` module -> the ``birder_hf`` modules it imports anywhere in its body."""
    files = {_module_name(p): p for p in (SRC / PACKAGE).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = here.split(".")
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                # "from . import x" / "from .pkg import mod": the names may be modules themselves
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:  # "birder_hf.collectives.X" -> "birder_hf.collectives"
                    t = t.rpartition(".")[0]
                if t and t != name and t != PACKAGE:  # the package's __init__ re-exports: not a dependency edge
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_parsed():
    graph = import_graph()
    assert "birder_hf.collectives" in graph and "birder_hf.quantize" in graph["birder_hf.collectives"]
    assert "birder_hf.integrations.transformers" in graph


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_src():
    found = cycles(import_graph())
    assert not found, "import cycles (function-level imports count): " + "; ".join(" <-> ".join(c) for c in found)


if __name__ == "__main__":
    for mod, deps in sorted(import_graph().items()):
        print(mod, "->", ", ".join(sorted(deps)))
    print("cycles:", cycles(import_graph()))
