"""k3compile.canonical.layout: a Layout read off a chain of view-like ATen ops indexes its root
exactly as the chain does (checked element by element), a cat along the contracted dim splits a
product into one term per piece, and products read as the einsum they compute."""

from __future__ import annotations

import math

import pytest
import torch

from k3compile.canonical.layout import einsum, layout, terms
from k3compile.rewrite import inductor


def graph(fn, *args):
    return inductor.fwd_only(fn, list(args)).graph


def output(g):
    out = next(n for n in g.nodes if n.op == "output").args[0]
    return out[0] if isinstance(out, (tuple, list)) else out


def gather(lay, root: torch.Tensor) -> torch.Tensor:
    """The tensor lay describes, read from `root`'s contiguous values."""
    index = torch.tensor(lay.offset)
    for dim in lay.dims:
        size = math.prod(s for s, _ in dim)
        k, at = torch.arange(size), torch.zeros(size, dtype=torch.long)
        for s, t in reversed(dim):
            at, k = at + (k % s) * t, k // s
        index = index.unsqueeze(-1) + at
    return root.flatten()[index]


CHAINS = {
    "permute_reshape_slice_expand":
        lambda x: x.permute(2, 0, 1).reshape(4, 6)[1:3].unsqueeze(0).expand(5, 2, 6),
    "split_transpose_clone_view": lambda x: x.split([1, 3], dim=-1)[1].transpose(0, 1).contiguous()
        .view(3, 6),
    "select_scaled": lambda x: x[:, 2].t() * 0.5,
    "strided_slice_squeeze": lambda x: x[..., ::2].unsqueeze(1).squeeze(1),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_layout_indexes_the_root_as_the_chain_does(name):
    x = torch.randn(2, 3, 4)
    g = graph(CHAINS[name], x)
    lay = layout(output(g))
    assert lay.root.op == "placeholder"
    want = CHAINS[name](x)
    torch.testing.assert_close(gather(lay, x) * lay.scale, want, rtol=0, atol=0)


def test_reshape_across_permuted_dims():
    x = torch.randn(2, 3, 4)
    # [2, 4, 3] -> [2, 3, 4] regroups the flat order across the permuted dims: not strided
    assert layout(output(graph(lambda x: x.permute(0, 2, 1).reshape(2, 3, 4), x))) is None
    # merging whole permuted dims is (one dim of several strided sub-dims)
    for f in (lambda x: x.permute(0, 2, 1).reshape(2, 12), lambda x: x.permute(1, 0, 2).reshape(3, 8)):
        lay = layout(output(graph(f, x)))
        torch.testing.assert_close(gather(lay, x), f(x), rtol=0, atol=0)


def test_cat_along_the_contraction_is_one_term_per_piece():
    q, k1, k2 = torch.randn(2, 3, 5), torch.randn(2, 4, 3), torch.randn(2, 4, 2)
    g = graph(lambda q, k1, k2: q @ torch.cat([k1, k2], dim=-1).transpose(1, 2), q, k1, k2)
    bmm = next(n for n in g.nodes if n.target == torch.ops.aten.bmm.default)
    parts = terms(bmm)
    assert [t.b.root.name for t in parts] == ["k1_1", "k2_1"]
    for t, k, lo in zip(parts, (k1, k2), (0, 3)):
        width = k.shape[-1]
        torch.testing.assert_close(gather(t.a, q), q[..., lo:lo + width], rtol=0, atol=0)
        torch.testing.assert_close(gather(t.b, k), k.transpose(1, 2), rtol=0, atol=0)


def test_product_reads_as_its_einsum_and_refuses_an_outer_product():
    q, k = torch.randn(2, 3, 4, 5), torch.randn(2, 6, 4, 5)
    axes_q = [("b", 2, 0), ("t", 3, 0), ("h", 4, 0), ("d", 5, 0)]
    axes_k = [("b", 2, 0), ("l", 6, 0), ("h", 4, 0), ("d", 5, 0)]
    for spec, out in (("bthd,blhd->bhtl", {"b", "h", "t", "l"}), ("bthd,blhd->hbtl", {"b", "h", "t", "l"})):
        g = graph(lambda q, k: torch.einsum(spec, q, k), q, k)  # noqa: B023 (traced at once)
        bmm = next(n for n in g.nodes if n.target == torch.ops.aten.bmm.default)
        (term,) = terms(bmm)
        axes = {term.a.root: axes_q if term.a.root.name == "q_1" else axes_k,
                term.b.root: axes_k if term.b.root.name == "k_1" else axes_q}
        e = einsum(term, axes, batched=True)
        assert {x[0] for x in e.out} == out and [(a[0], b[0]) for a, b in e.k] == [("d", "d")]
    # b on both sides but not paired: an outer product over batches, not the attention einsum
    g = graph(lambda q, k: torch.einsum("bthd,cshd->bthcs", q, k), q, k)
    bmm = next(n for n in g.nodes if n.target == torch.ops.aten.bmm.default)
    (term,) = terms(bmm)
    assert einsum(term, {term.a.root: axes_q, term.b.root: [("b", 2, 0), ("l", 6, 0),
                                                            ("h", 4, 0), ("d", 5, 0)]},
                  batched=True) is None
