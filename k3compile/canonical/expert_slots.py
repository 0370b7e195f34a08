"""Rule `expert_slots`: the routed MXFP4 experts run as a Python loop over the top-k slots (per
slot j: the experts `w[ids[:, j]]` of one row each, FC1 / FC3, SiTU, FC2, the slot's routing
weight, summed into an fp32 accumulator) -> the k slots at once, the form
`k3compile.math.mxfp4_experts` has, which `patterns/moe_experts.py` matches:

    for j in range(k): acc = acc + w(j) * fc2(situ(fc1(z, W1[ids[:, j]]), ...), W2[ids[:, j]])
    ->  mxfp4_experts(z, ids, weights.gather(1, ids), lut, w1p, w1s, w3p, w3s, w2p, w2s, b1, b2)

where `weights` [N, E] is what each slot's weight is read from (a dense routing matrix,
`weights.gather(1, ids[:, j:j+1])`; Megatron's `probs`), or the routed weights [N, k] themselves
(`top[:, j:j+1]`, gathered with an identity). Found structurally: an integer [N, k] tensor whose
k slots are each read (`select(ids, 1, j)` / `slice(ids, 1, j, j + 1)`), the first node that
depends on all k of them (the sum), and the tensors the slots' computation reads besides: six
uint8 expert stacks (packed nibbles and E8M0 scales of W1, W3, W2, told apart by their shapes),
one [16] E2M1 table, the [N, L] latent z and the weights. What the region computes is then proven
on random values (distinct ids per row, random bytes, scales in [118, 137]) against the
canonical experts, for each assignment of the stacks to W1 / W3 / W2 and each (beta, linear beta)
pair among the region's float constants: the first that agrees within RTOL of the largest value
(the slots' running sum adds in another order than the canonical reduction: fp32 rounding) is
spliced in; none: left alone.

Left alone: a loop over fewer or other slots than the k of ids, a region that reads anything
else (another tensor, a placeholder that is not one of the above), one that is not the MXFP4
SiTU experts (another activation, other weights, dense experts), a bf16 finalize that rounds
otherwise than the canonical one (the check fails on dtype or value), and a region too large to
evaluate at compile time (more than MAX_ELEMENTS values: its near miss stays).
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.expert_gather import dequant_roots, splice, traced
from k3compile.canonical.region import VIEWS, nodes_between, root
from k3compile.canonical.region import static_shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.math import E2M1_VALUES, mxfp4_experts
from k3compile.rewrite import inductor

aten = torch.ops.aten
RTOL = 1e-5
MAX_ELEMENTS = 1 << 26  # values the region's evaluation may hold, summed over its nodes


def _integer(node) -> bool:
    v = _val(node)
    return v is not None and not v.dtype.is_floating_point and v.dtype != torch.bool


def _slot(node: fx.Node, ids: fx.Node, k: int) -> int | None:
    """j where node is `select(ids, 1, j)` or `slice(ids, 1, j, j + 1)`."""
    if node.op != "call_function" or not node.args or node.args[0] is not ids:
        return None
    if len(node.args) < 3 or node.args[1] not in (1, -1):
        return None
    j = node.args[2]
    if node.target is aten.slice.Tensor:
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        if not isinstance(j, int) or step != 1 or end not in (j + 1, j + 1 - k):
            return None
    elif node.target is not aten.select.int:
        return None
    return j % k if isinstance(j, int) and -k <= j < k else None


def _sum_of_slots(ids: fx.Node, slots: dict[fx.Node, int], k: int) -> fx.Node | None:
    """The first node (graph order) that depends on every slot."""
    full, masks = (1 << k) - 1, {}
    nodes = list(ids.graph.nodes)
    for node in nodes[nodes.index(ids) + 1:]:
        mask = 1 << slots[node] if node in slots else 0
        for a in node.all_input_nodes:
            mask |= masks.get(a, 0)
        if mask:
            masks[node] = mask
        if mask == full:
            return node
    return None


def _dependents(ids: fx.Node) -> set[fx.Node]:
    """Every node computed from ids."""
    deps = {ids}
    nodes = list(ids.graph.nodes)
    for node in nodes[nodes.index(ids) + 1:]:
        if any(a in deps for a in node.all_input_nodes):
            deps.add(node)
    return deps


def _weight_sources(ids: fx.Node, slots: dict[fx.Node, int], k: int) -> list[fx.Node]:
    """The tensors the slots' routing weights are read from: X of `gather(X, 1, ids[:, j:j+1])`
    (a dense [N, E] routing matrix), or a float [N, k] X read as `X[:, j]` for every j."""
    found = {u.args[0] for sl in slots for u in sl.users
             if u.target is aten.gather.default and u.args[1] in (1, -1) and u.args[2] is sl}
    for node in ids.graph.nodes:
        v = _val(node)
        if node is ids or v is None or not v.dtype.is_floating_point or _shape(node) != _shape(
                ids):
            continue
        if {_slot(u, node, k) for u in node.users} >= set(range(k)):
            found.add(node)
    return list(found)


def _outside(out: fx.Node, ids: fx.Node, stop: set[fx.Node]) -> set[fx.Node] | None:
    """The nodes the slots' computation reads that are not computed from ids, and the `stop`
    nodes (nodes without inputs, constants such as an E2M1 table's iota, are part of the
    region)."""
    deps = _dependents(ids) - stop
    seen, todo, outside = set(), [out], set()
    while todo:
        n = todo.pop()
        if n in seen or n is ids:
            continue
        seen.add(n)
        if n.op == "placeholder" or n in stop or (n not in deps and n.all_input_nodes):
            outside.add(n)
        elif n.op != "call_function":
            return None
        else:
            todo += n.all_input_nodes
    return outside


def _stack_pairs(stacks: list[fx.Node], region: list[fx.Node]
                 ) -> list[tuple[fx.Node, fx.Node]] | None:
    """(packed, scale) of each of the three experts' weights: the two stacks one dequant of the
    region reads (through their gathers by a slot's ids)."""
    pairs = set()
    for node in region:
        v = _val(node)
        roots = dequant_roots(node) if v is not None and v.dtype.is_floating_point else None
        if roots is None:
            continue
        packed, scale = (r.args[0] if r.target is aten.index.Tensor else None for r in roots[:2])
        if packed in stacks and scale in stacks:
            pairs.add((packed, scale))
    if len(pairs) != 3 or len({x for pair in pairs for x in pair}) != 6:
        return None
    return sorted(pairs, key=lambda pair: pair[0].name)


def _roles(outside: set[fx.Node], n: int):
    """(the two other float inputs: z and the weights in some order, lut, the six stacks) from
    what the slots read, or None."""
    stacks = [x for x in outside if _val(x) is not None and _val(x).dtype == torch.uint8]
    floats = [x for x in outside if x not in stacks]
    luts = [x for x in floats if _shape(x) == (16,)]
    rest = list(dict.fromkeys(root(x, VIEWS) for x in floats if x not in luts))  # z, once
    if len(luts) != 1 or len(rest) != 2 or len(stacks) != 6 or any(
            _shape(x) is None or _shape(x)[0] != n or not _val(x).dtype.is_floating_point
            for x in rest):
        return None
    return rest, luts[0], stacks


@functools.cache
def _canonical(beta: float, linear_beta: float):
    def experts(z, ids, weights, lut, w1p, w1s, w3p, w3s, w2p, w2s):
        n = ids.shape[0]
        w = weights.gather(1, ids) if weights.shape[1] != ids.shape[1] else weights
        return mxfp4_experts(z.reshape(n, -1), ids, w, lut.to(z.dtype), w1p, w1s, w3p, w3s,
                             w2p, w2s, beta, linear_beta).float()
    return experts


def _random_inputs(inputs: list[fx.Node], gen: torch.Generator) -> list[torch.Tensor]:
    z, ids, weights, lut, *stacks = inputs
    n, k = _shape(ids)
    experts = _shape(stacks[0])[0]
    values = [torch.randn(_shape(z), generator=gen).to(_val(z).dtype),
              torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)]),
              torch.rand(_shape(weights), generator=gen).to(_val(weights).dtype),
              torch.tensor(E2M1_VALUES, dtype=_val(lut).dtype)]
    for i, s in enumerate(stacks):
        lo, hi = (0, 256) if i % 2 == 0 else (118, 138)
        values.append(torch.randint(lo, hi, _shape(s), generator=gen, dtype=torch.uint8))
    return values


