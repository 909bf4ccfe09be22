"""The package's structure: no import circles, one parameter order, and parts wired once."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from tiny import tiny_config, tiny_machine

from trainer2.learning.params import ParamTable

PACKAGE = Path(__file__).resolve().parent.parent / "trainer2"


def import_graph() -> dict[str, set[str]]:
    """module -> trainer2 modules it imports anywhere in the file (function-level imports included)."""
    pattern = re.compile(r"^\s*(?:from trainer2\.(\w+) import|from trainer2 import (\w+)|import trainer2\.(\w+))", re.M)
    graph = {}
    for path in PACKAGE.glob("*.py"):
        found = {next(g for g in m.groups() if g) for m in pattern.finditer(path.read_text())}
        graph[path.stem] = found - {path.stem}
    return graph


def test_no_import_circles_inside_the_package():
    graph = import_graph()
    assert "checkpoint" in graph["trainer"] and "bench" in graph["cli"]  # the parser sees real imports
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
