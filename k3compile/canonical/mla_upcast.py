"""Rule `mla_upcast`: non-absorbed MLA whose attention products read fp32 upcasts of bf16 operands
-> the same attention with bf16 products, the form rule `mla_absorb` (next in `ORDER`) takes.

SDPA's math path in bf16 upcasts q, k and v to fp32 at entry and casts o back at exit (spell6);
hand-written code upcasts them itself (spell8: `q.float()`, `key.float()`, `v.float()`, the
softmax and p·v in fp32, the output gate in fp32 before o's cast). The canonical bf16 attention
(`GatedMLA.forward`) rounds where bf16 products round. At each latent-cache site, every fp32
`bmm` whose operands are, through view-like ops and scalar multiples, upcasts of bf16 tensors
(or the fp32 softmax p) becomes:

* a score product: `bmm` of the bf16 operands (rounded to bf16), upcast, times the scalars that
  were on its operands (SDPA's √scale on q and on kᵀ), in fp32;
* p·v: `bmm(bf16(p), v)` in bf16, its view chain in bf16 down to the first other op, where the
  upcast goes (an exit cast back to bf16, SDPA's, cancels it);
* the output gate `bf16(o.float() * σ(g.float()))` of that o and a bf16 g (spell8): `o * σ(g)`
  in bf16, the canonical gate (one rounding more: σ(g) to bf16 before the product).

A rounding change with no fusion behind it is a loss, so a site is kept only where `mla_absorb`
then takes it (`mla_absorb.takes`) or, for attention written absorbed (DeepSeek-inference style,
`einsum(q_lat.float(), c.float())`, p·c in fp32 and cast back), `mla_absorbed` does
(`mla_absorbed.takes`, or the site is then the canonical form already); elsewhere every node the
rule added goes and the site is as it was. fp32 graphs have no upcasts of bf16 and are never
touched.

Rounding. Eager rounds to bf16 only K|V = c·W_kvbᵀ and o (after the gate, spell8; after p·v,
SDPA); scores, softmax, p·v and the gate stay fp32. The rule's graph rounds the scores q·kᵀ, p,
p·v and σ(g) to bf16 as well, and the absorbed form `mla_absorb` makes of it rounds q·W_UK, the
two score terms and their sum, p, p·c and o (our model's bf16 graph, bit for bit). Measured
(one attention layer, tests/canonical/mla_spellings.py, 2 steps, against an fp32 copy of the
same bf16 weights, relative error of the layer's output; session 28): spell8's form, eager
3.4e-3 / 5.2e-3 (B 2, T 1) and 3.6e-3 / 7.5e-3 (B 1, T 3), compiled 3.6e-3 / 5.6e-3 and 3.6e-3 /
1.05e-2; SDPA, eager 3.6e-3 / 5.2e-3 and 3.6e-3 / 9.8e-3, compiled the same as spell8's (one
canonical graph); compiled vs eager <= 7.4e-3 (TOL["bfloat16"] 2e-2). Whole spell6 / spell8 bf16,
compiled vs eager: 4.6e-2 / 4.2e-2 (4.5e-2 / 4.5e-2 without the rule; TOL["diffsuite_bf16"] 5e-2).
Absorbed (tests/canonical/absorbed_mla_spellings.py `upcast_products`: eager rounds q_lat and
o_lat to bf16, the two score terms, their sum, p and p·c stay fp32; the rule rounds each score
term, p and p·c to bf16, mla_absorbed then the sum too; session 29, same measure): eager 3.6e-3
/ 5.2e-3 (B 2, T 1) and 4.1e-3 / 1.01e-2 (B 1, T 3), compiled 3.6e-3 / 5.6e-3 and 3.6e-3 /
1.05e-2 (our bf16 graph, as above); compiled vs eager <= 4.9e-3.

Before: convert(q), convert(k), mul(·, √s), bmm (fp32), + mask, softmax, convert(v), bmm (fp32),
    view, convert(bf16)
After:  bmm (bf16), convert, mul(·, s), + mask, softmax, convert(p), bmm (bf16), view
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, mla_absorb, mla_absorbed
from k3compile.canonical.layout import SPLITS, is_scalar, layout_source
from k3compile.canonical.region import CAST, CASTS, LOW, cast_dtype, half_upcast
from k3compile.graph import call

aten = torch.ops.aten


def _dtype(n) -> torch.dtype | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _viewable(n: fx.Node, size) -> bool:
    """n's value (a fake tensor) can be viewed as `size` without a copy."""
    try:
        n.meta["val"].view(size)
    except (RuntimeError, ValueError):  # fake tensors raise the latter
        return False
    return True


