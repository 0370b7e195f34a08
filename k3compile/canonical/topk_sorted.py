"""Rule `topk_sorted`: `topk(x, k, dim, largest, sorted=False)` -> the sorted top-k, its arguments
written as `torch.topk(x, k)` traces (the last dim as -1, defaults left out).

K3 routers written after DeepSeek-V3 (transformers, Moonshot's gate, vLLM) choose experts with
`torch.topk(scores_for_choice, k, dim=-1, sorted=False)`; ours writes `torch.topk(s, k, dim=-1)`,
which traces to `topk(s, k)`. The patterns match the arguments as traced, so `dim=1` of a 2-D
tensor or an explicit `sorted=False` hides the router from `moe_route`.

Why sorted=True is a faithful rewrite: torch's contract for `sorted=False` promises the k largest
elements and their indices in an unspecified order, so the sorted result is one valid result of
the original call (its values and indices are the same set per row). Eager CPU does return
another order (a partial selection; measured: E=8, k=3 and E=384, k=8 rows come back unsorted),
and CUDA another again: code that computes a different value depending on that order depends on
unspecified behaviour. Downstream sums over the k experts may round differently in the other
order, by the rounding of those sums only.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites

aten = torch.ops.aten
_NAMES = ("self", "k", "dim", "largest", "sorted")
_DEFAULTS = {"dim": -1, "largest": True, "sorted": True}


def _rank(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _canonical_args(node: fx.Node) -> tuple | None:
    call = {**_DEFAULTS, **dict(zip(_NAMES, node.args)), **node.kwargs}
    rank = _rank(call["self"])
    if rank is None or not isinstance(call["dim"], int):
        return None
    if rank > 0 and call["dim"] % rank == rank - 1:
        call["dim"] = -1
    call["sorted"] = True
    args = [call[name] for name in _NAMES]
    while len(args) > 2 and args[-1] == _DEFAULTS[_NAMES[len(args) - 1]]:
        args.pop()
    return tuple(args)


def _site(node: fx.Node) -> tuple | None:
    """The canonical arguments, where they are not node's own."""
    args = _canonical_args(node)
    return args if args is not None and (args, {}) != (tuple(node.args), dict(node.kwargs)) else None


def _write(graph: fx.Graph, node: fx.Node, args: tuple) -> None:
    node.args, node.kwargs = args, {}


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.topk.default}, tidy=False)


RULE = Rule("topk_sorted", apply,
            "topk(x, k, last dim, sorted=False) -> topk(x, k) (an unsorted top-k's order is free)")
