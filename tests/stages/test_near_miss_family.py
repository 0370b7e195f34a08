"""`near_miss.probe` traces only the patterns of a fusion's family whose distinctive ops the layer
holds (one if none does): spell10's bf16 KDA, whose short conv no rule recognises, made every one
of kda_decode's 1024 variants fit, and the probe traced them all (30-90 s of a compile)."""

from __future__ import annotations

import torch
from torch import fx

from k3compile.rewrite import near_miss


class FakePattern:
    """What `probe` reads of a pattern; counts how often its search graph is traced."""

    def __init__(self, name: str, distinctive: tuple[str, ...]):
        self.name, self.distinctive, self.anchors, self.traced = name, distinctive, set(), 0

    @property
    def expr(self):
        self.traced += 1
        self._search_gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)


def _layer() -> tuple[fx.Node, list[fx.Node]]:
    gm = fx.symbolic_trace(lambda x: torch.sigmoid(torch.relu(x)).sum())
    nodes = list(gm.graph.nodes)
    return next(n for n in nodes if n.target is torch.relu), nodes


def _probe(family):
    evidence, nodes = _layer()
    return near_miss.probe(evidence, nodes, family, lambda name: True, 2, "the relu")


def test_a_family_whose_distinctive_ops_are_absent_traces_one_pattern():
    family = [FakePattern(f"p{i}", ("convolution", "relu")) for i in range(6)]
    miss = _probe(family)
    assert [p.traced for p in family] == [1, 0, 0, 0, 0, 0]
    assert miss.pattern == "p0" and "relu" in miss.reason  # still names the evidence node


def test_patterns_whose_distinctive_ops_are_present_are_all_traced():
    family = [FakePattern(f"p{i}", ("relu", "sigmoid")) for i in range(3)]
    family.append(FakePattern("absent", ("convolution",)))
    _probe(family)
    assert [p.traced for p in family] == [1, 1, 1, 0]
