"""Rule `expert_rows`: the routed MXFP4 experts run on token-major pair rows (one row per
(token, slot) pair, p = n*k + j: z repeated k times, the flat ids and weights, the experts
gathered by the flat ids, FC1 / FC3, SiTU, FC2 per row, the rows summed back to their tokens
by `index_add_`) -> the k slots at once, the form `k3compile.math.mxfp4_experts` has, which
`patterns/moe_experts.py` matches:

    acc = zeros(N, L); acc.index_add_(0, arange(N).repeat_interleave(k), w.flatten()[:, None] *
                                      fc2(situ(fc1(z.repeat_interleave(k, 0), W1[ids.flatten()])...)))
    ->  mxfp4_experts(z, ids, w, lut, w1p, w1s, w3p, w3s, w2p, w2s, b1, b2)

(tests/models/spell6_k3.py; spell7's sorted pairs are brought to this form by rule
`pair_order`). As traced, `index_add_` on zeros is `index_put(zeros, [t], src, accumulate=True)`.
Also the unweighted rows read as [N, k, L] and combined by the [N, k] weights in fp32,
`bmm(w.unsqueeze(1), rows.view(N, k, L).float())` (tests/models/spell11_k3.py, its grouped pairs
brought to token order by rule `pair_restore`; `expert_combine`'s finalize forms).

Proven in two parts, as `expert_slots` is:
1. Structure, exact, no evaluation of the experts. P = N*k rows (k >= 2). (a) t is a constant
   equal to arange(P) // k: row p goes to token p // k. (b) The rows enter the region only
   through *entries*: chains of data-movement ops (views, expand, clone, gathers by constant
   indices) from z [N, L], ids [N, k] or the weights [N, k], evaluated on position codes
   (arange of the source's size) to be exactly `ids.flatten()[p]`, `w.flatten()[p]` and
   `z[p // k]` in row p. (c) Every node computed from an entry is *row-wise* on dim 0 (`rowwise`:
   pointwise ops on aligned rows and broadcast constants, lookups into an outside table by a row
   index, views and reductions that keep dim 0, bmm over it). So src[p] = f(z[n], ids[n, j],
   w[n, j]) for one function f, and out[n] = sum_j f(...): the canonical finalize's sum over the
   k slots, up to the order of the k-term fp32 sum (`index_add_` adds in index order on CPU,
   in any order on CUDA; the canonical `sum(1)` in its own). The combine: src [P, L] reaches
   y [N, k, L] through views and casts only, y[n, j] = src[n*k + j] (checked on position
   codes), the rows' entries are z and the ids alone (the weights enter at the combine), and
   the combine is sum_j w[n, j] y[n, j] (`expert_combine.evaluates_as_sum`: random values).
2. f, on random values (distinct ids per row, random bytes, scales in [118, 137]): the region
   (the dequant as spelled, any layout) against the canonical experts within RTOL of the
   largest value, for the roles the data flow shows (`_roles`: the stack pair whose dequant
   alone reaches the sigmoid is W1, the one alone reaching a tanh W3, the third W2; the betas
   among the float constants next to each tanh and their reciprocals). Where large, at smaller
   I, L, E and fewer tokens (`_row_sizes`). The canonical experts keep the sum in fp32
   unrounded (`out_dtype` fp32 where z is not fp32), as `index_add_` into an fp32 accumulator
   does.

Left alone: a token index that is not arange(P) // k (a permutation, duplicate or dropped rows;
rows read as [k, N, L] by the combine),
an entry that is not the flat ids / weights or the repeated z (z tiled instead of repeated, a
permuted row order), a node mixing rows (a gather by a row index from a row tensor, a reduction
over dim 0, a row-aligned tensor from outside), an accumulator that is not zero, anything but
the MXFP4 SiTU experts (by the evaluation: another activation, a mask dropping pairs, other
weights), a region too large to evaluate even at the smaller sizes (e.g. K3's sizes at N = 2,
where P = 32 is also the MX group and cannot be shrunk; its near miss stays).
"""

from __future__ import annotations

import collections
import itertools
import math

import torch
from torch import fx
from torch.utils._pytree import tree_leaves, tree_map

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.expert_combine import combine_site, evaluates_as_sum
from k3compile.canonical.expert_slots import (
    FORMAT_INTS,
    SMALL_I,
    SMALL_L,
    canonical_experts,
    random_inputs,
    region_values,
    splice_experts,
)
from k3compile.canonical.region import VIEWS, call_on_cpu, on_cpu
from k3compile.canonical.region import static_shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.rewrite import inductor

