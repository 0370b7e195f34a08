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
one [16] E2M1 table, the [N, L] latent z and the weights.

Proven in two parts, so that the cost does not grow with k, I or L (K3: k 16, L 3584, I 192 a
TP16 rank, 3072 unsharded; evaluating the whole loop would dequantise N*k*I*L weights):
1. Structure (no evaluation). ids, the weights and the stacks are read only through one slot's
   columns (`ids[:, j]`, `weights[:, j]`, `gather(weights, 1, ids[:, j:j+1])`, `stack[col]`);
   the sum is ((z0 + t_a) + t_b) + ... in fp32, one [N, L] term per slot (z0 a zero or none);
   and each slot j's term is slot 0's with column j for column 0: matched from the terms up,
   operand by operand, a bijection of the slots' nodes with the same ops and arguments (shared
   nodes equal). So t_j = f(column j) for one function f, and the sum is the canonical
   finalize's up to order, unrounded: the canonical experts with z's dtype where that is fp32,
   else with `out_dtype` fp32 (spell5's bf16 loop: the GEMMs round to bf16, the sum does not).
2. f itself, slot 0's term, on random values (distinct ids per row, random bytes, scales in
   [118, 137]) against the canonical experts' slot 0, for each assignment of the stacks to W1 /
   W3 / W2 and each (beta, linear beta) among the float constants next to a tanh: the first
   that agrees within RTOL of the largest value is spliced in (all k slots). Where slot 0 is
   larger than BUDGET values, it runs at smaller I, L, E (`shrunk_sizes`: each int of its arguments
   and its inputs' shapes equal to one of those sizes, or to I/2, L/2, I/32, L/32, replaced):
   sound as long as an int equal to a size is that size, which is why sizes that collide (with
   each other, k or a format constant) are not shrunk.

Left alone: a loop over fewer or other slots than the k of ids, a slot whose chain differs from
slot 0's (another beta, stack, row or latent), a region that reads anything else (another
tensor, a placeholder that is not one of the above), one that is not the MXFP4 SiTU experts
(another activation, other weights, dense experts), slots summed in bf16 (decided from the
adds' dtypes, before any evaluation) or a slot rounding otherwise than the canonical experts'
(SiTU in bf16: by the evaluation), sizes that cannot be told apart or a slot too large to
evaluate even shrunk (its near miss stays).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.expert_gather import dequant_roots, traced
from k3compile.canonical.region import VIEWS, call_on_cpu, nodes_between, root, splice_if_same
from k3compile.canonical.region import static_shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.math import E2M1_VALUES, mxfp4_experts
from k3compile.rewrite import inductor

aten = torch.ops.aten
RTOL = 1e-5
BUDGET = 1 << 22  # values slot 0's evaluation may hold as it is (summed over its nodes)
MAX_ELEMENTS = 1 << 26  # ... at the smaller sizes
SMALL_I, SMALL_L = (160, 224, 288), (224, 352, 416)  # multiples of 32, I != L
# ints of a slot's arguments that are no size of the experts (dims, the nibble shift and mask,
# the E2M1 table, the MX group, the E8M0 bias): a size equal to one cannot be shrunk
FORMAT_INTS = frozenset((0, 1, 2, 3, 4, 15, 16, 32, 127, 255))


def _integer(node) -> bool:
    v = _val(node)
    return v is not None and not v.dtype.is_floating_point and v.dtype != torch.bool


def slot_of(node: fx.Node, ids: fx.Node, k: int) -> int | None:
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
        if {slot_of(u, node, k) for u in node.users} >= set(range(k)):
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


# ---- the structure: an fp32 running sum of k terms, slot j's term slot 0's with j for 0 ----------


def _slot_reads(ids: fx.Node, source: fx.Node, k: int) -> dict[fx.Node, int]:
    """Slot j's reads: `select` / `slice` of column j of ids, or of the [N, k] weights."""
    reads = {}
    for x in {ids, source} if _shape(source) == _shape(ids) else {ids}:
        reads.update((u, j) for u in x.users if (j := slot_of(u, x, k)) is not None)
    return reads


def slot_masks(region: list[fx.Node], reads: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Which slots each node of region is computed from (bit j: slot j's reads)."""
    masks: dict[fx.Node, int] = {}
    for n in region:
        mask = 1 << reads[n] if n in reads else 0
        for a in n.all_input_nodes:
            mask |= masks.get(a, 0)
        masks[n] = mask
    return masks


def _one_slot(mask: int) -> bool:
    return mask > 0 and mask & (mask - 1) == 0


def _read_by_slots(region, masks, reads, ids, source, stacks) -> bool:
    """ids, the weights and the stacks are read only through one slot's reads (a column of ids
    or of the [N, k] weights, `gather(source, 1, col)`, `stack[col]`): what slot j computes
    depends on no other column, so slot 0's function with j for 0 is slot j's."""
    for n in region:
        if n in reads:
            continue
        for a in n.all_input_nodes:
            by_slot = n.args[0] is a and _one_slot(masks[n]) and a not in n.args[1:]
            if a is ids or (a is source and not (by_slot and n.target is aten.gather.default)) or (
                    a in stacks and not (by_slot and n.target is aten.index.Tensor)):
                return False
    return True


def is_zero(x) -> bool:
    if type(x) in (int, float):
        return x == 0
    return isinstance(x, fx.Node) and (x.target in _ZEROS or x.target in _FULLS and x.args[1] == 0)


_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
_FULLS = {aten.full.default, aten.full_like.default}


def slot_terms(out: fx.Node, masks: dict[fx.Node, int], k: int) -> list[fx.Node] | None:
    """Slot j's term t_j for each j where out = ((z0 + t_a) + t_b) + ... in fp32, one term per
    slot (z0 a zero, or none), the sum of the [N, L] terms as the canonical finalize's is (up to
    order). None for any other sum."""
    def add_of(n):
        ok = (n.target is aten.add.Tensor and len(n.args) == 2 and not n.kwargs
              and _val(n).dtype == torch.float32 and _shape(n) == _shape(out))
        return n.args if ok else None

    terms, acc = {}, out
    while True:
        args = add_of(acc)
        mask = masks.get(acc, 0)
        if not _one_slot(mask):
            if args is None or not all(isinstance(a, fx.Node) for a in args):
                return None
            a, b = args
            if _one_slot(masks.get(b, 0)) and masks.get(a, 0) == mask & ~masks[b]:
                terms[masks[b]], acc = b, a
            elif _one_slot(masks.get(a, 0)) and masks.get(b, 0) == mask & ~masks[a]:
                terms[masks[a]], acc = a, b
            else:
                return None
            continue
        if args is not None and is_zero(args[0]) and masks.get(args[0], 0) == 0:
            acc = args[1]
        elif args is not None and is_zero(args[1]) and masks.get(args[1], 0) == 0:
            acc = args[0]
        terms[mask] = acc
        break
    if len(terms) != k or any(_shape(t) != _shape(out) for t in terms.values()):
        return None
    return [terms[1 << j] for j in range(k)]


def same_slot(mine: fx.Node, first: fx.Node, j: int, reads, masks) -> bool:
    """Slot j's term computes slot 0's with column j for column 0: matched from the terms up,
    operand by operand (whatever the graph order), the same op with the same arguments, each
    node of slot j paired with exactly one of slot 0, a read of column j with the same read of
    column 0, a shared node (of no slot) the same node or the same deterministic op of equal
    operands."""
    pair: dict[fx.Node, fx.Node] = {}
    back: dict[fx.Node, fx.Node] = {}
    memo: dict[tuple[fx.Node, fx.Node], bool] = {}

    def same(x, y) -> bool:
        if isinstance(x, fx.Node) != isinstance(y, fx.Node):
            return False
        if not isinstance(x, fx.Node):
            return type(x) is type(y) and x == y
        if masks.get(x, 0) == 0 == masks.get(y, 0):
            return shared(x, y)
        if masks.get(x) != 1 << j or masks.get(y) != 1:
            return False
        if x in pair or y in back:
            return pair.get(x) is y and back.get(y) is x
        pair[x], back[y] = y, x
        if x.op != "call_function" or x.target != y.target or (x in reads) != (y in reads):
            return False
        if x in reads:
            return reads[x] == j and reads[y] == 0 and x.args[:2] == y.args[:2]
        return same_args(x, y)

    def shared(x, y) -> bool:
        if x is y:
            return True
        if (x, y) not in memo:
            memo[x, y] = False
            memo[x, y] = (x.op == y.op == "call_function" and x.target == y.target
                          and isinstance(x.target, torch._ops.OpOverload)
                          and torch.Tag.nondeterministic_seeded not in x.target.tags
                          and same_args(x, y)) or _same_constant(x, y)
        return memo[x, y]

    def same_args(x, y) -> bool:
        xs, x_spec = tree_flatten((x.args, x.kwargs))
        ys, y_spec = tree_flatten((y.args, y.kwargs))
        return x_spec == y_spec and all(map(same, xs, ys))

    return same(mine, first)


def _same_constant(x: fx.Node, y: fx.Node) -> bool:
    """Two get_attr constants holding equal tensors (a per-iteration `torch.tensor([0, 4])` of a
    Python loop becomes one constant per iteration)."""
    module = x.graph.owning_module
    if not (x.op == y.op == "get_attr" and module is not None):
        return False
    a, b = (getattr(module, n.target, None) for n in (x, y))
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape):
        return False
    with inductor.unset_fake_temporarily():  # real constants, inside a compile's fake mode
        return bool(torch.equal(a, b))


def _structure(region, out, inputs, ids, k):
    """Slot 0's term, where the region is a sum of k slots' terms each slot 0's with j for 0
    (ids, the weights and the stacks read only by one slot's columns); None otherwise."""
    _, _, source, _, *stacks = inputs
    reads = _slot_reads(ids, source, k)
    masks = slot_masks(region, reads)
    if not _read_by_slots(region, masks, reads, ids, source, set(stacks)):
        return None
    terms = slot_terms(out, masks, k)
    if terms is None:
        return None
    if not all(same_slot(t, terms[0], j, reads, masks) for j, t in enumerate(terms[1:], 1)):
        return None
    return terms[0]


# ---- slot 0's function, proven on random values (at smaller I, L, E where large) ---------------


@functools.cache
def canonical_experts(beta: float, linear_beta: float, slots: int | None):
    """The canonical experts with the loop's fp32 sum: z's dtype where that is fp32, else the
    finalize's sum unrounded (`out_dtype` fp32: the GEMMs still round to z's dtype). `slots` 1:
    slot 0's term alone (one slot's finalize)."""
    def experts(z, ids, weights, lut, w1p, w1s, w3p, w3s, w2p, w2s):
        n = ids.shape[0]
        w = weights.gather(1, ids) if weights.shape[1] != ids.shape[1] else weights
        if slots is not None:
            ids, w = ids[:, :slots], w[:, :slots]
        z = z if z.dim() == 2 else z.reshape(n, -1)
        return mxfp4_experts(z, ids, w, lut.to(z.dtype), w1p, w1s, w3p, w3s, w2p, w2s, beta,
                             linear_beta, None if z.dtype == torch.float32 else torch.float32)
    return experts


def region_values(region: list[fx.Node], sizes: dict[int, int]) -> int:
    return sum(math.prod(sizes.get(d, d) for d in _shape(n)) for n in region
               if _shape(n) is not None)


def shrunk_sizes(region: list[fx.Node], inputs: list[fx.Node]) -> dict[int, int] | None:
    """{} where slot 0 is small enough to evaluate as it is; else smaller I, L, E (and I/2, L/2,
    I/32, L/32) as a map applied to every int of the region's arguments and its inputs' shapes.
    Their full sizes must be told apart: pairwise different, none k or a format constant (its
    int would be ambiguous). N, where it equals one of them, goes with it (the smaller slot keeps
    the full one's equal sizes equal); no smaller size equals an N kept, k or a format constant
    (no equality the full slot lacks). None where that is impossible or the region stays too
    large."""
    values = [*region, *inputs]
    if region_values(values, {}) <= BUDGET:
        return {}
    z, ids, _, _, *stacks = inputs
    n, k = _shape(ids)
    latent, experts = _shape(z)[-1], _shape(stacks[0])[0]
    inter = {_shape(s)[1] for s in stacks} - {latent}
    if len(inter) != 1 or any(_shape(s)[0] != experts for s in stacks):
        return None
    (inter,) = inter
    full = [inter, inter // 2, inter // 32, latent, latent // 2, latent // 32, experts]
    fixed = {k, *FORMAT_INTS}
    if inter % 32 or latent % 32 or len(set(full)) != 7 or fixed & set(full):
        return None
    kept = fixed | ({n} - set(full))
    for i, lat in itertools.product(SMALL_I, SMALL_L):
        small = [i, i // 2, i // 32, lat, lat // 2, lat // 32]
        small.append(next(e for e in itertools.count(k + 1) if e not in {*small, *kept}))
        if len(set(small)) == 7 and not kept & set(small):
            sizes = dict(zip(full, small))
            return sizes if region_values(values, sizes) <= MAX_ELEMENTS else None
    return None


def random_inputs(inputs: list[fx.Node], sizes: dict[int, int], gen: torch.Generator):
    z, ids, weights, lut, *stacks = inputs
    shape = {x: tuple(sizes.get(d, d) for d in _shape(x)) for x in inputs}
    n, k = shape[ids]
    experts = shape[stacks[0]][0]
    values = [torch.randn(shape[z], generator=gen).to(_val(z).dtype),
              torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)]),
              torch.rand(shape[weights], generator=gen).to(_val(weights).dtype),
              torch.tensor(E2M1_VALUES, dtype=_val(lut).dtype)]
    for i, s in enumerate(stacks):
        lo, hi = (0, 256) if i % 2 == 0 else (118, 138)
        values.append(torch.randint(lo, hi, shape[s], generator=gen, dtype=torch.uint8))
    return dict(zip(inputs, values))


def _slot_values(region, inputs, term, sizes):
    """(random inputs, slot 0's term on them): the region run with every int of `sizes` in its
    arguments replaced."""
    def resize(a):
        return sizes.get(a, a) if type(a) is int else a

    env = random_inputs(inputs, sizes, torch.Generator().manual_seed(0))
    values = dict(env)
    for node in region:
        args, kwargs = tree_map(resize, fx.map_arg((node.args, node.kwargs), env.__getitem__))
        env[node] = call_on_cpu(node.target, args, kwargs)
    return values, env[term]


def _proof(region, inputs, term):
    """(beta, linear beta, the stacks as W1, W3, W2) for which slot 0's term is the canonical
    experts' slot 0 (within RTOL of the largest value), or None."""
    sizes = shrunk_sizes(region, inputs)
    if sizes is None:
        return None
    with inductor.unset_fake_temporarily():  # real values, inside a compile's fake mode
        return _agreeing(region, inputs, term, sizes)


def _agreeing(region, inputs, term, sizes):
    try:
        values, got = _slot_values(region, inputs, term, sizes)
    except RuntimeError:  # an int of the region that was not a size
        return None
    if got.dtype != torch.float32:
        return None
    z, ids, weights, lut, *stacks = inputs
    scale = float(got.abs().max().clamp_min(1e-30))
    for order in itertools.permutations([stacks[0:2], stacks[2:4], stacks[4:6]]):
        stacks = list(itertools.chain(*order))
        args = [values[x] for x in (z, ids, weights, lut, *stacks)]
        for beta, linear_beta in itertools.product(situ_constants(region), repeat=2):
            try:
                want = canonical_experts(beta, linear_beta, 1)(*args)
            except RuntimeError:  # shapes that do not fit this assignment
                break
            if want.shape == got.shape and float((got - want).abs().max()) <= RTOL * scale:
                return beta, linear_beta, stacks
    return None


def situ_constants(region: list[fx.Node]) -> list[float]:
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
    slots = {u: j for u in ids.users if (j := slot_of(u, ids, k)) is not None}
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
    if roles is None or sources[0] not in roles[0]:
        return None
    (z,), (weights,), (lut, stacks) = set(roles[0]) - set(sources), sources, roles[1:]
    region = nodes_between([z, ids, weights, lut, *stacks], out, limit=100_000)
    pairs = _stack_pairs(stacks, region) if region is not None else None
    if pairs is None:
        return None
    inputs = [z, ids, weights, lut, *itertools.chain(*pairs)]  # (packed, scale) of each
    term = _structure(region, out, inputs, ids, k)
    if term is None:
        return None
    slot_region = nodes_between(inputs, term, limit=100_000)
    proof = _proof(slot_region, inputs, term)
    return (out, [z, ids, weights, lut], proof) if proof is not None else None


def splice_experts(graph: fx.Graph, ids: fx.Node, site, cache: dict) -> bool:
    out, inputs, (beta, linear_beta, stacks) = site
    inputs = [*inputs, *stacks]
    gm = traced(canonical_experts(beta, linear_beta, None), inputs, cache)
    return splice_if_same(graph, gm, inputs, out)


def apply(graph: fx.Graph) -> int:
    if graph.owning_module is None:
        return 0
    cache: dict = {}
    return rewrite_sites(graph, _site, lambda g, n, s: splice_experts(g, n, s, cache), sort=True)


RULE = Rule("expert_slots", apply,
            "routed MXFP4 experts as a loop over the top-k slots (per-slot gathers, an fp32 "
            "running sum) -> the k slots at once (math.mxfp4_experts)")

__all__ = ["RULE", "apply"]
