"""Rule `token_view`: per-token values computed on flat [B*T, ...] token rows and viewed to
[B, T, ...] late (or [B, T, ...] values flattened to rows early) -> the same ops on [B, T, ...]
values, the form `patterns/kda_decode.py` reads (q, k, v, the decay, β and the output norm on
[B, T, H, d]; the projections viewed [B, T, W] where the GEMMs leave them).

Serving code runs a step on flat tokens (tests/models/spell7_k3.py: q, k, v cut from the conv
output as [N, H, d], the l2 norms, the decay and β on [N, ...], viewed `view(B, T, H, d)` only
before the recurrence; the output `.reshape(B*T, H, d)` before its gated norm). Row n of a flat
tensor is element (n // T, n % T) of its [B, T] view (a view splits or merges dim 0 only, in
order), so every op that is row-wise on dim 0 computes on the [B, T] view exactly what it
computed on the rows. The rule moves such views through those ops:

* up: `view(f(a, ...), [B, T, *s])` with f row-wise and every reader of f(a, ...) that same view
  -> `f(view(a, [B, T, ...]), ...)`; the new views move up in turn, to where the value is not
  row-wise (a GEMM's output: `view(mm, [B, T, C])`, then viewed on as the old view was);
* down: `f(view(z [B, T, *s], [B*T, *s']), ...)` with f row-wise -> `view(f(z', ...), [B*T,
  ...])` (other flat operands of f viewed to [B, T] and moved up), down to what is not row-wise
  (a GEMM, which reads the flat rows as `F.linear` of a [B, T, ...] value does);
* a split view of a merge view, or a merge of a split, is one view of the source (or the
  source); an unbound piece of `view(y [B, T, C], [B*T, n, *r])` is a `split(C/n, -1)` piece of
  y viewed [B, T, *r] (the cut of the q|k|v conv output, spell7's `reshape(N, 3, H, d)
  .unbind(1)`).

Row-wise here: pointwise ops (operands of lower rank broadcast over trailing dims only, as they
did; an operand of full rank has the same leading dim), casts, sums / means over dims other than
0, unsqueezes not at 0. Bit for bit (the same elements, the same ops in the same order; no dtype
or shape change for any value read outside the moved ops) but for one case: at T > 1 the cut's
`reshape` copies the transposed conv output (a `clone`), which the split reads without the copy,
as the canonical form does; elementwise CPU kernels may then round an ulp apart on the strided
layout (measured <= 2.4e-7 relative on the l2 norms, tests/canonical/test_token_view.py).
Scope: the modules that run a depthwise short conv and their submodules (spell10's output norm
is an `o_norm` module inside its KDA module), and only views of that conv's (B, T) (its
output [B, C, T]): at T = 1 a unit token dim is no different by its shape from other unit dims
(the built-in model's [B, 1, D] residual stream, its AttnRes mixes and MoE, which moves there
would unfuse), and [B*H] merges of heads are no tokens. Within it, a view moves up only for a
per-head value ([B, T, H, d]), β (a sigmoid of its projection [B, T, H]) or a projection's upcast
(bf16 models: `g.float()`, `sigmoid(b.float())` of bf16 GEMMs, spell7's) computed from GEMM
outputs, cut pieces or step inputs (`_from_projections`: not from a state read or the
recurrence), and down only from a per-head value read, through row-wise ops, by a GEMM alone
(`_into_gemm`: the output norm into o_proj). Without these, hf's KDA (values on [B, 1, ...]
read back into its recurrence) and spell9's layers (one module: its FFN and in-proj views) lost
fused ops. B and T come from each view (T may be 1, B*T = the rows); a view that
also reshapes the trailing dims is split into the two. Left alone: views mixing rows with
other dims ([B*T, n] -> [B, T*n]), ops over dim 0 (a sum over tokens, a gather of rows), values
read by anything but the one view (an escape), and flat values of another row count.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.canonical.region import CASTS, refresh, shape, val
from k3compile.canonical.short_conv import depthwise
from k3compile.graph import RESHAPES, call, fake_value

aten = torch.ops.aten
_BINARY = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor}
_UNARY = {aten.exp.default, aten.neg.default, aten.sigmoid.default, aten.rsqrt.default,
          aten.sqrt.default, aten.tanh.default, aten.pow.Tensor_Scalar, aten.silu.default,
          aten.reciprocal.default, aten.abs.default}
_SUMS = {aten.sum.dim_IntList, aten.mean.dim}
_LIMIT = 2000  # moves per graph: each moves a view strictly up or down, this only bounds a bug


def _split(node: fx.Node):
    """(B, T) where node views a floating [B*T, *s] value as [B, T, *s'] (prod s = prod s')."""
    if node.target not in RESHAPES or not isinstance(node.args[0], fx.Node):
        return None
    src, out, v = shape(node.args[0]), shape(node), val(node)
    if (src is None or out is None or len(src) < 2 or len(out) < 3 or out[0] * out[1] != src[0]
            or math.prod(src[1:]) != math.prod(out[2:]) or not v.dtype.is_floating_point
            or tuple(src[:2]) == tuple(out[:2])):  # [B, 1, ...] at T = 1: no rows to split
        return None
    return tuple(out[:2])


def _merge(node: fx.Node):
    """(B, T) where node views a floating [B, T, *s] value as [B*T, *s'] (prod s = prod s'),
    and T > 1 or the source's third dim is no unit dim of the output (at T = 1 `view(z [B, 1,
    H, d], [B, H, d])` merges; `view(y [B, H], [B, H])` is no merge)."""
    if node.target not in RESHAPES or not isinstance(node.args[0], fx.Node):
        return None
    src, out, v = shape(node.args[0]), shape(node), val(node)
    if (src is None or out is None or len(src) < 3 or len(out) < 2 or src[0] * src[1] != out[0]
            or math.prod(src[2:]) != math.prod(out[1:]) or not v.dtype.is_floating_point
            or len(src) != len(out) + 1):
        return None
    return tuple(src[:2])


def _rows_dim(d: int, rank: int) -> int | None:
    """dim d of a flat value of `rank` on its [B, T] form (a negative dim is the same); None for
    dim 0."""
    if d < 0:
        return d if d > -rank else None
    return None if d == 0 or d >= rank else d + 1


def _row_wise(node: fx.Node, rows: int) -> bool:
    """node (its value [rows, ...]) is row-wise on dim 0 of its full-rank operands."""
    out = shape(node)
    if out is None or not out or out[0] != rows or node.op != "call_function":
        return False
    t, args = node.target, node.args
    tensors = [a for a in args if isinstance(a, fx.Node)]
    if t in _BINARY and len(args) == 2 and not node.kwargs:
        return all(shape(a) is not None and (len(shape(a)) < len(out) or shape(a)[0] in (rows, 1)
                                             and len(shape(a)) == len(out)) for a in tensors)
    if t in _UNARY or t in CASTS:
        return len(tensors) == 1 and shape(args[0]) == out and set(node.kwargs) <= {"dtype"}
    if t is aten.unsqueeze.default:
        return _rows_dim(args[1], len(out)) is not None
    if t in _SUMS and len(args) >= 2 and len(tensors) == 1 and set(node.kwargs) <= {"dtype"}:
        rank = len(shape(args[0]))
        return shape(args[0])[0] == rows and all(_rows_dim(d, rank) is not None for d in args[1])
    return False


def _uncast(node):
    """node, or the value a chain of casts reads (the GEMM an upcast reads)."""
    while isinstance(node, fx.Node) and node.target in CASTS:
        node = node.args[0]
    return node


def _module(node: fx.Node):
    stack = node.meta.get("nn_module_stack")
    return next(reversed(stack.values()))[0] if stack else None


def _in_scope(node: fx.Node, scope: dict) -> set:
    """The (B, T) of the conv modules node runs in: its own module's, or an enclosing one's (a
    norm module inside the KDA module, spell10's `o_norm`; None, a conv with no module stack,
    the top module's, encloses every node)."""
    stack = node.meta.get("nn_module_stack") or {}
    return set(scope.get(None, ())).union(*(scope.get(path, ()) for path, _ in stack.values()))


def _conv_modules(graph: fx.Graph) -> dict:
    """module -> the (B, T) of its depthwise short conv (a KDA layer's; its output [B, C, T]):
    the scope of the moves (module None: a graph traced without module stacks, whole). Only
    views of those (B, T) move: a [B*H] merge of heads (spell5's `reshape(b * h, dk, dk)`) is
    no token merge, and `head_rows` / `delta_einsum` read it as written."""
    scope = {}
    for n in graph.nodes:
        if depthwise(n) is not None and len(shape(n)) == 3:  # a conv or a bf16 product sum
            scope.setdefault(_module(n), set()).add((shape(n)[0], shape(n)[2]))
    return scope


_GEMMS = {aten.mm.default, aten.addmm.default}


def _from_projections(node: fx.Node, rows: int, depth: int = 40) -> bool:
    """node [rows, ...] is computed row-wise from GEMM outputs, cut pieces and step inputs only
    (the KDA front: projections, the q|k|v cut of the conv output), not from a state read or
    the recurrence, which the moves must leave as written."""
    if node.op == "placeholder":
        return True  # a step input (flat activations)
    if depth == 0 or node.op != "call_function":
        return False
    if node.target in _GEMMS or node.target is operator.getitem:
        return True
    if node.target in RESHAPES or node.target is aten.clone.default:
        a = node.args[0]
        return isinstance(a, fx.Node) and (shape(a)[0] == rows or len(shape(a)) >= 3
                                           and shape(a)[0] * shape(a)[1] == rows) and (
            _from_projections(a, shape(a)[0], depth - 1))
    if not _row_wise(node, rows):
        return False
    rank = len(shape(node))  # (a sum's input may have more dims than the sum)
    return all(_from_projections(a, rows, depth - 1) for a in node.args
               if isinstance(a, fx.Node) and len(shape(a)) >= rank and shape(a)[0] == rows)


def _into_gemm(node: fx.Node, rows: int, depth: int = 40) -> bool:
    """every reader of node [rows, ...] is row-wise or a view keeping the rows, down to a GEMM
    reading them (the KDA output's o_proj), none a state write or the recurrence."""
    if depth == 0 or not node.users:
        return False
    for user in node.users:
        if user.target in _GEMMS and user.args[-2 if user.target is aten.addmm.default
                                                else 0] is node:
            continue
        if user.target in RESHAPES and shape(user) and shape(user)[0] == rows or _row_wise(
                user, rows):
            if not _into_gemm(user, rows, depth - 1):
                return False
            continue
        return False
    return True


class _Moves:
    def __init__(self, graph: fx.Graph, scope: set):
        self.graph, self.done, self.changed, self.scope = graph, 0, [], scope
        self.splits = {}  # (y, width) -> the one split of y's columns its pieces share

    def view(self, x: fx.Node, out: list[int], like: fx.Node) -> fx.Node:
        if list(shape(x)) == list(out):
            return x
        return call(self.graph, aten.view.default, (x, list(out)), like=like)

    def lifted(self, a, bt, rows: int, like: fx.Node):
        """Operand a of a row-wise op, as it reads on [B, T]."""
        if not isinstance(a, fx.Node) or shape(a) is None:
            return a
        s = shape(a)
        if len(s) < len(shape(like)):
            return a  # broadcasts over trailing dims: the same there
        if s[0] == rows:
            return self.view(a, [*bt, *s[1:]], like)
        return self.view(a, [1, 1, *s[1:]], like)  # a unit leading dim

    def rewrite(self, node: fx.Node, bt, rows: int) -> fx.Node:
        """node written again on its [B, T] operands (inserted before node)."""
        rank, t = len(shape(node)), node.target
        with self.graph.inserting_before(node):
            if t is aten.unsqueeze.default:
                x = self.lifted(node.args[0], bt, rows, node)
                return call(self.graph, t, (x, _rows_dim(node.args[1], rank)), like=node)
            if t in _SUMS:
                x = self.lifted(node.args[0], bt, rows, node.args[0])
                dims = [_rows_dim(d, len(shape(node.args[0]))) for d in node.args[1]]
                return call(self.graph, t, (x, dims, *node.args[2:]), node.kwargs, like=node)
            args = tuple(self.lifted(a, bt, rows, node) for a in node.args)
            return call(self.graph, t, args, node.kwargs, like=node)

    def up(self, view: fx.Node) -> bool:
        """Move split view `view` above its source, if the source is row-wise or a view."""
        bt, src = _split(view), view.args[0]
        rows, out = bt[0] * bt[1], list(shape(view))
        if len(out) < 4 and not (src.target in _UNARY | CASTS and len(src.users) == 1
                                 and _uncast(src.args[0]).target in _GEMMS | {operator.getitem}):
            # per-head values ([B, T, H, d]), β (a sigmoid of its projection) and a projection's
            # upcast (bf16 models: the decay's and the gate's GEMMs, β's before its sigmoid)
            return False
        if src.op != "call_function" or bt not in _in_scope(src, self.scope):
            return False
        if len(shape(src)) + 1 != len(out) or list(shape(src)[1:]) != out[2:]:
            if src.target in RESHAPES:
                return False  # trailing dims reshaped too: first split, then reshape
            with self.graph.inserting_before(view):
                inner = call(self.graph, aten.view.default, (src, [*bt, *shape(src)[1:]]),
                             like=view)
                new = call(self.graph, aten.view.default, (inner, out), like=view)
            return self._replace(view, new)
        readers = list(src.users)
        if any(_split(u) != bt or list(shape(u)) != out for u in readers):
            return self._uncloned(view)
        if src.target in RESHAPES and isinstance(src.args[0], fx.Node):
            a = src.args[0]
            if len(shape(a)) >= 3 and tuple(shape(a)[:2]) == bt:  # split of a merge
                with self.graph.inserting_before(view):
                    new = self.view(a, out, view)
            elif shape(a) and shape(a)[0] == rows and _from_projections(a, rows):
                # a view keeping the rows
                with self.graph.inserting_before(view):
                    new = self.view(self.view(a, [*bt, *shape(a)[1:]], view), out, view)
            else:
                return False
        elif src.target is operator.getitem and (new := self._unbound(src, bt, out, view)):
            pass
        elif not _from_projections(src, rows):
            return False
        elif _row_wise(src, rows):
            new = self.rewrite(src, bt, rows)
        else:
            return False
        for u in readers:
            self._replace(u, new)
        return True

    def _uncloned(self, view: fx.Node) -> bool:
        """view(clone(a)) -> view(a): a reshape's copy of a strided value (a piece of the
        transposed conv output cut per q, k, v and reshaped to [B*T, H, d]), where the view
        reads a as well (the same elements; a split of the last dim)."""
        src = view.args[0].args[0] if view.args[0].target in RESHAPES else None
        if (src is None or src.target is not aten.clone.default or len(src.users) != 1
                or set(src.kwargs) - {"memory_format"}):
            return False
        try:
            fake_value(aten.view.default, (src.args[0], list(shape(view))))
        except RuntimeError:
            return False
        with self.graph.inserting_before(view):
            return self._replace(view, self.view(src.args[0], list(shape(view)), view))

    def _unbound(self, get: fx.Node, bt, out, like) -> fx.Node | None:
        """getitem(unbind(view(y [B, T, C], [B*T, n, *r]), 1), i) -> y's i-th C/n columns."""
        unbind, i = get.args
        if unbind.target is not aten.unbind.int or (unbind.args[1:] or (0,))[0] not in (1, -len(
                shape(unbind.args[0]))):
            return None
        cut = unbind.args[0]
        if cut.target not in RESHAPES or not isinstance(cut.args[0], fx.Node):
            return None
        y, n = cut.args[0], shape(cut)[1]
        while (y.target is aten.clone.default and len(y.users) == 1
               and set(y.kwargs) <= {"memory_format"}):
            y = y.args[0]  # reshape's copy of a transposed value: the same elements
        ys = shape(y)
        if ys is None or len(ys) != 3 or tuple(ys[:2]) != bt or ys[2] % n or list(
                shape(cut)) != [bt[0] * bt[1], n, *out[2:]] or ys[2] != n * math.prod(out[2:]):
            return None
        split = self.splits.get((y, ys[2] // n))
        if split is None or split._erased:
            with self.graph.inserting_after(y):
                split = call(self.graph, aten.split.Tensor, (y, ys[2] // n, -1), like=like)
            self.splits[(y, ys[2] // n)] = split
        with self.graph.inserting_before(like):
            piece = call(self.graph, operator.getitem, (split, i), like=like)
            return self.view(piece, out, like)

    def down(self, merge: fx.Node) -> bool:
        """Move merge view `merge` below one row-wise reader."""
        bt = _merge(merge)
        rows = bt[0] * bt[1]
        if list(shape(merge.args[0])[2:]) != list(shape(merge)[1:]):
            return False  # trailing dims reshaped: left to the readers' views
        if len(shape(merge.args[0])) < 4 or not _into_gemm(merge, rows):
            return False  # per-head values only ([B, T, H, d]): an FFN's [B, T, D] input stays
        for user in list(merge.users):
            if bt not in _in_scope(user, self.scope):
                continue
            if user.target in RESHAPES and (_split(user) == bt or shape(user)[0] == rows):
                # a split of the merge, or a view keeping its rows: one view of the source
                with self.graph.inserting_before(user):
                    new = self.view(merge.args[0], list(shape(user)), user)
                return self._replace(user, new)
            if _row_wise(user, rows) and user.target not in RESHAPES:
                new = self.rewrite(user, bt, rows)
                with self.graph.inserting_before(user):
                    back = call(self.graph, aten.view.default, (new, list(shape(user))),
                                like=user)
                return self._replace(user, back)
        return False

    def _replace(self, old: fx.Node, new: fx.Node) -> bool:
        if val(new).dtype != val(old).dtype or shape(new) != shape(old):
            raise AssertionError(f"token_view: {old.name} {shape(old)} -> {shape(new)}")
        old.replace_all_uses_with(new)
        self.done += 1
        self.changed.append(new)
        return True


def apply(graph: fx.Graph) -> int:
    scope = _conv_modules(graph)
    if not scope:
        return 0
    moves = _Moves(graph, scope)
    progress = True
    while progress and moves.done < _LIMIT:
        progress = False
        for node in list(graph.nodes):
            if node._erased or node.op != "call_function" or not node.users:
                continue
            if _split(node) and moves.up(node) or _merge(node) and moves.down(node):
                progress = True
                graph.eliminate_dead_code()
                break
    if moves.done:
        _one_view_each(graph, scope)
        refresh([n for n in moves.changed if not n._erased])
        graph.eliminate_dead_code()
    return moves.done


def _one_view_each(graph: fx.Graph, scope: set) -> None:
    """Equal views of one value (each reader's operand was viewed on its own) -> one view, as a
    value viewed once and read twice traces."""
    seen = {}
    for node in list(graph.nodes):
        src = node.args[0] if node.target is aten.view.default else None
        if (src is not None and _module(node) in scope and src.target is aten.clone.default
                and len(src.users) == 1 and not set(src.kwargs) - {"memory_format"}
                and src.args[0].target is operator.getitem
                and src.args[0].args[0].target is aten.split.Tensor):
            # a reshape's copy of a piece of the cut, viewed: the view of the piece
            try:
                fake_value(aten.view.default, (src.args[0], list(shape(node))))
                node.args = (src.args[0], *node.args[1:])
                graph.erase_node(src)
            except RuntimeError:
                pass
        if node.target is aten.view.default and _module(node) in scope:
            key = (node.args[0], tuple(node.args[1]))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node


RULE = Rule("token_view", apply,
            "row-wise ops on flat [B*T, ...] tokens viewed to [B, T, ...] late (or flattened "
            "early) -> the same ops on [B, T, ...]; an unbound piece of a [B*T, n, ...] view -> "
            "a split piece viewed [B, T, ...]")

__all__ = ["RULE", "apply"]
