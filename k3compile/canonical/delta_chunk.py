"""Rule `delta_chunk`: the gated delta rule written in the chunked form at chunk size 1 (output
and delta from the old state) -> the sequential step of `k3compile.math.delta_rule_step` (decay
the state, delta from the decayed state, write, read the new state), the form the `kda_decode`
pattern traces.

spell12 (`tests/models/spell12_k3.py`, `KDA.forward`) runs fla's chunk_kda with C = 1: per token,
on the old fp32 state S [B, H, K, V], with α, k, q [B, H, K], v [B, H, V], β [B, H, 1],

    u = β (v − Sᵀ(α⊙k));   o = Sᵀ(α⊙q) + (q·k) u;   S' = α⊙S + k uᵀ
->  S₁ = S ⊙ α[..., None];  u = β (v − S₁ᵀk);  S' = S₁ + k uᵀ;  o = S'ᵀq

(the reads any einsum lowering: a bmm of view chains of S and the vector, `region.state_read`;
the rule runs before `token_select`, which would move q·k's token select below the product of
the whole q and k, and before `delta_einsum`, whose canonical reads the splice already has).
The same function in real arithmetic (k3_arch §3.1 step 6): S₁ᵀk = Sᵀ(α⊙k) (the
decay is diagonal), and S'ᵀq = S₁ᵀq + u (kᵀq) = Sᵀ(α⊙q) + (q·k) u. In fp32 it rounds otherwise:
the decay multiplies the state instead of the vectors, and o sums the new state's K products
instead of the old one's plus a separate dot product. Measured on the CPU at K3's sizes (B 8,
H 96, K = V 128, 5 seeds; S ~ N(0, 1), α = exp(−5σ(N(0, 1))), q and k l2-normalised, q scaled by
K^-1/2, v ~ N(0, 1), β = σ(N(0, 1))), relative to the largest value of the fp64 result: the chunk
form is within 3.4e-7 (o) and 7.3e-8 (S') of fp64, the sequential form within 4.7e-7 and 7.3e-8,
and the two differ by at most 6.8e-7 (o) and 7.4e-8 (S'), below fp32's K-term summation bound
K·2^-24 ≈ 7.6e-6 (tests/canonical/test_delta_chunk.py bounds the rewrite at 2e-6 there).
The fused op computes the sequential form, as the spec writes it.

Site: a 4-D fp32 add S' = (α[..., None] ⊙ S) + k ⊗ u where u = β (v − read(S, α⊙k)), and a
read read(S, α⊙q) of the same S whose only reader is o = read + (q·k)[..., None] ⊙ u (the dot
product a sum over the last dim, unsqueezed back or kept); each operand in either order, the
repeated α, k and q equal (one node, or the same select of one tensor). Taken only where both
outputs, run on random values, equal the sequential form within 1e-5 of the largest value
(`canonical.region`). Left alone: the sequential form itself, a chunk form with any other term, a read of another state.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, region, rewrite_sites
from k3compile.canonical.region import shape, state_read, val
from k3compile.canonical.window_stack import same
from k3compile.graph import call

aten = torch.ops.aten
RTOL = 1e-5


def sequential(S, alpha, k, v, beta, q, k_write=None):
    """One token of the gated delta rule as `k3compile.math.delta_rule_step` orders it, on the
    token's rows: (the new state, o). `k_write`: k's row as the write reads it (the canonical
    graph selects k's row once per read), k by default."""
    S = S * alpha.unsqueeze(-1)
    u = beta * (v - torch.einsum("bhkv,bhk->bhv", S, k))
    S = S + (k if k_write is None else k_write).unsqueeze(-1) * u.unsqueeze(-2)
    return S, torch.einsum("bhkv,bhk->bhv", S, q)


def _binary(node, target) -> tuple | None:
    """node's two operands where it is a call of target on two nodes, else None."""
    if (isinstance(node, fx.Node) and node.target is target and len(node.args) == 2
            and not node.kwargs and all(isinstance(a, fx.Node) for a in node.args)):
        return tuple(node.args)
    return None


def _unsqueezed(node, dim: int, rank: int) -> fx.Node | None:
    if isinstance(node, fx.Node) and node.target is aten.unsqueeze.default and (
            node.args[1] % rank == dim % rank):
        return node.args[0]
    return None


def _pair(node, target, test) -> tuple | None:
    """test(a, b) for node = target(a, b) or target(b, a): the first truthy result."""
    ops = _binary(node, target)
    if ops is None:
        return None
    for a, b in (ops, ops[::-1]):
        if (found := test(a, b)) is not None:
            return found
    return None


def _decayed(node, S) -> fx.Node | None:
    """α where node = α[..., None] ⊙ S (either order)."""
    return _pair(node, aten.mul.Tensor,
                 lambda a, b: _unsqueezed(a, -1, 4) if b is S else None)


def _read(out: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(S, x) where out is a canonical state read Σ_k S x."""
    bmm = region.root(out)
    if not (isinstance(bmm, fx.Node) and bmm.target is aten.bmm.default):
        return None
    found = state_read(bmm, "bhkv")
    if found is None or found[1] is not out:
        return None
    return found[0][0], found[0][1]


def _times(node, alpha) -> fx.Node | None:
    """x where node = α ⊙ x (either order)."""
    return _pair(node, aten.mul.Tensor, lambda a, b: b if same(a, alpha) else None)


def _delta(u, S, alpha):
    """(k, v, β) where u = β (v − read(S, α⊙k))."""
    def inner(beta, diff):
        ops = _binary(diff, aten.sub.Tensor)
        if ops is None or shape(beta) is None or shape(beta)[-1] != 1:
            return None
        v, r = ops
        read = _read(r)
        if read is None or read[0] is not S:
            return None
        k = _times(read[1], alpha)
        return None if k is None else (k, v, beta)
    return _pair(u, aten.mul.Tensor, inner)


def _rows_of(x, q, k) -> bool:
    """x is q ⊙ k (either order), or token t's row of Q ⊙ K where q, k are token t's rows of Q, K
    (rule `token_select` takes the select after the product)."""
    ops = _binary(x, aten.mul.Tensor)
    if ops is not None:
        return same(ops[0], q) and same(ops[1], k) or same(ops[0], k) and same(ops[1], q)
    if not (isinstance(x, fx.Node) and x.target is aten.select.int):
        return False
    rows = [(n.args[0], n.args[1:]) if isinstance(n, fx.Node) and n.target is aten.select.int
            else (None, None) for n in (q, k)]
    ops = _binary(x.args[0], aten.mul.Tensor)
    return (ops is not None and rows[0][1] == rows[1][1] == tuple(x.args[1:])
            and set(ops) == {rows[0][0], rows[1][0]} and len(ops) == 2)


def _dot(c, q, k) -> bool:
    """c = (q·k)[..., None]: the sum of q ⊙ k over the last dim, unsqueezed back or kept."""
    total = _unsqueezed(c, -1, 3)
    kept = total is None
    total = c if kept else total
    return (isinstance(total, fx.Node) and total.target is aten.sum.dim_IntList
            and len(total.args) == 2 + kept and list(total.args[1]) in ([-1], [2])
            and (not kept or total.args[2] is True) and _rows_of(total.args[0], q, k))


def _output(S, alpha, k, u):
    """(o, q) where o = read(S, α⊙q) + (q·k)[..., None] ⊙ u, read only there."""
    for bmm in S.graph.nodes:
        if bmm.target is not aten.bmm.default:
            continue
        found = state_read(bmm, "bhkv")
        if found is None or found[0][0] is not S:
            continue
        (_, x), r = found
        q = _times(x, alpha)
        if q is None or len(r.users) != 1:
            continue
        (o,) = r.users
        if _corrected(o, r, u, q, k):
            return o, q
    return None


def _corrected(o, r, u, q, k) -> bool:
    """o = r + (q·k)[..., None] ⊙ u (either order)."""
    corr = _pair(o, aten.add.Tensor, lambda a, b: b if a is r else None)
    return corr is not None and _pair(
        corr, aten.mul.Tensor, lambda c, w: True if w is u and _dot(c, q, k) else None) is not None


def _site(new: fx.Node):
    v = val(new)
    if v is None or v.dim() != 4 or v.dtype != torch.float32:
        return None
    ops = _binary(new, aten.add.Tensor)
    if ops is None:
        return None
    for decayed, outer in (ops, ops[::-1]):
        for S in _binary(decayed, aten.mul.Tensor) or ():
            alpha = _decayed(decayed, S)
            if alpha is None or val(S) is None or val(S).dim() != 4:
                continue
            factors = _binary(outer, aten.mul.Tensor)
            if factors is None:
                continue
            for a, b in (factors, factors[::-1]):
                k, u = _unsqueezed(a, -1, 4), _unsqueezed(b, -2, 4)
                if k is None or u is None:
                    continue
                found = _delta(u, S, alpha)
                if found is None or not same(found[0], k):
                    continue
                out = _output(S, alpha, k, u)
                if out is not None:
                    return S, alpha, k, found[1], found[2], out[1], out[0]
    return None


def _merge(node: fx.Node) -> None:
    """Every other node computing node's value (the same call) read as node (exact)."""
    for other in list(node.graph.nodes):
        if other is not node and same(other, node):
            other.replace_all_uses_with(node)


def _write(graph: fx.Graph, new: fx.Node, site, cache: dict) -> bool:
    S, alpha, k, v, beta, q, o = site
    inputs = [S, alpha, k, v, beta, q]
    for x in (alpha, k, q):  # the chunk form reads α, k and q rows twice, each its own select
        _merge(x)
    for output, i in ((new, 0), (o, 1)):
        nodes = region.nodes_between(inputs, output)
        if nodes is None or not region.agrees(inputs, output, nodes,
                                              lambda *a, i=i: sequential(*a)[i], RTOL):
            return False
    key = tuple((shape(x), val(x).dtype, val(x).stride()) for x in inputs)
    if key not in cache:
        cache[key] = region.trace_canonical(sequential, [val(x) for x in (*inputs, k)])
    gm = cache[key]
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min(new, o, key=order.__getitem__)):
        k_write = call(graph, k.target, k.args, k.kwargs, like=k) if k.op == "call_function" \
            else k
        env = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], (*inputs, k_write)))
        for n in gm.graph.nodes:
            if n.op == "call_function":
                args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = call(graph, n.target, args, kwargs, like=new)
    state, out = (env[x] for x in gm.graph.output_node().args[0])
    if shape(state) != shape(new) or shape(out) != shape(o):
        return False
    new.replace_all_uses_with(state)
    o.replace_all_uses_with(out)
    region.refresh([state, out])
    return True


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.add.Tensor}, traced=True, sort=True)


RULE = Rule("delta_chunk", apply,
            "chunk-1 delta rule (o, u from the old state) -> the sequential step "
            "(decay, delta, write, read)")

__all__ = ["RULE", "apply", "sequential"]
