"""Rule `head_split`: a pointwise chain on a projection's [..., H·K] channels, split into heads
only at its end -> the chain on the heads, the projection split first: the order
`k3compile.math` / `patterns/kda_decode.py` write KDA's decay and output gate in.

    exp(c * sigmoid(exp(A_log).repeat_interleave(K) * (graw + dt_bias))).view(.., H, K)
    ->  exp(c * sigmoid(exp(A_log).view(H, 1) * (graw.view(.., H, K) + dt_bias.view(H, K))))
    sigmoid(g).view(.., H, K)  ->  sigmoid(g.view(.., H, K))

(spell6: the decay and the gate computed on [B, T, W] and unflattened to heads at the end.)
The split view moves up through the chain to its leaves: an operand of the chain's shape is
split the same way; a per-channel [H·K] operand becomes [H, K], and one that repeats a per-head
[H] value K times (`repeat_interleave`, traced to `expand` of [H, 1] to [H, K], `clone`, `view`)
becomes that value viewed [H, 1], as the canonical form broadcasts it; scalars stay.

Exact: pointwise ops compute each element alone, and the operands are re-indexed so that every
element meets the same operands. Taken: a `view` that only splits the last dim (leading dims
unchanged) of a region of the pointwise ops below, each read only inside the region, whose
full-shape leaves are all projection outputs (`view(mm(..))`, F.linear's form), with at least
one op. Left alone: chains read in their middle, leaves that are not projections (our model
splits before the chain, so nothing of it is taken), operands broadcast over other dims.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten
POINTWISE = {aten.exp.default, aten.sigmoid.default, aten.neg.default, aten.tanh.default,
             aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor,
             torch.ops.prims.convert_element_type.default}


def _projection(node) -> bool:
    return (isinstance(node, fx.Node) and node.target in RESHAPES
            and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.mm.default)


def _per_head(node: fx.Node, heads: int, width: int) -> fx.Node | None:
    """The [H] value a [H·K] operand repeats K times (view(clone(expand([H, 1]))), if it does."""
    chain = node
    while isinstance(chain, fx.Node) and chain.target in RESHAPES | {aten.clone.default}:
        chain = chain.args[0]
    if not (isinstance(chain, fx.Node) and chain.target is aten.expand.default
            and _shape(chain) == (heads, width // heads)):
        return None
    src = chain.args[0]
    if _shape(src) != (heads, 1):
        return None
    if src.target in (aten.unsqueeze.default, *RESHAPES) and _shape(src.args[0]) == (heads,):
        return src.args[0]
    return None


def _region(top: fx.Node, full: tuple[int, ...]) -> list[fx.Node] | None:
    """The pointwise ops from `top` up whose values reach only the view, or None where a leaf of
    the full shape is no projection or an operand broadcasts other than per channel."""
    region, todo = [], [top]
    while todo:
        node = todo.pop()
        region.append(node)
        for a in node.args[:1] if node.target is torch.ops.prims.convert_element_type.default \
                else node.args:
            if not isinstance(a, fx.Node):
                continue
            s = _shape(a)
            if s == full:
                if a.target in POINTWISE and len(a.users) == 1 and not a.kwargs:
                    todo.append(a)
                elif not _projection(a):
                    return None
            elif s != (full[-1],):
                return None
    return region


def _site(view: fx.Node):
    src = view.args[0]
    if not (isinstance(src, fx.Node) and src.target in POINTWISE and len(src.users) == 1
            and not src.kwargs):
        return None
    out, full = _shape(view), _shape(src)
    if (out is None or full is None or len(out) != len(full) + 1 or out[:-2] != full[:-1]
            or out[-2] * out[-1] != full[-1] or out[-2] == 1 or out[-1] == 1):
        return None
    region = _region(src, full)
    return (region, out) if region else None


def _write(graph: fx.Graph, view: fx.Node, site) -> None:
    region, out = site
    heads, width = out[-2], out[-2] * out[-1]
    done: dict[fx.Node, fx.Node] = {}

    def operand(a):
        if not isinstance(a, fx.Node):
            return a
        if a in done:
            return done[a]
        if _shape(a) == (width,):
            head = _per_head(a, heads, width)
            return call(graph, aten.view.default, (head, [heads, 1]) if head is not None
                        else (a, out[-2:]), like=view)
        return call(graph, aten.view.default, (a, list(out)), like=view)

    with graph.inserting_before(view):
        for node in reversed(region):  # leaves first
            args = tuple(operand(a) for a in node.args)
            done[node] = call(graph, node.target, args, node.kwargs, like=node)
    view.replace_all_uses_with(done[region[0]])


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets=RESHAPES)


RULE = Rule("head_split", apply,
            "pointwise(proj[.., H*K]).view(.., H, K) -> pointwise(proj.view(.., H, K)), per-channel "
            "operands viewed [H, K], per-head repeats [H, 1]")

__all__ = ["RULE", "apply"]
