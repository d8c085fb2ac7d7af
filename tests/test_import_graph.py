"""Imports go down: errors < model < data < hf < train < eval and generate (peers) < bench, and no
module imports itself back through others (read with `ast`, deferred imports included). hf sits
below train: reading a run is train's job, and train starts from Hugging Face directories."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEVEL = {"errors": 0, "model": 1, "data": 2, "hf": 3, "train": 4, "eval": 5, "generate": 5, "bench": 6}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages."""
    found = {}
    for path in REPO.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[0] in LEVEL:
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (for `from pkg import name`, the submodule if `name` is one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_no_package_imports_one_above_it_or_a_peer():
    wrong = []
    for module, imported in _graph().items():
        package = module.split(".")[0]
        for other in imported:
            other_package = other.split(".")[0]
            if other_package != package and LEVEL[other_package] >= LEVEL[package]:
                wrong.append(f"{module} imports {other}")
    assert not wrong, wrong


def test_no_import_cycle_between_modules():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph.get(module, ())):
            if state.get(other) == 1:
                cycles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_the_graph_reader_sees_deferred_and_from_imports():
    graph = _graph()
    assert "train.checkpoint" in graph["train.elastic"]  # `from train.checkpoint import ...`
    assert "model" in graph["train.trainer"] or "model.gpt" in graph["train.trainer"]
