"""K3 MoE routers as code written elsewhere spells them, around one LatentMoE front module.

`Router` holds what `k3.moe_front` + `k3.moe_route` take (router weight [E, D], correction bias
[E], latent down-projection [L, D]) and routes the fp32 logits with one of `SPELLINGS`: the
transformers-style gate (`bias.unsqueeze(0)`, `topk(sorted=False)`, `gather(1)`), Moonshot's
gate (its no-op `scores.view(N, -1)`), DeepSeek-V3-style group-limited top-k with one group
(transformers: group score = top-2 sum, `masked_fill(.., 0.0)`; vLLM-like: group max, -inf) and
with every group kept, a bias as `view(1, -1)` or `[None].expand_as(..)`. `LOOKALIKES` route
differently and must not become the canonical router: a real group limit (2 groups, 1 kept).
Each is written here from the math (spec §3.3), not copied from those projects.

`routed_equal` compares two routings up to the order of the k experts in a row: an unsorted
top-k's order is unspecified, so the canonical (sorted) routing is a valid result of it.
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from k3compile.patterns import ORDER as PATTERNS
from torch import nn

import k3compile.backend as k3be
from k3compile.math import route_top_k
from tests.conftest import rel_err

N, D, E, L, K, SCALING = 3, 32, 16, 8, 4, 2.5


def ours(logits, bias):
    return route_top_k(logits, bias, K, SCALING)


def hf(logits, bias):
    scores = logits.sigmoid()
    scores_for_choice = scores + bias.unsqueeze(0)
    _, ids = torch.topk(scores_for_choice, k=K, dim=-1, sorted=False)
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * SCALING


def moonshot(logits, bias):
    """A no-op view of the scores to [tokens, E]; one group: no group limit (skipped in Python)."""
    n_tokens = logits.shape[0]
    scores = logits.sigmoid().view(n_tokens, -1)
    scores_for_choice = scores + bias.unsqueeze(0)
    _, ids = torch.topk(scores_for_choice, k=K, dim=-1, sorted=False)
    weights = scores.gather(1, ids)
    if K > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * SCALING


def _group_mask(group_scores, kept: int, experts: int):
    """[n, E] mask of the experts in the `kept` best groups (a scatter into [n, groups])."""
    n, groups = group_scores.shape
    group_idx = torch.topk(group_scores, k=kept, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    return group_mask.unsqueeze(-1).expand(n, groups, experts // groups).reshape(n, -1)


def grouped_top2(logits, bias, groups=1, kept=1):
    """Group score = the sum of its top 2; dropped groups filled with 0.0 (transformers)."""
    scores = logits.sigmoid()
    scores_for_choice = scores.view(-1, E) + bias.unsqueeze(0)
    group_scores = scores_for_choice.view(-1, groups, E // groups).topk(2, dim=-1)[0].sum(dim=-1)
    mask = _group_mask(group_scores, kept, E)
    scores_for_choice = scores_for_choice.masked_fill(~mask.bool(), 0.0)
    ids = torch.topk(scores_for_choice, k=K, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return ids, weights * SCALING


def grouped_max(logits, bias, groups=1, kept=1):
    """Group score = its max; dropped groups filled with -inf; weights of the unbiased scores."""
    scores = logits.sigmoid()
    original_scores = scores
    scores = scores + bias.unsqueeze(0)
    group_scores = scores.view(scores.shape[0], groups, -1).max(dim=-1).values
    mask = _group_mask(group_scores, kept, scores.shape[-1])
    choice = scores.masked_fill(~mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=K, dim=-1, sorted=False)[1]
    weights = original_scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * SCALING


def grouped_mask_mul(logits, bias, groups=1, kept=1):
    """The group mask multiplied in (dropped groups score 0)."""
    scores = logits.sigmoid()
    choice = scores + bias.unsqueeze(0)
    group_scores = choice.view(-1, groups, E // groups).amax(dim=-1)
    choice = choice * _group_mask(group_scores, kept, E)
    _, ids = choice.topk(K, dim=1, sorted=False)
    weights = scores.gather(-1, ids)
    return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * SCALING


def view_bias(logits, bias):
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + bias.view(1, -1), K, dim=1)
    weights = scores.gather(1, ids)
    return ids, SCALING * (weights / (weights.sum(-1, keepdim=True) + 1e-20))


def expand_bias(logits, bias):
    scores = torch.sigmoid(logits)
    _, ids = (scores + bias[None].expand_as(scores)).topk(K, sorted=False)
    weights = torch.gather(scores, -1, ids)
    return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * SCALING


def _groups(route, groups: int, kept: int):
    def fn(logits, bias):
        return route(logits, bias, groups, kept)

    fn.__name__ = f"{route.__name__}[{groups}:{kept}]"
    return fn


SPELLINGS = {
    "ours": ours, "hf": hf, "moonshot": moonshot, "view_bias": view_bias,
    "expand_bias": expand_bias, "grouped_top2": grouped_top2, "grouped_max": grouped_max,
    "grouped_mask_mul": grouped_mask_mul,
    "grouped_top2_all_kept": _groups(grouped_top2, 2, 2),
    "grouped_max_all_kept": _groups(grouped_max, 4, 4),
}
LOOKALIKES = {  # a real group limit: experts outside the best group are never chosen
    "grouped_top2_2_groups": _groups(grouped_top2, 2, 1),
    "grouped_max_4_groups_2_kept": _groups(grouped_max, 4, 2),
    "grouped_mask_mul_2_groups": _groups(grouped_mask_mul, 2, 1),
}


class Router(nn.Module):
    """A LatentMoE front: fp32 router logits and the latent down-projection of the same x; the
    logits routed by `route(logits, bias) -> (ids [N, k], weights [N, k])`."""

    def __init__(self, route, dtype=torch.float32, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.route = route
        self.weight = nn.Parameter(torch.randn(E, D, generator=g).to(dtype))
        self.e_score_correction_bias = nn.Parameter(0.1 * torch.randn(E, generator=g))
        self.down = nn.Parameter((torch.randn(L, D, generator=g) / D**0.5).to(dtype))

    def forward(self, x):
        logits = F.linear(x.float(), self.weight.float())
        ids, weights = self.route(logits, self.e_score_correction_bias)
        return ids, weights, F.linear(x, self.down)


def tokens(dtype=torch.float32, n: int = N) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(1)).to(dtype)


def by_expert(ids: torch.Tensor, *per_choice: torch.Tensor):
    """ids and the per-choice tensors with each row's choices in expert order."""
    order = ids.argsort(dim=-1)
    return (ids.gather(-1, order), *(t.gather(-1, order) for t in per_choice))


