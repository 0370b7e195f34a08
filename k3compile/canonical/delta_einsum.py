"""Rule `delta_einsum`: the gated delta rule's two products spelled in other einsum orders or by
hand -> the lowering of `k3compile.math.delta_rule_step`'s own (`patterns/kda_decode.py`):

    read   o[b,h,v] = Σ_k S[b,h,k,v] x[b,h,k]   einsum("bhkv,bhk->bhv", S, x)   (S·k, S·q)
    write  d[b,h,k,v] = k[b,h,k] u[b,h,v]       k.unsqueeze(-1) * u.unsqueeze(-2)

e.g. `einsum("bhk,bhkv->bhv", k, S)` (the operands swapped: another chain of permutes and clones
around another bmm), `(x.unsqueeze(-2) @ S).squeeze(-2)`, `einsum("bhk,bhv->bhkv", k, u)` (a mul
of permuted unsqueezes). Found structurally: a `bmm` whose operands are view chains of a 4-D
fp32 matrix S [B, H, K, V] and a 3-D vector x [B, H, K], read back through views as [B, H, V]; a
4-D `mul` of two view chains of 3-D tensors that each insert a unit dim. Taken only where the
region, run on random values (`canonical.region`), equals the canonical product: the read within
1e-5 of the largest value (fp32 summation order), the write exactly. A matrix-vector product
over V, a product of other ranks or dtypes, a mul that is no outer product: left alone. A
read of a token's row `x[:, t]` (t > 0) of a [B, T, H, K] tensor is a non-contiguous vector,
whose canonical lowering has a clone (as the patterns traced over T tokens have it):
`region.replace` traces the canonical form on the vector's strides there.

The query scale: `o = einsum("bhkv,bhk->bhv", S, q) * c` (a spelling that scales the output, as
the red-team spelling's KDA layer does) -> the product of S and `q * c`, the canonical form's
`l2norm(q) * q_scale` before the read. Where the read's vector is a token's row `x[:, t]` of a
[B, T, H, K] tensor, the scale goes on that tensor (one mul for all its tokens' reads, as the
canonical form has it) and the read takes its row of the scaled tensor. Taken where c is a
Python number, the read's output reaches the mul through views only and is read by nothing else,
and the vector reaches the bmm through views only (a bmm is linear in each operand, so
(S·x)·c = S·(x·c) in real arithmetic); fp32 only. Not bit-equal: the scale rounds q instead of
o, ~1 ulp per element (measured below 2e-7 relative in the test), as a model that scales q
computes. Left alone: a tensor scale, a mul of a product whose output is read elsewhere too.

The batch-merged form (tests/models/spell5_k3.py): the state reshaped to [B*H, K, V], each
token's rows to [B*H, 1, K], the decay to [B*H, K, 1], β to [B*H, 1, 1], reads as `bmm(k_t, S)`,
the write as `bmm(k_tᵀ, u)` (or a broadcast product of a column and a row). Each merged tensor
stands for a per-head one (a row [B*H, 1, X] for [B, H, X], a matrix for [B, H, A, C]); the
region of merged pointwise ops, bmm and transposes reachable from views of per-head tensors is
rewritten per head (the reads as bmm of per-head views, taken by the read site above; the
outer product as the canonical write), where every node of it is read only inside the region or
by a view back to its per-head shape: a merged state read by anything else leaves the region as
it is. A token's row read twice (by the read and the write) is selected once per read, as the
canonical form has it.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import (
    VIEWS,
    below,
    closed_region,
    refresh,
    replace,
    root,
    shape,
    state_read,
    val,
)
from k3compile.graph import call

aten = torch.ops.aten
READ_RTOL = 1e-5


def read(S, x):
    return torch.einsum("bhkv,bhk->bhv", S, x)


def write(k, u):
    return k.unsqueeze(-1) * u.unsqueeze(-2)


def _sum_read_site(total: fx.Node):
    """([S, x], total) where total = (S * x.unsqueeze(-1)).sum(-2): the read as a broadcast
    product and a sum over K (spell8, spell6's `kda_heads`)."""
    mul = total.args[0]
    keep = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    if (len(total.args) < 2 or keep or list(total.args[1]) not in ([-2], [2])
            or not isinstance(mul, fx.Node) or mul.target is not aten.mul.Tensor
            or len(mul.args) != 2 or len(mul.users) != 1):
        return None
    for S, col in (mul.args, mul.args[::-1]):
        if not (isinstance(S, fx.Node) and isinstance(col, fx.Node)
                and col.target is aten.unsqueeze.default and col.args[1] in (-1, 3)):
            continue
        x, s = col.args[0], shape(S)
        if (s is not None and len(s) == 4 and val(S).dtype == torch.float32
                and shape(x) == s[:3] and val(x).dtype == torch.float32):
            return [S, x], total
    return None


def _inserts_unit_dim(node: fx.Node) -> bool:
    while node.op == "call_function" and node.target in VIEWS:
        if node.target is aten.unsqueeze.default:
            return True
        node = node.args[0]
    return False


def _write_site(mul: fx.Node):
    out = shape(mul)
    if out is None or len(out) != 4 or len(mul.args) != 2:
        return None
    a, b = mul.args
    if not all(isinstance(n, fx.Node) and _inserts_unit_dim(n) for n in (a, b)):
        return None
    ra, rb = root(a), root(b)
    if len(shape(ra) or ()) != 3 or len(shape(rb) or ()) != 3 or ra is rb:
        return None
    for k, u in ((ra, rb), (rb, ra)):
        if shape(k)[:2] == out[:2] and (shape(k)[2], shape(u)[2]) == out[2:]:
            return [k, u]
    return None


def _chain(top: fx.Node, x: fx.Node) -> list[fx.Node] | None:
    """The view nodes from x (excluded) up to top (included), x first; None where top is not a
    chain of VIEWS over x."""
    chain = []
    while top is not x:
        if not (isinstance(top, fx.Node) and top.op == "call_function" and top.target in VIEWS):
            return None
        chain.append(top)
        top = top.args[0]
    return chain[::-1]


def _scaled_read(mul: fx.Node):
    """(bmm, the operand to scale, its chain, the tensor to scale, c) where mul = (S·x) * c."""
    if len(mul.args) != 2 or mul.kwargs:
        return None
    out, c = mul.args
    if isinstance(out, (int, float)):
        out, c = c, out
    if not (isinstance(c, (int, float)) and not isinstance(c, bool) and isinstance(out, fx.Node)
            and len(out.users) == 1 and val(mul) is not None
            and val(mul).dtype == torch.float32 and shape(mul) == shape(out)):
        return None
    bmm = root(out)
    if bmm.op != "call_function" or bmm.target is not aten.bmm.default:
        return None
    site = state_read(bmm, "bhkv")
    if site is None or below(bmm, shape(out)) is not out:
        return None
    (_, x), _ = site
    operand = next((a for a in bmm.args if root(a) is x), None)
    chain = None if operand is None else _chain(operand, x)
    if not chain or any(len(n.users) != 1 for n in chain[:-1]):
        return None
    base = x
    rows = x.args[0] if x.target is aten.select.int else None
    if isinstance(rows, fx.Node) and val(rows) is not None and val(rows).dtype == torch.float32:
        base = x.args[0]  # a token's row: scale the whole [B, T, H, K]
        chain = [x, *chain]
    return bmm, operand, chain, base, c


def _move_scale(graph: fx.Graph, mul: fx.Node, site, cache: dict) -> bool:
    bmm, operand, chain, base, c = site
    key = ("q_scale", base, c)
    if key not in cache or cache[key]._erased:
        with graph.inserting_after(base):
            cache[key] = call(graph, aten.mul.Tensor, (base, c), like=base)
    node = cache[key]
    with graph.inserting_before(bmm):
        for link in chain:
            node = call(graph, link.target, (node, *link.args[1:]), link.kwargs, like=link)
    bmm.replace_input_with(operand, node)
    mul.replace_all_uses_with(mul.args[0] if isinstance(mul.args[0], fx.Node) else mul.args[1])
    return True


def _site(node: fx.Node):
    """(inputs, out, the canonical function, rtol, its name) of a state read or write, or the
    scale of a read's output ("scale")."""
    if node.target is aten.mul.Tensor and (site := _scaled_read(node)) is not None:
        return site, None, None, None, "scale"
    if node.target is aten.bmm.default and (site := state_read(node, "bhkv")) is not None:
        return (*site, read, READ_RTOL, "read")
    if node.target is aten.sum.dim_IntList and (site := _sum_read_site(node)) is not None:
        return (*site, read, READ_RTOL, "read")
    if node.target is aten.mul.Tensor and (ins := _write_site(node)) is not None:
        return ins, node, write, 0.0, "write"
    return None


def _write(graph: fx.Graph, node: fx.Node, site, cache: dict) -> bool:
    inputs, out, fn, rtol, name = site
    if name == "scale":
        return _move_scale(graph, node, inputs, cache)
    return replace(inputs, out, fn, rtol, cache, name) is not None


# ---- the batch-merged form: bmm over [B*H, ...] ------------------------------------------------
#
# A merged fp32 tensor [B*H, r, c] stands for a per-head one: a row [B*H, 1, X] for [B, H, X] (a
# token's k, q, v, the read's output, u; β as [B*H, 1, 1] for [B, H, 1]), a matrix [B*H, A, C]
# (A > 1) for [B, H, A, C] (the state; the decay as a column [B*H, K, 1] for [B, H, K, 1]).

_POINTWISE = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor}
_MERGES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _per_head(merged, B: int, H: int) -> tuple[int, ...] | None:
    """The per-head shape a merged [B*H, r, c] stands for."""
    if merged is None or len(merged) != 3 or merged[0] != B * H:
        return None
    return (B, H, merged[2]) if merged[1] == 1 else (B, H, *merged[1:])


