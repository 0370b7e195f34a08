"""Rule `sigmoid_round`: the sigmoid of a bf16 / fp16 value computed on its fp32 upcast and
rounded back -> the sigmoid in that dtype.

gpt-fast's spelling of KDA (tests/models/spell14_k3.py) writes its output gate as
`torch.sigmoid(g.view(B, T, H, K).float()).to(x.dtype)`, where `k3compile/math.py` and the
`kda_decode` pattern take `torch.sigmoid(g.view(B, T, H, K))` on the bf16 value:

    convert(sigmoid(M(convert(x, fp32))), D)      (spell14; x of dtype D, M views)
    -> sigmoid(M(x))                               (canonical)

Exact: torch computes a bf16 / fp16 sigmoid in fp32 (its opmath type) and rounds once, on the
CPU (bit for bit over every bf16 and fp16 value, tests/canonical/test_sigmoid_round.py) and in
its CUDA kernel (`1 / (1 + exp(-opmath(x)))`); the same values, dtype and shape.

Taken: a downcast to D of an fp32 sigmoid whose input is, through views / reshapes, an fp32
upcast of a value of dtype D, every node of the chain read only by the next. Left alone: a
round to another dtype than x's (the upcast of an fp16 value rounded to bf16), a sigmoid read
in fp32 as well (its fp32 value is used), an fp32 sigmoid of an fp32 value, a chain through a
computing op (`sigmoid(x.float() * 2)`: the product is not rounded to D).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CAST, half_upcast, val
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten


def _site(down: fx.Node) -> list[fx.Node] | None:
    """[the sigmoid, M's views outermost first, the upcast] above the downcast, or None."""
    sig = down.args[0]
    if not (val(down) is not None and isinstance(sig, fx.Node) and sig.target is aten.sigmoid.default
            and len(sig.users) == 1 and val(sig) is not None and val(sig).dtype == torch.float32):
        return None
    chain, node = [sig], sig.args[0]
    while isinstance(node, fx.Node) and node.target in RESHAPES and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    if not (half_upcast(node) and len(node.users) == 1
            and val(node.args[0]).dtype == val(down).dtype):
        return None
    return [*chain, node]


def _write(graph: fx.Graph, down: fx.Node, chain: list[fx.Node]) -> None:
    x = chain[-1].args[0]
    with graph.inserting_before(down):
        for view in reversed(chain[1:-1]):
            x = call(graph, view.target, (x, *view.args[1:]), view.kwargs, like=view)
        x = call(graph, aten.sigmoid.default, (x,), like=chain[0])
    down.replace_all_uses_with(x)
    graph.erase_node(down)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={CAST})


RULE = Rule("sigmoid_round", apply, "sigmoid(M(x.float())).to(x.dtype), M views -> "
                                    "sigmoid(M(x))")