aten, prims = torch.ops.aten, torch.ops.prims
# fp32 GEMMs and the k-term sum in other orders than the canonical ones: measured 1.0e-5 of the
# largest value at K3's TP16 sizes, N = 2 (k = 16, shrunk to I 160, L 352), 3e-7 at the tests'
# sizes; a look-alike (another beta, a dropped pair, a bf16 rounding) differs by 1e-3 or more
RTOL = 1e-4
BUDGET = 1 << 24  # values the region's evaluation may compute at its own sizes (all N*k rows)
MAX_VALUES = 1 << 28  # ... at the smaller sizes (each dropped after its last use)
_GATHERS = {aten.index.Tensor, aten.index_select.default}
_LOOKUPS = {aten.index.Tensor, aten.index_select.default, aten.take.default}
_REDUCTIONS = {aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.mean.dim}
_MOVES = VIEWS | {prims.convert_element_type.default}  # the rows to the combine's [N, k, L]


# ---- constants and the index of the finalize ---------------------------------------------------


def constant(node, memo: dict) -> bool:
    """Whether node depends on no graph input (an iota, a zeros, ops of those)."""
    if not isinstance(node, fx.Node):
        return True
    todo = [node]  # depth first, without recursion: a model's graph is thousands of nodes deep
    while todo:
        n = todo[-1]
        if n in memo:
            todo.pop()
        elif n.op != "call_function":
            memo[n] = n.op == "get_attr"
        elif any(memo.get(a) is False for a in n.all_input_nodes):
            memo[n] = False
        elif (missing := [a for a in n.all_input_nodes if a not in memo]):
            todo += missing
        else:
            memo[n] = True
    return memo[node]


def evaluate(node: fx.Node, env: dict, resize=None):
    """node's value from env (values of some nodes) and constants computed on the way (graph
    constants read from the module); `resize` maps each int argument."""
    if node in env:
        return env[node]
    if node.op == "get_attr":
        env[node] = on_cpu(_attr(node))
        return env[node]
    if node.op != "call_function":
        raise KeyError(node)
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: evaluate(a, env, resize))
    if resize is not None:
        args, kwargs = tree_map(lambda a: resize.get(a, a) if type(a) is int else a,
                                (args, kwargs))
    env[node] = call_on_cpu(node.target, args, kwargs)
    return env[node]


def _attr(node: fx.Node):
    value = node.graph.owning_module
    for name in node.target.split("."):
        value = getattr(value, name)
    return value


def real_value(node: fx.Node, env: dict | None = None):
    """node's real value from env, or None where it needs anything else (call it outside any
    fake mode)."""
    try:
        return evaluate(node, dict(env or {}))
    except (KeyError, RuntimeError, TypeError, IndexError):
        return None


def index_put_finalize(node: fx.Node):
    """(acc, t, src) of `index_put(acc, [t], src, True)`, acc a zero fp32 [N, L] constant."""
    if node.target is not aten.index_put.default or len(node.args) < 4 or node.args[3] is not True:
        return None
    acc, indices, src = node.args[:3]
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or indices[0] is None:
        return None
    out, rows = _shape(node), _shape(src)
    if (out is None or rows is None or len(out) != 2 or rows[1:] != out[1:]
            or rows[0] % out[0] or rows[0] < 2 * out[0] or _val(node).dtype != torch.float32
            or _val(src).dtype != torch.float32):
        return None
    if not (isinstance(acc, fx.Node) and not acc.all_input_nodes and (
            acc.target is aten.zeros.default
            or acc.target is aten.full.default and acc.args[1] == 0)):
        return None
    return acc, indices[0], src


# ---- row-wise regions ------------------------------------------------------------------------


def _dim(d, rank: int) -> int:
    return d % rank if rank else d


