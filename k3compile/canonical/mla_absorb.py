"""Rule `mla_absorb`: Gated MLA written in the non-absorbed form over a latent cache -> the absorbed
form our model (`GatedMLA.forward`) traces to, which patterns mla_q_absorb, mla_decode and
mla_uv_gate match.

DeepSeek/HF-style code up-projects every cached latent, kv = c·W_kvbᵀ [B, L, H·(N + V)], splits it
per head into k_nope | v, scores q against cat(k_nope, k_pe) (or as a nope and a rope term), masks,
softmaxes and takes p·v. The rewrite is algebraic, q·(W_UK·c)ᵀ = (W_UKᵀ·q)·cᵀ and
p·(c·W_UVᵀ) = (p·c)·W_UVᵀ, so it rounds differently: against the non-absorbed eager code the
rewritten graph is within 6e-7 relative in fp32 (tests), and bit for bit our model's graph. In
bf16 both forms round every product to bf16 and softmax in fp32; they round at different points
(absorbed: q·W_UK, the two score terms and their sum, p·c; non-absorbed: c·W_kvbᵀ, the scores and
their bf16 scaling), so a near-tie top-k downstream may go either way: tests/adapt checks the
compiled bf16 step is as close to an fp32 copy of the weights as Moonshot's eager is.

Matching is structural, not by spelling: from each read of a cache that was just written
(`index(index_put(cache, [slots, pos], rows), [slots])`) the rule follows the contractions
(`mm`/`bmm`, however einsum/matmul/linear lowered them) through view-like ops and reads each one
as an einsum over named axes (`k3compile.canonical.layout`): kv = c·W_kvbᵀ, scores =
q_nope·k_nopeᵀ + q_pe·k_peᵀ, o = p·v, o flattened to [B, T, H·V] (or, T-less, to [B, H·V]: code
without a token dim, its cache write lifted by rule token_dim; the absorbed o is viewed back).
Head count and head dims are solved from the shapes (every head count dividing both projections is
tried). What lies between the scores and p (scale, mask as -inf fill or additive bias, softmax in
fp32 or not, casts) is not matched but evaluated: on random scores and positions it must equal the
canonical scale -> causal mask over `pos` -> fp32 softmax, or the site is left alone. The cache
write's row indices are put in mla_decode's form too (`slots.view(B, 1)`, `positions.view(B, 1) +
arange(T)` for foreign `unsqueeze(1)` / `[:, None]`).

Before: bmm(c, W_kvbᵀ), view, split, cat(k_nope, expand(k_pe)), bmm(q, kᵀ), mul, where/add, softmax,
    bmm(p, v), permute, view
After:  view(q_b), split, einsum(q_nope, W_UK), einsum(q_lat, c) + einsum(q_pe, k_pe), convert, mul,
    le, where, softmax, convert, einsum(p, c), einsum(o_lat, W_UV), view   (= GatedMLA.forward)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.canonical.layout import (
    SPLITS,
    Axis,
    Einsum,
    einsum,
    flat,
    is_contraction,
    is_scalar,
    labels,
    layout,
    layout_source,
    terms,
)
from k3compile.canonical.region import call_on_cpu, output_of, splice
from k3compile.graph import call
from k3compile.rewrite import inductor

log = logging.getLogger("k3compile")
aten, prims = torch.ops.aten, torch.ops.prims

# p (the softmax output, <= 1) against the canonical one on random scores, absolute: the canonical
# form scales and masks in fp32, a bf16 spelling may round the scaled scores first (measured on
# the test spellings: bf16 <= 1e-3, fp32 <= 6e-8)
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}

# ---- the site ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Site:
    read: fx.Node  # cache_out[slots]: [B, L, C + R]
    pos: fx.Node  # [B, T] positions of the written rows (the cache write's index)
    weight: fx.Node  # kv_b_proj.weight [H·(N + V), C]
    projections: list[fx.Node]  # the contractions c·W_kvbᵀ (one, or k and v apart)
    scores: list[fx.Node]  # the contractions q·kᵀ (one over cat(q, k), or nope and rope apart)
    pv: fx.Node  # p·v
    p: fx.Node  # softmax output (what pv reads)
    out: fx.Node  # o flattened [B, T, H·V]


def reached_contractions(node: fx.Node, through) -> list[fx.Node]:
    """Contractions reached from node through users that `through` accepts."""
    seen, todo, found = set(), [node], []
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if is_contraction(u):
                found.append(u)
            elif through(u):
                todo.append(u)
    return found


def viewlike(n: fx.Node) -> bool:
    return layout_source(n) is not None or n.target == aten.cat.default or n.target in SPLITS


def cache_reads(graph: fx.Graph):
    for node in graph.nodes:
        if node.target != aten.index.Tensor or len(node.args[1]) != 1:
            continue
        write = node.args[0]
        if getattr(write, "target", None) != aten.index_put.default or len(write.args[1]) != 2:
            continue
        pos = write.args[1][1]
        if isinstance(pos, fx.Node) and node.meta["val"].dim() == 3 \
                and pos.meta["val"].dim() == 2 and pos.meta["val"].dtype == torch.int64:
            yield node, pos


def find_site(read: fx.Node, pos: fx.Node) -> Site | str:
    """The non-absorbed attention over the cache read `read`, or why there is none."""
    width = int(read.meta["val"].shape[-1])
    by_weight: dict[fx.Node, list[fx.Node]] = {}
    from_read = reached_contractions(read, viewlike)
    for mm in from_read:
        for term in terms(mm) or []:
            w = {term.a.root, term.b.root} - {read}
            w = next(iter(w)) if len(w) == 1 else None
            if w is not None and w.op == "placeholder" and w.meta["val"].dim() == 2 \
                    and int(w.meta["val"].shape[1]) < width:
                by_weight.setdefault(w, []).append(mm)
    if len(by_weight) != 1:
        return f"{len(by_weight)} weights project the cached latents (want one: kv_b_proj)"
    weight, projections = next(iter(by_weight.items()))
    products = {s for p in projections for s in reached_contractions(p, viewlike)}
    products |= set(from_read) - set(projections)
    pv = [s for s in products if softmax_root(s) is not None]
    if len(pv) != 1:
        return f"{len(pv)} products of softmax probabilities with projected values (want one)"
    pv, scores = pv[0], sorted(products - {pv[0]}, key=graph_order(read))
    if not scores:
        return "no product of queries with the projected keys"
    out = flat_output(pv, read, pos)
    if out is None:
        return "the attention output is never flattened to [B, T, heads x v_dim]"
    return Site(read, pos, weight, projections, scores, pv, softmax_root(pv), out)


def graph_order(read: fx.Node):
    return {n: i for i, n in enumerate(read.graph.nodes)}.__getitem__


def softmax_root(node: fx.Node) -> fx.Node | None:
    """The root of node's operand that comes from a softmax (exp over a sum of exps, maybe
    cast), if node is one product."""
    ts = terms(node) or []
    roots = [r for r in ((ts[0].a.root, ts[0].b.root) if len(ts) == 1 else ()) if softmax_like(r)]
    return roots[0] if len(roots) == 1 else None


def softmax_like(node: fx.Node) -> bool:
    while node.target in (prims.convert_element_type.default, aten._to_copy.default):
        node = node.args[0]
    if node.target == aten._softmax.default:
        return True
    if node.target != aten.div.Tensor or not isinstance(node.args[1], fx.Node):
        return False
    total = node.args[1]
    return total.target == aten.sum.dim_IntList and total.args[0] is node.args[0] \
        and node.args[0].target == aten.exp.default


def _flat_output(pv: fx.Node, rank: int = 3) -> fx.Node | None:
    """The first node down pv's single-user view-like chain that is 3-D ([B, T, H·V]); with
    rank 2, the first that is 2-D ([B, H·V], a T-less site)."""
    node = pv
    while len(node.users) == 1:
        node = next(iter(node.users))
        if layout_source(node) is None or node.target in (aten.mul.Tensor, aten.div.Tensor):
            return None
        if node.meta["val"].dim() == rank:
            return node
    return None


def flat_output(pv: fx.Node, read: fx.Node, pos: fx.Node) -> fx.Node | None:
    """The flattened output o of the site: [B, T, H·V], or at T = 1 [B, H·V] where no
    [B, T, ...] node comes first (attention written without a token dim, rule token_dim)."""
    B, T = int(read.meta["val"].shape[0]), int(pos.meta["val"].shape[1])
    out = _flat_output(pv)
    if out is not None and list(out.meta["val"].shape[:2]) == [B, T] or T != 1:
        return out
    flat = _flat_output(pv, rank=2)
    return flat if flat is not None and int(flat.meta["val"].shape[0]) == B else out


# ---- reading the site: sizes, the einsums, the softmax chain -----------------------------------

@dataclasses.dataclass(frozen=True)
class Sizes:
    B: int
    T: int
    L: int
    H: int
    N: int  # nope head dim
    R: int  # rope dim
    V: int  # value head dim
    C: int  # kv_lora_rank
    q: fx.Node  # the q_b projection's output, [B·T, H·(N + R)] or [B, T, H·(N + R)]
    term_scale: float  # what q (or k) was multiplied by before the scores


def _query(site: Site) -> fx.Node | None:
    known = {site.read, *site.projections}
    roots = {r for s in site.scores for t in terms(s) or [] for r in (t.a.root, t.b.root)} - known
    return next(iter(roots)) if len(roots) == 1 else None


def read_site(site: Site) -> tuple[Sizes, dict] | str:
    """Sizes under which every contraction of the site is the einsum non-absorbed MLA computes
    (the head count solved by trying each that fits both projections) and the named axes of
    every root and product, or why there are none."""
    B, L, width = (int(s) for s in site.read.meta["val"].shape)
    T = int(site.pos.meta["val"].shape[1])
    J, C = (int(s) for s in site.weight.meta["val"].shape)
    q = _query(site)
    if q is None:
        return "the scores do not read one query tensor"
    dtypes = {n.meta["val"].dtype for n in (q, site.weight, site.read, site.out)}
    if len(dtypes) != 1:
        return f"queries, W_kvb, cache and output in {sorted(map(str, dtypes))}: not one dtype"
    Jq, rem = divmod(q.meta["val"].numel(), B * T)
    if rem:
        return f"queries {list(q.meta['val'].shape)} are not [B={B}, T={T}, ...]"
    R = width - C
    tried = []
    for H in (h for h in range(math.gcd(J, Jq), 0, -1) if J % h == 0 and Jq % h == 0):
        N = Jq // H - R
        V = J // H - N
        if N <= 0 or V <= 0:
            continue
        sizes = Sizes(B, T, L, H, N, R, V, C, q, 1.0)
        why = _check_einsums(site, sizes)
        if not isinstance(why, str):
            return why
        tried.append(f"{H} heads: {why}")
    return "; ".join(tried[:3]) or f"no head count fits W_kvb [{J}, {C}] and queries of {Jq}"


def _check_einsums(site: Site, z: Sizes) -> tuple[Sizes, dict] | str:
    axes = {site.read: [("b", z.B, 0), ("l", z.L, 0), ("w", z.C + z.R, 0)],
            site.weight: [("h", z.H, 0), ("e", z.N + z.V, 0), ("c", z.C, 0)],
            z.q: [("b", z.B, 0), ("t", z.T, 0), ("h", z.H, 0), ("d", z.N + z.R, 0)]}
    for mm in site.projections:
        e = _einsums(mm, axes)
        if e is None or len(e) != 1 or _pairs(e[0]) != {("w", z.C, 0), ("c", z.C, 0)}:
            return f"{mm.name} is not c·W_kvbᵀ over all {z.C} latent channels"
        if _names(e[0].out) != _want(z, "behl") or not _full(e[0].out, z, "bhl"):
            return f"{mm.name} does not give [B, L, heads, dims]"
        axes[mm] = e[0].out
    kinds, scales = [], set()
    nope, rope = {("d", z.N, 0), ("e", z.N, 0)}, {("d", z.R, z.N), ("w", z.R, z.C)}
    for s in site.scores:
        es = _einsums(s, axes)
        if not es or any(_names(e.out) != _want(z, "bhlt") for e in es) \
                or not all(_full(e.out, z, "bhlt") for e in es) \
                or any(e.out != es[0].out for e in es):
            return f"{s.name} is not a [B, heads, T, L] score product"
        for e in es:
            kind = "nope" if _pairs(e) == nope else "rope" if _pairs(e) == rope else None
            if kind is None or (kind == "nope") != (site.weight not in e.roots and z.q in e.roots
                                                    and site.read not in e.roots):
                return f"{s.name} contracts {sorted(_pairs(e))}, not q_nope·k_nope or q_pe·k_pe"
            kinds.append(kind)
            scales.add(e.scale)
        axes[s] = es[0].out
    if sorted(kinds) != ["nope", "rope"] or len(scales) != 1:
        return f"score terms {sorted(kinds)} with scales {sorted(scales)}"
    p_axes = _probability_axes(site, axes)
    if p_axes is None:
        return "the softmax does not keep the scores' shape"
    axes[site.p] = p_axes
    e = _einsums(site.pv, axes)
    if e is None or len(e) != 1 or _pairs(e[0]) != {("l", z.L, 0)} \
            or _names(e[0].out) != _want(z, "beht") \
            or not _full(e[0].out, z, "bht") or ("e", z.V, z.N) not in e[0].out:
        return f"{site.pv.name} is not p·v over the value half of each head"
    flat = layout(site.out)
    dims = [[("b", z.B, 0)], [("t", z.T, 0)], [("h", z.H, 0), ("e", z.V, z.N)]]
    if site.out.meta["val"].dim() == 2:  # T-less: o [B, heads·v_dim] (rule token_dim)
        del dims[1]
    want = [[x for x in dim if x[1] > 1] for dim in dims]
    if flat is None or flat.root is not site.pv or flat.scale != 1.0 \
            or labels(flat, e[0].out) != want:
        return f"{site.out.name} is not o [B, T, heads·v_dim]"
    return dataclasses.replace(z, term_scale=scales.pop()), axes


def _einsums(mm: fx.Node, axes) -> list[Einsum] | None:
    ts = terms(mm)
    if ts is None:
        return None
    es = [einsum(t, axes, mm.target == aten.bmm.default) for t in ts]
    return None if any(e is None for e in es) else es


def _pairs(e: Einsum) -> set:
    return {x for pair in e.k for x in pair} if len(e.k) == 1 else {("many", 0, 0)}


def _names(out: list[Axis]) -> list[str]:
    return sorted(x[0] for x in out)


def _want(z: Sizes, names: str) -> list[str]:
    size = {"b": z.B, "h": z.H, "l": z.L, "t": z.T}
    return sorted(n for n in names if n == "e" or size[n] > 1)


def _full(out: list[Axis], z: Sizes, names: str) -> bool:
    size = {"b": z.B, "h": z.H, "l": z.L, "t": z.T}
    return all(x[1:] == (size[x[0]], 0) for x in out if x[0] in names) and \
        all(x[0] != "*" for x in out)


def _score_view(s: fx.Node) -> fx.Node:
    """The last node down s's single-user chain of pure layout ops (no scalar multiples)."""
    node = s
    while len(node.users) == 1:
        user = next(iter(node.users))
        if layout_source(user) is None or user.target in (aten.mul.Tensor, aten.div.Tensor):
            break
        node = user
    return node


