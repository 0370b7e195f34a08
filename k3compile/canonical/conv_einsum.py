"""Rule `conv_einsum`: KDA's depthwise short conv written as a contraction over an `unfold`ed
window (`einsum("bctk,ck->btc", window.unfold(-1, taps, 1), w)`, `unfold(...) @ w[..., None]`, ...
lowered to a bmm) -> the `convolution` of the canonical form (`patterns/kda_decode.py`), and the
pointwise tail of the conv (SiLU, casts) before the transpose back to [B, T, C], where the
canonical form has it.

    y = permute(bmm(view(permute(unfold(window))), view(w)))  [B, T, C]   (any such view chain)
    ->  y = permute(convolution(window, w.reshape(C, 1, taps), groups=C), [0, 2, 1])
    then silu(permute(c)) -> permute(silu(c))     (a pointwise region read only at its end)

A time-major window [B, L, C] (a conv state [S, taps-1, C], vLLM v1's layout, spell5) unfolded
on dim 1, `(window.unfold(1, taps, 1) * w).sum(-1)` [B, T, C], is the conv of its transpose,
`conv(window.transpose(1, 2), w).transpose(1, 2)`: the form `patterns/kda_decode.py`'s
`conv_time_major` variants trace.

Found structurally: an `unfold(window [B, C, L], -1, taps, 1)` whose chain of views reaches a
bmm with a [C, taps] (or [C, 1, taps]) weight on the other side, read back as [B, T, C] or
[B, C, T] (T = L - taps + 1); at B·T = 1 that bmm is a batch of dot products, which Inductor
decomposes on CPU into `sum(a.squeeze(1) * b.squeeze(-1), 1, keepdim=True)`: the mul + sum is
taken as the bmm. Taken only where that region, run on random values (`canonical.region`),
equals the conv within 1e-5 of the largest value (fp32 summation order).
bf16 / fp16, to rounding: the user's bmm rounds the conv to the activations' dtype and the
SiLU after it rounds again; the canonical form (and the fused KDA op) convolves and applies the
SiLU in fp32 and rounds once. The conv is taken there together with the SiLU-like pointwise tail
that follows it in that dtype, and only where the pair, run on random values, is within 2 ulps
(2·eps of the dtype) of the largest value of the canonical fp32 conv + SiLU rounded once
(measured on random values up to B 64 x 12288 channels: <= 0.78 eps of the largest value in
bf16, <= 0.96 eps in fp16); a conv with no such tail, or
another activation, is left alone. The tail may compute in fp32 between casts (F.silu on a bf16
tensor lowers so in the compile) where it ends in the dtype. A time-major window sum multiplied
in bf16 (spell5: each product rounded, then the sum, then the SiLU) passes the same check
(session 26, B 1-64 x 12288 channels: <= 0.88 eps of the largest value, as the double rounding of
the bmm form). A channel-major window sum multiplied in bf16 / fp16 (`(unfold(window, -1, taps,
1) * w).sum(-1)`, spell10's and spell12's) is left alone: rule `short_conv` writes it as its
canonical product sum, which `kda_decode`'s `conv_products_rounded` computes bit for bit (session
34). Moving pointwise ops ahead of a permute is exact (each
element is computed alike).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import (
    CAST,
    LOW,
    POINTWISE,
    VIEWS,
    below,
    pointwise_tail,
    refresh,
    replace,
    root,
    shape,
    val,
)
from k3compile.canonical.short_conv import MAX_TAPS
from k3compile.graph import call

aten = torch.ops.aten
RTOL = 1e-5
# the bmm's decomposition computes in fp32 (`pw_cast_for_opmath`): casts around it
THROUGH = VIEWS | {CAST}


def _conv(window, w):
    C, taps = w.shape[0], w.shape[-1]
    return F.conv1d(window, w.reshape(C, 1, taps), groups=C)


def _conv_t(window, w):
    return _conv(window, w).transpose(1, 2)


def _silu_conv(window, w):
    """The canonical form in bf16 / fp16: conv and SiLU in fp32, rounded once after."""
    C, taps = w.shape[0], w.shape[-1]
    c = F.conv1d(window.float(), w.reshape(C, 1, taps).float(), groups=C)
    return (c * torch.sigmoid(c)).to(window.dtype)


def _silu_conv_t(window, w):
    return _silu_conv(window, w).transpose(1, 2)


def _conv_tm(window, w):
    """A time-major window [B, L, C] (a conv state [S, taps-1, C]): the conv of its transpose."""
    return _conv(window.transpose(1, 2), w).transpose(1, 2)


def _silu_conv_tm(window, w):
    return _silu_conv(window.transpose(1, 2), w).transpose(1, 2)


def _site(unfold: fx.Node):
    """([window, w], the region's output, the canonical function, rtol) or None."""
    window = unfold.args[0]
    s = shape(window)
    dtype = val(window).dtype if s is not None else None
    if (s is None or len(s) != 3 or unfold.args[1] % 3 not in (1, 2) or unfold.args[3] != 1
            or dtype not in (torch.float32, *LOW)):  # bf16: conv and SiLU rounded by the user's ops
        return None
    time_major = unfold.args[1] % 3 == 1
    B, C, L = (s[0], s[2], s[1]) if time_major else s
    taps = unfold.args[2]
    T = L - taps + 1
    if taps > MAX_TAPS or T < 1:
        return None
    node = unfold
    while len(node.users) == 1 and (user := next(iter(node.users))).target in THROUGH:
        node = user
    product = window_product(node)
    if product is None or (not time_major and product.target is aten.mul.Tensor
                           and val(product).dtype in LOW):
        return None  # a window sum multiplied in bf16: short_conv's product sum, exact
    other = product.args[1] if product.args[0] is node else product.args[0]
    w = root(other, THROUGH)
    if shape(w) not in ((C, taps), (C, 1, taps)) or val(w).dtype != dtype:
        return None
    end = product if product.target is aten.bmm.default else next(iter(product.users))
    outs = ((((B, T, C), (_conv_tm, _silu_conv_tm)),) if time_major else
            (((B, T, C), (_conv_t, _silu_conv_t)), ((B, C, T), (_conv, _silu_conv))))
    for want, fns in outs:
        out = below(end, want, THROUGH)
        if out is None:
            continue
        if dtype == torch.float32:
            return [window, w], out, fns[0], RTOL
        # bf16 / fp16: the SiLU that follows goes with the conv (it rounds after it)
        tail = silu_tail(out, dtype)
        if tail is None:
            return None
        return [window, w], tail[1], fns[1], 2 * torch.finfo(dtype).eps
    return None


def silu_tail(out: fx.Node, dtype: torch.dtype) -> tuple | None:
    """The pointwise tail after the conv, in `dtype`, or computed in fp32 between casts where it
    ends in `dtype`: F.silu on a bf16 tensor lowers so in the compile (`x / (1 + exp(-x))` on
    the upcast, then the cast back; spell8's conv). Which function it is, the caller checks on
    random values."""
    tail = pointwise_tail(out, POINTWISE, dtype)
    if tail is not None and tail[0]:
        return tail
    tail = pointwise_tail(out, POINTWISE)
    if tail is None or not tail[0] or val(tail[1]).dtype != dtype:
        return None
    return tail


def window_product(node: fx.Node) -> fx.Node | None:
    """The window's contraction with the taps: a bmm, or the mul that a bmm of dot products
    ([C, 1, taps] @ [C, taps, 1], B·T = 1) decomposes to on CPU (`sum(a.squeeze(1) *
    b.squeeze(-1), 1, keepdim=True)`, Inductor's `bmm` decomposition), its one user the sum."""
    (user,) = node.users if len(node.users) == 1 else (None,)
    if user is None or node not in user.args:
        return None
    if user.target is aten.bmm.default:
        return user
    if user.target is aten.mul.Tensor and len(user.users) == 1:
        (total,) = user.users
        if total.target is aten.sum.dim_IntList and total.kwargs.get("dtype") is None:
            return user
    return None


def _sink_pointwise(graph: fx.Graph, perm: fx.Node) -> bool:
    """f(permute(c)) -> permute(f(c)) for a pointwise region f that reads only the permute (and
    scalars), takes every use of it, and is read from outside only at its last node."""
    tail = pointwise_tail(perm, POINTWISE)
    if not tail or not tail[0]:
        return False
    region, end = tail
    env = {perm: perm.args[0]}
    with graph.inserting_before(end):
        for n in region:
            args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = call(graph, n.target, args, kwargs, like=n)
        moved = call(graph, aten.permute.default, (env[end], list(perm.args[1])), like=perm)
    end.replace_all_uses_with(moved)
    refresh([moved])
    return True


def _write(graph: fx.Graph, node: fx.Node, site, cache: dict) -> bool:
    inputs, out, fn, rtol = site
    new = replace(inputs, out, fn, rtol, cache, fn.__name__)
    if new is not None and new.target is aten.permute.default:
        _sink_pointwise(graph, new)
    return new is not None


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.unfold.default}, traced=True)


RULE = Rule("conv_einsum", apply,
            "depthwise short conv as an einsum / bmm over unfold(window) -> "
            "convolution(window, w[C,1,taps], groups=C), its pointwise tail before the transpose")

__all__ = ["RULE", "apply"]