def rowwise(node: fx.Node, rows: set[fx.Node], p: int) -> bool:
    """Whether node's row i (dim 0, P rows) is a function of its row operands' rows i alone:
    operands in `rows` are row tensors [P, ...], any other is outside. Outside tensors may only
    broadcast over the rows (lower rank, or a size-1 dim 0) or be looked up by a row index."""
    shape, t = _shape(node), node.target
    if node.op != "call_function" or shape is None or not shape or shape[0] != p:
        return False
    operands = node.all_input_nodes
    row = [a for a in operands if a in rows]
    if not row or any(_shape(a) is None or not _shape(a) or _shape(a)[0] != p for a in row):
        return False
    outside = [a for a in operands if a not in rows]
    rank = len(shape)
    if t in _LOOKUPS:  # table[idx]: the table outside, the index a row tensor
        table, idx = node.args[0], (node.args[1] if t is not aten.index_select.default
                                    else node.args[2])
        if t is aten.index_select.default and node.args[1] != 0:
            return False
        if t is aten.index.Tensor:
            if len(idx) != 1 or idx[0] is None:
                return False
            idx = idx[0]
        return table not in rows and idx in rows and len(_shape(idx)) >= 1
    if t is aten.bmm.default:
        return all(a in rows for a in node.args[:2])
    if t in _REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else None
        src_rank = len(_shape(node.args[0]))
        return (not outside and dims is not None and len(dims) > 0
                and 0 not in {_dim(d, src_rank) for d in dims})
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
        return (all(len(_shape(a)) == rank for a in row)
                and all(_shape(a) is not None and (len(_shape(a)) < rank or _shape(a)[0] == 1)
                        for a in outside))
    if outside and not (t is aten.cat.default):
        return False
    src = node.args[0]
    src_rank = len(_shape(src)) if isinstance(src, fx.Node) and _shape(src) is not None else 0
    if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.clone.default, aten.alias.default):
        return True  # both shapes start with P: row i stays row i
    if t is aten.unsqueeze.default:
        return _dim(node.args[1], rank) != 0
    if t in (aten.squeeze.dim, aten.select.int, aten.slice.Tensor):
        return _dim(node.args[1], src_rank) != 0
    if t is aten.squeeze.dims:
        return 0 not in {_dim(d, src_rank) for d in node.args[1]}
    if t is aten.expand.default:
        return src_rank == rank
    if t is aten.permute.default:
        return _dim(node.args[1][0], rank) == 0
    if t is aten.transpose.int:
        return 0 not in {_dim(d, rank) for d in node.args[1:3]}
    if t is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
        return (not outside and _dim(dim, rank) != 0
                and all(len(_shape(a)) == rank for a in node.args[0]))
    if t is aten.gather.default:
        return not outside and _dim(node.args[1], rank) != 0
    return False


def rows_from(roots: set[fx.Node], out: fx.Node, p: int) -> set[fx.Node] | None:
    """The nodes between roots and out computed from a root (out included), where every one is
    row-wise over P rows; None otherwise."""
    seen, todo = set(roots), [out]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += node.all_input_nodes
    order = {node: i for i, node in enumerate(out.graph.nodes)}
    region = sorted(seen - set(roots), key=order.__getitem__)
    rows = set(roots)
    for node in region:
        if any(a in rows for a in node.all_input_nodes):
            if not rowwise(node, rows, p):
                return None
            rows.add(node)
    return rows - set(roots)


# ---- entries: z, ids and the weights moved into rows -------------------------------------------


def _moves(node: fx.Node, memo: dict) -> bool:
    """A data-movement op: a view / expand / clone, or a gather by a constant index."""
    if node.op != "call_function":
        return False
    if node.target in VIEWS:
        return True
    if node.target in _GATHERS:
        idx = node.args[1] if node.target is aten.index.Tensor else node.args[2]
        return all(constant(i, memo) for i in (idx if isinstance(idx, (list, tuple)) else [idx]))
    return False


def _source(node: fx.Node, memo: dict) -> fx.Node | None:
    """The first node up node's chain of movement ops that is not one (node itself if it moves
    nothing: None)."""
    if not _moves(node, memo):
        return None
    while _moves(node, memo):
        node = node.args[0]
    return node