def _probability_axes(site: Site, axes) -> list[Axis] | None:
    s = site.scores[0]
    view = _score_view(s)
    dims = labels(layout(view), axes[s]) if view is not s else [[x] for x in axes[s]]
    if dims is None or list(site.p.meta["val"].shape) != list(view.meta["val"].shape):
        return None
    return flat(dims)


def cone(outputs: list[fx.Node], stop: set[fx.Node]) -> list[fx.Node]:
    """Nodes outputs depend on, not looking past `stop`, in graph order."""
    seen, todo = set(), list(outputs)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo += n.all_input_nodes
    order = graph_order(outputs[0])
    return sorted(seen, key=order)


def chain_scale(site: Site) -> float:
    """The scalars the scores are multiplied by on their way to the softmax."""
    scale, after = 1.0, set(site.scores)
    for n in cone([site.p], set(site.scores)):
        if n in after or not any(a in after for a in n.all_input_nodes):
            continue
        after.add(n)
        if n.target in (aten.mul.Tensor, aten.div.Tensor) and is_scalar(n.args[1]):
            scale = scale * n.args[1] if n.target == aten.mul.Tensor else scale / n.args[1]
    return scale


def probe(site: Site, z: Sizes, axes: dict, scale: float, seed: int = 0) -> str | None:
    """Run what lies between the score products and p on random scores and positions; None when
    it equals scale -> causal mask over `pos` -> fp32 softmax -> cast (the canonical chain).
    The verdict is kept per chain (ops, literals, shapes): the layers of one model share it."""
    nodes = cone([site.p, site.pos], set(site.scores))
    key = (_chain_key(nodes, site), scale,
           *(tuple(axes[n]) for n in (site.p, *site.scores)))
    if key not in _PROBED:
        if len(_PROBED) > 256:
            _PROBED.clear()
        _PROBED[key] = _run_probe(site, z, axes, scale, nodes, seed)
    return _PROBED[key]


