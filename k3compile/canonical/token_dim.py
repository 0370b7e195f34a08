"""Rule `token_dim`: attention written on [B, X] activations (one token per row, vLLM's flattened
[num_tokens, D]) -> the [B, T=1, X] form the attention patterns are traced on.

Our model, and every attention pattern, carries a token dim T through its attention modules
(`GatedMLA.forward`: x [B, T, D], the latent cache written at `(slots.view(B, 1),
positions.view(B, 1) + arange(T))` with rows [B, T, C + R]). Serving code that decodes one token
per request writes the same attention without it: rows [B, C + R] written at `(slots,
positions)`, the norms, the query and the gate on [B, X]. The values are the same; the graphs are
not (a pattern traced at rank 3 does not match rank 2).

This rule adds the unit dim where an attention site is recognised by its state, and nowhere else:

* MLA: a latent-cache write `index_put(cache [S, L, W], [slots [B], positions [B]], rows [B, W])`
  whose new cache reaches a state write-back and is read back at `[slots]` becomes
  `index_put(cache, [slots.view(B, 1), positions.view(B, 1) + iota(1)], rows')`, rows' = rows
  with a unit dim at 1 (`lift`; at B = 1, `cache[slots, positions] = rows` writes rows viewed to
  [W]: the [1, W] rows are read). Rule `mla_absorbed` (absorbed) or `mla_absorb` (non-absorbed)
  then rewrites the attention over it, T = 1, its flattened output [B, H·V] from a [B, 1, H·V]
  form, the query's GEMM input and the output gate lifted with it (`sink`).
* KDA: a recurrent-state write `index_put(S [S, H, K, V], [slots], new)` reaching a state
  write-back, new computed from `index(S, [slots])`, whose recurrence (the nodes from that read
  to new and to o, the first [B, H, V] value after one contraction of the new state) reads
  per-token values that are not `select(x, 1, t)` (the T form): each such value x the
  recurrence reads (through the unsqueezes / permutes of a broadcast or a lowered einsum) is
  read as `select(lift(x), 1, 0)`, as `delta_rule_step` reads token 0 of [B, T, ...]; o is
  `view(o, [B, 1, H, V])` (the stack of one token) for the norm and gate after it, whose
  o_proj GEMM reads their lifted form; a lifted GEMM output whose input is a piece of a split
  (f_b on the in-projection's f_a) reads that piece lifted too; the short conv's new window
  column `unsqueeze(x [B, 3W], -1)` is `permute(lift(x), [0, 2, 1])` and its output's
  `squeeze(-1)` lifts to `permute(conv, [0, 2, 1])` (the transposes of the T form).

`lift(x)` builds x's value with a unit dim inserted at dim 1 from the lifted values of x's inputs,
through the ops that are shape-polymorphic in a known way (pointwise ops, broadcasting operands
of lower rank left as they are; reductions, splits, cats, views, permutes over dims >= 1, their
dims shifted); at any other op (a GEMM's mm, a graph input) it views that op's output
[B, 1, ...], as the T = 1 trace of a linear does (`view(mm(...), [B, T, N])`); a view that
removed the unit dim of a lifted value gives that value back. Nodes equal to existing ones are
reused. Every step only inserts a size-1 dim: the values, dtypes and rounding are those of the
rank-2 graph, bit for bit. The rank-2 nodes nothing reads any more go with dead code.

Left alone: cache writes with [B, 1] / [B, T] indices (the canonical form), writes of [B, T, W]
rows, writes whose cache is not read back at the same slots, writes that reach no state
write-back; recurrences that read selects of dim 1 (the T form), weights or constants besides
the state, or whose new state is not contracted to one [B, H, V] output.

Before: index_put(cache, [slots, positions], cat([norm(c), k_pe]))     rows [B, C + R]
After:  index_put(cache, [view(slots, [B, 1]), add(view(positions, [B, 1]), iota(1))],
            cat([norm(view(c', [B, 1, .])), view(k_pe', [B, 1, .])]))   rows [B, 1, C + R]
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.state_write import reaches_state
from k3compile.graph import call

aten, prims = torch.ops.aten, torch.ops.prims

# elementwise ops: operands broadcast from the right, the output has the operands' shape
POINTWISE = frozenset({
    aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor, aten.sqrt.default, aten.rsqrt.default, aten.exp.default,
    aten.exp2.default, aten.log.default, aten.neg.default, aten.abs.default,
    aten.sigmoid.default, aten.tanh.default, aten.silu.default, aten.reciprocal.default,
    aten.square.default, aten.clone.default, aten.where.self, aten.maximum.default,
    aten.minimum.default, aten.clamp_min.default, aten.clamp.default,
    prims.convert_element_type.default, aten._to_copy.default, aten.masked_fill.Scalar,
    aten.bitwise_not.default, aten.eq.Tensor, aten.gt.Tensor, aten.lt.Tensor, aten.le.Tensor,
    aten.ge.Tensor})
# reductions (x, dims, keepdim, ...) over the dims named
REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.mean.dim, aten.amax.default,
                        aten.amin.default})
VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
SPLITS = frozenset({aten.split_with_sizes.default, aten.split.Tensor})


def _lifted_shape(shape: tuple) -> list:
    return [shape[0], 1, *shape[1:]]


def _dim(d: int, rank: int) -> int | None:
    """Dim d of a rank-`rank` tensor in the lifted tensor; None for dim 0 (the rows)."""
    if d < 0:
        return d if d + rank > 0 else None
    return d + 1 if d > 0 else None


class Lifter:
    """`lift(node)`: a node computing node's value with a unit dim at 1. One per graph rewrite;
    it remembers what it lifted."""

    def __init__(self, graph: fx.Graph, gemm_inputs: bool = False):
        self.graph = graph
        self.done: dict[fx.Node, fx.Node] = {}
        # a GEMM whose output is viewed [B, 1, N] reads its input through [B, 1, K] too (a
        # linear at T = 1), where the input is a part of a split (an in-projection's piece)
        self.gemm_inputs = gemm_inputs
        self.transposed: list[fx.Node] = []  # [B, N, 1] values read as [B, 1, N] (a conv's output)

    def _new(self, target, args, kwargs, like: fx.Node) -> fx.Node:
        """`target(*args)`, an existing equal node if there is one, else a new one after the
        latest of its inputs."""
        inputs = []
        fx.map_arg((args, kwargs), inputs.append)
        for user in (inputs[0].users if inputs else ()):
            if user.op == "call_function" and user.target == target and user.args == tuple(args) \
                    and user.kwargs == (kwargs or {}):
                return user
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        last = max(inputs, key=order.__getitem__) if inputs else None
        if last is None or last.op == "placeholder":
            last = next(n for n in self.graph.nodes if n.op != "placeholder").prev
        with self.graph.inserting_after(last):
            node = call(self.graph, target, tuple(args), kwargs, like=like)
        node.meta["k3_rule"] = "token_dim"
        return node

    def boundary(self, node: fx.Node) -> fx.Node:
        """view(node, [B, 1, ...])."""
        if self.gemm_inputs and node.target == aten.mm.default:
            self.gemm_input(node, only_split=True)
        return self._new(aten.view.default, (node, _lifted_shape(_shape(node))), {}, node)

    def gemm_input(self, mm: fx.Node, only_split: bool = False) -> None:
        """mm(x [B, K], w) reads view(lift(x), [B, K]), as a linear at T = 1 does."""
        x = mm.args[0]
        if not isinstance(x, fx.Node) or len(_shape(x) or ()) != 2 or len(_shape(mm)) != 2:
            return
        if only_split and not (x.target is operator.getitem
                               and getattr(x.args[0], "target", None) in SPLITS):
            return
        mm.replace_input_with(x, self.squeezed(self.lift(x), x))

    def lift(self, node: fx.Node) -> fx.Node:
        if node not in self.done:
            self.done[node] = self._lift(node)
        return self.done[node]

    def _lift(self, node: fx.Node) -> fx.Node:
        shape = _shape(node)
        if node.op != "call_function" or not shape:
            return self.boundary(node)
        target, args = node.target, node.args
        src = args[0] if args and isinstance(args[0], fx.Node) else None
        # a view that removed the unit dim of a rank-3 value gives it back
        if src is not None and _shape(src) == tuple(_lifted_shape(shape)) and (
                target in VIEWS or (target == aten.squeeze.dim and args[1] in (1, -len(shape) - 1))
                or (target == aten.select.int and args[1] == 1 and args[2] in (0, -1))):
            return src
        try:
            lifted = self._lift_op(node, shape)
        except Exception:  # noqa: BLE001 (an op whose lifted form does not trace: a boundary)
            lifted = None
        if lifted is None or _shape(lifted) != tuple(_lifted_shape(shape)) \
                or lifted.meta["val"].dtype != node.meta["val"].dtype:
            return self.boundary(node)
        return lifted

    def _operand(self, a, rank: int):
        """A tensor operand of an elementwise op of rank `rank`: lifted where it has the rank,
        as it is where it broadcasts from the right over fewer dims."""
        if not isinstance(a, fx.Node):
            return a
        s = _shape(a)
        return self.lift(a) if s is not None and len(s) == rank else a

    def _lift_op(self, node: fx.Node, shape: tuple) -> fx.Node | None:
        target, args, kwargs, rank = node.target, node.args, dict(node.kwargs), len(shape)
        if target in POINTWISE:
            if any(isinstance(a, fx.Node) and len(_shape(a) or ()) > rank for a in args):
                return None
            if not any(isinstance(a, fx.Node) and len(_shape(a) or ()) == rank for a in args):
                return None
            new = tuple(self._operand(a, rank) for a in args)
            return self._new(target, new, kwargs, node)
        src = args[0]
        if target is operator.getitem and getattr(src, "target", None) in SPLITS:
            split = self._split(src)
            return None if split is None else self._new(target, (split, args[1]), kwargs, node)
        if target == aten.cat.default:
            parts = list(src)
            d = _dim(args[1] if len(args) > 1 else 0, rank)
            if d is None or any(len(_shape(p) or ()) != rank for p in parts):
                return None
            return self._new(target, ([self.lift(p) for p in parts], d), kwargs, node)
        if not isinstance(src, fx.Node) or _shape(src) is None:
            return None
        srank = len(_shape(src))
        if target in REDUCTIONS:
            dims = [_dim(d, srank) for d in (args[1] if isinstance(args[1], (list, tuple))
                                             else [args[1]])]
            if None in dims or srank != rank and not (len(args) > 2 and args[2] is False):
                return None
            return self._new(target, (self.lift(src), dims, *args[2:]), kwargs, node)
        if target in VIEWS:
            if _shape(src)[0] != shape[0]:
                return None
            return self._new(target, (self.lift(src), _lifted_shape(shape)), kwargs, node)
        if target == aten.squeeze.dim and srank == 3 and _shape(src)[2] == 1 \
                and args[1] in (2, -1):
            # [B, N, 1] -> [B, N]: lifted, [B, 1, N] = the transpose of the [B, N, T=1] input
            self.transposed.append(src)
            return self._new(aten.permute.default, (src, [0, 2, 1]), {}, node)
        if target in (aten.unsqueeze.default, aten.squeeze.dim, aten.select.int,
                      aten.slice.Tensor):
            d = _dim(args[1], rank if target == aten.unsqueeze.default else srank)
            if d is None:
                return None
            return self._new(target, (self.lift(src), d, *args[2:]), kwargs, node)
        if target == aten.permute.default:
            dims = [d % srank for d in args[1]]
            if dims[0] != 0:
                return None
            return self._new(target, (self.lift(src), [0, 1, *(d + 1 for d in dims[1:])]),
                             kwargs, node)
        if target == aten.transpose.int:
            a, b = (_dim(d, srank) for d in args[1:3])
            if a is None or b is None:
                return None
            return self._new(target, (self.lift(src), a, b), kwargs, node)
        if target == aten.expand.default:
            if list(args[1][:1]) != [shape[0]] or len(args[1]) != srank:
                return None
            return self._new(target, (self.lift(src), [shape[0], 1, *args[1][1:]]), kwargs, node)
        return None

    def _split(self, node: fx.Node) -> fx.Node | None:
        """The lifted split (of a lifted input, the dim shifted), or None."""
        if node not in self.done:
            x, rank = node.args[0], len(_shape(node.args[0]))
            d = _dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), rank)
            self.done[node] = None if d is None else self._new(
                node.target, (self.lift(x), node.args[1], d), {}, node)
        return self.done[node]

    def squeezed(self, lifted: fx.Node, like: fx.Node) -> fx.Node:
        """view(lifted, like's shape): the rank-2 value back, for like's readers."""
        return self._new(aten.view.default, (lifted, list(_shape(like))), {}, like)

    def sink(self, node: fx.Node, lifted: fx.Node) -> fx.Node:
        """node's readers read view(lifted, node's shape); each elementwise reader that takes it
        whole is lifted in turn (`o * sigmoid(g)`: the gate goes to [B, 1, ...] with it). Returns
        the last rank-2 value (a view of the last lifted node)."""
        self.done[node] = lifted
        out = self.squeezed(lifted, node)
        node.replace_all_uses_with(out)
        out.args = (lifted, *out.args[1:])  # replace_all_uses_with rewired out's own input
        users = [u for u in out.users if u.target in POINTWISE and _shape(u) == _shape(node)]
        if len(users) == 1 and len(out.users) == 1:
            user = users[0]
            return self.sink(user, self.lift(user))
        return out


# ---- MLA: the latent-cache write ------------------------------------------------------------------

def _latent_write(node: fx.Node) -> tuple | None:
    """(cache, slots, positions, rows) of a T-less latent-cache write, or None."""
    if node.target != aten.index_put.default or len(node.args) < 3 or len(node.args[1]) != 2:
        return None
    if len(node.args) > 3 and node.args[3]:  # accumulate
        return None
    cache, (slots, positions), rows = node.args[:3]
    cs, ss, ps, rs = (_shape(n) for n in (cache, slots, positions, rows))
    if ss == (1,) and cs is not None and rs == (cs[2],) and rows.target in VIEWS \
            and _shape(rows.args[0]) == (1, cs[2]):
        rows, rs = rows.args[0], (1, cs[2])  # B = 1: `cache[slots, pos] = rows` drops rows' dim 0
    if None in (cs, ss, ps, rs) or len(cs) != 3 or len(ss) != 1 or ss != ps or rs != (ss[0], cs[2]):
        return None
    if any(n.meta["val"].dtype != torch.int64 for n in (slots, positions)):
        return None
    if not any(u.target == aten.index.Tensor and list(u.args[1]) == [slots] for u in node.users):
        return None
    if not reaches_state(node):
        return None
    return cache, slots, positions, rows


def _canonical_write(graph: fx.Graph, node: fx.Node, site: tuple) -> None:
    cache, slots, positions, rows = site
    lifter = Lifter(graph)
    B = _shape(slots)[0]
    new_rows = lifter.lift(rows)
    with graph.inserting_before(node):
        column = call(graph, aten.view.default, (slots, [B, 1]), like=node)
        start = call(graph, aten.view.default, (positions, [B, 1]), like=node)
        steps = call(graph, prims.iota.default, (1,), {
            "start": 0, "step": 1, "dtype": torch.int64,
            "device": positions.meta["val"].device, "requires_grad": False}, like=node)
        pos = call(graph, aten.add.Tensor, (start, steps), like=node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    if order[new_rows] > order[node]:
        node.prepend(new_rows)  # pragma: no cover (rows are defined before their write)
    node.args = (cache, [column, pos], new_rows, *node.args[3:])
    for n in (column, start, steps, pos):
        n.meta["k3_rule"] = "token_dim"


# ---- KDA: the recurrent-state write --------------------------------------------------------------

# view-like ops between a value and the recurrence that reads it (unsqueeze for the broadcast, the
# permutes and views einsum lowers to)
_CHAIN = frozenset({aten.unsqueeze.default, aten.permute.default, aten.view.default,
                    aten.expand.default, aten.reshape.default, aten._unsafe_view.default})


# what a token's value goes through before the recurrence reads it (a broadcast's unsqueeze, the
# permutes and views of a lowered einsum); a view of a value that is not such a chain belongs to
# the value (`.view(B, H, K)`)
_EINSUM_VIEWS = frozenset({aten.unsqueeze.default, aten.permute.default})


def _cone_back(nodes) -> set:
    seen, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def _recurrent_write(node: fx.Node) -> tuple | None:
    """(read, new state, o) of a T-less KDA recurrence written into a [S, H, K, V] state, or
    None: index_put(S, [slots], new) reaching a state write-back, new computed from
    index(S, [slots]); o the first [B, H, V] value down the new state's readers (S^T q)."""
    if node.target != aten.index_put.default or len(node.args[1]) != 1 or not reaches_state(node):
        return None
    state, (slots,), new = node.args[:3]
    ss, ns = _shape(state), _shape(new)
    if ss is None or ns is None or len(ss) != 4 or len(ns) != 4 or ns[1:] != ss[1:]:
        return None
    reads = [u for u in state.users if u.target == aten.index.Tensor and list(u.args[1]) == [slots]]
    if len(reads) != 1 or reads[0] not in _cone_back([new]):
        return None
    B, H, V = ns[0], ns[1], ns[3]
    seen, todo, outs = set(), [(new, False)], []
    while todo:  # the readers of the new state, through views and one contraction
        n, contracted = todo.pop()
        for u in list(n.users):
            if u in seen or u is node:
                continue
            seen.add(u)
            if contracted and _shape(u) == (B, H, V):
                outs.append(u)
            elif u.target in _CHAIN or u.target == aten.bmm.default and not contracted:
                todo.append((u, contracted or u.target == aten.bmm.default))
    if len(outs) != 1:
        return None
    return reads[0], new, outs[0]


