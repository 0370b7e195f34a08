"""Rule `token_rows`: an FFN computed on [B, T, D] token tensors -> the same FFN on [B*T, D] rows,
the form the FFN patterns (moe_front, moe_route, norm_linear, situ_gate_up, the shared experts'
stream) are traced on.

Our model (`LatentMoE.forward`: `x.reshape(-1, D)` first, `.view(shape)` last) and serving code
run an FFN on token rows. Reference code keeps the token dim through it (tests/models/spell8_k3.py:
activations [B, T, D], T = 1 for one token): every GEMM is then `view(x, [B*T, D])`, `mm`,
`view(.., [B, T, N])`, and the router's sigmoid / top-k, the renormalisation and the latent
RMSNorm run on [B, T, ...] values, which the patterns traced at rank 2 do not match.

The site: an FFN input x (a [B, T, ...] value that a GEMM reads through views / casts) and the
region C of nodes computed from x alone (besides weights and constants), row by row, that ends in
ONE value y of x's shape, read only by elementwise ops (the residual add) or the graph's output.
Every node of C is written again on rows: each [B, T, ...] value as [B*T, ...] (`merged`), its
dims shifted down by one; y's readers read `view(rows(y), y's shape)`. Rows are formed only by
views of size-1 or merged leading dims (pure reshapes, element order kept), so every op computes
the same elements in the same order: the values, dtypes and rounding are the T-form graph's, bit
for bit. What a node of C may be:

* an elementwise op (operands of lower rank broadcast as before: one aligned with T must have
  size 1), a reduction / softmax / top-k / gather / cat / split / slice / unsqueeze / permute over
  dims >= 2 (not over the rows: B and T), a reduction over every dim (the one-hot range checks);
* a view whose output is a pure reshape of its input (checked by replaying it on an arange): the
  `view(x, [B*T, D])` into a GEMM, the einsum lowering's unsqueeze / permute / view chains;
* a GEMM reading rows of C by a weight: `mm(rows, W)`, `bmm(rows [1, N, K], W [1, K, M])`.

A weight is any value that does not depend on an integer graph input (token ids, slots,
positions): parameters, dequantised expert stacks, constants.

Where the spelling flattens its tokens itself before its routed experts (spell9: `z.reshape(-1,
L)`, `ids.reshape(-1, k)`, experts gathered by those ids), the experts' values are rows already:
their bmm's against the gathered weights and the views into and out of them are kept as written
(`Rows._on_rows`, `_into_experts`). Those are the einsum lowering's chains that the moe_experts
pattern is traced with; composed into one view each (at T = 1 their [B, 1, ...] shapes read as
tokens) they were lost.

Refused, nothing rewritten: regions
that read another per-token value (attention reads its cache at `slots`, a short conv its state,
the residual stream is computed from the ids), that reduce, index, cat or permute over B or T (a
sum over T, a conv window over the tokens), that mix rows in a GEMM (`mm(W, x)`), that end in
more than one value or in one read by anything but an elementwise op or the output (a
token-mixing op after the region), and regions with no GEMM or no op to move (the view around a
plain linear is our model's own form).

Before: view(x [B,1,D], [B, D]) -> mm -> view([B,1,E]) -> sigmoid -> add bias -> topk ...
After:  view(x, [B, D]) -> mm -> sigmoid -> add bias -> topk ...   (y viewed back to [B,1,D])
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from k3compile.canonical import Rule
from k3compile.canonical.region import CASTS, VIEWS
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.token_dim import POINTWISE
from k3compile.graph import call, fake_value

aten = torch.ops.aten

REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.mean.dim, aten.amax.default,
                        aten.amin.default, aten.any.dims, aten.all.dims, aten.prod.dim_int,
                        aten.any.dim, aten.all.dim})
FULL_REDUCTIONS = frozenset({aten.sum.default, aten.any.default, aten.all.default,
                             aten.amax.default, aten.amin.default, aten.any.dims, aten.all.dims,
                             aten.sum.dim_IntList, aten.mean.dim, aten.max.default,
                             aten.min.default})
ASSERTS = frozenset({aten._assert_async.msg, aten._assert_async.default})
SPLITS = frozenset({aten.split_with_sizes.default, aten.split.Tensor})
# ops of one tensor and one dim argument (at 1) over which they work
DIM_OPS = frozenset({aten._softmax.default, aten._log_softmax.default, aten.topk.default,
                     aten.sort.default, aten.cumsum.default, aten.select.int, aten.slice.Tensor,
                     aten.squeeze.dim, aten.argmax.default, aten.argmin.default,
                     *SPLITS})
GEMMS = frozenset({aten.mm.default, aten.bmm.default})
_INDEX_DTYPES = (torch.int32, torch.int64)


def _pointwise(target) -> bool:
    if target in POINTWISE:
        return True
    return (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
            and not target._schema.is_mutable)


def _varying(graph: fx.Graph) -> set[fx.Node]:
    """The nodes computed from an integer graph input (token ids, slots, positions): per-token
    values, never weights."""
    out = set()
    for n in graph.nodes:
        v = n.meta.get("val")
        index = n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dtype in _INDEX_DTYPES
        if index or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _constant(node: fx.Node) -> bool:
    """node reads no graph input (a `zeros` accumulator, an iota)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return False
        todo += n.all_input_nodes
    return True