def routed_equal(got, want, rel: float = 1e-6) -> None:
    """(ids, weights, ...) equal up to the order of the k choices in a row; the rest equal."""
    (got_ids, got_w), (want_ids, want_w) = by_expert(*got[:2]), by_expert(*want[:2])
    assert got_ids.dtype == want_ids.dtype and torch.equal(got_ids, want_ids)
    assert got_w.dtype == want_w.dtype and rel_err(got_w, want_w) <= rel, rel_err(got_w, want_w)
    for g, w in zip(got[2:], want[2:], strict=True):
        assert g.dtype == w.dtype and rel_err(g, w) <= rel, rel_err(g, w)


def fused(route, dtype=torch.float32) -> tuple[collections.Counter, tuple, tuple]:
    """Router(route) under the full backend (executor aten; of the patterns only the router's,
    so that the test does not trace every pattern): (the fused graph's op counts, the compiled
    outputs, the eager outputs)."""
    torch._dynamo.reset()
    module, x = Router(route, dtype), tokens(dtype)
    others = [name for name in PATTERNS if name not in ("moe_front", "moe_route")]
    step = torch.compile(module, backend="k3", fullgraph=True,
                         options={"executor": "aten", "disabled_patterns": others})
    with torch.no_grad():
        got, want = step(x), module(x)
    graph = next(iter(k3be.last_compiled().observer.graphs.values()))
    ops = collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")
    return ops, got, want


FUSED = ("k3.moe_front.default", "k3.moe_route.default")


def only(rule: str) -> dict:
    """Options for `compiled.canonicalize` that run one canonical rule."""
    from k3compile.canonical import ORDER

    return {"disabled_rules": [name for name in ORDER if name != rule]}