def _kda_site(graph: fx.Graph, node: fx.Node, site: tuple) -> bool:
    read, new, o = site
    B = _shape(new)[0]
    forward, todo = set(), [read]
    while todo:
        n = todo.pop()
        for u in list(n.users):
            if u not in forward and u is not node:
                forward.add(u)
                todo.append(u)
    core = ({read} | forward) & _cone_back([new, o])
    edges = []  # (reader, value): the recurrence reads value, maybe through a view chain
    for n in core:
        if n is read:
            continue
        for a in n.all_input_nodes:
            if a in core:
                continue
            reader = n
            while a.target in _CHAIN and len(a.users) == 1 and isinstance(a.args[0], fx.Node):
                if a.target not in _EINSUM_VIEWS and a.args[0].target not in _CHAIN:
                    break  # the value's own view (`.view(B, H, K)`), not the einsum's
                reader, a = a, a.args[0]
            edges.append((reader, a))
    values = {a for _, a in edges}
    for a in values:
        shape = _shape(a)
        if a.op != "call_function" or not shape or shape[0] != B or len(shape) < 2:
            return False  # a weight or a constant: not a per-token activation
        if a.target == aten.select.int and a.args[1] == 1:
            return False  # the T form already
    lifter = Lifter(graph, gemm_inputs=True)
    lifter.done[o] = lifter.boundary(o)  # o as a stack of one token: view(o, [B, 1, H, V])
    token = {}
    for a in values:
        lifted = lifter.lift(a)
        token[a] = lifter._new(aten.select.int, (lifted, 1, 0), {}, a)
    for reader, a in edges:
        reader.replace_input_with(a, token[a])
    for out in lifter.transposed:  # the short conv the recurrence's q, k, v come from
        conv = _producer(out, aten.convolution.default)
        col = _conv_window(conv) if conv is not None else None
        if col is not None:  # [B, C] -> [B, C, 1] as the transpose of the [B, 1, C] input
            new_col = lifter._new(aten.permute.default, (lifter.lift(col.args[0]), [0, 2, 1]),
                                  {}, col)
            col.replace_all_uses_with(new_col)
    # the output: the GEMM reading o's norm and gate reads their [B, 1, ...] form
    seen, todo = set(), [o]
    while todo:
        n = todo.pop()
        for u in list(n.users):
            if u in seen or u in core:
                continue
            seen.add(u)
            if u.target == aten.mm.default and u.args[0] is n:
                lifter.gemm_input(u)
            elif u.target in POINTWISE | REDUCTIONS | VIEWS:
                todo.append(u)
    return True