def _scalar_op(n: fx.Node) -> bool:
    return n.target in (aten.mul.Tensor, aten.div.Tensor) and is_scalar(n.args[1])


class Trial:
    """The rewrite of one site: new nodes, the uses it moved, and the way back."""

    def __init__(self, graph: fx.Graph, low: torch.dtype):
        self.graph, self.low = graph, low
        self.before = set(graph.nodes)
        self.moved: list[tuple[fx.Node, fx.Node]] = []
        self.lows: dict[fx.Node, tuple[fx.Node, float] | None] = {}

    def call(self, target, args, like: fx.Node, kwargs=None, at: fx.Node | None = None) -> fx.Node:
        """A new node before `at` (default: before `like`, whose module stack it takes)."""
        with self.graph.inserting_before(at or like):
            return call(self.graph, target, args, kwargs, like=like)

    def move(self, old: fx.Node, new: fx.Node) -> None:
        old.replace_all_uses_with(new)
        self.moved.append((old, new))

    def revert(self) -> None:
        for old, new in reversed(self.moved):
            new.replace_all_uses_with(old)
        for n in reversed([n for n in self.graph.nodes if n not in self.before]):
            self.graph.erase_node(n)

    def lowered(self, n: fx.Node) -> tuple[fx.Node, float] | None:
        """(x, c): x in bf16 and n == x.float() * c, x built from n's upcast sources by the same
        view-like ops; None where n is not that."""
        if n not in self.lows:
            self.lows[n] = self._lower(n)
        return self.lows[n]

    def _lower(self, n: fx.Node) -> tuple[fx.Node, float] | None:
        if _dtype(n) != torch.float32 or n.op != "call_function":
            return None
        if half_upcast(n, to_copy=True):
            return (n.args[0], 1.0) if _dtype(n.args[0]) == self.low else None
        if n.target == aten.cat.default:
            pieces = [self.lowered(p) for p in n.args[0]]
            if any(p is None for p in pieces) or len({c for _, c in pieces}) != 1:
                return None
            return self.call(n.target, ([x for x, _ in pieces], *n.args[1:]), n), pieces[0][1]
        src = layout_source(n)
        if src is None:
            return None
        if n.target is operator.getitem:
            split = self.lowered(n.args[0].args[0])
            if split is None or n.args[0].target not in SPLITS:
                return None
            cut = self.call(n.args[0].target, (split[0], *n.args[0].args[1:]), n.args[0])
            return self.call(operator.getitem, (cut, n.args[1]), n), split[1]
        inner = self.lowered(src)
        if inner is None:
            return None
        if _scalar_op(n):
            return inner[0], inner[1] * n.args[1] if n.target == aten.mul.Tensor \
                else inner[1] / n.args[1]
        low = inner[0]
        if n.target is aten.view.default and not _viewable(low, n.args[1]):
            # the upcast copied an expanded cache read (GQA's k.expand(); spell14): its view
            # reads the copy, so the bf16 form is copied as well
            low = self.call(aten.clone.default, (low,), n,
                            {"memory_format": torch.contiguous_format})
        return self.call(n.target, (low, *n.args[1:]), n, n.kwargs), inner[1]

    def operand(self, n: fx.Node, p: fx.Node | None) -> tuple[fx.Node, float] | None:
        """n's bf16 form; the softmax output p (fp32) is rounded to bf16 where it is met."""
        if p is not None and p not in self.lows:
            self.lows[p] = (self.call(CAST, (p, self.low), p, at=p.next), 1.0)
        return self.lowered(n)


def _products(read: fx.Node) -> list[fx.Node]:
    """The fp32 contractions reached from the cache read through views and upcasts, also past
    the bf16 projections of the cached latents."""
    def through(u):
        return mla_absorb.viewlike(u) or half_upcast(u, to_copy=True)

    found = mla_absorb.reached_contractions(read, through)
    for mm in [m for m in found if _dtype(m) in LOW]:
        found += [m for m in mla_absorb.reached_contractions(mm, through) if m not in found]
    return [m for m in found if m.target == aten.bmm.default and _dtype(m) == torch.float32]


