"""Rule `heads_first`: KDA's per-head tensors written heads-first [B, H, T, D] (`view(B, T, H,
D).transpose(1, 2)`, tests/models/spell5_k3.py) -> the tokens-first [B, T, H, D] form of
`patterns/kda_decode.py` (`k3compile.math.delta_rule_step` reads token t as `x[:, t]`).

Input side: a `permute(x, [0, 2, 1, 3])` (or `[0, 2, 1]` of β [B, T, H]) whose values reach
only token selects `select(., 2, t)` through pointwise ops and last-dim keepdim reductions (the
l2 norm, q's scale, the decay) is pushed down to them: each op runs on x instead (an operand it
broadcasts, a per-head parameter [H, 1, D], viewed in the tokens-first order, which only moves a
unit dim), and `select(permute(y), 2, t)` is `select(y, 1, t)`. Output side: a
`permute(o, [0, 2, 1, 3])` back to tokens-first, fed by pointwise ops and last-dim keepdim
reductions (the head norm, the gate) that nothing else reads, whose leaves are the delta rule's
outputs stacked on dim 2 (`view([B, H, V] -> [B, H, 1, V])` at T = 1, `stack(., 2)`, its
decomposition `view(cat(., -1), [B, H, T, V])`, or `cat(unsqueeze(., 2), 2)`), other permutes `[0, 2, 1, 3]` (the gate's heads-first view, which
cancel) and broadcast parameters, is pulled up to the leaves: the stack on dim 1, the gate's
permute gone. A stacked output counts as the delta rule's where it is a product with a 4-D fp32
[B, H, K, V] tensor that reaches a state buffer write (an `index_put`) through views and
state updates. Every step moves the
same values to other positions: exact.

Left alone: a permute whose values reach anything but token selects (attention's heads-first
q, k, v, which the MLA patterns take as they are), an output permute whose region is read
elsewhere or has other leaves, stacks of anything but delta-rule reads.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.canonical.region import POINTWISE, VIEWS, refresh, root, shape, val
from k3compile.graph import call

aten = torch.ops.aten
_REDUCE = {aten.sum.dim_IntList, aten.mean.dim}
_SWAP = {4: [0, 2, 1, 3], 3: [0, 2, 1]}


def _is_swap(node) -> bool:
    return (isinstance(node, fx.Node) and node.target is aten.permute.default
            and list(node.args[1]) == _SWAP.get(len(node.args[1])))


def _last_dim_keepdim(node: fx.Node) -> bool:
    rank = len(shape(node.args[0]) or ())
    dims = node.args[1] if len(node.args) > 1 else None
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return bool(keep) and dims is not None and [d % rank for d in dims] == [rank - 1]


def _elementwise(node: fx.Node) -> bool:
    return node.target in POINTWISE or node.target in _REDUCE and _last_dim_keepdim(node)


def _swap_shape(s, rank: int) -> list[int] | None:
    """A broadcast operand's shape in the other order: dims 1 and 2 (right aligned to `rank`)
    swapped where one of them is a unit dim (a view), else None (no pure move of values)."""
    if s is None or len(s) > rank:
        return None
    padded = [1] * (rank - len(s)) + list(s)
    if padded[1] != 1 and padded[2] != 1:
        return None
    padded[1], padded[2] = padded[2], padded[1]
    lead = rank - len(s)
    return padded[lead:] if all(d == 1 for d in padded[:lead]) else padded


def _operands_move(nodes, inside: set, rank: int) -> bool:
    return all(_swap_shape(shape(a), rank) is not None for n in nodes for a in n.args
               if isinstance(a, fx.Node) and a not in inside)


def _copy(graph: fx.Graph, nodes, env: dict, rank: int) -> None:
    """Each of nodes recomputed on env's values, its other operands in the other order."""
    for n in nodes:
        with graph.inserting_before(n):
            args = []
            for a in n.args:
                if isinstance(a, fx.Node) and a not in env:
                    new = _swap_shape(shape(a), rank)
                    src = a.args[0] if a.target is aten.view.default else a  # a view of a view
                    a = a if new == list(shape(a)) else call(graph, aten.view.default,
                                                             (src, new), like=n)
                args.append(env.get(a, a) if isinstance(a, fx.Node) else a)
            env[n] = call(graph, n.target, tuple(args), dict(n.kwargs), like=n)


# ---- input side: sink a permute to the token selects --------------------------------------------


def _sink_region(perm: fx.Node):
    """(region in graph order, the selects it ends at) or None."""
    rank = len(shape(perm))
    region, selects, todo = {perm}, [], [perm]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in region:
                continue
            if u.target is aten.select.int and u.args[0] is n and u.args[1] == 2:
                selects.append(u)
            elif _elementwise(u) and len(shape(u) or ()) == rank:
                region.add(u)
                todo.append(u)
            else:
                return None
    if not selects:
        return None
    order = [n for n in perm.graph.nodes if n in region]
    for n in order[1:]:  # every other operand broadcasts and lies outside the region
        for a in n.args:
            if isinstance(a, fx.Node) and a not in region and len(shape(a) or ()) == rank:
                return None
    return order, selects