def _producer(node: fx.Node, target) -> fx.Node | None:
    """The `target` node node is computed from elementwise (its activation, a cast), or None."""
    while node.target != target:
        if node.target not in POINTWISE or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
    return node


def _conv_window(node: fx.Node) -> fx.Node | None:
    """The new column `unsqueeze(x [B, C], -1)` of a short conv's window cat(state[slots], it),
    or None."""
    if node.target != aten.convolution.default:
        return None
    window = node.args[0]
    if getattr(window, "target", None) != aten.cat.default or len(window.args[0]) != 2 \
            or window.args[1] not in (-1, 2):
        return None
    old, col = window.args[0]
    if getattr(old, "target", None) != aten.index.Tensor or col.target != aten.unsqueeze.default \
            or col.args[1] not in (-1, 2) or len(_shape(col.args[0]) or ()) != 2:
        return None
    return col


def apply(graph: fx.Graph) -> int:
    done = 0
    for node in list(graph.nodes):
        site = _latent_write(node)
        if site is not None:
            _canonical_write(graph, node, site)
            done += 1
            continue
        rec = _recurrent_write(node) if node.target == aten.index_put.default else None
        if rec is not None and _kda_site(graph, node, rec):
            done += 1
    if done:
        graph.eliminate_dead_code()
    return done


RULE = Rule("token_dim", apply,
            "T-less attention ([B, X] rows: MLA latent cache written at 1-D (slots, positions)) "
            "-> the [B, 1, X] form with [B, 1] indices")