_ORDER_KEEPING = {*_MERGES, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
                  aten.clone.default}


def _merge(node: fx.Node):
    """((B, H), source, unsqueeze) where node views a per-head fp32 tensor [B, H, ...] as
    [B*H, r, c] through ops that keep the elements' order (views, unsqueezes, clones);
    `unsqueeze`: the per-head form is the source with a last unit dim."""
    out = shape(node)
    if node.target not in _ORDER_KEEPING or out is None or len(out) != 3:
        return None
    src = node.args[0]
    while isinstance(src, fx.Node):
        while src.target is aten.clone.default:  # the per-head rows are read as they are
            src = src.args[0]
        s = shape(src)
        if s is not None and len(s) >= 2 and 1 not in s[:2] and val(src).dtype == torch.float32:
            want = _per_head(out, *s[:2])
            if want is not None and s in (want, want[:-1]) and (s == want or want[-1] == 1):
                return s[:2], src, s != want
        if src.op != "call_function" or src.target not in _ORDER_KEEPING:
            return None
        src = src.args[0]
    return None


def _operand(merged, out, B: int, H: int) -> tuple[int, ...]:
    """The per-head shape a pointwise op with merged output `out` reads its merged operand as:
    a row in a matrix op broadcasts over the matrix's rows ([B, H, 1, X], as the canonical outer
    product k.unsqueeze(-1) * u.unsqueeze(-2) has it)."""
    four = _per_head(merged, B, H)
    return (*four[:2], 1, four[2]) if len(four) == 3 and out[1] > 1 else four


