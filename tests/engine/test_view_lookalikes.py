"""Session 37: a site's reshapes lay out their input as the pattern's do. Inductor's
`fx_to_pattern` leaves a view's sizes free (`Ignored`), and sessions 35-36 left them free on
purpose (they follow the site's shapes), so a site whose view put a dim elsewhere matched
wherever the broadcasts after it still type-checked: `A_log.view(1, H)` for the pattern's
`A_log.view(H, 1)` on square heads (H = K), a head split `view(B, H, T, K)` moving T = 1 between
the heads and the head dim. The engine now compares a view's output shape with the pattern's
traced one (`inductor.disagreement`, `_carried_otherwise`): a size-1 output dim stays size 1,
and an output dim to which the pattern's view carries an input dim whole is a whole input dim
at the site too. Graphs edited in one view each (the look-alike), compared with the edited
graph's own eager values; the trace cache keeps the traced shapes (format 2)."""

from __future__ import annotations

import pytest
import torch

from k3compile.rewrite import inductor
from patterns import fb_kda_decode, kda_decode, mla_decode
from tests.engine.test_lookalikes import _assert_fused, _assert_refused, _edit
from tests.fusions.attention_checks import family

_VIEW = torch.ops.aten.view.default


def _kda_square():
    """kda_decode's bf16 batch-2 one-token site with square heads (H = K = 4): (function,
    arguments, patterns). The pattern is traced at H = 2, K = 8."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    B, T, H, K, taps = 2, 1, 4, 4, 4
    W = H * K
    args = [*(r(B, T, W) for _ in range(5)), r(B, T, H), r(3, 3 * W, taps - 1),
            r(3, H, K, K, dtype=torch.float32) * 0.05, torch.tensor([0, 2]),
            *(r(W, 1, taps) for _ in range(3)), r(H, dtype=torch.float32),
            r(W, dtype=torch.float32), r(K)]
    scalars = {**kda_decode.SCALARS, "q_scale": K**-0.5}
    return kda_decode.kda_step, [*args, *scalars.values()], family("kda_decode")


# the site's views in graph order: q, k, v split into heads [B, T, H, K] (0-2), A_log [H, 1] (3),
# graw's head split (4), dt_bias [H, K] (5)
@pytest.mark.parametrize(("edit", "words"), [
    (_edit(_VIEW, 3, 1, [1, 4]), ("view_3", "size=[1, 4]", "[2, 1] of [2]: its dim 1 of size 1")),
    (_edit(_VIEW, 0, 1, [4, 1, 4, 2]), ("view (view", "size=[4, 1, 4, 2]", "dim 0 a whole")),
    (_edit(_VIEW, 2, 1, [1, 2, 4, 4]), ("view_2", "size=[1, 2, 4, 4]", "dim 1 of size 1")),
    (_edit(_VIEW, 2, 1, [2, 4, 1, 4]), ("view_2", "size=[2, 4, 1, 4]", "dim 1 of size 1")),
    (_edit(_VIEW, 2, 1, [2, 4, 4, 1]), ("view_2", "size=[2, 4, 4, 1]", "dim 1 of size 1")),
], ids=["decay_per_head_along_k", "q_batch_regrouped", "v_batch_for_token",
        "v_token_between_heads", "v_token_last"])
def test_kda_step_laying_out_heads_otherwise_is_refused(edit, words):
    """The bug: each fused into k3.kda_decode (bf16, B = 2, T = 1, H = K = 4; the pattern
    traced at H = 2, K = 8); measured without the check, max |fused - eager| over the outputs:
    the decay exp(A_log) applied along K, not the heads 0.025; q viewed [4, 1, 4, 2] (batch and
    heads regrouped) 3.98; v viewed [1, 2, 4, 4] 2.74, [2, 4, 1, 4] 1.74; graw viewed
    [2, 4, 4, 1] 0.16."""
    fn, args, patterns = _kda_square()
    _assert_refused(fn, args, patterns, [edit], "literal_mismatch", *words)


@pytest.mark.parametrize("edits", [[], [_edit(_VIEW, 0, 1, [2, 1, -1, 4])]],
                         ids=["as_spelled", "minus_one"])
def test_kda_step_with_square_heads_still_fuses(edits):
    fn, args, patterns = _kda_square()
    _assert_fused(fn, args, patterns, edits, "k3.kda_decode")


def test_mla_decode_viewing_heads_as_the_head_dim_is_refused():
    """The bug: mla_decode at B = T = 1 (bf16, 2 heads of 12) with a [2, 1, 1, 1, 12] view laid
    out [1, 12, 1, 1, 2] (heads and head dim swapped) fused into k3.mla_decode: 2.36 off eager
    at most without the check (1.27 at the view before it)."""
    variant = next(p for p in family("mla_decode") if p.name == "mla_decode[B=1,T=1,bfloat16]")
    _assert_refused(mla_decode.search, variant.example_inputs(), family("mla_decode"),
                    [_edit(_VIEW, 14, 1, [1, 12, 1, 1, 2])], "literal_mismatch", "view_")


@pytest.mark.parametrize("edit", [_edit(_VIEW, 2, 1, [2, 64, 96, 1]),
                                  _edit(_VIEW, 1, 1, [32, 2, 64, 3, 1])],
                         ids=["rows_as_experts", "groups_regrouped"])
def test_moe_experts_regrouping_a_weight_is_refused(edit):
    """The bug: moe_experts (bf16, one row, 2 experts of [64, 96] int4-packed weights) with a
    view of the dequantised weights laid out otherwise fused into k3.moe_experts; measured
    without the check on one draw of the example inputs: [2, 64, 96, 1] for [1, 2, 64, 96]
    4640 off eager at most (eager's outputs up to 7680), [32, 2, 64, 3, 1] for
    [1, 2, 64, 3, 32] 1792 (of 2096)."""
    variant = next(p for p in family("moe_experts") if p.name == "moe_experts[bfloat16,one_row]")
    _assert_refused(variant.search, variant.example_inputs(), family("moe_experts"), [edit],
                    "literal_mismatch", "view_")


def test_fb_kda_step_at_one_row_of_eight_tokens_fuses():
    """Session 38: fb_kda_decode's graw view [B * T, N] -> [B, T, N], traced at B = 2, T = 1 as
    [2, 1, N], is [1, 8, N] at a site of B = 1, T = 8: the trace's size-1 dim holds the site's 8
    tokens. It was refused as a moved unit dim (blind_k3, spell6, the HF spelling lost their KDA
    step at B = 1, T > 1); its inputs' token dim (1 in the trace, 8 at the site) now says so."""
    g = torch.Generator().manual_seed(0)
    args = fb_kda_decode.example_inputs(torch.bfloat16)
    for name in ("q", "k", "v", "g", "fa", "b"):
        i = fb_kda_decode.NAMES.index(name)
        args[i] = torch.randn(1, 8, args[i].shape[-1], generator=g).to(args[i].dtype)
    state = fb_kda_decode.NAMES.index("recurrent_state")
    args[state] = args[state] * 0.05
    args[fb_kda_decode.NAMES.index("slots")] = torch.tensor([1])
    args[fb_kda_decode.NAMES.index("q_scale")] = kda_decode.K**-0.5
    _assert_fused(fb_kda_decode.search, args, family("fb_kda_decode"), [], "k3.fb_kda_decode")


def _carried(traced_in, traced_out, site_in, site_out, at_one=frozenset()):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(site_in, device="meta")
    view = graph.call_function(_VIEW, (x, list(site_out)))
    view.meta["val"] = torch.empty(site_out, device="meta")
    return inductor._carried_otherwise((tuple(traced_in), tuple(traced_out)), view, at_one)


@pytest.mark.parametrize(("traced", "site", "same"), [
    (([2], [2, 1]), ([4], [4, 1]), True),
    (([2], [2, 1]), ([4], [1, 4]), False),  # the unit dim moved: the broadcast goes elsewhere
    (([2, 1, 16], [2, 1, 2, 8]), ([3, 1, 16], [3, 1, 4, 4]), True),  # other sizes, a square
    (([2, 1, 16], [2, 1, 2, 8]), ([1, 1, 16], [1, 1, 4, 4]), True),  # a batch of 1
    (([2, 1, 16], [2, 1, 2, 8]), ([2, 1, 16], [2, 4, 1, 4]), False),  # T among the heads
    (([2, 16], [4, 8]), ([2, 16], [4, 8]), True),  # a split the trace's sizes show
    (([4, 8], [4, 8]), ([2, 16], [4, 8]), False),  # the trace kept both dims: a regrouping
    (([2, 1, 32], [2, 32]), ([2, 3, 32], [6, 32]), True),  # view(B * T, D) traced at T = 1
    (([2, 24], [2, 1, 24]), ([6, 24], [2, 3, 24]), True),  # view(B, T, N) traced at T = 1
    (([2, 2, 8, 8], [4, 8, 8]), ([3, 4, 4, 4], [12, 4, 4]), True),  # batch and heads merged
    (([2, 2, 8, 8], [4, 8, 8]), ([4, 4, 4, 4], [4, 16, 4]), False),
    (([2, 3], [6]), ([4, 4], [16]), True),  # sizes only a product
    # mla_q_absorb at B = 1, T = 8: the einsum's decomposition drops B and puts its size-1
    # dims last; a reshape reads its input in order, so they change nothing
    (([2, 2, 2, 8, 1], [2, 4, 8]), ([4, 8, 32, 1, 1], [4, 8, 32]), True),
    # view(B, T, N) traced at B = 2, T = 1, at a site of B = 1, T = 8: without evidence that the
    # trace's 1 is a count (the unit dim moved, as unit_moved), with it (an input's traced size-1
    # dim is 8 at the site)
    (([2, 16], [2, 1, 16]), ([8, 64], [1, 8, 64]), False),
    (([2, 16], [2, 1, 16]), ([8, 64], [1, 8, 64], {8}), True),
    (([2], [2, 1]), ([4], [1, 4], {8}), False),  # evidence of another size
], ids=["unit_kept", "unit_moved", "square_split", "batch_1", "token_moved", "split",
        "identity_trace", "merge_t1", "split_t1", "merge", "merge_otherwise", "flatten",
        "input_units_elsewhere", "tokens_8_batch_1_unknown", "tokens_8_batch_1",
        "unit_moved_other_count"])
def test_a_view_is_compared_by_the_dims_it_carries(traced, site, same):
    """The rule on single views: a size-1 output dim of the pattern's stays size 1 (unless the
    site's inputs show a count traced at 1 of the size the site has there), and where the
    pattern's view carries an input dim whole the site's output dim there is a whole input dim
    too; sizes a view makes and a site with fewer size-1 dims than the trace (a batch or token
    count traced at 1) stay free."""
    assert (_carried(*traced, *site) is None) == same