_PROBED: dict[tuple, str | None] = {}


def _chain_key(nodes: list[fx.Node], site: Site) -> tuple:
    where = {n: i for i, n in enumerate(nodes)}
    roles = {site.p: "p", site.pos: "pos", **{s: "scores" for s in site.scores}}

    def describe(n: fx.Node):
        val = n.meta.get("val")
        meta = (str(val.dtype), tuple(val.shape), str(val.device)) if isinstance(val, torch.Tensor) \
            else None
        if n in site.scores or n.op != "call_function":
            return roles.get(n, n.op), meta
        args = fx.map_arg((n.args, n.kwargs), lambda a: ("node", where[a]))
        return roles.get(n, n.op), str(n.target), repr(args), meta

    return tuple(describe(n) for n in nodes)


def _run_probe(site: Site, z: Sizes, axes: dict, scale: float, nodes: list[fx.Node],
               seed: int) -> str | None:
    gen = torch.Generator().manual_seed(seed)
    env: dict[fx.Node, object] = {}
    with inductor.unset_fake_temporarily():
        for n in nodes:
            val = n.meta.get("val")
            if n in site.scores:
                env[n] = torch.randn(list(val.shape), generator=gen).to(val.dtype)
            elif n.op == "placeholder":
                if val.dtype != torch.int64 or val.dim() != 1:
                    return f"the mask reads {n.name} ({val.dtype}{list(val.shape)})"
                env[n] = torch.randint(0, z.L - z.T + 1, list(val.shape), generator=gen)
            elif n.op == "call_function" and not is_write(n):
                args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = call_on_cpu(n.target, args, kwargs)
            else:
                return f"the softmax input depends on {n.name} ({n.op} {n.target})"
        return _compare(env[site.p], _canonical_p(site, z, axes, env, scale))


