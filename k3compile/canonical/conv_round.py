"""Rule `conv_round`: KDA's short conv run in bf16 / fp16 (`F.conv1d(window, taps, groups=C)` on
the activations, no `.float()`; the red-team spelling) with its SiLU after it -> the canonical
form's fp32 conv + SiLU, rounded once (`patterns/kda_decode.py`).

    y = silu(convolution(window, w, groups=C))          bf16 conv (rounds), bf16 SiLU (rounds)
    ->  y = (c * sigmoid(c)).to(bf16),  c = convolution(window.float(), w.float(), groups=C)

To rounding, as rule `conv_einsum` takes the same pair written as a bmm over an unfolded window
(spell8): torch's bf16 conv on CPU is the fp32 conv rounded once (measured bit-equal, B 1-8 x
768 channels), so the user's pair rounds the conv, then the SiLU; the canonical form rounds once.
Taken only where the pair, run on random values, is within 2 ulps (2·eps of the dtype) of the
largest value of the canonical form (`conv_einsum`'s bound; measured there <= 0.78 eps in bf16):
a conv with no SiLU-like pointwise tail in its dtype, or another activation, is left alone, and
so is an fp32 conv (already canonical) and one that is not depthwise.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.conv_einsum import LOW, _silu_conv, _silu_tail
from k3compile.canonical.region import replace, shape, val
from k3compile.canonical.short_conv import MAX_TAPS

aten = torch.ops.aten
_PLAIN = ([1], [0], [1], False, [0])  # stride, padding, dilation, transposed, output_padding


def _site(conv: fx.Node):
    """([window, w], the tail's end) of a low-precision depthwise short conv with a SiLU-like
    tail, or None."""
    window, w, bias = conv.args[:3]
    s, ws, out = shape(window), shape(w), val(conv)
    if (out is None or out.dtype not in LOW or s is None or ws is None or len(s) != 3
            or bias is not None or list(conv.args[3:8]) != list(_PLAIN)):
        return None
    C = s[1]
    if ws[0] != C or ws[1] != 1 or ws[2] > MAX_TAPS or conv.args[8] != C or C == 1:
        return None
    if val(window).dtype != out.dtype or val(w).dtype != out.dtype:
        return None
    tail = _silu_tail(conv, out.dtype)
    return None if tail is None else ([window, w], tail[1])


def _write(graph: fx.Graph, conv: fx.Node, site, cache: dict) -> bool:
    inputs, end = site
    rtol = 2 * torch.finfo(val(conv).dtype).eps
    return replace(inputs, end, _silu_conv, rtol, cache, "conv_round") is not None


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.convolution.default}, traced=True)


RULE = Rule("conv_round", apply,
            "bf16 / fp16 depthwise conv + SiLU (each rounded) -> fp32 conv + SiLU rounded once, "
            "to rounding")

__all__ = ["RULE", "apply"]
