"""Rule `gemm`: each spelling of a projection by a weight input becomes the F.linear form
(mm(x2d, permute(W, [1, 0])) with views) and computes what the unrewritten graph computes; GEMMs
that are not projections by a weight input are left alone; under the full backend a bmm/einsum
projection fuses into k3.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import ORDER as PATTERNS
from torch import nn

import k3compile.backend as k3be
from k3compile.canonical import ORDER as CANONICAL
from tests.conftest import rel_err

from .compiled import assert_same_values, canonicalize, targets

K, N, G = 16, 12, 3
aten = torch.ops.aten


class Proj(nn.Module):
    """`fn(x, w)` over a weight parameter of `shape`."""

    def __init__(self, fn, shape=(N, K)):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(1)))
        self.fn = fn

    def forward(self, x):
        return self.fn(x, self.w)


def _x(rows=(2, 1)):
    return torch.randn(*rows, K, generator=torch.Generator().manual_seed(0))


def _eager(m, *args):
    with torch.no_grad():
        return m(*args)


def _projections(c) -> list[torch.fx.Node]:
    """The rewritten graph's mm's in the F.linear form: mm(x2d, permute(w, [1, 0])), w a weight
    placeholder or a select/slice of one."""
    found = []
    for node in c.after.graph.nodes:
        if node.target is not aten.mm.default:
            continue
        wt = node.args[1]
        assert wt.target is aten.permute.default and list(wt.args[1]) == [1, 0], node.format_node()
        w = wt.args[0]
        while w.op != "placeholder":
            assert w.target in (aten.select.int, aten.slice.Tensor), w.format_node()
            w = w.args[0]
        found.append(node)
    return found


SPELLINGS = {
    "bmm": lambda x, w: torch.bmm(x, w.t().expand(x.shape[0], -1, -1)),
    "einsum": lambda x, w: torch.einsum("btd,ed->bte", x, w),
    "einsum_2d": lambda x, w: torch.einsum("bd,ed->be", x[:, -1], w),
    "einsum_w_first": lambda x, w: torch.einsum("ed,btd->bte", w, x),
    "matmul_column": lambda x, w: torch.matmul(w, x.unsqueeze(-1)).squeeze(-1),
    "inner": lambda x, w: torch.inner(x, w),
    "bmm_w_first": lambda x, w: torch.bmm(w.expand(x.shape[0], -1, -1), x.transpose(1, 2)).transpose(1, 2),
    "einsum_row_slice": lambda x, w: torch.einsum("btd,ed->bte", x, w[4:10]),
}


@pytest.mark.parametrize("rows", [(2, 1), (2, 4)], ids=["decode", "verify"])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_projection_spellings_become_the_linear_form(spelling, rows):
    m, x = Proj(SPELLINGS[spelling]), _x(rows)
    c = canonicalize(None, {"x": x}, module=m)
    assert c.counts["gemm"] == 1
    assert len(_projections(c)) == 1
    assert "aten.bmm.default" not in targets(c.after)
    assert_same_values(c)
    assert rel_err(c.output, _eager(m, x)) <= 1e-6


@pytest.mark.parametrize("spelling", ["bmm", "einsum_w_first", "matmul_column"])
def test_bf16_projection_keeps_dtype_and_values(spelling):
    """bmm and mm accumulate a bf16 product alike (measured bit-equal on CPU); at most one bf16
    ulp of the largest output is allowed."""
    m, x = Proj(SPELLINGS[spelling]).to(torch.bfloat16), _x((2, 4)).bfloat16()
    c = canonicalize(None, {"x": x}, module=m)
    assert c.counts["gemm"] == 1 and len(_projections(c)) == 1
    assert c.output.dtype == torch.bfloat16
    assert_same_values(c, rel=2**-7)


@pytest.mark.parametrize("rows", [(2, 1), (2, 4)], ids=["decode", "verify"])
@pytest.mark.parametrize("stack", ["param", "rows_of_2d"])
def test_stacked_bmm_becomes_one_mm_per_weight(stack, rows):
    """q|k|v "lowered to bmm": one bmm over a [G, N, K] stack of one input expanded G times."""

    def qkv(x, w):
        w = w.view(G, N, K) if stack == "rows_of_2d" else w
        y = torch.bmm(x.reshape(1, -1, K).expand(G, -1, -1), w.transpose(1, 2))
        q, k, v = y.unbind(0)
        return q.view(*x.shape[:-1], N), k.view(*x.shape[:-1], N), torch.sigmoid(v)

    m, x = Proj(qkv, (G, N, K) if stack == "param" else (G * N, K)), _x(rows)
    c = canonicalize(None, {"x": x}, module=m)
    assert c.counts["gemm"] == 1
    mms = _projections(c)
    assert len(mms) == G
    # one x, G weights; each mm reads x through its own view (as each F.linear traces)
    x2ds = [mm.args[0] for mm in mms]
    assert len({x.args[0] if str(x.target) == "aten.view.default" else x for x in x2ds}) == 1
    assert all(len(x.users) == 1 for x in x2ds if str(x.target) == "aten.view.default")
    assert "aten.bmm.default" not in targets(c.after)
    assert_same_values(c)
    for got, want in zip(c.output, _eager(m, x)):
        assert rel_err(got, want) <= 1e-6


def test_stacked_bmm_read_whole_is_stacked_back():
    def whole(x, w):
        return torch.bmm(x.reshape(1, -1, K).expand(G, -1, -1), w.transpose(1, 2)) * 2

    m, x = Proj(whole, (G, N, K)), _x()
    c = canonicalize(None, {"x": x}, module=m)
    assert c.counts["gemm"] == 1 and len(_projections(c)) == G
    assert "aten.stack.default" in targets(c.after)
    assert_same_values(c)


def test_several_projections_of_one_input_share_it():
    """As F.linear traces: every mm reads a view of the same x node (linear_concat binds it)."""

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Parameter(torch.randn(N, K)) for _ in range(3))

        def forward(self, x):
            return (torch.einsum("btd,ed->bte", x, self.q), x @ self.k.t(),
                    torch.bmm(x, self.v.t().expand(x.shape[0], -1, -1)))

    m, x = QKV(), _x((2, 4))
    c = canonicalize(None, {"x": x}, module=m)
    mms = _projections(c)
    assert len(mms) == 3
    assert len({mm.args[0].args[0] for mm in mms}) == 1  # view(x, [R, K]) of one x
    assert_same_values(c)


# ---- look-alikes left alone -------------------------------------------------------------------

def _left_alone(m, args: dict, **options):
    # gemm's own doing: the view rules after it split e.g. a view read by two products
    c = canonicalize(None, args, module=m, disabled_rules=CANONICAL[CANONICAL.index("gemm") + 1:],
                     **options)
    assert c.counts["gemm"] == 0
    assert targets(c.after) == targets(c.before)
    return c


class Fn(nn.Module):
    def __init__(self, fn, **params):
        super().__init__()
        for name, shape in params.items():
            setattr(self, name, nn.Parameter(torch.randn(*shape)))
        self.fn = fn

    def forward(self, *args):
        return self.fn(self, *args)


def test_our_linear_forms_are_left_as_they_are():
    """The model's own F.linear, and f_b on f_a's output (view(view(mm)) stays)."""
    m = Fn(lambda s, x: F.linear(F.linear(x, s.a), s.b), a=(8, K), b=(N, 8))
    _left_alone(m, {"x": _x((2, 4))})


def test_activation_products_are_left_alone():
    """Attention scores and the delta rule's state products: no operand is a weight input."""

    def attention(s, x, k_in):
        q = (x * 2).view(2, -1, 4, 4).transpose(1, 2)
        k = torch.tanh(x).view(2, -1, 4, 4).transpose(1, 2)
        state = torch.einsum("bhtd,bhte->bhde", k, q)
        return q @ k.transpose(-1, -2), state, torch.bmm(x, k_in.transpose(1, 2))

    _left_alone(Fn(attention), {"x": _x((2, 3)), "k_in": torch.randn(2, 5, K)})


