"""Rule `expert_dense`: the routed MXFP4 experts as a static loop over ALL E experts, each run on
every row and weighted by its column of a dense [N, E] routing matrix that is zero off the
top-k ids (spell8: `routing = (one_hot(ids, E) * w[..., None]).sum(-2)`) -> the k chosen
experts only, the form `expert_slots` writes (`k3compile.math.mxfp4_experts`), which
`patterns/moe_experts.py` matches:

    for e in range(E): acc = acc + routing[:, e:e+1] * fc2(situ(fc1(z, W1[e]), ...), W2[e])
    ->  mxfp4_experts(z, ids, routing.gather(1, ids), lut, w1p, w1s, w3p, w3s, w2p, w2s, ...)

Proven in three parts:
1. The routing matrix is zero off the top-k (from the graph, not evaluated): ids are the
   indices of a `topk` over the last dim of an [N, E] tensor (k distinct experts per row) and
   the matrix is one of
   - the one-hot contraction sum_j onehot(ids)[n, j, e] * w[n, j], the one-hot `eq(ids[..., None],
     arange(E))` cast to a float; what lies between the one-hot, an [N, k] w and the matrix
     may only be views, casts, products and sums (`mul`, `bmm`, `sum`), and is checked on
     random values against `(onehot * w[..., None]).sum(1)` (a multilinear form agreeing with
     another on random values is that form);
   - `scatter(zeros, 1, ids, w)` (the weights scattered into zeros);
   - `where(scatter(full(False), 1, ids, True), s, 0)` (rule `route_mask`'s top-k mask).
2. The loop (structure, as `expert_slots` proves its slots): an fp32 running sum of E terms,
   term e `column_e * y_e` with column_e `routing[:, e]` (a slice, select or split of the
   matrix), y_e expert 0's y_0 with e for 0 (matched operand by operand, the stacks read only as
   `stack[e]`, i.e. `select(stack, 0, e)`).
3. y_0 itself on random values (at smaller sizes where large: `expert_slots.shrunk_sizes`)
   against the canonical experts' slot 0 with weight 1, for each assignment of the six stacks to
   W1 / W3 / W2 and each pair of betas among the constants next to a tanh.
Then sum_e routing[n, e] y_e(n) = sum_j routing[n, ids[n, j]] y_{ids[n, j]}(n): the other
E - k terms are 0 * y_e(n) = 0 and each chosen expert appears once (up to the sum's order).

**Non-finite outputs of unchosen experts**: eager computes every expert on every row, and an
unchosen expert whose output is inf or NaN on a row (an E8M0 scale byte of 255 is 2^128, inf in
fp32) gives 0 * inf = NaN there; the rewritten form never computes it and returns the chosen
experts' sum. We take the sparse form's value (the routing's meaning: an unchosen expert does
not contribute; no MoE runtime computes it) and document it as a deliberate difference from
eager (tests/canonical/test_expert_dense.py, `test_an_unchosen_inf_expert_*`). Where a chosen
expert is non-finite both give the same inf / NaN.

Left alone: a dense matrix not proven zero off the top-k (a softmax over all experts, weights
scattered at ids that are no top-k, a one-hot of other ids, a where over another mask), a loop
over fewer experts than E or with one expert computing otherwise (another stack, beta or row),
an expert read other than as `stack[e]`, k = E, a sum in bf16, a y_0 reading anything but z, the
E2M1 table and the stacks (and constants).
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical import expert_slots as slots
from k3compile.canonical.expert_gather import traced
from k3compile.canonical.region import (
    VIEWS,
    arange_length,
    call_on_cpu,
    on_cpu,
    root,
    splice_if_same,
)
from k3compile.canonical.region import static_shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.canonical.route_mask import is_constant
from k3compile.rewrite import inductor

aten, prims = torch.ops.aten, torch.ops.prims
RTOL = 1e-5
_CASTS = {prims.convert_element_type.default, aten._to_copy.default}
# the ops allowed between the one-hot, w and the routing matrix (multilinear in both)
_CONTRACTION = VIEWS | _CASTS | {aten.mul.Tensor, aten.bmm.default, aten.sum.dim_IntList,
                                 aten.mm.default}


# ---- 1. the routing matrix is zero off the top-k ids ------------------------------------------


def _topk_ids(node, n: int, e: int) -> fx.Node | None:
    """node where it is the indices of a `topk` over the last dim of an [N, E] tensor."""
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] == 1):
        return None
    topk = node.args[0]
    if topk.target is not aten.topk.default or _shape(topk.args[0]) != (n, e):
        return None
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    k = topk.args[1]
    return node if dim in (-1, 1) and isinstance(k, int) and 0 < k < e else None


def _scattered(routing: fx.Node, n: int, e: int) -> fx.Node | None:
    """ids of `scatter(zeros, 1, ids, w)` or `where(scatter(full(False), 1, ids, True), s, 0)`."""
    t, args = routing.target, routing.args
    if t is aten.scatter.src and args[1] in (1, -1) and slots.is_zero(args[0]):
        return _topk_ids(args[2], n, e)
    if t is aten.where.self and (is_constant(args[2], 0.0) or is_constant(args[2], 0)):
        mask = args[0]
        if (isinstance(mask, fx.Node) and mask.target is aten.scatter.value
                and mask.args[1] in (1, -1) and mask.args[3] is True
                and is_constant(mask.args[0], False)):
            return _topk_ids(mask.args[2], n, e)
    return None


def _one_hot(node: fx.Node, n: int, e: int) -> fx.Node | None:
    """ids where node is `eq(ids viewed [N, k, 1], arange(E))` (either operand order)."""
    if node.target not in (aten.eq.Tensor,) or len(node.args) != 2:
        return None
    for x, r in (node.args, node.args[::-1]):
        if arange_length(r) != e or not isinstance(x, fx.Node):
            continue
        ids = x.args[0] if x.target in (aten.view.default, aten.unsqueeze.default) else None
        if ids is None or _shape(ids) is None or _shape(x) != (*_shape(ids), 1):
            continue
        return _topk_ids(ids, n, e)
    return None


def _over_eq(node: fx.Node) -> fx.Node | None:
    """The eq a chain of casts starting at node reads, or None."""
    if not (node.op == "call_function" and node.target in _CASTS):
        return None
    while node.op == "call_function" and node.target in _CASTS:
        node = node.args[0]
    return node if node.op == "call_function" and node.target is aten.eq.Tensor else None


def _contraction(routing: fx.Node, n: int, e: int) -> fx.Node | None:
    """ids where routing is sum_j onehot(ids)[:, j] * w[:, j] (checked on random values)."""
    region, leaves, todo, seen = [], set(), [routing], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if _over_eq(node) is not None:
            leaves.add(node)  # the one-hot, cast (0 / 1: exact in any dtype)
        elif node.op == "call_function" and node.target in _CONTRACTION and len(region) < 64:
            region.append(node)
            todo += node.all_input_nodes
        else:
            leaves.add(node)
    hots = [x for x in leaves if _over_eq(x) is not None]
    ws = [x for x in leaves if x not in hots]
    if len(hots) != 1 or len(ws) != 1 or _val(ws[0]) is None:
        return None
    (hot,), (w,) = hots, ws
    ids = _one_hot(_over_eq(hot), n, e)
    if ids is None or _shape(w) != _shape(ids) or not _val(w).dtype.is_floating_point:
        return None
    if not _val(hot).dtype.is_floating_point:
        return None
    order = {x: i for i, x in enumerate(routing.graph.nodes)}
    region.sort(key=order.__getitem__)
    return ids if _agrees_contraction(region, hot, w, routing) else None


def _agrees_contraction(region, hot, w, routing) -> bool:
    with inductor.unset_fake_temporarily():
        gen = torch.Generator().manual_seed(0)
        env = {hot: torch.randn(_shape(hot), generator=gen).to(_val(hot).dtype),
               w: torch.randn(_shape(w), generator=gen).to(_val(w).dtype)}
        for node in region:
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = call_on_cpu(node.target, args, kwargs)
        got = env[routing]
        want = (env[hot].float() * env[w].float().unsqueeze(-1)).sum(1)
        if got.shape != want.shape or got.dtype != torch.float32:
            return False
        return float((got - want).abs().max()) <= RTOL * float(want.abs().max())


def _top_k_masked(routing: fx.Node) -> fx.Node | None:
    """The top-k ids off which the [N, E] routing matrix is zero, or None."""
    n, e = _shape(routing)
    return _scattered(routing, n, e) or _contraction(routing, n, e)


# ---- 2. the loop: an fp32 sum of E terms routing[:, e] * y_e, y_e expert 0's with e for 0 -----


def _columns(routing: fx.Node, e: int) -> dict[fx.Node, int]:
    """Column e's reads of routing: `routing[:, e:e+1]`, `routing[:, e]`, a split's e-th part."""
    cols = {}
    for u in routing.users:
        if u.target is aten.split_with_sizes.default and list(u.args[1]) == [1] * e and (
                u.args[2] if len(u.args) > 2 else 0) in (1, -1):
            cols.update((g, g.args[1]) for g in u.users if g.target is operator.getitem)
        elif (j := slots.slot_of(u, routing, e)) is not None:
            cols[u] = j
    return cols


def _stack_reads(graph: fx.Graph, e: int) -> dict[fx.Node, int]:
    """`select(stack, 0, c)` of the uint8 [E, ...] tensors, c constant."""
    return {u: u.args[2] % e for u in graph.nodes
            if u.target is aten.select.int and u.args[1] == 0 and isinstance(u.args[2], int)
            and _val(u.args[0]) is not None and _val(u.args[0]).dtype == torch.uint8
            and _shape(u.args[0]) is not None and _shape(u.args[0])[0] == e}


def _ancestors(out: fx.Node) -> list[fx.Node]:
    seen, todo = set(), [out]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += node.all_input_nodes
    return [x for x in out.graph.nodes if x in seen]


def _first_over_all(cols: dict[fx.Node, int], e: int) -> fx.Node | None:
    """The first node (graph order) computed from every column."""
    full, masks = (1 << e) - 1, {}
    for node in next(iter(cols)).graph.nodes:
        mask = 1 << cols[node] if node in cols else 0
        for a in node.all_input_nodes:
            mask |= masks.get(a, 0)
        if mask:
            masks[node] = mask
        if mask == full:
            return node
    return None


def _split_term(term: fx.Node, cols: dict[fx.Node, int], e: int) -> fx.Node | None:
    """y where term is `column_e * y` (column_e read of routing, possibly viewed)."""
    if term.target is not aten.mul.Tensor or len(term.args) != 2:
        return None
    for c, y in (term.args, term.args[::-1]):
        c = root(c, VIEWS) if isinstance(c, fx.Node) else c
        if c in cols and cols[c] == e and isinstance(y, fx.Node):
            return y
    return None


def _structure(out, routing, cols, e):
    """(y_0, the stacks, which experts each node is computed from) where out is sum_e column_e *
    y_e, each y_e y_0 with e for 0; else None."""
    graph = out.graph
    stack_reads = _stack_reads(graph, e)
    region = _ancestors(out)
    inside = set(region)
    stacks = {s.args[0] for s in stack_reads if s in inside}
    # the stacks are read only as stack[c] and the routing matrix only as its columns
    for node in region:
        for a in node.all_input_nodes:
            if (a in stacks and node not in stack_reads) or (a is routing and node not in cols
                                                             and node.target is not
                                                             aten.split_with_sizes.default):
                return None
    reads = {**cols, **{s: c for s, c in stack_reads.items() if s in inside}}
    masks = slots.slot_masks(region, reads)
    terms = slots.slot_terms(out, masks, e)
    if terms is None:
        return None
    ys = [_split_term(t, cols, j) for j, t in enumerate(terms)]
    if None in ys or any(masks.get(y) != 1 << j for j, y in enumerate(ys)):
        return None
    stack_only = {s: c for s, c in reads.items() if s in stack_reads}
    if not all(slots.same_slot(y, ys[0], j, stack_only, masks) for j, y in enumerate(ys[1:], 1)):
        return None
    return ys[0], sorted(stacks, key=lambda s: s.name), masks


# ---- 3. y_0 on random values against the canonical experts' slot 0 ---------------------------


def _expert_region(y0: fx.Node, stacks: list[fx.Node], masks: dict[fx.Node, int]):
    """(region in graph order, z, lut) where y_0 is computed from one float 2-D z, one [16] float
    table, the stacks and constants (get_attr and what only they feed); None otherwise."""
    region, outside, todo, seen = [], set(), [y0], set(stacks)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr" or node.op == "call_function" and (
                masks.get(node, 0) or _constant_only(node)):
            region.append(node)
            todo += node.all_input_nodes
        else:
            outside.add(node)
    luts = [x for x in outside if _shape(x) == (16,) and _val(x).dtype.is_floating_point]
    zs = [x for x in outside if x not in luts]
    if len(luts) != 1 or len(zs) != 1:
        return None
    (z,), (lut,) = zs, luts
    if _val(z) is None or len(_shape(z) or ()) != 2 or not _val(z).dtype.is_floating_point:
        return None
    order = {x: i for i, x in enumerate(y0.graph.nodes)}
    return sorted(region, key=order.__getitem__), z, lut


def _constant_only(node: fx.Node) -> bool:
    """Computed from get_attr constants only (or from nothing: iota, full)."""
    return all(a.op == "get_attr" or (a.op == "call_function" and _constant_only(a))
               for a in node.all_input_nodes)


def _assignments(stacks: list[fx.Node]):
    """The orders of the six stacks as (W1 packed, scale, W3 packed, scale, W2 packed, scale)
    that fit: packed [E, O, W/2] with a scale [E, O, W/32], W1 and W3 of one shape."""
    for order in itertools.permutations(stacks):
        shapes = [_shape(s) for s in order]
        if all(p[:2] == s[:2] and p[2] == 16 * s[2] for p, s in zip(shapes[0::2], shapes[1::2])) \
                and shapes[0] == shapes[2] and shapes[4][1] == 2 * shapes[0][2] \
                and shapes[0][1] == 2 * shapes[4][2]:
            yield list(order)


def _proof(y0, stacks, masks, ids):
    """(beta, linear beta, the stacks in W1, W3, W2 order, z, lut) for which y_0 is the
    canonical experts' slot 0 with weight 1 on expert 0, or None."""
    found = _expert_region(y0, stacks, masks) if len(stacks) == 6 else None
    if found is None:
        return None
    region, z, lut = found
    for order in _assignments(stacks):
        inputs = [z, ids, ids, lut, *order]  # ids twice: `_sizes` reads (N, k) from it
        sizes = slots.shrunk_sizes([x for x in region if x.op == "call_function"], inputs)
        if sizes is None:
            return None
        with inductor.unset_fake_temporarily():
            agreed = _agreeing(region, inputs, y0, sizes)
        if agreed is not None:
            return (*agreed, order, z, lut)
    return None


