"""Rule `conv_crop`: a zero-padded 1-d convolution of which only outputs that read no padding are
kept (sliced out of its last dim) -> the unpadded convolution, sliced only where it must be.

Spell6 (`tests/models/spell6_k3.py`, `KDA._conv`) writes KDA's causal short conv over the window
[B, C, K-1+T] as `F.conv1d(window, taps, groups=C, padding=K-1)[..., K-1 : K-1+T]`: the padded
conv's outputs K-1 .. K-2+T are exactly the unpadded conv's outputs 0 .. T-1 (output j + P of a
conv padded by P reads padded positions j + P .. j + P + K - 1, window positions j .. j + K - 1).
Our model and `patterns/kda_decode.py` convolve the window unpadded, and `qkv_split` walks from
that convolution to the split of its channels, so the padded spelling lost linear_concat. The
rule writes

    slice(convolution(x, w, b, [1], [P], [1], False, [0], g), -1, s, e)
    ->  convolution(x, w, b, [1], [0], [1], False, [0], g)      (sliced by [s - P, e - P) unless
                                                                 that is all of it)

where the kept outputs [s, e) read only the input: s >= P and e <= P + L - K + 1 (L the input's
length). The same products of the same inputs and taps, summed over the same taps; no padded
zero is read (tested equal to the unrewritten graph, fp32 and bf16). Left alone: a slice that
reaches into the padding at either end, a strided slice, a strided or dilated or transposed or
2-d conv, a conv read elsewhere as well.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape as _shape
from k3compile.graph import call

aten = torch.ops.aten


def _site(node: fx.Node) -> tuple[int, int] | None:
    """(start, end) in the unpadded conv's outputs of node = slice(padded conv, -1, s, e)."""
    conv = node.args[0]
    if not (isinstance(conv, fx.Node) and conv.op == "call_function"
            and conv.target is aten.convolution.default and len(conv.users) == 1):
        return None
    x, w, _, stride, padding, dilation, transposed, out_pad, _ = conv.args
    xs, ws, out = _shape(x), _shape(w), _shape(conv)
    if (xs is None or ws is None or out is None or len(xs) != 3 or len(ws) != 3
            or list(stride) != [1] or list(dilation) != [1] or transposed
            or list(out_pad) != [0] or len(padding) != 1 or padding[0] <= 0):
        return None
    dim = node.args[1] if len(node.args) > 1 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    if dim % 3 != 2 or step != 1:
        return None
    n = out[2]
    start, end, _ = slice(node.args[2] if len(node.args) > 2 else None,
                          node.args[3] if len(node.args) > 3 else None).indices(n)
    pad, valid = padding[0], xs[2] - ws[2] + 1
    if end <= start or start < pad or end - pad > valid:
        return None
    return start - pad, end - pad


def _write(graph: fx.Graph, node: fx.Node, site: tuple[int, int]) -> None:
    conv = node.args[0]
    start, end = site
    with graph.inserting_before(node):
        args = list(conv.args)
        args[4] = [0]
        out = call(graph, aten.convolution.default, tuple(args), like=conv)
        if (start, end) != (0, _shape(out)[2]):
            out = call(graph, aten.slice.Tensor, (out, 2, start, end), like=node)
    node.replace_all_uses_with(out)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.slice.Tensor})


RULE = Rule("conv_crop", apply,
            "slice(conv1d(x, w, padding=P), -1, s, e) reading no padding -> conv1d(x, w) "
            "(sliced by [s - P, e - P) unless whole)")

__all__ = ["RULE", "apply"]
