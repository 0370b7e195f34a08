"""Rule `scatter_sum`: a sum over consecutive row groups written as a scatter-add into zeros by
a constant token index -> the sum over the group dim.

A serving file that gathers each token's k experts ([N, k, ...], static shapes) finalizes them
into their tokens as a flat-row scatter (tests/models/spell10_k3.py):

    rows = (y.float() * w[:, :, None]).view(N * k, L)
    tok = torch.arange(N).repeat_interleave(k)
    out = torch.zeros(N, L).scatter_add_(0, tok[:, None].expand(N * k, L), rows)   # or
    out = torch.zeros(N, L).index_add_(0, tok, rows)

which is `(y.float() * w[:, :, None]).sum(1)`, the finalize `patterns/moe_experts.py` matches
(`k3compile.math.mxfp4_experts`). The rule writes

    scatter_add(full([N, L], 0), 0, expand(unsqueeze(idx, 1), [P, L]), view(X, [P, L]))
    index_add(full([N, L], 0), 0, idx, view(X, [P, L]))          ->   sum(X, [1])
    index_put(full([N, L], 0), [idx], view(X, [P, L]), True)     (index_add_ as traced)

where X is [N, k, L] (P = N*k) and idx, computed from constants alone (no graph input, no
parameter), equals `arange(N).repeat_interleave(k)`: row n*k + j of the view is X[n, j], added
into row n. The same terms; only the order of each row's k-term sum changes, so the rule takes
fp32 only (a bf16 accumulation rounds after every add).

Left alone: another index (tiled `arange(N).repeat(k)`, routed ids, anything read from a graph
input), a base that is not zeros, a scatter along another dim or with a reduce, a source that is
no [P, L] view of an [N, k, L] value, bf16 / fp16 values.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.scatter_rows import flat_column
from k3compile.graph import RESHAPES, call
from k3compile.rewrite import inductor

aten = torch.ops.aten
MAX_INDEX = 1 << 16


def _constant(node: fx.Node, memo: dict) -> torch.Tensor | None:
    """The value of an index computed from constants alone (no graph input or attribute)."""
    if node in memo:
        return memo[node]
    value = None
    shape = _shape(node)
    small = shape is not None and torch.Size(shape).numel() <= MAX_INDEX
    if node.op == "call_function" and small and all(
            _constant(a, memo) is not None for a in node.all_input_nodes):
        a, kw = fx.map_arg((node.args, node.kwargs), lambda n: memo[n])
        with inductor.unset_fake_temporarily():
            value = node.target(*a, **kw)
    memo[node] = value if isinstance(value, torch.Tensor) else None
    return memo[node]


def _args(node: fx.Node):
    """(base, dim, index, src, anything else) of the three spellings."""
    if node.target is aten.index_put.default:  # what `index_add_` traces to
        base, indices, src, *rest = node.args
        accumulate = rest[0] if rest else node.kwargs.get("accumulate", False)
        if accumulate is not True or len(indices) != 1 or len(rest) > 1:
            return None
        return base, 0, indices[0], src, False
    if node.target is aten.scatter_add.default:
        return *node.args[:4], len(node.args) > 4 or bool(node.kwargs)
    base, dim, index, src = node.args[:4]
    return base, dim, index, src, node.args[4:] not in ((), (1,)) or node.kwargs.get(
        "alpha", 1) != 1


def _site(node: fx.Node):
    parts = _args(node)
    if parts is None:
        return None
    base, dim, index, src, extra = parts
    if extra or dim != 0 or not isinstance(index, fx.Node) or not isinstance(src, fx.Node):
        return None
    out, rows = _shape(base), _shape(src)
    val = base.meta.get("val")
    if out is None or rows is None or len(out) != 2 or len(rows) != 2 or rows[1] != out[1]:
        return None
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.float32):
        return None
    if base.target is not aten.full.default or base.args[1] != 0:
        return None
    if src.target not in RESHAPES:
        return None
    x = src.args[0]
    n, p = out[0], rows[0]
    if _shape(x) != (n, p // n, out[1]) or p % n:
        return None
    if node.target is aten.scatter_add.default:
        index = flat_column(index, p)
        if index is None:
            return None
    value = _constant(index, {})
    with inductor.unset_fake_temporarily():
        want = torch.arange(n).repeat_interleave(p // n)
        same = value is not None and value.shape == want.shape and torch.equal(
            value.cpu().long(), want)
    return x if same else None


def _write(graph: fx.Graph, node: fx.Node, x: fx.Node) -> None:
    with graph.inserting_before(node):
        new = call(graph, aten.sum.dim_IntList, (x, [1]), like=node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write,
                         targets={aten.scatter_add.default, aten.index_add.default,
                                  aten.index_put.default})


RULE = Rule("scatter_sum", apply, "zeros(N, L).scatter_add / index_add(0, arange(N) repeated k, "
                                  "X.view(N*k, L)) -> X.sum(1) (fp32)")
