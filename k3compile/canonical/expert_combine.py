"""Rule `expert_combine`: the routed experts' weighted finalize Σ_k w[n, k] · y[n, k, :] written
as a batched product (`einsum("nk,nkl->nl", w, y)`, `bmm(w.unsqueeze(1), y)`,
`(w.unsqueeze(1) @ y).squeeze(1)`, `bmm(y.mT, w[..., None])`, ...) -> the form
`k3compile.math.mxfp4_experts` traces to, which `patterns/moe_experts.py` matches:

    (w.unsqueeze(-1) * y).sum(1)            unsqueeze, mul, sum over k, fp32

Anchored on a `bmm` whose operands are, through layout ops (views, permutes, unsqueezes,
squeezes, clones), the weights w [N, k] and the expert outputs y [N, k, L], both fp32, read back
as [N, L] fp32; y must be an expert FC2's output (up its layout ops and an fp32 upcast, a `bmm`
over a [N, k, ...] weight gathered by [N, k] routed ids, `expert_gemm._routed`), so the
Attention-Residual mix ([B, 1, S] x [B, S, D], the same shapes; `depth_mix` owns it) and other
products are left alone. The region between (w, y) and the [N, L] result is evaluated once on
random inputs against the canonical sum before it is replaced: fp32 on both sides, they differ
by summation order only (checked to RTOL); anything else (other weights, a sum over another dim,
bf16 math) fails the check and is left alone.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.expert_gather import traced
from k3compile.canonical.expert_gemm import routed_experts
from k3compile.canonical.region import call_on_cpu, splice_if_same
from k3compile.canonical.region import static_shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.graph import RESHAPES
from k3compile.rewrite import inductor

aten, prims = torch.ops.aten, torch.ops.prims
RTOL = 1e-5  # summation order in fp32
_LAYOUT = RESHAPES | {aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
                      aten.squeeze.default, aten.clone.default, aten.alias.default,
                      aten.expand.default}


def _layout(node: fx.Node) -> bool:
    """An op that only moves elements (or drops a size-1 dim: `x[:, 0]` of [N, 1, L])."""
    if node.op != "call_function":
        return False
    if node.target is aten.select.int:
        return (_shape(node.args[0]) or (0,) * 8)[node.args[1]] == 1
    return node.target in _LAYOUT


def _up(node, want) -> fx.Node | None:
    """The last node up node's chain of single-input layout ops whose shape satisfies want (the
    source before any permutes back and forth; the evaluation checks what it holds)."""
    found = None
    while isinstance(node, fx.Node):
        shape = _shape(node)
        if shape is not None and want(shape):
            found = node
        if not _layout(node):
            break
        node = node.args[0]
    return found


def _down(node: fx.Node, want: tuple) -> fx.Node | None:
    """The first node of shape want down node's single-user chain of layout ops."""
    while len(node.users) == 1:
        node = next(iter(node.users))
        if not _layout(node):
            return None
        if _shape(node) == want:
            return node
    return None


def _expert_output(y: fx.Node, n: int, k: int) -> bool:
    """y [N, k, L] is an FC2 product over experts gathered by [N, k] routed ids."""
    casts = _LAYOUT | {prims.convert_element_type.default}
    node = y
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in casts:
        node = node.args[0]
    bmm = node
    if not (isinstance(bmm, fx.Node) and bmm.target is aten.bmm.default):
        return False
    for operand in bmm.args[:2]:
        w = _up(operand, lambda s: len(s) == 4 and s[:2] == (n, k))
        if w is not None and routed_experts(w, n, k):
            return True
    return False


def combine_site(bmm: fx.Node, routed: bool = True):
    """(w [N, k], y [N, k, L], out [N, L]) of a weighted finalize at a bmm, all fp32 (the sum
    itself not yet checked: `evaluates_as_sum`); `routed`: y must be an expert FC2's output over
    [N, k] routed ids (rule `expert_rows` proves its pair rows otherwise)."""
    for a, b in (bmm.args[:2], bmm.args[1::-1]):
        w = _up(a, lambda s: len(s) == 2)
        if w is None:
            continue
        n, k = _shape(w)
        y = _up(b, lambda s, nk=(n, k): len(s) == 3 and s[:2] == nk and s[2] > 1)
        if y is None:
            continue
        out = _down(bmm, (n, _shape(y)[2]))
        if (out is None or any(_val(t).dtype != torch.float32 for t in (w, y, out))
                or routed and not _expert_output(y, n, k)):
            continue
        return w, y, out
    return None


def _canonical(w, y):
    return (w.unsqueeze(-1) * y).sum(1)


def _region(out: fx.Node, roots: set) -> list[fx.Node] | None:
    """The nodes between roots and out in graph order, if they read nothing else."""
    seen, stack = set(), [out]
    while stack:
        node = stack.pop()
        if node in seen or node in roots:
            continue
        if node.op != "call_function":
            return None
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in out.graph.nodes if n in seen]


def evaluates_as_sum(w: fx.Node, y: fx.Node, out: fx.Node) -> bool:
    region = _region(out, {w, y})
    if region is None:
        return False
    with inductor.unset_fake_temporarily():
        gen = torch.Generator().manual_seed(0)
        env = {w: torch.rand(_shape(w), generator=gen),
               y: torch.randn(_shape(y), generator=gen)}
        for node in region:
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = call_on_cpu(node.target, args, kwargs)
        got, want = env[out], _canonical(env[w], env[y])
        return (got.dtype == want.dtype and got.shape == want.shape
                and bool((got - want).abs().max() <= RTOL * want.abs().max()))


def _write(graph: fx.Graph, bmm: fx.Node, site: tuple, cache: dict) -> bool:
    w, y, out = site
    if not evaluates_as_sum(w, y, out):
        return False
    return splice_if_same(graph, traced(_canonical, [w, y], cache), [w, y], out)


def apply(graph: fx.Graph) -> int:
    if graph.owning_module is None:
        return 0
    cache: dict = {}
    return rewrite_sites(graph, combine_site, lambda g, n, s: _write(g, n, s, cache),
                         targets={aten.bmm.default}, sort=True)


RULE = Rule("expert_combine", apply,
            "the top-k weighted finalize as einsum / bmm / matmul over fp32 expert outputs -> "
            "(w.unsqueeze(-1) * y).sum(1)")

__all__ = ["RULE", "apply", "combine_site", "evaluates_as_sum"]
