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
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import VIEWS, below, replace, root, shape, val
from k3compile.graph import call

aten = torch.ops.aten
READ_RTOL = 1e-5


def read(S, x):
    return torch.einsum("bhkv,bhk->bhv", S, x)


def write(k, u):
    return k.unsqueeze(-1) * u.unsqueeze(-2)


def _read_site(bmm: fx.Node):
    roots = [root(a) for a in bmm.args]
    by_rank = {len(shape(r) or ()): r for r in roots}
    S, x = by_rank.get(4), by_rank.get(3)
    if S is None or x is None or len(set(roots)) != 2:
        return None
    B, H, K, V = shape(S)
    if val(S).dtype != torch.float32 or shape(x) != (B, H, K) or val(x).dtype != torch.float32:
        return None
    out = below(bmm, (B, H, V))
    return None if out is None else ([S, x], out)


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
    site = _read_site(bmm)
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
    if node.target is aten.bmm.default and (site := _read_site(node)) is not None:
        return (*site, read, READ_RTOL, "read")
    if node.target is aten.mul.Tensor and (ins := _write_site(node)) is not None:
        return ins, node, write, 0.0, "write"
    return None


def _write(graph: fx.Graph, node: fx.Node, site, cache: dict) -> bool:
    inputs, out, fn, rtol, name = site
    if name == "scale":
        return _move_scale(graph, node, inputs, cache)
    return replace(inputs, out, fn, rtol, cache, name) is not None


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.bmm.default, aten.mul.Tensor},
                         traced=True)


RULE = Rule("delta_einsum", apply,
            "delta-rule products in any einsum order (S·x over K, k ⊗ u) -> "
            "einsum('bhkv,bhk->bhv') / k.unsqueeze(-1) * u.unsqueeze(-2)")

__all__ = ["RULE", "apply"]