def _kind(node: fx.Node, heads: dict) -> tuple | None:
    """(B, H) where node computes a merged tensor from merged ones: a pointwise op (numbers
    aside), a bmm of a row and a matrix (a read) or of a column and a row (an outer product), a
    row's transpose."""
    out = shape(node)
    if out is None or len(out) != 3 or val(node).dtype != torch.float32 or node.kwargs:
        return None
    if node.target in _POINTWISE and len(node.args) == 2:
        ins = [heads[a] for a in node.args if isinstance(a, fx.Node) and a in heads]
        nodes = [a for a in node.args if isinstance(a, fx.Node)]
        if not ins or len(ins) != len(nodes) or len(set(ins)) != 1:
            return None
        B, H = ins[0]
        four = [_operand(shape(a), out, B, H) if isinstance(a, fx.Node) else () for a in node.args]
        try:
            if tuple(torch.broadcast_shapes(*four)) != _per_head(out, B, H):
                return None
        except RuntimeError:
            return None
        return ins[0]
    if node.target is aten.bmm.default:
        a, b = node.args
        if a not in heads or b not in heads or heads[a] != heads[b]:
            return None
        sa, sb = shape(a), shape(b)
        read = sa[1] == 1 and sb[1] == sa[2] > 1
        outer = sa[2] == 1 == sb[1] and sa[1] > 1
        return heads[a] if read or outer else None
    if (node.target is aten.expand.default and node.args[0] in heads
            and list(node.args[1]) == list(out)):  # bmm's broadcast of a merged operand: none
        return heads[node.args[0]]
    transposes = ((aten.transpose.int, (1, 2)), (aten.transpose.int, (2, 1)),
                  (aten.permute.default, ([0, 2, 1],)))
    if (node.target, tuple(node.args[1:])) in transposes and node.args[0] in heads:
        return heads[node.args[0]] if shape(node.args[0])[1] == 1 < out[1] else None
    return None


