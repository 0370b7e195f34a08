"""Rule `token_column`: the one token of a [B, 1, C] step appended to a channel-major conv window
as `x[:, 0, :, None]` (select, unsqueeze) -> `x.transpose(1, 2)`, the form the `kda_decode`
pattern builds its window with (`cat([conv_state[slots], cat([q, k, v], -1).transpose(1, 2)],
-1)`).

spell10 (`tests/models/spell10_k3.py`) runs vLLM's `causal_conv1d_update` reference token by
token: `window = cat([state, x[:, t, :, None]], -1)`, convolved, `state = window[:, :, 1:]`
(its probe `conv1d` appends `x.transpose(1, 2)` and convolves once). At T = 1 (decode) the loop
is one step, and rule `cell_conv` / `short_conv` already give its contraction the canonical
conv; what is left is the column, and the conv's [B, C, 1] output squeezed to [B, C] for the
SiLU and stacked back to [B, 1, C]:

    cat([state, unsqueeze(select(x [B, 1, C], 1, 0), -1)], -1)  ->  cat([state, permute(x, [0, 2, 1])], -1)
    view(silu(view(conv, [B, C])), [B, 1, C])                   ->  permute(silu(conv), [0, 2, 1])

the second by rule `reshape_fold`'s fold, applied here to that conv's output only (the rule
itself runs last; `qkv_split`, which cuts the q|k|v GEMM at the conv, reads the folded form).
Bit for bit (the same [B, C, 1] elements; the same elementwise ops). Taken only where the column's one reader is a cat on
the last dim whose result a depthwise convolution reads (the conv window), directly or through
an upcast (spell11: a bf16 state convolved in fp32, `convert(cat, f32)`), or the canonical
window sum multiplied in bf16 (`short_conv.depthwise`: spell10's bf16 conv). Left alone: a
[B, T, C] step with T > 1 (the loop has T windows: rule `token_windows` takes it), a column
of another token dim, a cat no conv reads.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, reshape_fold, rewrite_sites
from k3compile.canonical.region import shape, widens
from k3compile.canonical.short_conv import window_conv
from k3compile.graph import call

aten = torch.ops.aten


def conv_window(cat: fx.Node) -> bool:
    """cat is a concatenation on the last dim that a depthwise convolution reads as its input."""
    if cat.target is not aten.cat.default or shape(cat) is None:
        return False
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if dim % len(shape(cat)) != len(shape(cat)) - 1:
        return False
    return bool(_convs(cat))


def _convs(window: fx.Node) -> list[fx.Node]:
    """The depthwise convs (`short_conv.depthwise`: either form) of `window`, or of its upcast
    (a bf16 conv state convolved in fp32 through `.float()`: spell11's rolled state)."""
    found = [c for u in window.users if (c := window_conv(u, window)) is not None]
    for cast in window.users:
        if widens(cast, window):
            found += [c for u in cast.users if (c := window_conv(u, cast)) is not None]
    return found


def _site(unsq: fx.Node) -> fx.Node | None:
    """x [B, 1, C] where unsq = unsqueeze(select(x, 1, 0), -1) appended to a conv window."""
    sel = unsq.args[0]
    if unsq.args[1] not in (-1, 2) or len(unsq.users) != 1:
        return None
    if not (isinstance(sel, fx.Node) and sel.target is aten.select.int and len(sel.users) == 1
            and sel.args[1] in (1, -2) and sel.args[2] in (0, -1)):
        return None
    x = sel.args[0]
    sx = shape(x)
    if sx is None or len(sx) != 3 or sx[1] != 1:
        return None
    (cat,) = unsq.users
    return x if conv_window(cat) else None


def _write(graph: fx.Graph, unsq: fx.Node, x: fx.Node) -> None:
    (cat,) = unsq.users
    with graph.inserting_before(unsq):
        col = call(graph, aten.permute.default, (x, [0, 2, 1]), like=unsq)
    unsq.replace_all_uses_with(col)
    for conv in _convs(cat):
        squeeze = next((u for u in conv.users if reshape_fold.is_reshape(u)), None)
        if squeeze is not None:
            reshape_fold.fold(graph, squeeze, None)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.unsqueeze.default})


RULE = Rule("token_column", apply,
            "cat([state, x[:, 0, :, None]], -1) of a conv window (x [B, 1, C]) -> "
            "cat([state, x.transpose(1, 2)], -1)")

__all__ = ["RULE", "apply", "conv_window"]
