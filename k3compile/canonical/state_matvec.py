"""Rule `state_matvec`: a V-major recurrent state read as a matrix-vector product ->
the broadcast product summed over the last dim, the read rule `state_transpose` takes:

    torch.matmul(S, x.unsqueeze(-1)).squeeze(-1)        S [B, H, V, K], x [B, H, K]
    ->  (S * x.unsqueeze(-2)).sum(-1)                   o[b,h,v] = Σ_k S[b,h,v,k] x[b,h,k]

vLLM-style ports keep a head's state as the matrix that maps k to v ([V, K]) and read it with a
`matmul` (tests/models/spell7_k3.py: `torch.matmul(state, k.unsqueeze(-1))`, the same for q),
which traces to `expand` / `view` chains around a `bmm` over [B*H]. `state_transpose` takes a
V-major rule only where every read sums over the last dim (a product it leaves alone), and
`delta_einsum` takes a `bmm` read only over the state's third dim (K-major); this rule gives the
first the read it takes.

Site: a `bmm` whose operands are view chains of an fp32 [B, H, V, K] matrix S and a [B, H, K]
vector x, read back through views as [B, H, V] (`region.state_read`, `delta_einsum`'s read site
with the state laid out "bhvk"), where S is computed from a gathered state (an
`index` of a 4-D fp32 graph input, through the pointwise ops of the recurrence). Taken only
where the region, run on random values (`canonical.region`), equals the canonical read within
1e-5 of the largest value (the bmm and the sum add the K products in other orders: fp32
rounding). Left alone: a product over the state's third dim (a K-major read, `x^T S`), a
matrix-matrix product, a product of a tensor that is no gathered state.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import replace, shape, state_read, val

aten = torch.ops.aten
READ_RTOL = 1e-5
_POINTWISE = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor}


def read(S, x):
    return (S * x.unsqueeze(-2)).sum(-1)


def _gathered_state(node: fx.Node) -> bool:
    """node is computed from a gathered 4-D fp32 state by 4-D pointwise ops."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or not isinstance(n, fx.Node) or len(shape(n) or ()) != 4:
            continue
        seen.add(n)
        if n.target is aten.index.Tensor:
            buf = n.args[0]
            if buf.op == "placeholder" and len(shape(buf) or ()) == 4 and \
                    val(buf).dtype == torch.float32:
                return True
        elif n.target in _POINTWISE:
            todo.extend(a for a in n.args if isinstance(a, fx.Node))
    return False


def _site(bmm: fx.Node):
    site = state_read(bmm, "bhvk")
    return site if site is not None and _gathered_state(site[0][0]) else None


def _write(graph: fx.Graph, node: fx.Node, site, cache: dict) -> bool:
    inputs, out = site
    return replace(inputs, out, read, READ_RTOL, cache, "v_major_read") is not None


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.bmm.default}, traced=True)


RULE = Rule("state_matvec", apply,
            "a V-major state read matmul(S, x[..., None]) -> (S * x.unsqueeze(-2)).sum(-1)")

__all__ = ["RULE", "apply"]