def _compare(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"p is {got.dtype}{list(got.shape)}, the canonical p {want.dtype}{list(want.shape)}"
    err = float((got.double() - want.double()).abs().max())
    if not err <= TOLERANCE.get(got.dtype, 0.0):
        return f"scale/mask/softmax differ from the canonical ones by {err:.3g}"
    return None


def is_write(n: fx.Node) -> bool:
    return n.target in (aten.index_put.default, aten.copy_.default) or \
        getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable


def _canonical_p(site: Site, z: Sizes, axes: dict, env: dict, scale: float) -> torch.Tensor:
    order = "bhtl"
    total = 0
    for s in site.scores:
        names = [x[0] for x in axes[s]]
        v = env[s].reshape([x[1] for x in axes[s]])
        v = v.permute([names.index(n) for n in order if n in names])
        total = total + v.reshape(z.B, z.H, z.T, z.L)
    dtype = env[site.scores[0]].dtype
    pos = env[site.pos]
    visible = torch.arange(z.L, device=pos.device).view(1, 1, -1) <= pos.unsqueeze(-1)
    scores = (total.float() * scale).masked_fill(~visible.unsqueeze(1), float("-inf"))
    p = torch.softmax(scores, dim=-1).to(dtype)  # [B, H, T, L]
    names = [x[0] for x in axes[site.p]]
    full = [n for n in order if n not in names]
    p = p.permute([order.index(n) for n in full + names]).reshape(list(env[site.p].shape))
    return p


# ---- the rewrite -------------------------------------------------------------------------------

def absorbed(z: Sizes, scale: float):
    """GatedMLA.forward's attention from the q_b output to o [B, T, H·V], for tracing."""
    B, T, H, N, R, V, C, L = z.B, z.T, z.H, z.N, z.R, z.V, z.C, z.L

    def fn(q, w_kvb, cache, pos):
        if q.dim() == 2:
            q = q.view(B, T, H * (N + R))
        q_nope, q_pe = q.view(B, T, H, N + R).split([N, R], dim=-1)
        w_uk, w_uv = w_kvb.view(H, N + V, C).split([N, V], dim=1)
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)
        kv_lat, kv_pe = cache.split([C, R], dim=-1)
        scores = (torch.einsum("bthc,blc->bthl", q_lat, kv_lat)
                  + torch.einsum("bthr,blr->bthl", q_pe, kv_pe))
        scores = scores.float() * scale
        visible = torch.arange(L, device=q.device).view(1, 1, -1) <= pos.unsqueeze(-1)
        scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        o_lat = torch.einsum("bthl,blc->bthc", p, kv_lat)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * V)

    return fn


