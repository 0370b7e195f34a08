"""head_rows: a delta rule on `flatten(0, 1)`-ed [B*H, ...] rows with a `bmm` rank-1 write (after
`baddbmm_split`) is run on the [B, H, ...] tensors, bit for bit; spell6's rows then become the
per-head V-major rule `state_transpose` and `delta_einsum` take. Look-alikes stay: rows merged
from differently split tensors, an op over the rows' dim, a row read as rows elsewhere, a product
with an inner dim > 1 (a read), merged rows with no rank-1 write."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import baddbmm_split, delta_einsum, head_rows, state_transpose
from tests.canonical.rule_checks import assert_same, targets
from tests.conftest import rel_err
from tests.fusions import pattern_checks

H, D, S = 3, 8, 5
aten = torch.ops.aten


def _args(B=2, T=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    n = torch.nn.functional.normalize
    return [torch.randn(S, H, D, D, generator=g), torch.tensor([3, 0][:B]),
            n(torch.randn(B, T, H, D, generator=g), dim=-1),
            n(torch.randn(B, T, H, D, generator=g), dim=-1),
            torch.randn(B, T, H, D, generator=g).to(dtype),
            torch.rand(B, T, H, D, generator=g), torch.rand(B, T, H, generator=g)]


def rows(buf, slots, q, k, v, a, beta):
    """spell6's delta rule: V-major state on [B*H] rows, the write a `baddbmm`"""
    b, h, d = q.shape[0], q.shape[2], q.shape[3]
    s, outs = buf[slots].flatten(0, 1), []
    for t in range(q.shape[1]):
        kt, qt = k[:, t].flatten(0, 1), q[:, t].flatten(0, 1)
        s = s * a[:, t].flatten(0, 1).unsqueeze(-2)
        kv = (s * kt.unsqueeze(-2)).sum(-1)
        u = beta[:, t].reshape(-1, 1) * (v[:, t].flatten(0, 1).float() - kv)
        s = torch.baddbmm(s, u.unsqueeze(-1), kt.unsqueeze(1))
        outs.append((s * qt.unsqueeze(-2)).sum(-1).view(b, h, d))
    return torch.index_put(buf, (slots,), s.view(b, h, d, d)), torch.stack(outs, 1)


def heads(buf, slots, q, k, v, a, beta):
    """the same rule on [B, H, ., .] (spell6's probe `kda_heads`)"""
    s, outs = buf[slots], []
    for t in range(q.shape[1]):
        s = s * a[:, t].unsqueeze(-2)
        kv = (s * k[:, t].unsqueeze(-2)).sum(-1)
        u = beta[:, t].unsqueeze(-1) * (v[:, t].float() - kv)
        s = s + k[:, t].unsqueeze(-2) * u.unsqueeze(-1)
        outs.append((s * q[:, t].unsqueeze(-2)).sum(-1))
    return torch.index_put(buf, (slots,), s), torch.stack(outs, 1)


def merged_write(buf, slots, q, k, v, a, beta):
    """spell7's write: per-head tensors reshaped for one `baddbmm`, viewed back"""
    b, h, d = q.shape[0], q.shape[2], q.shape[3]
    s = buf[slots] * a[:, 0].unsqueeze(-2)
    kt = k[:, 0].unsqueeze(-1)
    u = beta[:, 0].unsqueeze(-1) * (v[:, 0] - torch.matmul(s, kt).squeeze(-1))
    s = torch.baddbmm(s.reshape(b * h, d, d), u.reshape(b * h, d, 1),
                      kt.reshape(b * h, 1, d)).view(b, h, d, d)
    return torch.index_put(buf, (slots,), s)


def _lift(fn, args):
    """(before, after, sites) with baddbmm_split then head_rows applied"""
    before, after = (pattern_checks.graph(fn, *args, joint=True) for _ in range(2))
    baddbmm_split.apply(after.graph)
    n = head_rows.apply(after.graph)
    after.graph.lint()
    after.recompile()
    return before, after, n