def _is_exit(user: fx.Node, node: fx.Node, bh: tuple[int, int]) -> bool:
    """user views node back as the per-head tensor it stands for."""
    return user.target in _MERGES and shape(user) == _per_head(shape(node), *bh)


def _unmerge(graph: fx.Graph) -> int:
    """Rewrite each batch-merged region per head (the read as a bmm of per-head views, which
    `state_read` then takes; the outer product as the canonical write); a region some node of
    which is read by anything else is left alone. Returns how many nodes were rewritten."""
    heads, merges, region = closed_region(graph, _merge, _kind, _is_exit)
    if not any(n.target is aten.bmm.default for n in region):
        return 0
    four, exits, uses = {}, [], {}

    def per_head(a, like):
        if not isinstance(a, fx.Node) or a not in merges:
            return four.get(a, a)
        _, src, unsqueeze = merges[a]
        if src.target is aten.select.int and uses.get(a):
            # the canonical form selects a token's row once per read of it
            src = call(graph, aten.select.int, src.args, like=like)
        uses[a] = True
        return call(graph, aten.unsqueeze.default, (src, -1), like=like) if unsqueeze else src

    for n in region:
        B, H = heads[n]
        with graph.inserting_before(n):
            args = [per_head(a, n) for a in n.args[:2] if not isinstance(a, (list, tuple))]
            if n.target is aten.expand.default:
                new = args[0]
            elif n.target in _POINTWISE:
                args = [call(graph, aten.unsqueeze.default, (x, -2), like=n)
                        if isinstance(a, fx.Node) and shape(a)[1] == 1 < shape(n)[1] else x
                        for a, x in zip(n.args, args)]
                new = call(graph, n.target, tuple(args), like=n)
            elif n.target is aten.bmm.default and shape(n.args[0])[2] == 1:  # k ⊗ u
                row = call(graph, aten.unsqueeze.default, (args[1], -2), like=n)
                new = call(graph, aten.mul.Tensor, (args[0], row), like=n)
            elif n.target is aten.bmm.default:  # S·x, through views `state_read` recognises
                x = call(graph, aten.reshape.default, (args[0], list(shape(n.args[0]))), like=n)
                S = call(graph, aten.reshape.default, (args[1], list(shape(n.args[1]))), like=n)
                new = call(graph, aten.view.default, (
                    call(graph, aten.bmm.default, (x, S), like=n), list(_per_head(shape(n), B, H))),
                    like=n)
            else:  # a row's transpose: a column
                new = call(graph, aten.unsqueeze.default, (args[0], -1), like=n)
        four[n] = new
        for u in list(n.users):
            if _is_exit(u, n, (B, H)):
                u.replace_all_uses_with(new)
                exits.append(new)
    graph.eliminate_dead_code()
    refresh(exits)
    return len(four)


def apply(graph: fx.Graph) -> int:
    unmerged = _unmerge(graph)
    return unmerged + rewrite_sites(graph, _site, _write, targets={aten.bmm.default, aten.mul.Tensor,
                                                                  aten.sum.dim_IntList},
                         traced=True)


RULE = Rule("delta_einsum", apply,
            "delta-rule products in any einsum order (S·x over K, k ⊗ u) -> "
            "einsum('bhkv,bhk->bhv') / k.unsqueeze(-1) * u.unsqueeze(-2)")

__all__ = ["RULE", "apply"]