def rewrite(graph: fx.Graph, site: Site, z: Sizes, scale: float) -> str | None:
    """Splice the absorbed attention in for site.out; None when done, else why not."""
    inputs = [z.q, site.weight, site.read, site.pos]
    vals = [n.meta["val"] for n in inputs]
    mode = torch._guards.detect_fake_mode(vals)
    with mode or contextlib.nullcontext():
        gm = inductor.fwd_only_joint(absorbed(z, scale), vals)
    old, got = site.out.meta["val"], output_of(gm).meta.get("val")
    # T-less (rule token_dim): o [B, H·V] from the canonical [B, 1, H·V]
    tokenless = got is not None and z.T == 1 and old.dim() == 2 and got.dim() == 3 \
        and list(got.shape) == [old.shape[0], 1, old.shape[1]]
    if got is None or got.dtype != old.dtype or list(got.shape) != list(old.shape) \
            and not tokenless:
        return f"the absorbed form gives {got and got.dtype}{list(got.shape) if got is not None else ''}"
    # its own ending: a T-less site's output is [B, H·V], the copy's [B, 1, H·V] (checked on
    # the trace, so nothing is copied in where the site stays)
    new = splice(graph, gm, inputs, site.out, rule="mla_absorb")
    if tokenless:
        _lift_tokenless(graph, site, z, new)
    else:
        site.out.replace_all_uses_with(new)
    return None