def _merged_views(gm) -> list:
    return [n for n in gm.graph.nodes if n.target in (aten.view.default, aten.reshape.default)
            and len(n.meta["val"].shape) >= 1 and n.meta["val"].shape[0] in (2 * H, H)
            and len(n.args[0].meta["val"].shape) >= 2
            and n.args[0].meta["val"].shape[1] == H]


@pytest.mark.parametrize("B,T", [(2, 2), (1, 1), (2, 1)])
def test_rows_are_the_per_head_rule(B, T):
    args = _args(B, T)
    before, after, n = _lift(rows, args)
    assert n > 0
    assert_same(after(*args), before(*args))
    assert "aten.bmm.default" not in targets(after) and not _merged_views(after)
    # then the V-major rule on heads, as spell6's probe `kda_heads` spells it
    assert state_transpose.apply(after.graph) == 1
    assert delta_einsum.apply(after.graph) == 2 * T
    after.recompile()
    for got, want in zip(after(*args), heads(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 1e-6


def test_bf16_values_cast_on_the_rows():
    args = _args(dtype=torch.bfloat16)
    before, after, n = _lift(rows, args)
    assert n > 0
    assert_same(after(*args), before(*args))
    assert not _merged_views(after)


def test_a_merged_write_on_per_head_tensors():
    args = _args()
    before, after, n = _lift(merged_write, args)
    assert n == 2  # the product and the add
    assert_same(after(*args), before(*args))
    bmms = [n for n in after.graph.nodes if n.target is aten.bmm.default]
    assert len(bmms) == 1 and bmms[0].meta["val"].shape[-1] == 1  # the read S·k stays


def _stays(fn, args):
    before, after, n = _lift(fn, args)
    split = pattern_checks.graph(fn, *args, joint=True)
    baddbmm_split.apply(split.graph)
    split.recompile()
    assert n == 0
    assert targets(after) == targets(split)
    assert_same(after(*args), before(*args))


def test_rows_of_differently_split_tensors_stay():
    def swapped(buf, slots, q, k, v, a, beta):  # u's rows from [H, B]: not k's row order
        s = buf[slots].flatten(0, 1)
        u = v[:, 0].transpose(0, 1).reshape(-1, D)
        s = torch.baddbmm(s, u.unsqueeze(-1), k[:, 0].flatten(0, 1).unsqueeze(1))
        return s.view(2, H, D, D)

    _stays(swapped, _args())


def test_an_op_over_the_rows_stays():
    def over_rows(buf, slots, q, k, v, a, beta):  # the rows summed over: not row-wise
        s = buf[slots].flatten(0, 1)
        u = v[:, 0].flatten(0, 1)
        s = torch.baddbmm(s, u.unsqueeze(-1), k[:, 0].flatten(0, 1).unsqueeze(1))
        return s.cumsum(0).view(2, H, D, D)

    _stays(over_rows, _args())


def test_rows_read_as_rows_stay():
    def escapes(buf, slots, q, k, v, a, beta):  # the new state returned as [B*H] rows too
        s = buf[slots].flatten(0, 1)
        s = torch.baddbmm(s, v[:, 0].flatten(0, 1).unsqueeze(-1),
                          k[:, 0].flatten(0, 1).unsqueeze(1))
        return s.view(2, H, D, D), s

    _stays(escapes, _args())


def test_a_batched_read_and_no_write_stay():
    def read(buf, slots, q, k, v, a, beta):  # bmm over K (spell5's batch-merged read)
        s = buf[slots].flatten(0, 1) * a[:, 0].flatten(0, 1).unsqueeze(-2)
        return torch.bmm(s, k[:, 0].flatten(0, 1).unsqueeze(-1)).view(2, H, D)

    def pointwise(buf, slots, q, k, v, a, beta):  # merged rows, no rank-1 write
        return (buf[slots].flatten(0, 1) * a[:, 0].flatten(0, 1).unsqueeze(-2)).view(2, H, D, D)

    _stays(read, _args())
    _stays(pointwise, _args())