def _sink(graph: fx.Graph, perm: fx.Node) -> bool:
    found = _sink_region(perm)
    if found is None:
        return False
    order, selects = found
    rank = len(shape(perm))
    if not _operands_move(order[1:], set(order), rank):
        return False
    env, moved = {perm: perm.args[0]}, []
    _copy(graph, order[1:], env, rank)
    for s in selects:
        with graph.inserting_before(s):
            moved.append(call(graph, aten.select.int, (env[s.args[0]], 1, s.args[2]), like=s))
        s.replace_all_uses_with(moved[-1])
        graph.erase_node(s)
    refresh(moved)
    return True


# ---- output side: pull a permute up to the delta rule's stacked outputs ------------------------


def _written_state_read(x: fx.Node) -> bool:
    """x [B, H, V] is a product with a 4-D fp32 tensor that is written to a state buffer."""
    mm = root(x)
    if not isinstance(mm, fx.Node) or mm.target is not aten.bmm.default:
        return False
    for operand in mm.args:
        s = root(operand)
        if len(shape(s) or ()) == 4 and val(s).dtype == torch.float32 and _written(s):
            return True
    return False


def _written(node: fx.Node, limit: int = 256) -> bool:
    """node's values reach a state buffer write (`index_put`) through views and the delta rule's
    state updates (mul by the decay, add of the outer product): token t's state in a step over
    T tokens, whose last state is written."""
    seen, todo = {node}, [node]
    while todo and len(seen) < limit:
        n = todo.pop()
        for u in n.users:
            if u.target is aten.index_put.default and u.args[2] is n:
                return True
            if u not in seen and (u.target in VIEWS or u.target in (aten.mul.Tensor,
                                                                     aten.add.Tensor)
                                  and len(shape(u) or ()) == 4):
                seen.add(u)
                todo.append(u)
    return False


def _stacked(node: fx.Node) -> list[fx.Node] | None:
    """The [B, H, V] outputs stacked on dim 2 into node [B, H, T, V], or None."""
    s = shape(node)
    if node.target in (aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default):
        x = node.args[0]
        if shape(x) is not None and s is not None and len(s) == 4 and s[2] == 1 and (
                shape(x) == (s[0], s[1], s[3])):
            return [x]
    if (node.target is aten.view.default and (cat := node.args[0]).target is aten.cat.default
            and len(s) == 4 and len(cat.users) == 1 and cat.args[1] in (2, -1)
            and len(cat.args[0]) == s[2]
            and all(shape(p) == (s[0], s[1], s[3]) for p in cat.args[0])):
        return list(cat.args[0])  # stack's decomposition: a cat on the last dim, viewed
    if node.target is aten.stack.default and (node.args[1] if len(node.args) > 1 else 0) == 2:
        return list(node.args[0])
    if node.target is aten.cat.default and len(node.args) > 1 and node.args[1] == 2 and all(
            p.target is aten.unsqueeze.default and p.args[1] == 2 and len(p.users) == 1
            for p in node.args[0]):
        return [p.args[0] for p in node.args[0]]
    return None


def _hoist_region(perm: fx.Node):
    """(region in graph order, its stacked leaves, its cancelling permutes) or None."""
    region, leaves, cancels, todo = set(), set(), set(), [perm.args[0]]
    while todo:
        n = todo.pop()
        if n in region or n in leaves or n in cancels:
            continue
        if _is_swap(n) and len(shape(n)) == 4:
            cancels.add(n)
        elif (outs := _stacked(n)) is not None:
            if not all(_written_state_read(o) for o in outs):
                return None
            leaves.add(n)
        elif isinstance(n, fx.Node) and _elementwise(n) and len(shape(n) or ()) == 4:
            region.add(n)
            todo += [a for a in n.args if isinstance(a, fx.Node) and len(shape(a) or ()) == 4]
        else:
            return None
    if not leaves:
        return None
    for n in region | leaves | cancels:  # nothing outside reads the heads-first values
        if any(u not in region and u is not perm for u in n.users):
            return None
    order = [n for n in perm.graph.nodes if n in region]
    if not _operands_move(order, region | leaves | cancels, 4):
        return None
    return order, leaves, cancels


def _hoist(graph: fx.Graph, perm: fx.Node) -> bool:
    found = _hoist_region(perm)
    if found is None:
        return False
    order, leaves, cancels = found
    env = {c: c.args[0] for c in cancels}
    for leaf in leaves:
        outs = _stacked(leaf)
        with graph.inserting_before(leaf):
            if len(outs) == 1:
                s = shape(leaf)
                env[leaf] = call(graph, aten.view.default, (outs[0], [s[0], 1, s[1], s[3]]),
                                 like=leaf)
            else:  # stack(outs, 1) as it decomposes: a cat on dim 1, viewed
                s = shape(leaf)
                rows = call(graph, aten.cat.default, (outs, 1), like=leaf)
                env[leaf] = call(graph, aten.view.default, (rows, [s[0], s[2], s[1], s[3]]),
                                 like=leaf)
    _copy(graph, order, env, 4)
    perm.replace_all_uses_with(env[perm.args[0]])
    refresh([env[perm.args[0]]])
    return True


def apply(graph: fx.Graph) -> int:
    done = 0
    for node in list(graph.nodes):
        if node._erased or not _is_swap(node):
            continue
        if _sink(graph, node) or _hoist(graph, node):
            done += 1
    if done:
        graph.eliminate_dead_code()
    return done


RULE = Rule("heads_first", apply,
            "KDA per-head tensors heads-first [B, H, T, D]: the permute pushed to the token "
            "selects (select(., 2, t) -> select(., 1, t)) and the output's pulled up to its stack")

__all__ = ["RULE", "apply"]