def _lift_tokenless(graph: fx.Graph, site: Site, z: Sizes, new: fx.Node) -> None:
    """A T-less site's readers read the [B, 1, H·V] output viewed back (its elementwise readers,
    the output gate, lifted to [B, 1, ...] with it), and the query's GEMM reads its input
    through [B, 1, ...] as a linear at T = 1 does (rule token_dim)."""
    from k3compile.canonical.token_dim import Lifter

    lifter = Lifter(graph)
    lifter.sink(site.out, new)
    q = z.q
    x = q.args[0] if q.target == aten.mm.default else None
    if isinstance(x, fx.Node) and x.meta["val"].dim() == 2 and q.meta["val"].dim() == 2:
        q.replace_input_with(x, lifter.squeezed(lifter.lift(x), x))


def apply(graph: fx.Graph) -> int:
    """Rewrite every non-absorbed MLA attention over a just-written latent cache, and the rows it
    was written at into `positions.view(B, 1) + arange(T)`; returns how many sites changed. A
    site that does not read as MLA is left alone (logged at debug level, with why)."""
    return apply_at_cache_reads(graph, "mla_absorb", _apply_one)


def apply_at_cache_reads(graph: fx.Graph, rule: str, apply_one, clean: bool = False) -> int:
    """`apply_one(graph, read, pos)` (None: rewritten; else why not) at every read of a
    just-written latent cache, then the rows the cache was written at in the canonical form;
    returns how many sites changed. A site that raises is left as it is (logged); `clean`: dead
    code goes after each rewritten site."""
    done = 0
    for read, pos in list(cache_reads(graph)):
        try:
            why = apply_one(graph, read, pos)
        except Exception as e:  # noqa: BLE001 (a site the rule cannot read stays as it is)
            log.warning("k3 %s: %s left alone: %s: %s", rule, read.name, type(e).__name__, e)
            why = "raised"
        if why is not None:
            log.debug("k3 %s: %s left alone: %s", rule, read.name, why)
        elif clean:
            graph.eliminate_dead_code()
        rows = _latent(read) and canonical_rows(graph, pos)
        done += why is None or rows
    return done


