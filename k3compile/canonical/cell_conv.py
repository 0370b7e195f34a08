"""Rule `cell_conv`: KDA's short conv for one token written inside a recurrent cell (spell9, a
JAX/Flax port scanning its cell over T): the window [B, taps, C] is the conv state's rows and
the token (`cat([state[slots], x_t[:, None]], 1)`, time-major), contracted with the taps per
channel (`einsum("bkc,kc->bc", window, taps)`, lowered to a bmm over the channels or, at B = 1,
a mul + sum) -> the canonical time-major conv of `patterns/kda_decode.py`, its SiLU-like
pointwise tail before the transpose back and the token selected after it:

    y = silu(einsum("bkc,kc->bc", cat([state[slots], unsqueeze(x[:, 0], 1)], 1), taps))  [B, C]
    ->  window = cat([state[slots], x], 1)
        y = select(permute(silu(convolution(permute(window), w, groups=C)), [0, 2, 1]), 1, 0)

Rule `token_select` then moves the select below the per-token feature math (split, head views,
L2 norms), where the pattern selects each token.

The taps may be a view of one weight ([taps, C] or [C, taps]) or a concatenation over the
channels of per-projection Flax conv kernels' slices (`cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)`,
each kernel [taps, 1, C_i]); the conv weight is then the concatenation of the kernels' [C_i, 1,
taps] views, the form whose q / k / v pieces the pattern takes as its three conv weights.

Taken only where (1) the window is a concatenation on dim 1 of a gather of a graph input by a
[B] index (the conv state's rows) and one token [B, 1, C], and its last taps-1 rows are written
back into that same buffer at the same rows (`index_put(state, [slots], window[:, 1:])`): the
window is the conv state; (2) every taps piece is a graph input that the graph does not write
(a weight); (3) the region between the window, the taps and the tail's end, run on random
values, equals the canonical form within 1e-5 of its largest value (summation order). A
contraction over any other window, with taps computed at run time, or with no SiLU-like tail,
is left alone.

bf16 / fp16 (session 27): the user's bmm rounds the conv to the activations' dtype and its SiLU
rounds again; the canonical form is then the conv in that dtype (its output rounded, as a bf16
`F.conv1d`'s) and the SiLU on it, which kda_decode's `conv_rounded` variant takes: the same two
roundings, not the one of the fp32 canonical conv (taking it so, session 26, raised spell9
bf16's logits error against eager from 2.6e-2 to 5.9e-2). Only the bmm form: at B = 1 the
contraction is a mul + sum whose products round one by one (left alone). The check allows one
ulp of the largest value (both sum four exact fp32 products, in an order that may differ).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.conv_einsum import LOW, RTOL, THROUGH, silu_tail, window_product
from k3compile.canonical.region import POINTWISE, below, pointwise_tail, replace, root, shape, val
from k3compile.canonical.short_conv import MAX_TAPS
from k3compile.graph import written_in_place

aten = torch.ops.aten


# ---- the taps: one weight, or per-projection Flax kernels [taps, 1, C_i] ----------------------


def _pieces(node: fx.Node, channels_last: bool) -> list[tuple[fx.Node, str]] | None:
    """The weights the taps [taps, C] (`channels_last`) or [C, taps] are cut from, each with how
    it is laid out: "k1c" (a Flax conv kernel [taps, 1, C_i] read as `kernel[:, 0]`), "kc",
    "ck", "c1k"; None where the taps are anything else."""
    while node.op == "call_function":
        t = node.target
        if t in (aten.permute.default, aten.t.default, aten.transpose.int) and len(shape(node)) == 2:
            node, channels_last = node.args[0], not channels_last
        elif t in (aten.view.default, aten.reshape.default, aten.clone.default,
                   aten.alias.default) and shape(node) == shape(node.args[0]):
            node = node.args[0]
        elif t is aten.select.int and len(shape(node.args[0])) == 3 and node.args[1] == 1 \
                and node.args[2] == 0 and shape(node.args[0])[1] == 1 and channels_last:
            return [(node.args[0], "k1c")] if node.args[0].op == "placeholder" else None
        elif t is aten.cat.default:
            dim = node.args[1] if len(node.args) > 1 else 0
            if dim % 2 != (1 if channels_last else 0):
                return None
            parts = [_pieces(p, channels_last) for p in node.args[0]]
            return None if any(p is None for p in parts) else [x for p in parts for x in p]
        else:
            return None
    if node.op != "placeholder" or len(shape(node)) not in (2, 3):
        return None
    if len(shape(node)) == 3:
        return [(node, "c1k")] if shape(node)[1] == 1 and not channels_last else None
    return [(node, "kc" if channels_last else "ck")]


def _weight(w: torch.Tensor, kind: str) -> torch.Tensor:
    """A piece read as the conv weight [C_i, 1, taps]."""
    if kind == "k1c":
        return w.permute(2, 1, 0)
    if kind == "kc":
        return w.t().unsqueeze(1)
    return w.unsqueeze(1) if kind == "ck" else w


def _canonical(kinds: tuple[str, ...], written_out: bool):
    def cell_conv(window, *weights):
        ws = [_weight(w, k) for w, k in zip(weights, kinds)]
        w = ws[0] if len(ws) == 1 else torch.cat(ws)
        c = F.conv1d(window.transpose(1, 2), w, groups=w.shape[0])
        c = c * torch.sigmoid(c) if written_out else F.silu(c)
        return c.transpose(1, 2)[:, 0]
    return cell_conv


# ---- the window: the conv state's rows and one token, its tail written back ------------------


def _window(node: fx.Node):
    """(state buffer, slots, the token's node [B, 1, C]) of a conv-state window, or None."""
    s = shape(node)
    if node.target is not aten.cat.default or s is None or len(s) != 3 or \
            (node.args[1] if len(node.args) > 1 else 0) % 3 != 1 or len(node.args[0]) != 2:
        return None
    past, new = node.args[0]
    if past.target is not aten.index.Tensor or len(past.args[1]) != 1:
        return None
    state, (slots,) = past.args[0], past.args[1]
    if state.op != "placeholder" or shape(past) != (s[0], s[1] - 1, s[2]) or \
            shape(new) != (s[0], 1, s[2]):
        return None
    return state, slots, new


def _writes_tail(window: fx.Node, state: fx.Node, slots: fx.Node) -> bool:
    """window[:, 1:] (any spelling of the last taps-1 rows) is put into state at slots."""
    taps = shape(window)[1]
    for u in window.users:
        if u.target is not aten.slice.Tensor or u.args[1] % 3 != 1:
            continue
        start = u.args[2] if len(u.args) > 2 else 0
        end = u.args[3] if len(u.args) > 3 else taps
        if (start + taps if start < 0 else start) != 1 or min(end, taps) != taps:
            continue
        todo = [u]
        while todo:
            n = todo.pop()
            for w in n.users:
                if w.target is aten.index_put.default and w.args[0] is state and \
                        w.args[2] is n and list(w.args[1]) == [slots]:
                    return True
                if w.target in THROUGH:
                    todo.append(w)
    return False


def _site(window: fx.Node):
    found = _window(window)
    if found is None:
        return None
    state, slots, new = found
    dtype = val(window).dtype
    B, taps, C = shape(window)
    if dtype not in (torch.float32, *LOW) or taps > MAX_TAPS or val(state).dtype != dtype or \
            not _writes_tail(window, state, slots):
        return None
    for start in window.users:
        if start.target not in THROUGH:
            continue
        node = start
        while len(node.users) == 1 and (user := next(iter(node.users))).target in THROUGH:
            node = user
        product = window_product(node)
        if product is None or dtype != torch.float32 and product.target is not aten.bmm.default:
            continue
        other = product.args[1] if product.args[0] is node else product.args[0]
        pieces = _taps(other, C)
        if pieces is None:
            continue
        end = product if product.target is aten.bmm.default else next(iter(product.users))
        out = below(end, (B, C), THROUGH)
        if out is None:
            continue
        # in bf16 F.silu computes in fp32 between casts (`silu_tail`)
        tail = pointwise_tail(out, POINTWISE, dtype) if dtype == torch.float32 else \
            silu_tail(out, dtype)
        if not tail or not tail[0]:
            return None  # the canonical form has the SiLU after the conv
        # the user's SiLU as torch's op (x / (1 + exp(-x))) or written out (x * sigmoid(x))
        written_out = not any(n.target is aten.div.Tensor for n in tail[0])
        if written_out and dtype != torch.float32:
            return None  # x * sigmoid(x) in bf16 rounds the sigmoid too: not F.silu's rounding
        return window, new, pieces, tail[1], written_out
    return None


def _taps(other: fx.Node, C: int) -> list[tuple[fx.Node, str]] | None:
    """The taps' weights, read from where the contraction reads them (through its views)."""
    taps = root(other, THROUGH - {aten.permute.default, aten.transpose.int, aten.t.default,
                                  aten.unsqueeze.default, aten.expand.default})
    while taps.target in (aten.unsqueeze.default, aten.permute.default, aten.view.default,
                          aten.expand.default) and len(shape(taps)) > 2:
        taps = taps.args[0]  # the contraction's own broadcast views of [taps, C]
    s = shape(taps)
    if s is None or len(s) != 2 or C not in s:
        return None
    pieces = _pieces(taps, s[1] == C)
    if pieces is None or sum(shape(p)[-1 if k in ("k1c", "kc") else 0] for p, k in pieces) != C \
            or any(written_in_place(p) for p, _ in pieces):
        return None
    return pieces


def _write(graph: fx.Graph, window: fx.Node, site, cache: dict) -> bool:
    window, new, pieces, end, written_out = site
    inputs = [window, *(p for p, _ in pieces)]
    kinds = tuple(k for _, k in pieces)
    fn = _canonical(kinds, written_out)
    dtype = val(window).dtype
    rtol = RTOL if dtype == torch.float32 else torch.finfo(dtype).eps
    if replace(inputs, end, fn, rtol, cache, ("cell_conv", kinds, written_out)) is None:
        return False
    # the token row of the window as the token itself (T = 1): x[:, 0][:, None] is x
    token = root(new, {aten.unsqueeze.default, aten.select.int, aten.view.default})
    if token is not new and shape(token) == shape(new) and val(token).dtype == val(new).dtype:
        window.replace_input_with(new, token)
    return True


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.cat.default}, traced=True)


RULE = Rule("cell_conv", apply,
            "short conv for one token in a scanned cell (einsum over the conv state's window) -> "
            "the time-major convolution, SiLU before the transpose, the token selected after")

__all__ = ["RULE", "apply"]
