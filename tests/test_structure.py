"""The package's structure: folders that show the architecture, no import circles, physics and learning that know
nothing of the application's config, classes short enough to read, one parameter order, and parts wired once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch
from tiny import tiny_config, tiny_machine

from trainer2.learning.params import ParamTable

PACKAGE = Path(__file__).resolve().parent.parent / "trainer2"
# Each folder may import from the folders before it in this order, never after: the data readers and the physics know
# nothing of the application's config (each component declares its own section, which the config assembles), the
# physics nothing of learning, learning nothing of running a job; the library's names and the command line sit on top.
LAYERS = (
    "base",
    "io",
    "data",
    "couplings",
    "physics",
    "kernels",
    "learning",
    "config",
    "monitor",
    "running",
    "api",
    "cli",
)
TOP = {
    "section": "base",
    "components": "base",
    "callbacks": "base",
    "train_config": "config",
    "presets": "config",
    "flags": "config",
    "__init__": "api",
    "cli": "cli",
    "__main__": "cli",
}
MAX_CLASS_LINES = 250


def module_name(path: Path) -> str:
    """trainer2/physics/energy.py -> physics.energy; trainer2/physics/couplings/__init__.py -> physics.couplings."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> trainer2 modules it imports anywhere in the file (function-level imports included)."""
    pattern = re.compile(
        r"^\s*(?:from trainer2\.([\w.]+) import ([\w, ]+)|from trainer2 import ([\w, ]+)|import trainer2\.([\w.]+))",
        re.M,
    )
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        found = set()
        for m in pattern.finditer(path.read_text()):
            base = m.group(1) or m.group(4)
            names = [n.strip().split(" as ")[0] for n in (m.group(2) or m.group(3) or "").split(",") if n.strip()]
            if base is None:
                found |= {n for n in names if n in modules}
            else:
                found.add(base)
                found |= {
                    f"{base}.{n}" for n in names if f"{base}.{n}" in modules
                }  # from trainer2.running import checkpoint
        graph[module_name(path)] = found - {module_name(path)}
    return graph


def layer_of(module: str) -> str:
    if module.startswith("physics.couplings"):
        return "couplings"
    return TOP.get(module, module.split(".")[0])


def test_the_modules_live_in_folders_that_show_the_architecture():
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == set(TOP), loose
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert set(folders) <= {"io", "data", "physics", "learning", "monitor", "running", "configs"}, folders


def test_no_import_circles_and_no_import_against_the_layering():
    graph = import_graph()
    assert "running.checkpoint" in graph["running.trainer"] and "running.bench" in graph["cli"]  # real imports seen
    assert "physics.machine" in graph["train_config"] and "running.run" in graph["__init__"]
    for module, deps in graph.items():
        for dep in deps:
            assert LAYERS.index(layer_of(dep)) <= LAYERS.index(layer_of(module)), f"{module} imports {dep}"
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(node) :] + [node]))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


def test_the_parameter_table_follows_the_one_written_order():
    cfg = tiny_config(hidden_sizes=[6, 5])
    m = tiny_machine(cfg)
    table = ParamTable.build(m, cfg.eta_scales, cfg.weight_decay)
    assert table.names == ("emb", "W_1", "b_1", "W_2", "b_2", "W_out", "b_out", "g_diag", "theta", "protos", "r_sc")
    assert all(t is m.named_params()[n] for n, t in zip(table.names, table.tensors))  # live tensors, not copies
    assert (
        table.groups[:1] == ("embed",) and set(table.groups[1:7]) == {"energy"} and set(table.groups[7:]) == {"readout"}
    )
    grads = {n: torch.zeros_like(t) for n, t in zip(table.names, table.tensors)}
    assert [g.shape for g in table.ordered(grads)] == [t.shape for t in table.tensors]
    del grads["theta"]
    try:
        table.ordered(grads)
    except KeyError as e:
        assert "theta" in str(e)
    else:
        raise AssertionError("a missing gradient must be refused")


def test_physics_and_learning_know_nothing_of_the_applications_config():
    """Each component is handed its own section (trainer2/section.py); only the layers above assemble TrainConfig."""
    for folder in ("physics", "learning", "data", "io"):
        for path in (PACKAGE / folder).rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"TrainConfig|trainer2\.train_config|trainer2\.presets", text), path


def test_no_class_is_longer_than_a_reader_can_hold():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= MAX_CLASS_LINES, f"{path.relative_to(PACKAGE)}: class {node.name} has {lines} lines"


def test_benchmarks_import_trainer2_as_an_installed_package():
    for path in (PACKAGE.parent / "benchmarks").glob("*.py"):
        assert "sys.path" not in path.read_text(), f"{path.name} edits sys.path"