def _pure_reshape(node: fx.Node) -> bool:
    """node (a view op of its first argument) keeps its input's elements in their order."""
    src = node.args[0]
    s, out = _shape(src), _shape(node)
    if s is None or out is None or any(not isinstance(d, int) for d in (*s, *out)):
        return False
    numel = 1
    for d in s:
        numel *= d
    with unset_fake_temporarily():
        ids = torch.arange(numel).view(s)
        try:
            got = node.target(ids, *node.args[1:], **node.kwargs)
        except Exception:  # noqa: BLE001 (replayed on a contiguous input: not a pure reshape)
            return False
        return tuple(got.shape) == out and got.numel() == numel and torch.equal(
            got.reshape(-1), torch.arange(numel))


def _feeds_gemm(node: fx.Node, depth: int = 6) -> bool:
    """A GEMM reads node (as its rows) through views and casts."""
    todo = [(node, 0)]
    while todo:
        n, d = todo.pop()
        for u in n.users:
            if u.target in GEMMS and u.args[0] is n:
                return True
            if d < depth and (u.target in VIEWS or u.target in CASTS):
                todo.append((u, d + 1))
    return False


class _Refused(Exception):
    pass


class Rows:
    """One site's rewrite: `rows[n]` is a node with n's value on rows ([B*T, ...] for a
    [B, T, ...] value, n's own shape otherwise)."""

    def __init__(self, graph: fx.Graph, x: fx.Node, varying: set[fx.Node]):
        self.graph, self.x, self.varying = graph, x, varying
        self.B, self.T = _shape(x)[:2]
        self.rows: dict[fx.Node, fx.Node] = {}
        self.created: list[fx.Node] = []
        self._per_token: dict[fx.Node, bool] = {}

    # ---- shapes ----------------------------------------------------------------------------------

    def token(self, shape) -> bool:
        return shape is not None and len(shape) >= 2 and tuple(shape[:2]) == (self.B, self.T)

    def merged(self, shape) -> list[int]:
        return [self.B * self.T, *shape[2:]] if self.token(shape) else list(shape)

    def lowered(self, node: fx.Node) -> bool:
        """Whether node's rows value has fewer dims than node (False for a value with no tensor
        shape: a tuple of split pieces, a scalar; hf_k3's FFN has one)."""
        low, high = _shape(self.rows[node]), _shape(node)
        return low is not None and high is not None and len(low) < len(high)

    def _dim(self, d: int, rank: int) -> int:
        """Dim d of a rank-`rank` [B, T, ...] value in its rows; refused for B and T."""
        if not isinstance(d, int) or not -rank <= d < rank or d % rank < 2:
            raise _Refused
        return d if d < 0 else d - 1

    # ---- nodes -----------------------------------------------------------------------------------

    def _new(self, target, args, kwargs, like: fx.Node, before: fx.Node) -> fx.Node:
        try:
            fake_value(target, tuple(args), kwargs)
        except Exception as e:  # the op refuses the rows' shapes or dtypes
            raise _Refused from e
        with self.graph.inserting_before(before):
            node = call(self.graph, target, tuple(args), kwargs, like=like)
        node.meta["k3_rule"] = "token_rows"
        self.created.append(node)
        return node

    def _full(self, a: fx.Node, before: fx.Node) -> fx.Node:
        """full(a's rows' shape), its value made in a's fake mode (it reads no tensor)."""
        args = (self.merged(_shape(a)), *a.args[1:])
        with torch._guards.detect_fake_mode([a.meta["val"]]):
            val = a.target(*args, **a.kwargs)
        with self.graph.inserting_before(before):
            node = self.graph.call_function(a.target, args, dict(a.kwargs))
        node.meta.update({**a.meta, "val": val, "k3_rule": "token_rows"})
        self.created.append(node)
        return node

    def view(self, node: fx.Node, shape, like: fx.Node, before: fx.Node) -> fx.Node:
        """view(node, shape): node itself where it has that shape (every GEMM on x reads the one
        [B*T, D] view of it, as every GEMM of our model reads its one [N, D] x), else one view of
        node's input where node is a view of ours (pure reshapes compose)."""
        if list(_shape(node)) == list(shape):
            return node
        while node.target == aten.view.default and node.meta.get("k3_rule") == "token_rows":
            node = node.args[0]
        if list(_shape(node)) == list(shape):
            return node
        return self._new(aten.view.default, (node, list(shape)), {}, like, before)

    def rollback(self) -> None:
        for node in reversed(self.created):
            self.graph.erase_node(node)

    # ---- one node of the region ------------------------------------------------------------------

    def operand(self, a, rank: int, node: fx.Node):
        """An operand of elementwise `node` (rank `rank`, its rows lowered) on rows."""
        if not isinstance(a, fx.Node):
            return a
        s = _shape(a)
        if a in self.rows:
            r = self.rows[a]
            if len(s) >= rank - 1 and not self.lowered(a):
                raise _Refused
            return r
        if s is None or len(s) <= rank - 2:
            return a
        if len(s) == rank - 1:  # aligned with T: broadcast only
            if s[0] != 1:
                raise _Refused
            return a
        if tuple(s[:2]) == (1, 1):
            return self.view(a, [1, *s[2:]], node, node)
        if self.token(s) and a.target == aten.full.default:  # an accumulator's zeros
            return self._full(a, node)
        if self.token(s) and _constant(a):
            return self.view(a, self.merged(s), node, node)
        raise _Refused

    def lower(self, n: fx.Node) -> fx.Node:
        t, args, kwargs = n.target, n.args, dict(n.kwargs)
        src = args[0] if args else None
        ins = [a for a in n.all_input_nodes if a in self.rows]
        if t in VIEWS and src in self.rows and _pure_reshape(n):
            if self._on_rows(n, ins):
                return self._same_op(n, ins)
            if self._into_experts(n, ins):
                return self._chain_root(n) or self._same_op(n, ins)
            return self.view(self.rows[src], self.merged(_shape(n)), n, n)
        if t == aten.bmm.default and all(a in self.rows for a in args[:2]):
            if self._on_rows(n, ins):
                return self._same_op(n, ins)
            try:
                return self._row_bmm(n)
            except _Refused:
                if not self._kept(n, ins):
                    raise
                return self._same_op(n, ins)  # batched otherwise: one expert per batch
        if t is operator.getitem:
            if self.rows[src] is src:
                return n
            return self._new(t, (self.rows[src], args[1]), {}, n, n)
        low = [a for a in ins if self.lowered(a)]
        mapped = fx.map_arg((args, kwargs), lambda a: self.rows.get(a, a))
        if not low:
            return self._same_shapes(n, ins, mapped)
        if len(low) != len(ins) and not _pointwise(t):
            raise _Refused
        if _shape(n) is None and t not in SPLITS and t not in (aten.topk.default,
                                                               aten.sort.default):
            raise _Refused
        if _pointwise(t):
            rank = len(_shape(n))
            new = [self.operand(a, rank, n) for a in args]
            out = self._new(t, new, kwargs, n, n)
            if list(_shape(out)) != self.merged(_shape(n)):
                raise _Refused
            return out
        rank = len(_shape(src))
        rest = list(args[2:])
        if t in REDUCTIONS or t in FULL_REDUCTIONS:
            dims = args[1] if len(args) > 1 else kwargs.pop("dim", None)
            if dims is None or dims == []:  # every dim: the same scalar on rows
                if _shape(n) != ():
                    raise _Refused
                return self._new(t, *mapped, n, n)
            many = isinstance(dims, (list, tuple))
            new_dims = [self._dim(d, rank) for d in (dims if many else [dims])]
            return self._new(t, (self.rows[src], new_dims if many else new_dims[0], *rest),
                             kwargs, n, n)
        if t in DIM_OPS:
            if t == aten.topk.default:  # (x, k, dim=-1, ...): the default stays unwritten
                if len(args) > 2 or "dim" in kwargs:
                    d = args[2] if len(args) > 2 else kwargs.pop("dim")
                    return self._new(t, (self.rows[src], args[1], self._dim(d, rank),
                                         *args[3:]), kwargs, n, n)
                return self._new(t, (self.rows[src], args[1]), kwargs, n, n)
            if t in SPLITS:
                d = args[2] if len(args) > 2 else kwargs.pop("dim", 0)
                return self._new(t, (self.rows[src], args[1], self._dim(d, rank)), kwargs, n, n)
            if t == aten.sort.default:
                d = args[1] if len(args) > 1 else kwargs.pop("dim", -1)
                return self._new(t, (self.rows[src], self._dim(d, rank), *args[2:]), kwargs, n, n)
            return self._new(t, (self.rows[src], self._dim(args[1], rank), *rest), kwargs, n, n)
        if t == aten.gather.default:  # (x, dim, index): the rows of both
            return self._new(t, (self.rows[src], self._dim(args[1], rank), self.rows[args[2]]),
                             kwargs, n, n)
        if t == aten.cat.default:
            d = args[1] if len(args) > 1 else 0
            parts = [self.rows[p] if p in self.rows and self.lowered(p) else None for p in src]
            if None in parts:
                raise _Refused
            return self._new(t, (parts, self._dim(d, rank)), kwargs, n, n)
        if t == aten.unsqueeze.default:
            return self._new(t, (self.rows[src], self._dim(args[1], rank + 1)), kwargs, n, n)
        if t == aten.permute.default:
            dims = [d % rank for d in args[1]]
            if dims[:2] == [0, 1]:
                return self._new(t, (self.rows[src], [0, *(d - 1 for d in dims[2:])]), kwargs,
                                 n, n)
            if dims[0] != 0 or self.T != 1:
                raise _Refused
            # T = 1 moved behind the features (a lowered einsum): B stays dim 0, one row each
            return self._new(t, (self.view(self.rows[src], _shape(src), n, n), dims), kwargs, n, n)
        if t == aten.expand.default:
            if len(args[1]) != rank or _shape(n)[:2] != _shape(src)[:2]:
                raise _Refused
            return self._new(t, (self.rows[src], self.merged(_shape(n))), kwargs, n, n)
        raise _Refused

    def _same_shapes(self, n: fx.Node, ins: list[fx.Node], mapped) -> fx.Node:
        """n reads rows of C that have their nodes' shapes: the op itself, on them, where it
        keeps the rows apart."""
        t = n.target
        if t in GEMMS:
            x, w = n.args[:2]
            if x not in self.rows or w in self.rows or w in self.varying:
                raise _Refused  # mm(W, x) sums over the rows
            if t == aten.bmm.default and _shape(w)[0] != 1:
                raise _Refused
            if t == aten.mm.default and self._low_rank(n):
                raise _Refused
        elif t in ASSERTS:
            pass
        elif not _pointwise(t) and not (t in FULL_REDUCTIONS and _shape(n) == ()) and not (
                self._kept(n, ins)):
            raise _Refused
        if t == aten.bmm.default:
            linear = self._linear(n)
            if linear is not None:
                return linear
        if all(self.rows[a] is a for a in ins):
            return n
        if t in ASSERTS:  # a check: no value to compute
            with self.graph.inserting_before(n):
                node = self.graph.call_function(t, *mapped)
            node.meta.update(n.meta)
            self.created.append(node)
            return node
        return self._new(t, *mapped, n, n)

    def _kept(self, n: fx.Node, ins: list[fx.Node]) -> bool:
        """n reads only values of the region that are rows already (none lowered: a spelling
        that flattens its tokens itself, spell9's `z.reshape(-1, L)` and `idx.reshape(-1, k)`
        before its experts) and is one of the experts' row-wise ops the region otherwise
        refuses: a gather of a weight's rows by ids of the region (`stack[ids]`, `lut[codes]`),
        a cat not over the rows, a permute keeping the rows first, a bmm batched otherwise (one
        expert per batch). Written as it
        is on its operands' rows (their values, in their shapes), it computes the same values."""
        t, args = n.target, n.args
        if not ins or any(self.lowered(a) for a in ins):
            return False
        if t == aten.index.Tensor:
            return args[0] not in self.rows and all(i in self.rows for i in args[1]
                                                    if isinstance(i, fx.Node))
        rank = len(_shape(n) or ())
        if t == aten.cat.default:
            dim = args[1] if len(args) > 1 else 0
            return isinstance(dim, int) and rank > 0 and dim % rank != 0
        if t == aten.permute.default:  # the rows stay dim 0
            return rank > 0 and args[1][0] % rank == 0
        return t == aten.bmm.default

    def _on_rows(self, n: fx.Node, ins: list[fx.Node]) -> bool:
        """n, a bmm against the routed experts' weights or a view of their values, reads only
        values that are rows already (none lowered: a spelling that flattens its tokens itself
        before its experts, spell9): kept as written (not the view that unflattens rows into
        tokens, `ys.reshape(B, T, k, L)`: its rows are its input). So the canonical einsum
        lowering's unsqueeze / permute / view chains around the experts' GEMMs, which
        patterns/moe_experts.py is traced with, stay those ops; composed into one view each (at
        T = 1 their [B, 1, ...] shapes read as tokens) they were lost."""
        if any(self.lowered(a) for a in ins) or self._unflattens(n):
            return False
        if n.target == aten.bmm.default:
            return self._expert_gemm(n)
        src = n
        while src.op == "call_function" and src.target in VIEWS:
            src = src.args[0]
        return self._expert_weight(src) or (src.target == aten.bmm.default
                                            and self._expert_gemm(src))

    def _into_experts(self, n: fx.Node, ins: list[fx.Node]) -> bool:
        """n, a view of rows (none lowered), reaches a bmm against the routed experts' weights
        through views only: the latent's chain into FC1 / FC3."""
        if any(self.lowered(a) for a in ins) or self._unflattens(n):
            return False
        todo = list(n.users)
        while todo:
            u = todo.pop()
            if u.target in VIEWS:
                todo += u.users
            elif u.target == aten.bmm.default and self._expert_gemm(u):
                return True
        return False

    def _unflattens(self, n: fx.Node) -> bool:
        """n views rows as tokens: [B*T, ...] -> [B, T, ...]."""
        out = _shape(n)
        return n.target in VIEWS and self.token(out) and self.merged(out) == list(
            _shape(n.args[0]))

    def _chain_root(self, n: fx.Node) -> fx.Node | None:
        """The rows of the value n's chain of pure reshapes starts from, where that value has n's
        shape (the spelling's own reshapes before the einsum, `z.view(..).reshape(-1, L)`: the
        einsum reads z itself, as where the tokens are flat)."""
        node, seen = n, set()
        while node.op == "call_function" and node.target in VIEWS and node not in seen:
            if not _pure_reshape(node):
                return None
            seen.add(node)
            src = node.args[0]
            node = src if self.rows.get(src) in seen else self.rows.get(src, src)
        return node if _shape(node) == _shape(n) else None

    def _expert_gemm(self, bmm: fx.Node) -> bool:
        return any(self._expert_weight(a) for a in bmm.args[:2])

    def per_token(self, node: fx.Node) -> bool:
        """node is computed from x or from an integer graph input (ids, slots, positions)."""
        memo, todo = self._per_token, [node]
        while todo:
            n = todo[-1]
            if n in memo:
                todo.pop()
                continue
            if n is self.x or n in self.varying:
                memo[n] = True
                continue
            ins = [a for a in n.all_input_nodes if a not in memo]
            if ins:
                todo += ins
                continue
            memo[n] = any(memo[a] for a in n.all_input_nodes)
        return memo[node]

    def _expert_weight(self, node: fx.Node, limit: int = 256) -> bool:
        """node is a weight or table indexed by per-token ids (`stack[ids]`, `lut[codes]`) or
        computed from one without a GEMM (the routed experts' dequantised weights)."""
        seen, todo = set(), [node]
        while todo and len(seen) < limit:
            n = todo.pop()
            if n in seen or n is self.x or n.op != "call_function" or n.target in GEMMS:
                continue
            seen.add(n)
            if n.target == aten.index.Tensor and not self.per_token(n.args[0]) and any(
                    self.per_token(i) for i in n.args[1] if isinstance(i, fx.Node)):
                return True
            todo += n.all_input_nodes
        return False

    def _same_op(self, n: fx.Node, ins: list[fx.Node]) -> fx.Node:
        """n itself on its operands' rows (n where they are its operands)."""
        if all(self.rows[a] is a for a in ins):
            return n
        return self._new(n.target, *fx.map_arg((n.args, n.kwargs), lambda a: self.rows.get(a, a)),
                         n, n)

    def _low_rank(self, mm: fx.Node) -> bool:
        """mm's rows are another mm's output through views only (`f_b(f_a(x))` on graph-input
        weights): a low-rank pair of an attention's projections, whose pattern
        (linear_concat[kda], rule `lowrank_view`) keeps the [B, T, R] view between the two. An
        FFN's mm's read an activation or a norm (LatentMoE's down-projection feeds the experts'
        bmm's, against computed weights: not an mm here)."""
        src = mm.args[0]
        while src.op == "call_function" and src.target in VIEWS:
            src = src.args[0]
        return src.op == "call_function" and src.target == aten.mm.default

    def _row_bmm(self, bmm: fx.Node) -> fx.Node:
        """bmm(a, b) of two values of the region batched over the rows (batch i = row i of both:
        one token's small matmul, the routing weights times its one-hot rows) on the rows."""
        rows = self.B * self.T
        a, b = bmm.args[:2]
        if any(_shape(v)[0] != rows or _shape(self.rows[v])[0] != rows for v in (a, b)):
            raise _Refused
        out = self._new(bmm.target, (self.view(self.rows[a], _shape(a), bmm, bmm),
                                     self.view(self.rows[b], _shape(b), bmm, bmm)), {}, bmm, bmm)
        return self.view(out, self.merged(_shape(bmm)), bmm, bmm)

    def _linear(self, bmm: fx.Node) -> fx.Node | None:
        """bmm(rows [1, N, K], W [1, K, M]) where W is the transpose of a 2-D value w [M, K]
        (an einsum against a weight computed in the graph, `router.float()`, which rule `gemm`
        leaves alone) -> view(mm(rows, permute(w, [1, 0])), [1, N, M]): the F.linear form, the
        same products (None where W is not such a transpose)."""
        x, w = bmm.args[:2]
        chain, root = [], w
        while root.op == "call_function" and root.target in VIEWS:
            chain.append(root)
            root = root.args[0]
        (_, N, K), (_, _, M) = _shape(x), _shape(w)
        if not chain or _shape(root) != (M, K) or _shape(x)[0] != 1 or _shape(w)[0] != 1:
            return None
        with unset_fake_temporarily():
            ids = torch.arange(M * K).view(M, K)
            got = ids
            for node in reversed(chain):
                got = node.target(got, *node.args[1:], **node.kwargs)
            if not torch.equal(got, ids.t().unsqueeze(0)):
                return None
        rows = self.view(self.rows[x], [N, K], bmm, bmm)
        weight = self._new(aten.permute.default, (root, [1, 0]), {}, bmm, bmm)
        mm = self._new(aten.mm.default, (rows, weight), {}, bmm, bmm)
        return self._new(aten.view.default, (mm, [1, N, M]), {}, bmm, bmm)

    # ---- the site --------------------------------------------------------------------------------

    def allowed(self, a: fx.Node) -> bool:
        """a, read by a node of the region from outside it, is a weight or a constant."""
        return a not in self.varying

    def grow(self) -> list[fx.Node] | None:
        """The region's nodes in graph order (each lowered into `rows`), or None (refused)."""
        x = self.x
        self.rows[x] = self.view(x, self.merged(_shape(x)), x, x.next)
        region, tainted = [], set()
        pending = set(x.users)
        order = list(self.graph.nodes)
        for n in order[order.index(x) + 1:]:
            if not pending:
                break
            if n in pending:
                pending.discard(n)
            ins = n.all_input_nodes
            if n.meta.get("k3_rule") == "token_rows":
                continue
            if any(a in tainted for a in ins):
                tainted.add(n)  # computed from a value the region could not take
                continue
            if not any(a in self.rows for a in ins):
                continue
            if n.op != "call_function" or any(a not in self.rows and not self.allowed(a)
                                              for a in ins):
                tainted.add(n)
                continue
            try:
                self.rows[n] = self.lower(n)
            except Exception:  # noqa: BLE001 (_Refused, or an op whose arguments we do not read)
                tainted.add(n)
                continue
            region.append(n)
            pending.update(n.users)
        return region

    def exits(self, region: list[fx.Node]) -> list[fx.Node]:
        """The nodes of the region read from outside it (the rows it wrote aside)."""
        inside = set(region) | set(self.created)
        return [n for n in region if any(u not in inside for u in n.users)]


