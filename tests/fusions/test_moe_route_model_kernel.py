"""A torch model of the k3::moe_route kernel's selection (CPU): the candidate bound keeps every
winner, candidates ranked by (key, lower expert) give the documented order, and at the K3 router
shape nearly every row takes the ranked way (not the serial fallback past CAP candidates)."""

import pytest
import torch
from k3compile.kernels.moe_route import CAP, MAX_EXPERTS


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the kernel's order-preserving 32-bit keys (as int64)."""
    bits = x.view(torch.int32).long()
    u = bits & 0xFFFFFFFF
    return torch.where(bits < 0, ~u & 0xFFFFFFFF, u | 0x80000000)


def select_model(keys: torch.Tensor, top_k: int):
    """keys int64 [N, E] -> (ids [N, k] in output order, rows that took the ranked way).
    Lane l of the selecting warp holds float4 vectors l, l + 32, ...; vectors past E read as 0."""
    n, n_experts = keys.shape
    v = -(-n_experts // 128)
    padded = torch.zeros(n, 128 * v, dtype=torch.int64)
    padded[:, :n_experts] = keys
    lane_max = padded.view(n, v, 32, 4).amax(dim=(1, 3))  # [N, 32]
    at_or_above = (lane_max[:, None, :] >= lane_max[:, :, None]).sum(-1)  # [N, 32]
    bound = lane_max.masked_fill(at_or_above < top_k, 0).amax(-1).clamp_min(1)
    candidate = keys >= bound[:, None]
    packed = keys * MAX_EXPERTS + (MAX_EXPERTS - 1 - torch.arange(n_experts))
    packed = packed.masked_fill(~candidate, -1)
    # rank = how many candidates are larger (candidates are unique: the inverse of their order)
    order = packed.argsort(dim=-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n_experts).expand(n, -1))
    ids = torch.full((n, top_k), -1, dtype=torch.int64)
    win = candidate & (rank < top_k)
    rows, experts = win.nonzero(as_tuple=True)
    ids[rows, rank[rows, experts]] = experts
    return ids, candidate.sum(-1) <= CAP


def stable_top(keys: torch.Tensor, top_k: int) -> torch.Tensor:
    return torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :top_k]


def routed_keys(gen, n, n_experts, ties=False):
    logits = torch.randn(n, n_experts, generator=gen) * 2
    bias = torch.randn(n_experts, generator=gen) * 0.1
    if ties:  # as test_moe_route: few distinct logits, no bias
        logits, bias = (logits * 2).round() / 4, torch.zeros_like(bias)
    return order_keys(torch.sigmoid(logits) + bias)


@pytest.mark.parametrize("n_experts,top_k", [(896, 16), (896, 1), (1024, 32), (64, 4), (100, 8),
                                             (8, 8), (4, 4), (4, 1), (128, 32)])
@pytest.mark.parametrize("ties", [False, True])
def test_model_matches_the_stable_order(n_experts, top_k, ties):
    gen = torch.Generator().manual_seed(n_experts * 100 + top_k + ties)
    keys = routed_keys(gen, 512, n_experts, ties)
    ids, ranked = select_model(keys, top_k)
    want = stable_top(keys, top_k)
    assert torch.equal(ids[ranked], want[ranked])


def test_all_equal_keys_go_the_serial_way():
    keys = torch.full((2, 896), 0x80000000 + 123, dtype=torch.int64)
    _, ranked = select_model(keys, 16)
    assert not ranked.any()


def test_k3_router_rows_take_the_ranked_way():
    gen = torch.Generator().manual_seed(0)
    _, ranked = select_model(routed_keys(gen, 4096, 896), 16)
    assert ranked.float().mean() > 0.99
