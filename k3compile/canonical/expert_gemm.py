"""Rule `expert_gemm`: the per-token expert GEMMs written as batched matrix-vector products
(`bmm` over [N*k, O, I] x [N*k, I, 1], `matmul(w, x.unsqueeze(-1)).squeeze(-1)`, `x @ w.mT`,
...) -> the lowered form of the einsums `k3compile.math.mxfp4_experts` writes, which
`patterns/moe_experts.py` matches:

    FC1  y[n,k,o] = sum_l z[n,l] W[n,k,o,l]       einsum("nl,nkil->nki", z, W)
         (x is the token z broadcast over the k routed experts)
    FC2  y[n,k,o] = sum_i x[n,k,i] W[n,k,o,i]     einsum("nki,nkli->nkl", x, W)

Matched structurally: a `bmm(A, B)` with A [N*k, O, I] and B [N*k, I, 1] (W·x), or A [N*k, 1, I]
and B [N*k, I, O] (x·Wᵀ, the last two dims of W swapped by a permute), where W is [N, k, O, I] and
x is [N, k, I] with the first two dims merged (through views, reshapes, contiguous clones,
identity permutes, same-shape expands, size-1 unsqueezes / squeezes: ops that keep the elements'
order), and the product read back as [N, k, O] (views / a squeeze). Where x is z [N, I] broadcast
to [N, k, I] (`expand(unsqueeze(z, 1))`) the FC1 form is produced, else the FC2 form. Also FC1 is
the per-token product, one token per batch and its k experts' rows stacked: A [N, k*O, I] (W's
middle two dims merged) and B [N, I, 1] (z as a column), or z [N, 1, I] times that A transposed.
The einsum is traced (Inductor's joint passes, as the model's graph is) at the site's shapes and
dtypes, so the row count's lowering (N = 1 or more) is the one the pattern's variant for it
has. The canonical bmm reduces over the same index in the same dtype; CPU GEMM blocking may round
the fp32 sum differently (within 1e-6 relative).

Only expert GEMMs: W must be made from experts gathered by the routed ids (an `index` by one
integer [N, k] tensor up its inputs, e.g. the dequant of `w_packed[ids]`); the same shapes occur
elsewhere (KDA's state [B, H, d, d] times a vector), and those are left as they are. Also left
alone: a product that is not this batched matrix-vector shape (a real GEMM), an x whose batch is
not W's [N, k] in the same order, a result not read back as [N, k, O]. A site the patterns then
do not fuse keeps the einsum's lowering, the form our own model's unfused experts have.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import splice_if_same
from k3compile.canonical.region import static_shape as _shape
from k3compile.rewrite import inductor

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}


def _transparent(node: fx.Node) -> bool:
    """An op that keeps the elements and their row-major order (only the shape may change)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    t, src = node.target, _shape(node.args[0])
    if t in _VIEWS or t is aten.clone.default:
        return True
    if t is aten.expand.default:
        return src == _shape(node)
    if t is aten.permute.default:
        order = _moved_dims(node)
        return order == sorted(order)
    # a size-1 dim: the order stays (squeeze.dims: torch.vmap's matrix-vector products)
    return t in (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims)


def _moved_dims(permute: fx.Node) -> list[int]:
    """The input dims of size > 1 in the order the permute puts them (size-1 dims carry no
    order: a permute that only moves them keeps the elements' order)."""
    shape = _shape(permute.args[0]) or ()
    return [d % len(shape) for d in permute.args[1] if shape[d] != 1]


def _source(node: fx.Node, want) -> fx.Node | None:
    """The earliest node up the transparent chain from node whose shape satisfies want."""
    found = None
    while isinstance(node, fx.Node):
        shape = _shape(node)
        if shape is not None and want(shape):
            found = node
        if not _transparent(node):
            break
        node = node.args[0]
    return found


def _result(bmm: fx.Node, want: tuple) -> fx.Node | None:
    """The node down the single-use transparent chain from bmm whose shape is want."""
    node = bmm
    while True:
        if _shape(node) == want and node is not bmm:
            return node
        if len(node.users) != 1:
            return None
        node = next(iter(node.users))
        if not _transparent(node):
            return None


def _broadcast_token(x: fx.Node, n: int, k: int) -> fx.Node | None:
    """z [N, I] where x = expand(unsqueeze(z, 1), [N, k, I])."""
    if x.target is not aten.expand.default:
        return None
    u = x.args[0]
    if not (isinstance(u, fx.Node) and u.target is aten.unsqueeze.default
            and u.args[1] in (1, -2)):
        return None
    z = u.args[0]
    shape = _shape(z)
    return z if shape is not None and len(shape) == 2 and shape[0] == n else None


def _weight(node, batch: int, out: int, width: int) -> fx.Node | None:
    """W [N, k, O, I] whose first two dims merged make node [N*k, O, I] (the per-expert batch),
    or whose middle two dims merged make node [N, k*O, I] (the per-token batch, the k experts'
    rows stacked)."""
    def want(s):
        return len(s) == 4 and s[3] == width and (
            (s[0] * s[1] == batch and s[2] == out) or (s[0] == batch and s[1] * s[2] == out))
    return _source(node, want)