def _latent(read: fx.Node) -> bool:
    """read is split along its last dim into two parts ([c_kv | k_pe]): a latent cache."""
    return any(len(u.args) == 3 and len(u.args[1]) == 2 and u.args[2] in (-1, 2)
               for u in read.users if u.target == aten.split_with_sizes.default)


def canonical_rows(graph: fx.Graph, pos: fx.Node) -> bool:
    """The latent cache write's indices as mla_decode's search traces them: slots as
    `view(slots, [B, 1])`, pos as `add(view(positions, [B, 1]), iota(T))` (foreign code writes
    `unsqueeze(1)`, `[:, None]`, or the sum the other way round). True when it changed any."""
    write = next(u for u in pos.users if u.target == aten.index_put.default)
    changed = False
    slots = _as_column(graph, write.args[1][0])
    if slots is not None:
        write.args = (write.args[0], [slots, pos], *write.args[2:])
        changed = True
    if pos.target != aten.add.Tensor or len(pos.args) != 2 or pos.kwargs:
        return changed
    rows, steps = pos.args if getattr(pos.args[1], "target", None) == prims.iota.default \
        else reversed(pos.args)
    if getattr(steps, "target", None) != prims.iota.default:
        return changed
    column = _as_column(graph, rows)
    if column is not None or pos.args[0] is not rows:
        pos.args = (column or rows, steps)
        changed = True
    return changed


def _as_column(graph: fx.Graph, node) -> fx.Node | None:
    """A new `view(x, [B, 1])` for node when node is x [B] (int) as a column spelled otherwise;
    None when it already is that view, or is no column of a 1-D tensor."""
    lay = layout(node) if isinstance(node, fx.Node) else None
    if lay is None or lay.root is node or lay.scale != 1.0 or lay.root.meta["val"].dim() != 1:
        return None
    if node.target == aten.view.default and node.args[0] is lay.root:
        return None
    B = int(lay.root.meta["val"].shape[0])
    if list(node.meta["val"].shape) != [B, 1] or \
            labels(lay, [("b", B, 0)]) != [[("b", B, 0)] if B > 1 else [], []]:
        return None
    with graph.inserting_before(node):
        return call(graph, aten.view.default, (lay.root, [B, 1]), like=node)


def takes(read: fx.Node, pos: fx.Node) -> tuple[Site, Sizes, float] | str:
    """(site, sizes, the scores' whole scale) where the rule rewrites the attention over the
    cache read `read`, else why it does not (rule `mla_upcast` asks before it keeps a rewrite)."""
    site = find_site(read, pos)
    if isinstance(site, str):
        return site
    found = read_site(site)
    if isinstance(found, str):
        return found
    z, axes = found
    chain = chain_scale(site)
    if why := probe(site, z, axes, chain):
        return why
    return site, z, z.term_scale * chain


def _apply_one(graph: fx.Graph, read: fx.Node, pos: fx.Node) -> str | None:
    found = takes(read, pos)
    return found if isinstance(found, str) else rewrite(graph, *found)


RULE = Rule(
    name="mla_absorb",
    apply=apply,
    summary="non-absorbed MLA over a latent cache (K/V up-projected, cat/two-term rope, any "
            "scale/mask/softmax spelling) -> the absorbed form (W_UK into q, W_UV after p·c)",
)
