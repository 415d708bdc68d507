"""The house's layering, read from the source with ``ast`` (nothing is imported or run):

- the runtime (common/, edge_client/, cloud_verifier/) is imported only as ``specdec_runtime.*``: a bare ``common``
  is whatever package of that name comes first on an app's path;
- ``common`` imports neither side; the edge and the cloud never import each other; the runtime never imports the
  tooling package ``specdec``;
- no import circles among the modules of the runtime and ``specdec`` (function-level imports included);
- no private name (``_x``) imported from another module.

Each rule is also run on a small tree that breaks it, so a checker that stopped seeing violations fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "specdec_runtime"
RUNTIME = ("common", "edge_client", "cloud_verifier")
FORBIDDEN = {("common", "edge_client"), ("common", "cloud_verifier"), ("edge_client", "cloud_verifier"),
             ("cloud_verifier", "edge_client"), *((side, "specdec") for side in RUNTIME)}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([NAMESPACE, *parts] if parts[0] in RUNTIME else parts)


def _side(module: str) -> str:
    return module.removeprefix(NAMESPACE + ".").split(".", 1)[0]


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the modules of the tree it imports, the violations found on the way: bare runtime names and
    private names imported from another module)."""
    paths = {_module_name(root, p): p for top in (*RUNTIME, "specdec") if (root / top).is_dir()
             for p in (root / top).rglob("*.py")}
    graph, problems = {}, []
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0] if node.level > 1
                                                  else package, node.module]))
                names = [(base, alias.name) for alias in node.names]
            else:
                continue
            for source, name in names:
                if source.split(".", 1)[0] in RUNTIME:
                    problems.append(f"{module}: bare import of {source} (use {NAMESPACE}.{source})")
                full = f"{source}.{name}" if name else source
                target = full if full in paths else source
                if name and target == source and name.startswith("_") and not name.startswith("__") \
                        and source in paths:
                    problems.append(f"{module}: imports the private name {name} of {source}")
                if target in paths and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph, problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while (member := stack.pop()) != node:
                    on_stack.discard(member), component.append(member)
                on_stack.discard(node)
                if component:
                    found.append(sorted([node, *component]))
    return found


def violations(root: Path) -> list[str]:
    graph, problems = import_graph(root)
    problems += [f"{a} imports {b}" for a, targets in graph.items() for b in targets
                 if (_side(a), _side(b)) in FORBIDDEN]
    problems += [f"circle: {' -> '.join(c)}" for c in circles(graph)]
    return problems


def test_the_tree_keeps_its_layers():
    graph, _ = import_graph(ROOT)
    assert len(graph) > 150 and any(_side(m) == "edge_client" for m in graph)  # the tree was read
    assert violations(ROOT) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"common/__init__.py": "", "edge_client/__init__.py": "", "cloud_verifier/__init__.py": "",
                       "specdec/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, expected", [
    ({"edge_client/a.py": "from specdec_runtime.cloud_verifier import b\n", "cloud_verifier/b.py": ""},
     "specdec_runtime.edge_client.a imports specdec_runtime.cloud_verifier.b"),
    ({"common/a.py": "def f():\n    import specdec_runtime.edge_client.b\n", "edge_client/b.py": ""},
     "specdec_runtime.common.a imports specdec_runtime.edge_client.b"),
    ({"cloud_verifier/a.py": "from specdec.cli import x\n", "specdec/cli.py": ""},
     "specdec_runtime.cloud_verifier.a imports specdec.cli"),
    ({"edge_client/a.py": "from common.types import X\n"}, "bare import of common.types"),
    ({"edge_client/a.py": "from .b import _hidden\n", "edge_client/b.py": "_hidden = 1\n"},
     "imports the private name _hidden"),
    ({"specdec/a.py": "from specdec import b\n", "specdec/b.py": "def f():\n    from specdec.a import g\n"},
     "circle: specdec.a -> specdec.b"),
])
def test_each_rule_bites(tmp_path, files, expected):
    found = violations(_tree(tmp_path, files))
    assert any(expected in v for v in found), found
    assert violations(_tree(tmp_path / "clean", {"edge_client/a.py": "from .b import c\n",
                                                  "edge_client/b.py": "c = 1\n"})) == []