def _agrees(region: list[fx.Node], inputs: list[fx.Node], out: fx.Node, fn) -> bool:
    with inductor.unset_fake_temporarily():
        env = dict(zip(inputs, _random_inputs(inputs, torch.Generator().manual_seed(0))))
        want = fn(*env.values())
        for node in region:
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = node.target(*args, **kwargs)
        got = env[out]
        if got.shape != want.shape or got.dtype != _val(out).dtype:
            return False
        scale = float(want.abs().max().clamp_min(1e-30))
        return float((got.float() - want.float()).abs().max()) <= RTOL * scale


def _constants(region: list[fx.Node]) -> list[float]:
    """The positive float constants of the ops next to a tanh: the SiTU betas' candidates."""
    def near_tanh(n):
        return any(x.target is aten.tanh.default for x in [*n.all_input_nodes, *n.users])
    return sorted({a for n in region if near_tanh(n) for a in n.args
                   if isinstance(a, float) and a > 0})


def _site(ids: fx.Node):
    shape = _shape(ids)
    if not _integer(ids) or shape is None or len(shape) != 2 or shape[1] < 2:
        return None
    n, k = shape
    slots = {u: j for u in ids.users if (j := _slot(u, ids, k)) is not None}
    if set(slots.values()) != set(range(k)):
        return None
    out = _sum_of_slots(ids, slots, k)
    if out is None or _shape(out) is None or len(_shape(out)) != 2 or _shape(out)[0] != n:
        return None
    sources = _weight_sources(ids, slots, k)
    if len(sources) != 1:
        return None
    outside = _outside(out, ids, set(sources))
    roles = _roles(outside, n) if outside is not None else None
    if roles is None:
        return None
    rest, lut, stacks = roles
    candidates = []
    for z, weights in (rest, rest[::-1]):
        inputs = [z, ids, weights, lut, *stacks]
        region = nodes_between(inputs, out, limit=100_000)
        pairs = _stack_pairs(stacks, region) if region is not None else None
        if pairs is not None and _small(region):
            candidates.append(([z, ids, weights, lut, *itertools.chain(*pairs)], region))
    return (out, candidates) if candidates else None