def _softmax(bmm: fx.Node) -> fx.Node | None:
    """The fp32 softmax output one operand of bmm is a view of, if any."""
    for arg in bmm.args:
        node = arg
        while layout_source(node) is not None and not _scalar_op(node):
            node = layout_source(node)
        if mla_absorb.softmax_like(node) and node.target not in CASTS:
            return node
    return None


def _rewrite_product(t: Trial, bmm: fx.Node) -> bool:
    p = _softmax(bmm)
    ops = [t.operand(a, p) for a in bmm.args]
    if any(o is None for o in ops):
        return False
    low = t.call(aten.bmm.default, (ops[0][0], ops[1][0]), bmm)
    scale = ops[0][1] * ops[1][1]
    if p is not None and scale != 1.0:
        return False
    _sink(t, bmm, low, scale, gate=p is not None)
    return True


def _sink(t: Trial, old: fx.Node, low: fx.Node, scale: float, gate: bool) -> None:
    """The product's views replayed on its bf16 form down to the first other op; the upcast
    (and the scale) goes there, or cancels an exit cast to bf16 (SDPA's); with `gate`, spell8's
    fp32 gate after p·v becomes the bf16 gate."""
    while len(old.users) == 1:
        user = next(iter(old.users))
        if cast_dtype(user) == t.low and scale == 1.0:
            t.move(user, low)
            return
        if layout_source(user) is None or _scalar_op(user) or user.target is operator.getitem:
            break
        low = t.call(user.target, (low, *user.args[1:]), user, user.kwargs)
        old = user
    up = t.call(CAST, (low, torch.float32), old)
    if scale != 1.0:
        up = t.call(aten.mul.Tensor, (up, scale), old)
    t.move(old, up)
    if gate:
        _gate(t, up, low)


def _gate(t: Trial, up: fx.Node, o: fx.Node) -> None:
    """bf16(o.float() * σ(g.float())) -> o * σ(g) in bf16 (g bf16, o's shape)."""
    if len(up.users) != 1:
        return
    mul = next(iter(up.users))
    if mul.target != aten.mul.Tensor or len(mul.args) != 2 or not mul.users:
        return
    sig = mul.args[1] if mul.args[0] is up else mul.args[0]
    if getattr(sig, "target", None) != aten.sigmoid.default \
            or not half_upcast(sig.args[0], to_copy=True) or _dtype(sig.args[0].args[0]) != t.low \
            or sig.meta["val"].shape != mul.meta["val"].shape:
        return
    if any(cast_dtype(u) != t.low for u in mul.users):
        return
    gate = t.call(aten.sigmoid.default, (sig.args[0].args[0],), sig)
    args = (o, gate) if mul.args[0] is up else (gate, o)
    new = t.call(aten.mul.Tensor, args, mul)
    for cast in list(mul.users):
        t.move(cast, new)


def _apply_one(graph: fx.Graph, read: fx.Node, pos: fx.Node) -> bool:
    products = _products(read)
    if not products or _dtype(read) not in LOW:
        return False
    t = Trial(graph, _dtype(read))
    if not all(_rewrite_product(t, mm) for mm in products):
        t.revert()
        return False
    why = _taken(read, pos)
    if why is not None:
        mla_absorb.log.debug("k3 mla_upcast: %s left alone: %s", read.name, why)
        t.revert()
        return False
    return True


def _taken(read: fx.Node, pos: fx.Node) -> str | None:
    """None where mla_absorb (non-absorbed) or mla_absorbed (absorbed, or the canonical form
    already) takes the rewritten site, else why neither does."""
    try:
        absorb = mla_absorb.takes(read, pos)
        if not isinstance(absorb, str):
            return None
        done = mla_absorbed.takes(read, pos)
    except Exception as e:  # noqa: BLE001 (a site a taker cannot read is not taken: undo the trial)
        return f"raised {type(e).__name__}: {e}"
    if not isinstance(done, str) or done == mla_absorbed.CANONICAL:
        return None
    return f"mla_absorb would not take it: {absorb}; mla_absorbed would not: {done}"


def apply(graph: fx.Graph) -> int:
    done = sum(_apply_one(graph, read, pos) for read, pos in list(mla_absorb.cache_reads(graph)))
    if done:
        graph.eliminate_dead_code()
    return done


RULE = Rule(
    name="mla_upcast",
    apply=apply,
    summary="MLA attention products of fp32 upcasts of bf16 operands (SDPA's math path, "
            ".float() spellings, the fp32 output gate) -> bf16 products, where mla_absorb "
            "or mla_absorbed then takes the site",
)
