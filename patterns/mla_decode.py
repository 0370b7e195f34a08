"""Gated MLA's latent-cache write + decode attention over the cache -> `k3.mla_decode`
(spec §3.2 steps 6-7).

Matches `GatedMLA.forward` from q_lat, q_pe, c_kv, k_pe on: positions `pos .. pos + T - 1`, the
write of [c_kv | k_pe] into the slots' cache rows (functional in the graph, in place in the op),
the read of the slots' caches, the two score einsums (latent and rope parts), fp32 scale, the
causal mask (row t sees cache rows <= pos + t), softmax, cast, and the value einsum over the
latent part. Size-1 batch or token dims change the einsums' graph: variants per (B == 1, T == 1)
and per dtype.

Before: view, iota, add, cat, view, index_put, index, split_with_sizes, 3 x (einsum: unsqueeze,
    permute, view, bmm, view, permute, ...), add, convert, mul, iota, le, bitwise_not, where,
    amax, sub, exp, sum, div, convert
After:  o_lat = k3.mla_decode(q_lat, q_pe, c_kv, k_pe, kv_cache!, slots, positions, scale)
"""

from __future__ import annotations

import itertools

import torch
from k3compile.patterns.kda_decode import setitem

from k3compile.rewrite import Pattern, tensor_meta

DTYPES = (torch.bfloat16, torch.float32)
SIZES = ((1, 1), (1, 2), (2, 1), (2, 2))  # (B, T) of the example: size 1 or not, per dim
H, N, R, C, L = 2, 8, 4, 12, 6  # tracing sizes; matching ignores sizes


def search(q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions, scale):
    B, T = q_lat.shape[:2]
    pos = positions.view(B, 1) + torch.arange(T, device=q_lat.device)
    kv_cache_out = setitem(kv_cache, (slots.view(B, 1), pos), torch.cat([c_kv, k_pe], dim=-1))
    cache = kv_cache_out[slots]
    kv_lat, kv_pe = cache.split([c_kv.shape[-1], k_pe.shape[-1]], dim=-1)
    scores = (torch.einsum("bthc,blc->bthl", q_lat, kv_lat)
              + torch.einsum("bthr,blr->bthl", q_pe, kv_pe))
    scores = scores.float() * scale
    visible = torch.arange(cache.shape[1], device=q_lat.device).view(1, 1, -1) <= pos.unsqueeze(-1)
    scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q_lat.dtype)
    return kv_cache_out, torch.einsum("bthl,blc->bthc", p, kv_lat)


def replace(q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions, scale):
    o_lat = torch.ops.k3.mla_decode(q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions, scale)
    return kv_cache, o_lat


def check(match) -> str | None:
    if not isinstance(match.kwargs["scale"], float):
        return "scale is not a compile-time float"
    names = ("q_lat", "q_pe", "c_kv", "k_pe", "kv_cache", "slots", "positions")
    q_lat, q_pe, c_kv, k_pe, cache, slots, positions = (tensor_meta(match.kwargs[k]) for k in names)
    if any(t is None for t in (q_lat, q_pe, c_kv, k_pe, cache, slots, positions)):
        return "an input has no tensor metadata"
    if q_lat.dim() != 4 or q_pe.dim() != 4 or c_kv.dim() != 3 or k_pe.dim() != 3 or cache.dim() != 3:
        return "ranks: want q_lat/q_pe [B, T, H, *], c_kv/k_pe [B, T, *], kv_cache [S, L, C + R]"
    c, r = c_kv.shape[-1], k_pe.shape[-1]
    if q_lat.shape[-1] != c or q_pe.shape[-1] != r or cache.shape[-1] != c + r:
        return (f"widths q_lat {q_lat.shape[-1]}, q_pe {q_pe.shape[-1]}, cache {cache.shape[-1]} "
                f"do not fit c_kv {c} + k_pe {r}")
    if q_lat.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {q_lat.dtype}"
    if {q_pe.dtype, c_kv.dtype, k_pe.dtype, cache.dtype} != {q_lat.dtype}:
        return f"q/c_kv/k_pe/cache dtypes {q_pe.dtype}, {c_kv.dtype}, {k_pe.dtype}, {cache.dtype} differ"
    for name, t in (("slots", slots), ("positions", positions)):
        if t.dtype != torch.int64 or t.dim() != 1:
            return f"{name} {t.dtype} rank {t.dim()} is not int64 [B]"
    return None


def _variant(B: int, T: int, dtype: torch.dtype) -> Pattern:
    def example_inputs():
        # strides as in the model: q_lat an einsum result, q_pe and k_pe split views
        q = torch.randn(B, T, H, N + R, dtype=dtype)
        q_nope, q_pe = q.split([N, R], dim=-1)
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, torch.randn(H, N, C, dtype=dtype))
        k_pe = torch.randn(B, T, C + R, dtype=dtype)[..., C:]
        cache = torch.randn(3, 2 * L, C + R, dtype=dtype)
        return [q_lat, q_pe, torch.randn(B, T, C, dtype=dtype), k_pe, cache,
                torch.tensor([0, 2][:B]), torch.tensor([1, 3][:B]), 0.123]

    return Pattern(
        name=f"mla_decode[B={'1' if B == 1 else 'n'},T={'1' if T == 1 else 'n'},"
             f"{str(dtype).removeprefix('torch.')}]",
        search=search, replace=replace, example_inputs=example_inputs, op="k3.mla_decode",
        check=check, scalars={"scale": 0.123}, distinctive=("index_put", "amax", "bmm"),
        joint_passes=True,
    )


def patterns() -> list[Pattern]:
    return [_variant(b, t, d) for (b, t), d in itertools.product(SIZES, DTYPES)]
