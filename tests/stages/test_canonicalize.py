"""Stage `canonicalize` under verify (K3_VERIFY=1): a canonical rule that changes what the graph
computes (values, dtype, a written state buffer) is undone and reported; one that does not is
kept. The rules here are test doubles swapped in for `k3compile.canonical.all_rules`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import k3compile.backend as k3be
from k3compile.canonical import Rule
from k3compile.stages import canonicalize as stage

aten = torch.ops.aten


class Step(nn.Module):
    """A projection, a sigmoid product, and a state written in place."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("state", torch.zeros(4, 8))

    def forward(self, x, slots):
        y = torch.sigmoid(x @ self.w.t()) * 3.0
        self.state[slots] = y
        return y


def _retarget(old, new):
    def apply(graph):
        n = 0
        for node in graph.nodes:
            if node.target is old:
                node.target, n = new, n + 1
        return n
    return apply


def _to_double(graph):  # changes the dtype of the step's output
    node = next(n for n in graph.nodes if n.target is aten.mul.Tensor)
    with graph.inserting_after(node):
        up = graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float64})
    node.replace_all_uses_with(up, delete_user_cb=lambda u: u.op == "output")
    return 1


def _drop_state_write(graph):  # the written state no longer changes
    node = next(n for n in graph.nodes if n.target is aten.index_put.default)
    node.replace_all_uses_with(node.args[0])
    return 1


def _raise_midway(graph):  # a buggy rule: edits the graph, then raises
    _retarget(aten.mul.Tensor, aten.add.Tensor)(graph)
    raise RuntimeError("a bug in a rule")


def _raise_after_add_as_sub(graph):
    _retarget(aten.add.Tensor, aten.sub.Tensor)(graph)
    raise RuntimeError("a bug in a rule")


RULES = {
    "raises": Rule("raises", _raise_midway, "edits, then raises"),
    "raises_late": Rule("raises_late", _raise_after_add_as_sub, "edits add, then raises"),
    "idle": Rule("idle", lambda graph: 0, "finds nothing"),
    "noop": Rule("noop", lambda graph: 1, "claims a rewrite, changes nothing"),
    "mul_as_add": Rule("mul_as_add", _retarget(aten.mul.Tensor, aten.add.Tensor), "wrong"),
    "to_double": Rule("to_double", _to_double, "wrong dtype"),
    "drop_state_write": Rule("drop_state_write", _drop_state_write, "loses a state write"),
}


def _compile(monkeypatch, names, verify=True):
    torch._dynamo.reset()
    monkeypatch.setattr(stage, "all_rules", lambda: tuple(RULES[n] for n in names))
    torch.manual_seed(0)
    model, eager = Step(), Step()
    eager.load_state_dict(model.state_dict())
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "verify": verify})
    x, slots = torch.randn(2, 8), torch.tensor([3, 1])
    torch.testing.assert_close(step(x, slots), eager(x, slots))  # the bad rules were undone
    torch.testing.assert_close(model.state, eager.state)
    compiled = k3be.last_compiled()
    (report,) = compiled.observer.reports.values()
    (notes,) = compiled.observer.notes.values()
    return report, notes["canonicalize"]


@pytest.mark.parametrize("bad,why", [("mul_as_add", "relative error"), ("to_double", "float64"),
                                     ("drop_state_write", "relative error")])
def test_a_rule_that_changes_the_graph_is_undone(monkeypatch, bad, why):
    report, counts = _compile(monkeypatch, ["noop", bad])
    assert [r.pattern for r in report.reverted] == [f"canonical.{bad}"]
    assert why in report.reverted[0].error, report.reverted[0].error
    assert counts == {"noop": 1, bad: 0}


@pytest.mark.parametrize("verify", [True, False])
def test_a_rule_that_raises_is_undone_and_the_compile_goes_on(monkeypatch, verify):
    report, counts = _compile(monkeypatch, ["raises", "noop"], verify=verify)
    assert [r.pattern for r in report.reverted] == ["canonical.raises"]
    assert "a bug in a rule" in report.reverted[0].error
    assert counts == {"raises": 0, "noop": 1}


def test_without_verify_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(stage, "all_rules", lambda: (RULES["mul_as_add"],))
    torch._dynamo.reset()
    step = torch.compile(Step(), backend="k3", fullgraph=True, options={"executor": "aten"})
    x = torch.randn(2, 8)
    want = torch.sigmoid(x @ step._orig_mod.w.t()) + 3.0  # the wrong rule stands
    torch.testing.assert_close(step(x, torch.tensor([0, 1])), want)
    (report,) = k3be.last_compiled().observer.reports.values()
    assert not report.reverted


def test_without_verify_one_undo_copy_per_pass(monkeypatch):
    """Without verify the graph is copied once, before the first rule; a rule that raises undoes
    the pass, which runs again without it (a graph copy costs O(nodes): tens of thousands of
    placeholders with per-expert parameters)."""
    copies = []
    copy = stage._copy
    monkeypatch.setattr(stage, "_copy", lambda graph: copies.append(1) or copy(graph))
    report, counts = _compile(monkeypatch, ["idle", "idle", "noop", "idle", "raises", "idle"],
                              verify=False)
    assert len(copies) == 2  # before the first rule; again in the pass without `raises`
    assert [r.pattern for r in report.reverted] == ["canonical.raises"]
    assert counts == {"idle": 0, "noop": 1, "raises": 0}


def test_an_undo_after_a_kept_rewrite_keeps_it(monkeypatch):
    """mul_as_add (not verified) stands; the rule raising after an idle one is undone to the
    graph with mul_as_add's rewrite, not to an older copy."""
    monkeypatch.setattr(stage, "all_rules",
                        lambda: tuple(RULES[n] for n in ("idle", "mul_as_add", "idle",
                                                         "raises_late")))
    torch._dynamo.reset()
    step = torch.compile(Step(), backend="k3", fullgraph=True, options={"executor": "aten"})
    x = torch.randn(2, 8)
    want = torch.sigmoid(x @ step._orig_mod.w.t()) + 3.0
    torch.testing.assert_close(step(x, torch.tensor([0, 1])), want)
    (report,) = k3be.last_compiled().observer.reports.values()
    assert [r.pattern for r in report.reverted] == ["canonical.raises_late"]