def _site(y: fx.Node, x: fx.Node, region: list[fx.Node], rows: Rows) -> bool:
    """The region is an FFN: one exit of x's shape and dtype on rows, read only by elementwise ops
    or the output, a GEMM in it and an op it moves onto rows."""
    inside = set(region) | set(rows.created)
    if _shape(y) != _shape(x) or y.meta["val"].dtype != x.meta["val"].dtype or not rows.lowered(y):
        return False
    if any(u.op != "output" and not _pointwise(u.target) for u in y.users if u not in inside):
        return False
    if not any(n.target in GEMMS for n in region):
        return False
    return any(rows.lowered(n) and rows.rows[n] is not n and n.target not in VIEWS
               and n.target not in GEMMS for n in region)


def _rewrite(graph: fx.Graph, x: fx.Node, varying: set[fx.Node]) -> bool:
    rows = Rows(graph, x, varying)
    try:
        region = rows.grow()
    except _Refused:
        region = None
    exits = rows.exits(region) if region else []
    if len(exits) != 1 or not _site(exits[0], x, region, rows):
        rows.rollback()
        return False
    (y,) = exits
    inside = set(region)
    back = rows._new(aten.view.default, (rows.rows[y], list(_shape(y))), {}, y, y)
    y.replace_all_uses_with(back, delete_user_cb=lambda u: u not in inside and u is not back)
    for n in reversed(region):
        if rows.rows[n] is not n and not n.users:
            graph.erase_node(n)
    return True


def apply(graph: fx.Graph) -> int:
    varying = _varying(graph)
    done = 0
    for x in list(graph.nodes):
        if x._erased or x.op == "output" or x.meta.get("k3_rule") == "token_rows":
            continue
        s = _shape(x)
        if s is None or len(s) < 3 or not _feeds_gemm(x):
            continue
        if _rewrite(graph, x, varying):
            done += 1
            varying = _varying(graph)
    if done:
        graph.eliminate_dead_code()
    return done


RULE = Rule("token_rows", apply,
            "an FFN on [B, T, D] token tensors (T = 1: one token) -> the same FFN on [B*T, D] "
            "rows, viewed back to [B, T, D] at its one exit")
