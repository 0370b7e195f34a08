"""Where the engine places a fused op whose anchor lies outside every layer (`_site_module`): in
the one layer that what it computes feeds (layer 0's input norm written in the model's forward,
as spell6, spell8 and the red-team spelling write it), else where its anchor is.

A hand-built two-layer graph with module stacks set by hand: the input norm, computed in the
model's forward and read (through a view there) only by layer 0's projection, goes to layer 0's
module; layer 1's norm, in its layer, stays there; the final norm, which feeds the graph's
output, stays outside. Look-alikes that stay outside: an input norm also read by layer 1, and
one also returned. Every rewrite keeps the graph's values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import k3compile.ops  # noqa: F401
import patterns.rms_norm as rms
from k3compile.math import rms_norm
from k3compile.rewrite import apply_patterns, inductor, module_path

EPS = 1e-5
# node -> module path (every other node lies in the model's forward); layer 0 is entered through
# its block, so its stack holds `layers.0`, then `layers.0.attn`
LAYER_0 = ("permute", "mm", "view_1", "add_1")
LAYER_1 = ("pow_2", "mean_1", "add_2", "rsqrt_1", "mul_2", "mul_3", "permute_1", "view_2",
           "mm_1", "view_3", "add_3")


def model(case, emb, ids, w_in, w0, w1, w_out):
    x = emb[ids]
    h = rms_norm(x, w_in, EPS)
    a = x + (h.view(-1, 64) @ w0.t()).view(2, 1, 64)
    b = a + (rms_norm(a, w_in, EPS).view(2, 64) @ w1.t()).view(2, 1, 64)
    if case == "read_by_layer_1":  # the norm also feeds layer 1's residual
        b = b + h
    out = rms_norm(b, w_out, EPS)
    return (out, h) if case == "returned" else out


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(10, 64, generator=g), torch.tensor([[3], [7]]),
            torch.randn(64, generator=g), torch.randn(64, 64, generator=g) * 0.1,
            torch.randn(64, 64, generator=g) * 0.1, torch.randn(64, generator=g)]


def _place(graph):
    for n in graph.nodes:
        if n.name in LAYER_0:
            n.meta["nn_module_stack"] = {"l0": ("layers.0", nn.Module),
                                         "l0a": ("layers.0.attn", nn.Module)}
        # add_4 reading add_3: "read_by_layer_1"'s `b + h`, layer 1's residual
        elif n.name in LAYER_1 or (n.name == "add_4" and n.args[0].name == "add_3"):
            n.meta["nn_module_stack"] = {"l1n": ("layers.1.norm", nn.Module)}


def _fused_norms(case):
    args = _inputs()
    gm = inductor.fwd_only_fake(lambda *a: model(case, *a), args)
    _place(gm.graph)
    want = model(case, *args)
    report = apply_patterns(gm.graph, [rms.patterns()[1]])  # rms_norm[float32]
    gm.recompile()
    got, want = (gm(*args), want) if case == "returned" else ((gm(*args),), (want,))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert len(report.hits) == 3
    return [(module_path(n), n.args[0].name)
            for n in gm.graph.nodes if n.target is torch.ops.k3.rms_norm.default]


def test_a_norm_in_the_forward_goes_to_the_one_layer_it_feeds():
    assert _fused_norms("plain") == [("layers.0", "index"), ("layers.1.norm", "add_1"),
                                     ("", "add_3")]


@pytest.mark.parametrize("case", ["read_by_layer_1", "returned"])
def test_a_norm_also_read_elsewhere_stays_outside(case):
    assert _fused_norms(case)[0] == ("", "index")
