"""The inputs whose values a compile read (k3compile/read_guard.py): a causal-mask buffer that rule
`causal_mask` rewrote by is checked at every call; the same values written again (a version bump)
keep the compiled step, other values compile the bucket again, and the step then computes eager's
answer on the new mask (never the old mask's)."""

from __future__ import annotations

import logging

import pytest
import torch

import k3compile.backend as k3be
from k3compile import pipeline
from k3compile.read_guard import ReadGuard

L = 16


class Masked(torch.nn.Module):
    """Scores masked by a row of a causal buffer gathered at each query's position (gpt-fast)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("causal_mask", torch.ones(L, L, dtype=torch.bool).tril(),
                             persistent=False)
        self.w = torch.nn.Parameter(torch.randn(L, L, generator=torch.Generator().manual_seed(0)))

    def forward(self, x, pos):
        mask = self.causal_mask[pos]  # [B, T, L]
        return (x @ self.w).masked_fill(~mask, float("-inf")).softmax(-1)


def _inputs():
    x = torch.randn(2, 3, L, generator=torch.Generator().manual_seed(1))
    return x, torch.tensor([[3, 4, 5], [0, 1, 2]])


def test_guard_takes_same_values_and_names_changed_ones():
    buf = torch.ones(L, L, dtype=torch.bool).tril()
    guard = ReadGuard({0}, [buf, torch.zeros(3)])
    assert guard.changed([buf]) is None
    buf.copy_(torch.ones(L, L, dtype=torch.bool).tril())  # a version bump, the same values
    assert guard.changed([buf]) is None
    buf[4, 9] = True
    assert "graph input 0 (torch.bool [16, 16])" in guard.changed([buf])


def test_only_tables_are_guarded():
    """The caller's inputs and the state the step writes are not guarded (rule mxfp4_dequant's
    folding records any small input it evaluates: blind_k3's [5, 192, 3] conv state, written every
    step, recompiled every call before; tests/fusions/test_moe_front_route.py's blind-fp32 case
    failed on it); with the written inputs unknown, nothing is."""
    assert pipeline.guarded_reads({0, 3, 8}, frozenset({3}), frozenset({8, 9})) == {0}
    assert pipeline.guarded_reads({0, 3, 8}, frozenset(), None) == frozenset()


def test_changed_mask_compiles_the_bucket_again(caplog):
    model = Masked().requires_grad_(False)
    x, pos = _inputs()
    torch._dynamo.reset()
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    before = step(x, pos)
    torch.testing.assert_close(before, model(x, pos), rtol=1e-6, atol=1e-6)
    (bucket,) = k3be.last_compiled().buckets.values()
    assert bucket.reads is not None and bucket.reads.positions  # rule causal_mask read the buffer

    model.causal_mask.copy_(torch.ones(L, L, dtype=torch.bool).tril())  # same values
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        torch.testing.assert_close(step(x, pos), before, rtol=0, atol=0)
    assert "changed in place" not in caplog.text

    model.causal_mask[4, 9] = True  # row 4 (request 0's second token) now sees column 9
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        after = step(x, pos)
    want = model(x, pos)
    assert not torch.allclose(want, before)  # the old mask's answer would be wrong
    torch.testing.assert_close(after, want, rtol=1e-6, atol=1e-6)
    assert "whose values the compile read, changed in place" in caplog.text


@pytest.mark.gpu
def test_changed_mask_compiles_the_bucket_again_under_cuda_graphs(caplog):
    """On CUDA the bucket's step is captured in a CUDA graph at its second call, and replays run
    no Python of the compiled step: the backend asks the guard before each replay."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = Masked().requires_grad_(False).cuda()
    x, pos = (t.cuda() for t in _inputs())
    torch._dynamo.reset()
    step = torch.compile(model, backend="k3", fullgraph=True)
    for _ in range(3):  # run, capture, replay
        before = step(x, pos).clone()
    (bucket,) = k3be.last_compiled().buckets.values()
    assert bucket.graph is not None and bucket.reads.positions
    torch.testing.assert_close(before, model(x, pos), rtol=1e-5, atol=1e-5)
    model.causal_mask[4, 9] = True
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        after = step(x, pos)
    want = model(x, pos)
    assert not torch.allclose(want, before)
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-5)
    assert "whose values the compile read, changed in place" in caplog.text
