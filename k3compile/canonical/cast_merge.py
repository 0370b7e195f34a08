"""Rule `cast_merge`: a dtype cast of a head merge -> the cast, then the merge.

Merging the heads back into the last dim and casting commute (a cast is elementwise, a view moves
no value), and code does them in either order. A KDA layer that keeps its output in fp32 through
the gated norm casts once at the end: spell8 (`o.reshape(B, T, H·K).to(x.dtype)`) merges the
heads first, the red-team spelling (`o.to(x.dtype).reshape(B, H·K)`) and the `kda_decode`
pattern's `o_fp32` variant cast first (the op returns [B, T, H, K]):
    convert_element_type(view(x, [B, T, H·D]))     (spell8)
    view(convert_element_type(x), [B, T, H·D])     (canonical)
Exact: the same values, dtype and shape. The mirror of rule `cast_view` (a cast after a head
split goes first too).

Taken: a `convert_element_type` from fp32 to bf16 / fp16 whose input is a view / reshape that
keeps the leading dims and merges the last two into one (of more than one head), and that
nothing else reads. Left alone: casts after other views (a size-1 "head" dim, a split, a merge of
other dims), other casts (an upcast; an integer cast of merged codes, as the red-team spelling's
MXFP4 nibbles `stack(lo, hi).flatten(-2).to(int32)`, which `nibble_unpack` reads in that form),
and a merge also read in its own dtype.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.cast_view import cast_first, same_size
from k3compile.canonical.region import CAST
from k3compile.canonical.region import val as _val
from k3compile.graph import RESHAPES


def _head_merge(view) -> bool:
    """view: [..., H, D] -> [..., H·D], the leading dims kept, H > 1, read only by the cast."""
    if not (isinstance(view, fx.Node) and view.op == "call_function" and view.target in RESHAPES
            and len(view.users) == 1):
        return False
    src, out = _val(view.args[0]), _val(view)
    if src is None or out is None or out.dim() < 1 or src.dim() != out.dim() + 1:
        return False
    lead = all(same_size(a, b) for a, b in zip(src.shape[:-2], out.shape[:-1], strict=True))
    return (lead and same_size(src.shape[-2] * src.shape[-1], out.shape[-1])
            and not same_size(src.shape[-1], out.shape[-1]))


# fp32 values rounded to the activations' dtype: the output cast of a layer kept in fp32 (integer
# casts of merged codes, as an MXFP4 dequant's nibbles, are other rules' forms)
DOWNCASTS = {torch.bfloat16, torch.float16}


def _site(node: fx.Node) -> bool:
    if not (node.op == "call_function" and node.target is CAST and _head_merge(node.args[0])):
        return False
    val, src = _val(node), _val(node.args[0])
    return (val is not None and src is not None and src.dtype == torch.float32
            and val.dtype in DOWNCASTS)


def _write(graph: fx.Graph, cast: fx.Node, _) -> None:
    view = cast.args[0]
    cast_first(graph, cast, _)  # cast_view's swap: the cast, then the view
    graph.erase_node(view)  # read only by the cast (`_head_merge`)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, tidy=False)


RULE = Rule("cast_merge", apply, "a dtype cast after a head merge (view [..., H, D] -> "
                                 "[..., H·D]) -> the cast, then the merge")
