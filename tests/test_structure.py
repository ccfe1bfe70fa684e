"""The package's layering, read from the import statements of every module (``ast``, so
imports inside functions count too): each stage imports only the stages before it.

formats -> compiler -> codegen -> runtime -> ops -> nn -> models / train; ``ops/`` itself
is a DAG (its order is in ``ops/README.md``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "sparsetorch"


def _modules(root: Path = PACKAGE) -> dict:
    """Dotted name -> (path, is a package's ``__init__``) of every module under ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph(root: Path = PACKAGE) -> dict:
    """Module -> the sparsetorch modules it imports, at module level or in a function. A
    name imported from a package counts as its submodule when one has that name."""
    modules = _modules(root)
    graph = {}
    for name, (path, is_package) in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in modules else source)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t == "sparsetorch" or t.startswith("sparsetorch.")}
    return graph


def _stage(module: str) -> str:
    """The subpackage a module belongs to ('' for the package's own ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _violations(graph, stage: str, allowed) -> list:
    return sorted(f"{m} imports {t}" for m, targets in graph.items() if _stage(m) == stage
                  for t in targets if _stage(t) != stage and _stage(t) not in allowed)


def _cycle(graph, members) -> list | None:
    """One import cycle among ``members`` (a list of modules, closed), or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m] & members):
            if state.get(t) == "open":
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t, path + [t])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(members):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_graph_sees_function_local_imports(tmp_path):
    pkg = tmp_path / "sparsetorch"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "a.py").write_text("from .b import f\n")
    (pkg / "ops" / "b.py").write_text("def f():\n    from . import a\n    from .. import ops\n")
    g = import_graph(pkg)
    assert g["sparsetorch.ops.a"] == {"sparsetorch.ops.b"}
    assert g["sparsetorch.ops.b"] == {"sparsetorch.ops.a", "sparsetorch.ops"}
    assert _cycle(g, {"sparsetorch.ops.a", "sparsetorch.ops.b"}) is not None


@pytest.mark.parametrize("stage, allowed", [("compiler", {"formats"}),
                                            ("codegen", {"formats", "compiler"})])
def test_compiler_stages_import_only_earlier_ones(graph, stage, allowed):
    assert _violations(graph, stage, allowed) == []


def test_formats_import_no_compute_stage(graph):
    later = {"compiler", "codegen", "runtime", "ops"}
    assert [v for v in _violations(graph, "formats", set())
            if _stage(v.split(" imports ")[1]) in later] == []


# (_files: the atomic writer; _modes: caches' inference-mode and version helpers; no stage)
@pytest.mark.parametrize("stage, allowed", [("nn", {"ops", "formats", "", "_modes"}),
                                            ("models", {"ops", "formats", "", "nn"}),
                                            ("train", {"ops", "formats", "", "nn", "_files"})])
def test_layers_use_ops_and_formats_only(graph, stage, allowed):
    assert _violations(graph, stage, allowed) == []


def test_ops_modules_form_no_cycle(graph):
    ops = {m for m in graph if m.startswith("sparsetorch.ops.")}
    assert len(ops) > 10
    assert _cycle(graph, ops) is None
