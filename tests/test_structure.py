"""The package's structure: folders that show the architecture, no import circles, one parameter order, and parts
wired once."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from tiny import tiny_config, tiny_machine

from trainer2.learning.params import ParamTable

PACKAGE = Path(__file__).resolve().parent.parent / "trainer2"
# Each folder may import from the folders before it in this order, never after: the couplings know nothing of the
# config (which validates `layers` against their registry), the physics nothing of learning, learning nothing of
# running a job, and the command line sits on top.
LAYERS = ("couplings", "config", "physics", "kernels", "io", "learning", "running", "cli")
TOP = {"config": "config", "flags": "config", "cli": "cli", "__main__": "cli", "__init__": "config"}


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
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py", "config.py", "flags.py"], loose
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert set(folders) <= {"physics", "kernels", "io", "learning", "running", "configs"}, folders


def test_no_import_circles_and_no_import_against_the_layering():
    graph = import_graph()
    assert "running.checkpoint" in graph["running.trainer"] and "running.bench" in graph["cli"]  # real imports seen
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
    table = ParamTable.build(m, cfg)
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