def test_computed_weights_are_left_alone():
    m = Fn(lambda s, x: torch.einsum("btd,ed->bte", x, s.w * 2), w=(N, K))
    _left_alone(m, {"x": _x()})


def test_written_state_is_not_a_weight():
    class Cache(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.randn(N, K))

        def forward(self, x):
            scores = torch.einsum("btd,ld->btl", x, self.cache)
            self.cache.mul_(0.5)
            return scores

    c = _left_alone(Cache(), {"x": _x()})
    assert_same_values(c)


def test_per_head_weights_of_per_head_inputs_are_left_alone():
    """MLA's absorption: each head its own input and its own weight (not one input expanded),
    in both weight layouts."""
    m = Fn(lambda s, q: (torch.einsum("bhd,hcd->bhc", q, s.w_uk),
                         torch.einsum("bhc,hcd->bhd", q[..., :8], s.w_uv)),
           w_uk=(4, 8, K), w_uv=(4, 8, K))
    _left_alone(m, {"q": torch.randn(2, 4, K)})


def test_in_out_weight_layout_is_left_alone():
    """x @ W with W [K, N]: not the [N, K] layout a linear reads. (Stage kernel_layout, before
    canonicalize, reads such a weight as Wᵀ where it may move it; pack_weights off, it may not.)"""
    _left_alone(Fn(lambda s, x: torch.einsum("btd,de->bte", x, s.w), w=(K, N)), {"x": _x()},
                pack_weights=False)


def test_in_out_weight_read_transposed_by_kernel_layout_is_a_linear():
    """The same with stage kernel_layout free to re-lay W: gemm sees mm(x, permute(Wᵀ))."""
    m, x = Fn(lambda s, x: torch.einsum("btd,de->bte", x, s.w), w=(K, N)), _x()
    want = _eager(m, x)
    c = canonicalize(None, {"x": x}, module=m,
                     disabled_rules=CANONICAL[CANONICAL.index("gemm") + 1:])
    assert c.counts["gemm"] == 1
    assert rel_err(c.output, want) <= 1e-6


# ---- the purpose: the patterns now see a linear -----------------------------------------------

@pytest.mark.parametrize("spelling", ["bmm", "einsum"])
def test_bmm_and_einsum_projections_fuse_into_k3_linear(spelling):
    m, x = Proj(SPELLINGS[spelling]), _x((2, 4))
    # only linear's pattern (the others trace for ~20 s on first use and have nothing to take)
    others = [name for name in PATTERNS if name != "linear"]
    c = canonicalize(None, {"x": x}, module=m, disabled_stages=[], disabled_patterns=others)
    assert c.counts["gemm"] == 1
    assert "k3.linear.default" in _final_targets()
    assert rel_err(c.output, _eager(m, x)) <= 1e-6
    canonicalize(None, {"x": x}, module=m, disabled_stages=[], disabled_patterns=others,
                 disabled_rules=["gemm"])
    assert "k3.linear.default" not in _final_targets()


def _final_targets() -> list[str]:
    graph = next(iter(k3be.last_compiled().observer.graphs.values()))
    return [str(n.target) for n in graph.nodes]
