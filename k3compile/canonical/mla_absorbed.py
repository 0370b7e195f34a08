"""Rule `mla_absorbed`: Gated MLA already written in the absorbed form, but spelled otherwise ->
the absorbed form our model (`GatedMLA.forward`) traces to, which patterns mla_q_absorb,
mla_decode and mla_uv_gate match (rule `mla_absorb` does the same for the non-absorbed form).

DeepSeek-inference-style code absorbs W_UK / W_UV itself, but its spelling is its own: W_UK and
W_UV as slices of kv_b's weight in einsums, q_nope | q_pe and the cache parts by slicing, the
scale applied before or after the cast to fp32, the causal mask by `torch.where(visible, s,
-inf)` on a [B, T, 1, L] comparison, the cache written at `slots.unsqueeze(1)`. Each of these is
the same attention; none is the graph the patterns were traced from. SDPA over one latent "KV
head" [c_kv | k_pe] with V its first C columns (`enable_gqa` or the head broadcast; the mask the
positions' causal one) reaches this rule as such a spelling once rule sdpa_math has read its math
path: the scale split as √c on q and on kᵀ, before the products. spell12's attention (scores one
`baddbmm` of an additive 0 / -inf bias over [B, T·H, C + R] queries, the cache written by
`Tensor.put`) reaches it once rules put_rows / paged_write have made the write a (slot, position)
row write and baddbmm_mask the scores a masked, scaled `bmm`.

Matching is structural, then numerical. From each read of a cache that was just written
(`index(index_put(cache, [slots, pos], rows), [slots])`): the products that read it (mm/bmm,
however lowered; `k3compile.canonical.layout`) are p·c (p a softmax) and the score terms; p·c
feeds one product with a weight W_kvb [H·(N + V), C] (or kept 3-D, [H, N + V, C], as spell13
keeps it: its first dim is then the head count) whose output is flattened to
[B, T, H·V]; the score terms read one query q (the q_b output) besides the cache, directly or
through one product with W_kvb (q_nope·W_UK). Head count and dims are solved from the shapes
(every head count dividing both widths is tried); the scale is the product of the scalars between
the scores and the softmax and of those the score products' operands were multiplied by (one
number for every term). Then the whole site, from (q, W_kvb, cache, positions) to the flattened
output, runs on random values: it must equal the canonical absorbed attention within
`TOLERANCE`, or the site is left alone (SDPA's V not the cache's first C columns, a mask not the
positions' causal one). A site that is the canonical form already (the same ops
as its trace) is left as it is, unchecked. The cache write's indices are put in mla_decode's
form (rule mla_absorb's).

Rounding: in fp32 equal to rounding order (the tests: <= 1e-6 relative); in bf16 a spelling
that scales the scores in bf16 before the cast rounds them once more than the canonical form.

Before: slice(q), einsum(q_nope, slice(view(W_kvb))), slice(cache) x 3, einsums, add, mul, le,
    where(visible, s, full(-inf)), softmax, einsum(p, c), einsum(o_lat, slice(view(W_kvb))), view
After:  (= rule mla_absorb's After: GatedMLA.forward's absorbed attention)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.canonical.layout import terms
from k3compile.canonical.mla_absorb import (
    Site,
    Sizes,
    absorbed,
    apply_at_cache_reads,
    chain_scale,
    cone,
    flat_output,
    graph_order,
    is_write,
    reached_contractions,
    rewrite,
    softmax_root,
    viewlike,
)
from k3compile.canonical.region import call_on_cpu
from k3compile.rewrite import inductor

# the site's output against the canonical attention on the same random inputs, relative to its
# largest magnitude (bf16: a spelling may round the scaled scores to bf16 before the softmax)
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def find_site(read: fx.Node, pos: fx.Node) -> tuple[Site, fx.Node] | str:
    """The absorbed attention over the cache read `read` and its query q, or why there is none."""
    width = int(read.meta["val"].shape[-1])
    from_read = reached_contractions(read, viewlike)
    pv = [s for s in from_read if softmax_root(s) is not None]
    if len(pv) != 1:
        return f"{len(pv)} products of softmax probabilities with the cache (want one: p·c)"
    pv = pv[0]
    scores = sorted(set(from_read) - {pv}, key=graph_order(read))
    if not scores:
        return "no product of queries with the cache"
    ups = reached_contractions(pv, viewlike)
    weights = {r for t in (terms(ups[0]) or []) for r in (t.a.root, t.b.root)} - {pv} \
        if len(ups) == 1 else set()
    weight = next(iter(weights)) if len(weights) == 1 else None
    if weight is None or weight.op != "placeholder" or weight.meta["val"].dim() not in (2, 3) \
            or int(weight.meta["val"].shape[-1]) >= width:
        return ("p·c is not projected by one weight [H·(N + V), C] or [H, N + V, C] (W_UV, a "
                "part of kv_b_proj.weight)")
    out = flat_output(ups[0], read, pos)
    if out is None:
        return "the attention output is never flattened to [B, T, heads x v_dim]"
    queries = set()
    for s in scores:
        for t in terms(s) or [None]:
            if t is None:
                return f"{s.name} is no product of two tensors"
            for root in {t.a.root, t.b.root} - {read}:
                inner = {r for u in (terms(root) or []) for r in (u.a.root, u.b.root)} \
                    if root.target in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default) \
                    else set()
                queries |= (inner - {weight}) if weight in inner else {root}
    if len(queries) != 1:
        return f"the scores read {len(queries)} query tensors (want one: the q_b output)"
    return Site(read, pos, weight, [], scores, pv, softmax_root(pv), out), queries.pop()


def all_sizes(site: Site, q: fx.Node):
    """Every Sizes the shapes allow, most heads first."""
    B, L, width = (int(s) for s in site.read.meta["val"].shape)
    T = int(site.pos.meta["val"].shape[1])
    *heads, C = (int(s) for s in site.weight.meta["val"].shape)
    J = math.prod(heads)  # a 3-D weight [H, N + V, C] names its head count
    Jq, rem = divmod(q.meta["val"].numel(), B * T)
    R = width - C
    if rem or R <= 0:
        return
    for H in (h for h in range(math.gcd(J, Jq), 0, -1) if J % h == 0 and Jq % h == 0
              and (len(heads) == 1 or h == heads[0])):
        N, V = Jq // H - R, J // H - (Jq // H - R)
        if N > 0 and V > 0:
            yield Sizes(B, T, L, H, N, R, V, C, q, 1.0)


def term_scale(site: Site) -> float | None:
    """What the score products' operands were multiplied by before the products, one number for
    every term (SDPA's math path splits its scale as √c on q and on kᵀ: rule sdpa_math), or None
    where the terms carry different ones (the check would refuse the site anyway)."""
    scales = {t.a.scale * t.b.scale for s in site.scores for t in terms(s) or []}
    return scales.pop() if len(scales) == 1 else None


def _ops(nodes) -> collections.Counter:
    return collections.Counter(str(n.target) for n in nodes if n.op == "call_function")


def check(site: Site, z: Sizes, scale: float, seed: int = 0) -> str | None:
    """None when the site computes the canonical attention under sizes z (random q, W_kvb, cache
    and positions), else why not."""
    stops = {z.q, site.weight, site.read}
    nodes = cone([site.out, site.pos], stops)
    gen = torch.Generator().manual_seed(seed)
    env: dict[fx.Node, object] = {}
    with inductor.unset_fake_temporarily():
        for n in nodes:
            val = n.meta.get("val")
            if n in stops:
                scale_in = (1.0 if n is not site.weight else z.C ** -0.5)
                env[n] = (torch.randn(list(val.shape), generator=gen) * scale_in).to(val.dtype)
            elif n.op == "placeholder":
                if val.dtype != torch.int64 or val.dim() != 1:
                    return f"the attention reads {n.name} ({val.dtype}{list(val.shape)})"
                env[n] = torch.randint(0, z.L - z.T + 1, list(val.shape), generator=gen)
            elif n.op == "call_function" and not is_write(n):
                args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = call_on_cpu(n.target, args, kwargs)
            else:
                return f"the attention depends on {n.name} ({n.op} {n.target})"
        got = env[site.out]
        want = absorbed(z, scale)(*(env[n] for n in (z.q, site.weight, site.read, site.pos)))
        if got.dim() == 2 and z.T == 1:  # a T-less site (rule token_dim)
            want = want.reshape(got.shape[0], -1)
        if got.dtype != want.dtype or got.shape != want.shape:
            return (f"o is {got.dtype}{list(got.shape)}, the canonical o "
                    f"{want.dtype}{list(want.shape)}")
        err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
    if not err <= TOLERANCE.get(got.dtype, 0.0):
        return f"differs from the canonical absorbed attention by {err:.3g} (relative)"
    return None


def canonical_already(site: Site, z: Sizes, scale: float) -> bool:
    """The site's ops are those of the canonical form's trace (kept per sizes and dtypes: the
    layers of one model share it)."""
    vals = [n.meta["val"] for n in (z.q, site.weight, site.read, site.pos)]
    key = (dataclasses.astuple(dataclasses.replace(z, q=None)), scale,
           tuple((v.dtype, tuple(v.shape)) for v in vals))
    if key not in _TRACED:
        mode = torch._guards.detect_fake_mode(vals)
        with mode or contextlib.nullcontext():
            gm = inductor.fwd_only_joint(absorbed(z, scale), vals)
        _TRACED[key] = _ops(gm.graph.nodes)
    inputs = {z.q, site.weight, site.read, site.pos}
    mine = [n for n in cone([site.out], inputs) if n not in inputs]
    return _ops(mine) == _TRACED[key]


_TRACED: dict[tuple, collections.Counter] = {}


CANONICAL = "the canonical form already"


def takes(read: fx.Node, pos: fx.Node) -> tuple[Site, Sizes, float] | str:
    """(site, sizes, the scores' scale) where the rule rewrites the absorbed attention over the
    cache read `read`, else why it does not: `CANONICAL` where the site is the canonical form
    already (rule `mla_upcast` asks before it keeps a rewrite)."""
    found = find_site(read, pos)
    if isinstance(found, str):
        return found
    site, q = found
    before = term_scale(site)
    if before is None:
        return "the score terms' operands are scaled by different numbers"
    scale = before * chain_scale(site)
    tried = []
    for z in all_sizes(site, q):
        if canonical_already(site, z, scale):
            return CANONICAL
        why = check(site, z, scale)
        if why is None:
            return site, z, scale
        tried.append(f"{z.H} heads: {why}")
    return "; ".join(tried[:3]) or "no head count fits W_kvb and the queries"


def _apply_one(graph: fx.Graph, read: fx.Node, pos: fx.Node) -> str | None:
    found = takes(read, pos)
    return found if isinstance(found, str) else rewrite(graph, *found)


def apply(graph: fx.Graph) -> int:
    """Rewrite every absorbed MLA attention over a just-written latent cache that is not spelled
    in the canonical form, and the rows it was written at; returns how many sites changed."""
    return apply_at_cache_reads(graph, "mla_absorbed", _apply_one, clean=True)


RULE = Rule(
    name="mla_absorbed",
    apply=apply,
    summary="absorbed MLA in another spelling (W_UK/W_UV as weight slices, sliced q and cache, "
            "where-mask, scale before the cast or on q and kᵀ, unsqueezed cache rows) -> the "
            "canonical absorbed form",
)
