"""Stage `fuse`'s `fitting`: a pattern variant whose distinctive graph ops the graph lacks is not
traced, one variant of each op kept for its near miss; a distinctive op that an earlier fusion
makes (a k3 op) never counts as lacking. spell10's bf16 graph has no recognised short conv, so
`fits` passed all 1024 kda_decode variants and the compile traced each (130-270 s)."""

from __future__ import annotations

import types

import torch
from torch import fx

from k3compile.stages.fuse import fitting


def _pattern(name, op, distinctive):
    return types.SimpleNamespace(name=name, op=op, distinctive=distinctive, fits=None)


def _graph():
    return fx.symbolic_trace(lambda x: torch.sigmoid(torch.relu(x)).sum()).graph


def test_variants_lacking_a_distinctive_op_are_not_traced_but_one():
    family = [_pattern(f"conv{i}", "k3.conv_op", ("convolution", "relu")) for i in range(5)]
    fit, unfit = fitting(_graph(), family)
    assert [p.name for p in fit] == ["conv0"]
    assert unfit == []  # the op still fits (one variant): its near miss names a node


def test_variants_holding_their_distinctive_ops_all_fit():
    family = [_pattern(f"act{i}", "k3.act_op", ("relu", "sigmoid")) for i in range(3)]
    assert [p.name for p in fitting(_graph(), family)[0]] == ["act0", "act1", "act2"]


def test_an_op_an_earlier_fusion_makes_is_not_lacking():
    first = _pattern("first", "k3.first_op", ("relu",))
    later = [_pattern(f"later{i}", "k3.later_op", ("first_op", "sigmoid")) for i in range(3)]
    fit, _ = fitting(_graph(), [first, *later])
    assert [p.name for p in fit] == ["first", "later0", "later1", "later2"]