def _small(region: list[fx.Node]) -> bool:
    total = sum(_val(n).numel() for n in region if _val(n) is not None)
    return total <= MAX_ELEMENTS


def _write(graph: fx.Graph, ids: fx.Node, site, cache: dict) -> bool:
    out, candidates = site
    for (z, _, weights, lut, *stacks), region in candidates:
        pairs = [stacks[0:2], stacks[2:4], stacks[4:6]]
        for order in itertools.permutations(pairs):
            inputs = [z, ids, weights, lut, *itertools.chain(*order)]
            for beta, linear_beta in itertools.product(_constants(region), repeat=2):
                fn = _canonical(beta, linear_beta)
                try:
                    if not _agrees(region, inputs, out, fn):
                        continue
                except RuntimeError:  # shapes that do not fit this assignment
                    break
                new = splice(graph, traced(fn, inputs, cache), inputs, out)
                if _shape(new) != _shape(out) or _val(new).dtype != _val(out).dtype:
                    return False
                out.replace_all_uses_with(new)
                return True
    return False


def apply(graph: fx.Graph) -> int:
    if graph.owning_module is None:
        return 0
    cache: dict = {}
    return rewrite_sites(graph, _site, lambda g, n, s: _write(g, n, s, cache), sort=True)


RULE = Rule("expert_slots", apply,
            "routed MXFP4 experts as a loop over the top-k slots (per-slot gathers, an fp32 "
            "running sum) -> the k slots at once (math.mxfp4_experts)")

__all__ = ["RULE", "apply"]