def _entry_role(entry: fx.Node, source: fx.Node, n: int, k: int) -> str | None:
    """'ids' / 'weights' (row p = source.flatten()[p]) or 'z' (row p = source[p // k]) where the
    movement chain from source to entry does that exactly, checked on position codes."""
    shape, v = _shape(source), _val(source)
    if shape is None or v is None or len(shape) != 2 or shape[0] != n:
        return None
    code = torch.arange(n * shape[1]).view(shape)
    moved = real_value(entry, {source: code})
    if moved is None or moved.dim() == 0 or moved.shape[0] != n * k:
        return None
    got = moved.reshape(n * k, -1)
    if shape[1] == k:
        want, role = code.reshape(n * k, 1), ("weights" if v.dtype.is_floating_point else "ids")
    elif v.dtype.is_floating_point:
        want, role = code[torch.arange(n * k) // k], "z"
    else:
        return None
    return role if got.shape == want.shape and torch.equal(got, want) else None


def _from_tokens(source: fx.Node, n: int) -> bool:
    shape = _shape(source)
    return shape is not None and len(shape) == 2 and shape[0] == n


def _entries(src: fx.Node, n: int, k: int, roles: set[str]):
    """({role: source}, entries) of the row region ending at src, or None: walking up from src
    through nodes of P rows, each operand is a constant, an entry (movement chain from an [N, .]
    source), or a node of the region."""
    memo, p = {}, n * k
    sources, entries, seen, todo = {}, set(), set(), [src]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for a in node.all_input_nodes:
            if constant(a, memo) or a in entries:
                continue
            source, shape = _source(a, memo), _shape(a)
            if source is not None and shape and shape[0] == p and _from_tokens(source, n):
                role = _entry_role(a, source, n, k)
                if role is None or sources.setdefault(role, source) is not source:
                    return None
                entries.add(a)
            elif shape and shape[0] == p and a.op == "call_function":
                todo.append(a)
    if set(sources) != roles:
        return None
    return sources, entries


# ---- the site ----------------------------------------------------------------------------------


def _tables(rows: set[fx.Node], entries: set[fx.Node], memo: dict):
    """(lut, six stacks) the row region reads from outside (the E2M1 table may be a constant),
    or None where it reads any other non-constant tensor."""
    outside = {a for node in rows for a in node.all_input_nodes
               if a not in rows and a not in entries}
    stacks = [a for a in outside if not constant(a, memo) and _val(a) is not None
              and _val(a).dtype == torch.uint8]
    luts = {_uncast(a) for a in outside if a not in stacks and _shape(a) == (16,)}
    if (len(stacks) != 6 or len(luts) != 1 or any(not _val(a).dtype.is_floating_point
                                                  for a in luts)
            or any(not constant(a, memo) for a in outside
                   if a not in stacks and _uncast(a) not in luts)):
        return None
    return luts.pop(), stacks


def _uncast(node: fx.Node) -> fx.Node:
    """The table a float cast or a view reads (the E2M1 table cast or viewed per dequant: exact,
    E2M1 values are exact in every float type)."""
    while (node.target is prims.convert_element_type.default
           and _val(node).dtype.is_floating_point and _val(node.args[0]).dtype.is_floating_point
           or node.target in VIEWS and _shape(node.args[0]) == _shape(node) == (16,)):
        node = node.args[0]
    return node


def _combine(bmm: fx.Node):
    """(out, src, w, y) of the weighted combine of the pair rows at a bmm: w [N, k] (k >= 2) and
    the rows src [P, L] read as y [N, k, L] (views, maybe a cast: row p is (p // k, p % k),
    checked on position codes), the product read back as out [N, L] fp32
    (`bmm(w.unsqueeze(1), y)`, spell11's); the sum itself is checked later (`expert_combine`'s
    evaluation)."""
    found = combine_site(bmm, routed=False)
    if found is None:
        return None
    w, y, out = found
    (n, k), width = _shape(w), _shape(y)[2]
    if k < 2:
        return None
    src = y
    while _shape(src) != (n * k, width) and src.op == "call_function" and src.target in _MOVES:
        src = src.args[0]
    if _shape(src) != (n * k, width):
        return None
    code = torch.arange(n * k * width).view(n * k, width)
    got = real_value(y, {src: code})
    if got is None or got.shape != (n, k, width):
        return None
    return (out, src, w, y) if torch.equal(got.long(), code.view(n, k, width)) else None


def _site(out: fx.Node):
    with inductor.unset_fake_temporarily():  # real values, inside a compile's fake mode
        return _real_site(out)


def _real_site(out: fx.Node):
    memo: dict = {}
    if out.target is aten.bmm.default:  # the rows read as [N, k, L] and combined by w [N, k]
        found = _combine(out)
        if found is None:
            return None
        out, src, combined, y = found
        (n, k), p = _shape(combined), _shape(src)[0]
    else:  # the rows summed back to their tokens
        found = index_put_finalize(out)
        if found is None:
            return None
        _, t, src = found
        n, p, combined = _shape(out)[0], _shape(src)[0], None
        k = p // n
        if not constant(t, memo) or _shape(t) != (p,):
            return None
        index = real_value(t)
        if index is None or not torch.equal(index, torch.arange(p) // k):
            return None
    found = _entries(src, n, k, {"z", "ids"} if combined is not None else
                     {"z", "ids", "weights"})
    if found is None:
        return None
    sources, entries = found
    if combined is not None:
        sources["weights"] = combined
    rows = rows_from(entries, src, p)
    tables = _tables(rows, entries, memo) if rows is not None else None
    if tables is None:
        return None
    lut, stacks = tables
    z, ids, weights = sources["z"], sources["ids"], sources["weights"]
    if _shape(ids) != (n, k) or _val(ids).dtype not in (torch.int64, torch.int32):
        return None
    region = _region([z, ids, weights, lut, *stacks], out)
    pairs = _pairs(stacks, region) if region is not None else None
    if pairs is None:
        return None
    if combined is not None and not evaluates_as_sum(combined, y, out):
        return None
    inputs = [z, ids, weights, lut, *(x for pair in pairs for x in pair)]
    proof = _proof(region, inputs, out, pairs)
    return (out, [z, ids, weights, lut], proof) if proof is not None else None


def _region(inputs: list[fx.Node], out: fx.Node) -> list[fx.Node] | None:
    """The nodes out is computed from, stopping at inputs, in graph order (graph constants
    included); None where it reads another graph input."""
    seen, todo, region = set(inputs), [out], []
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op not in ("call_function", "get_attr"):
            return None
        region.append(node)
        todo += node.all_input_nodes
    order = {node: i for i, node in enumerate(out.graph.nodes)}
    return sorted(region, key=order.__getitem__)


def _pairs(stacks: list[fx.Node], region: list[fx.Node]) -> list[tuple[fx.Node, fx.Node]] | None:
    """(packed, scale) of each of the three experts' weights, whatever the dequant's spelling:
    the two stacks that first meet in a node of the region (packed [E, O, W/2], scale
    [E, O, W/32])."""
    deps: dict[fx.Node, frozenset] = {x: frozenset([x]) for x in stacks}
    for node in region:
        deps[node] = frozenset().union(*(deps.get(a, frozenset()) for a in node.all_input_nodes))
    met = {d for d in deps.values() if len(d) == 2}
    pairs = []
    for pair in met:
        packed, scale = sorted(pair, key=lambda x: -_shape(x)[-1])
        ps, ss = _shape(packed), _shape(scale)
        if len(ps) != 3 or ps[:2] != ss[:2] or ps[2] != 16 * ss[2]:
            return None
        pairs.append((packed, scale))
    if len(pairs) != 3 or {x for pair in pairs for x in pair} != set(stacks):
        return None
    return sorted(pairs, key=lambda pair: pair[0].name)


def _values_of(region, inputs, out, sizes):
    """(random inputs, out on them): the region run in graph order with every int of `sizes` in
    its arguments and its inputs' shapes replaced (as `expert_slots._slot_values`; graph
    constants read), each value dropped after its last use (the rows of every pair at once)."""
    values = random_inputs(inputs, sizes, torch.Generator().manual_seed(0))
    env, uses = dict(values), collections.Counter(a for n in region for a in n.all_input_nodes)
    for node in region:
        evaluate(node, env, sizes)
        for a in node.all_input_nodes:
            uses[a] -= 1
            if uses[a] == 0 and a not in values:
                del env[a]
    return values, env[out]


def _ints(nodes: list[fx.Node]) -> set[int]:
    """Every int of the nodes' arguments and shapes."""
    found = set()
    for node in nodes:
        found.update(_shape(node) or ())
        found.update(a for a in tree_leaves((node.args, node.kwargs)) if type(a) is int)
    return found


def _row_sizes(region: list[fx.Node], inputs: list[fx.Node]) -> dict[int, int] | None:
    """{} where the region is small enough to evaluate as it is; else smaller sizes, as a map
    applied to every int of its arguments and its inputs' shapes (as `expert_slots.shrunk_sizes`):
    I, L, E (and I/2, L/2, I/32, L/32) where they can be told apart from each other, from N, P,
    k and the format's constants, and N, P = N*k where they can be told apart from every other
    int of the region. The smaller sizes are ints the region does not hold (no equality the full
    region lacks). None where the region stays too large."""
    values = [*region, *inputs]
    if region_values(values, {}) <= BUDGET:
        return {}
    z, ids, _, _, *stacks = inputs
    (n, k), p = _shape(ids), math.prod(_shape(ids))
    latent, experts = _shape(z)[-1], _shape(stacks[0])[0]
    inter = {_shape(s)[1] for s in stacks} - {latent}
    present, sizes = _ints(values), {}
    if len(inter) == 1 and inter.copy().pop() % 32 == 0 == latent % 32:
        (inter,) = inter
        full = [inter, inter // 2, inter // 32, latent, latent // 2, latent // 32, experts]
        if len(set(full)) == 7 and not {n, p, k, *FORMAT_INTS} & set(full):
            for i, lat in itertools.product(SMALL_I, SMALL_L):
                small = [i, i // 2, i // 32, lat, lat // 2, lat // 32]
                if len(set(small)) == 6 and not set(small) & present:
                    small.append(_fresh(k + 1, present | set(small)))
                    sizes = dict(zip(full, small))
                    break
    others = present - {n, p} - set(sizes)  # the ints the map leaves
    if not {n, p} & (others | FORMAT_INTS | {k}):
        taken = others | FORMAT_INTS | set(sizes.values())
        rows = next((m for m in range(2, n) if not {m, m * k} & taken), None)
        if rows is not None:
            sizes.update({n: rows, p: rows * k})
    return sizes if region_values(values, sizes) <= MAX_VALUES else None


def _fresh(start: int, taken: set[int]) -> int:
    return next(m for m in itertools.count(start) if m not in taken)


def _roles(pairs, region: list[fx.Node]):
    """[(the stacks as W1, W3, W2, beta candidates, linear beta candidates)] read off the data
    flow: W1's dequant alone reaches a sigmoid (SiTU's gate), W3's alone a tanh, W2's is the
    third; the betas are the float constants next to each one's tanh, or their reciprocals
    (`tanh(g * (1 / b1)) * b1`: spell6's SiTU, which rule `situ_forms` canonicalises only later).
    Empty where the flow shows no such roles."""
    deps: dict[fx.Node, frozenset] = {x: frozenset([pair]) for pair in pairs for x in pair}
    for node in region:
        deps[node] = frozenset().union(*(deps.get(a, frozenset()) for a in node.all_input_nodes))

    def alone(target):
        return {next(iter(deps[n])): n for n in region
                if n.target is target and len(deps.get(n, ())) == 1}

    gates, tanhs = alone(aten.sigmoid.default), alone(aten.tanh.default)
    found = []
    for w1 in set(gates) & set(tanhs):
        for w3 in set(tanhs) - {w1}:
            (w2,) = set(pairs) - {w1, w3}
            found.append(([*w1, *w3, *w2], _betas(tanhs[w1]), _betas(tanhs[w3])))
    return found


def _betas(tanh: fx.Node) -> list[float]:
    near = [*tanh.all_input_nodes, *tanh.users]
    return sorted({x for n in near for c in n.args if isinstance(c, float) and c > 0
                   for x in (c, float(f"{1 / c:.12g}"))})


def _proof(region, inputs, out, pairs):
    """(beta, linear beta, the stacks as W1, W3, W2) for which the region equals the canonical
    experts on random values (within RTOL of the largest value), or None."""
    sizes = _row_sizes(region, inputs)
    roles = _roles(pairs, region)
    if sizes is None or not roles:
        return None
    try:
        values, got = _values_of(region, inputs, out, sizes)
    except (RuntimeError, IndexError):  # an int of the region that was not a size
        return None
    scale = float(got.abs().max().clamp_min(1e-30))
    for ordered, betas, linear_betas in roles:
        args = [values[x] for x in (*inputs[:4], *ordered)]
        for beta, linear_beta in itertools.product(betas, linear_betas):
            try:
                want = canonical_experts(beta, linear_beta, None)(*args)
            except RuntimeError:  # shapes that do not fit this assignment
                break
            if (want.shape == got.shape and want.dtype == got.dtype
                    and float((got - want).abs().max()) <= RTOL * scale):
                return beta, linear_beta, ordered
    return None


def apply(graph: fx.Graph) -> int:
    if graph.owning_module is None:
        return 0
    cache: dict = {}
    return rewrite_sites(graph, _site, lambda g, n, s: splice_experts(g, n, s, cache),
                         targets={aten.index_put.default, aten.bmm.default}, sort=True)


RULE = Rule("expert_rows", apply,
            "routed MXFP4 experts on token-major pair rows (z repeated k times, flat ids, "
            "index_add_ finalize or a weighted [N, k] combine) -> the k slots at once "
            "(math.mxfp4_experts)")

__all__ = ["RULE", "apply", "constant", "evaluate", "rows_from"]