def _agreeing(region, inputs, y0, sizes):
    z, _, _, lut, *stacks = inputs
    values = slots.random_inputs(inputs, sizes, torch.Generator().manual_seed(0))
    env = dict(values)
    module = y0.graph.owning_module
    try:
        for node in region:
            if node.op == "get_attr":
                env[node] = on_cpu(getattr(module, node.target))
                continue
            args, kwargs = torch.utils._pytree.tree_map(
                lambda a: sizes.get(a, a) if type(a) is int else a,
                fx.map_arg((node.args, node.kwargs), env.__getitem__))
            env[node] = call_on_cpu(node.target, args, kwargs)
    except (RuntimeError, KeyError, AttributeError):
        return None
    got = env[y0]
    if got.dtype != torch.float32:
        return None
    n = values[z].shape[0]
    first = torch.zeros(n, 1, dtype=torch.long)
    one = torch.ones(n, 1)
    scale = float(got.abs().max().clamp_min(1e-30))
    args = [values[z], first, one, values[lut], *(values[s] for s in stacks)]
    for beta, linear_beta in itertools.product(slots.situ_constants(region), repeat=2):
        try:
            want = slots.canonical_experts(beta, linear_beta, 1)(*args)
        except RuntimeError:
            return None
        if want.shape == got.shape and float((got - want).abs().max()) <= RTOL * scale:
            return beta, linear_beta
    return None


