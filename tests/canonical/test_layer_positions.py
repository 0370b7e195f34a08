"""layer_positions: the verify rows' positions computed once and read by several layers
(spell14's gpt-fast `input_pos`) get one copy per layer, as `k3compile/math.py` computes them in
each layer (the mla_decode pattern absorbs them); bit-equal. Positions read by one layer, other
index arithmetic and float adds stay. End to end: spell14 with its mask as `arange <= input_pos`
(probe `mask`) gets mla_decode back in both MLA layers (tests/e2e/test_spell14_spelling.py)."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import layer_positions
from tests.canonical.rewrite_checks import ops
from tests.canonical.rule_checks import assert_same, trace

B, T = 3, 2

# which layer (module path) reads a value: the readers are the only ops of these kinds
READERS = {"mul": "model.layers.2.attention", "sub": "model.layers.3.attention",
           "remainder": "model.layers.3.attention", "neg": "model"}


def _in_layers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for n in gm.graph.nodes:
        name = getattr(n.target, "_opname", "")
        if name in READERS:
            n.meta["nn_module_stack"] = {"m": (f"L['self'].{READERS[name]}", torch.nn.Module)}
    return gm


def _readers(p):
    return p * 5, p - 1, p % 4, -p  # layer 2, layer 3 (twice), outside every layer


SPELLINGS = {
    # gpt-fast / spell14: input_pos = positions[:, None] + arange(T), once for every layer
    "unsqueeze_arange": lambda pos: _readers(pos.unsqueeze(1) + torch.arange(T)),
    # the built-in model's index, written once: view(B, 1) + arange, the operands swapped
    "view_swapped": lambda pos: _readers(torch.arange(T) + pos.view(B, 1)),
}


def _args():
    return (torch.tensor([0, 7, 3]),)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_positions_read_by_two_layers_get_a_copy_per_layer(name):
    args = _args()
    gm = _in_layers(trace(SPELLINGS[name], args))
    n = layer_positions.RULE.apply(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert n == 1
    adds = [a for a in gm.graph.nodes if a.target is torch.ops.aten.add.Tensor]
    assert len(adds) == 2
    readers = {u.target._opname: a for a in adds for u in a.users}
    # layer 3's two readers share its copy; layer 2 and the outside read the original
    assert readers["sub"] is readers["remainder"] is not readers["mul"]
    assert readers["mul"] is readers["neg"]
    assert_same(gm(*args), SPELLINGS[name](*args))


LOOKALIKES = {
    # one layer reads the positions (the pattern's own intermediate): nothing to copy
    "one_layer": lambda pos: (pos.unsqueeze(1) + torch.arange(T)) * 5,
    # another index: the positions plus a second input, not a range
    "plus_input": lambda pos: _readers(pos.unsqueeze(1) + pos.flip(0).unsqueeze(1)),
    # float arithmetic is no index
    "float": lambda pos: _readers(pos.float().unsqueeze(1) + torch.arange(T)),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_other_index_arithmetic_stays(name):
    args = _args()
    gm = _in_layers(trace(LOOKALIKES[name], args))
    before = ops(gm)
    n = layer_positions.RULE.apply(gm.graph)
    gm.recompile()
    assert n == 0 and ops(gm) == before
    assert_same(gm(*args), LOOKALIKES[name](*args))