def _transposed_weight(node, batch: int, out: int, width: int) -> fx.Node | None:
    """W [N, k, O, I] where node [N*k, I, O] or [N, I, k*O] is its merge (as in `_weight`) with
    the last two dims swapped (a permute of them anywhere up the transparent chain)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is aten.permute.default:
            order = _moved_dims(node)
            if len(order) >= 2 and order[:-2] + order[-2:][::-1] == sorted(order):
                return _weight(node.args[0], batch, out, width)
        if not _transparent(node):
            return None
        node = node.args[0]
    return None


def routed_experts(w: fx.Node, n: int, k: int, limit: int = 256) -> bool:
    """Whether W [N, k, O, I] is made from experts gathered by the routed ids: an `index` by one
    integer [N, k] tensor up its inputs (what makes the product an expert GEMM, not, say, a
    recurrent state [B, H, d, d] times a vector)."""
    seen, stack = set(), [w]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node in seen or not isinstance(node, fx.Node) or node.op != "call_function":
            continue
        seen.add(node)
        if node.target is aten.index.Tensor and len(node.args[1]) == 1:
            ids = node.args[1][0]
            val = ids.meta.get("val") if isinstance(ids, fx.Node) else None
            if (isinstance(val, torch.Tensor) and tuple(val.shape) == (n, k)
                    and val.dtype in (torch.int64, torch.int32)):
                return True
        stack.extend(node.all_input_nodes)
    return False


def _site(bmm: fx.Node):
    """(W, x or z, is_fc1, result node) of a batched matrix-vector product, else None: W·x
    (bmm([B, O', I], [B, I, 1])) or x·Wᵀ (bmm([B, 1, I], [B, I, O'])), where B O' is N*k O
    (one expert per batch) or N k*O (one token per batch, its k experts' rows stacked)."""
    a, b = bmm.args[:2]
    sa, sb = _shape(a), _shape(b)
    if sa is None or sb is None or len(sa) != 3 or len(sb) != 3 or sa[0] != sb[0]:
        return None
    if sb[1:] == (sa[2], 1) and sa[1] > 1:  # W·x
        (batch, out, width), vector = sa, b
        w = _weight(a, batch, out, width)
    elif sa[1] == 1 and sb[1] == sa[2] and sb[2] > 1:  # x·Wᵀ
        (batch, width, out), vector = sb, a
        w = _transposed_weight(b, batch, out, width)
    else:
        return None
    if w is None:
        return None
    n, k, o = _shape(w)[:3]
    if not routed_experts(w, n, k):
        return None
    result = _result(bmm, (n, k, o))
    if result is None:
        return None
    x = _source(vector, lambda s: s == (n, k, width)) if (batch, out) == (n * k, o) else None
    if x is not None:  # per expert: x [N, k, I], maybe z broadcast over k
        z = _broadcast_token(x, n, k)
        return (w, z, True, result) if z is not None else (w, x, False, result)
    if (batch, out) == (n, k * o):  # per token: one z [N, I] for all k experts
        z = _source(vector, lambda s: s == (n, width))
        return None if z is None else (w, z, True, result)
    return None


def _fc1(z, w):
    return torch.einsum("nl,nkil->nki", z, w)


def _fc2(x, w):
    return torch.einsum("nki,nkli->nkl", x, w)


def _op(node: fx.Node) -> str:
    """A node's target and its non-node arguments (dims, shapes)."""
    return f"{node.target}{fx.map_arg(node.args, lambda _: '%')}"


def _cone(result: fx.Node, roots: set) -> list[str]:
    """The ops between the roots and result."""
    seen, stack, out = set(), [result], []
    while stack:
        n = stack.pop()
        if n in seen or n in roots or n.op != "call_function":
            continue
        seen.add(n)
        out.append(_op(n))
        stack.extend(n.all_input_nodes)
    return sorted(out)


def _splice(graph: fx.Graph, node: fx.Node, site: tuple, traced: dict) -> bool:
    w, x, fc1, result = site
    fn = _fc1 if fc1 else _fc2
    key = (fc1, _shape(x), _shape(w), x.meta["val"].dtype, w.meta["val"].dtype)
    if key not in traced:
        mode = torch._guards.detect_fake_mode([x.meta["val"], w.meta["val"]])
        with mode:
            traced[key] = inductor.fwd_only_joint(fn, [x.meta["val"], w.meta["val"]])
    gm = traced[key]
    canonical = sorted(_op(n) for n in gm.graph.nodes if n.op == "call_function")
    if _cone(result, {w, x}) == canonical:
        return False  # already the einsum's form
    return splice_if_same(graph, gm, [x, w], result)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _splice, targets={aten.bmm.default}, traced=True,
                         sort=True)


RULE = Rule("expert_gemm", apply,
            "per-token expert GEMMs as bmm / matmul matrix-vector products over [N, k, O, I] "
            "-> the lowered einsums nl,nkil->nki (z broadcast) / nki,nkli->nkl")

__all__ = ["RULE", "apply"]