# ---- the rule -------------------------------------------------------------------------------


def _site(routing: fx.Node):
    shape = _shape(routing)
    v = _val(routing)
    if shape is None or len(shape) != 2 or shape[1] < 2 or v.dtype != torch.float32:
        return None
    e = shape[1]
    cols = _columns(routing, e)
    if set(cols.values()) != set(range(e)):
        return None
    out = _first_over_all(cols, e)
    if out is None or len(_shape(out) or ()) != 2 or _shape(out)[0] != shape[0]:
        return None
    ids = _top_k_masked(routing)
    if ids is None:
        return None
    found = _structure(out, routing, cols, e)
    if found is None:
        return None
    proof = _proof(*found, ids)
    if proof is None:
        return None
    beta, linear_beta, stacks, z, lut = proof
    return out, [z, ids, routing, lut, *stacks], beta, linear_beta


def _write(graph: fx.Graph, routing: fx.Node, site, cache: dict) -> bool:
    out, inputs, beta, linear_beta = site
    gm = traced(slots.canonical_experts(beta, linear_beta, None), inputs, cache)
    return splice_if_same(graph, gm, inputs, out)


def apply(graph: fx.Graph) -> int:
    if graph.owning_module is None:
        return 0
    cache: dict = {}
    return rewrite_sites(graph, _site, lambda g, n, s: _write(g, n, s, cache), sort=True)


RULE = Rule("expert_dense", apply,
            "routed MXFP4 experts as a loop over all E experts weighted by a dense routing matrix "
            "zero off the top-k -> the k chosen experts (math.mxfp4_experts)")

__all__ = ["RULE", "apply"]
