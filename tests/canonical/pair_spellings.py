"""Routed MXFP4 experts dispatched over their (token, slot) pairs, as serving engines write them,
and look-alikes (tests/canonical/test_expert_rows.py, test_pair_order.py, test_pair_restore.py):

* `token_major`: spell6's form (tests/models/spell6_k3.py): the pairs in token order, z repeated
  k times (`repeat_interleave`), the experts gathered by the flat ids and dequantised to fp32 by
  `repeat_interleave(2)` and a [0, 4] shift, fp32 `matmul` GEMMs rounded to z's dtype, the
  weighted rows summed back by an fp32 `index_add_`.
* `sorted_pairs`: spell7's form (tests/models/spell7_k3.py, vLLM's): the pairs sorted by expert
  (`argsort(flat_ids, stable=True)`), token `order // k`, `index_select` gathers, a broadcast
  nibble shift, `bmm` in z's dtype, an fp32 `index_add_`; `sort=False`: the pairs in token order
  (`order = arange`).
* `grouped_pairs`: spell11's form (tests/models/spell11_k3.py): the pairs sorted by expert, the
  outputs put back in token order through the inverse permutation, a `bmm` combine by the [N, k]
  weights.

`odd` names a look-alike (`TOKEN_MAJOR_ODD`, `SORTED_ODD`, `GROUPED_ODD`)."""

from __future__ import annotations

import torch

from k3compile.math import E2M1_VALUES, situ

BETAS = (4.0, 25.0)


def routed(scores, ids):
    top = scores.gather(1, ids)
    return top / (top.sum(-1, keepdim=True) + 1e-20)


def _decode_shift(packed, scale, lut):
    """spell6's dequant: [..., O, W/2] nibbles (low first), [..., O, W/32] E8M0 -> fp32."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8).repeat(packed.shape[-1])
    codes = (packed.repeat_interleave(2, -1) >> shifts) & 15
    scales = torch.pow(2.0, scale.float() - 127.0).repeat_interleave(32, -1)
    return torch.take(lut, codes.long()) * scales


def _decode_broadcast(packed, scale, lut, dtype):
    """spell7's dequant: a broadcast shift, the E2M1 value by `take`, the scale per block."""
    codes = torch.bitwise_right_shift(packed.unsqueeze(-1), torch.tensor([0, 4], dtype=torch.uint8))
    vals = torch.take(lut, (codes & 0xF).long()).flatten(-2)
    blocks = vals.unflatten(-1, (scale.shape[-1], 32))
    return (blocks * torch.pow(2.0, scale.float() - 127).unsqueeze(-1)).flatten(-2).to(dtype)


TOKEN_MAJOR_ODD = ("token_dropped", "z_tiled", "ids_first_slot", "mask_drops_pairs",
                   "rows_mixed", "acc_residual")


def token_major(z, scores, ids, lut, w1p, w1s, w3p, w3s, w2p, w2s, odd=None):
    n, k = ids.shape
    lut = torch.tensor(E2M1_VALUES)  # spell6's fp32 buffer
    weights = routed(scores, ids).flatten()
    token = torch.arange(n).repeat_interleave(k)
    if odd == "token_dropped":  # the last pair summed into token 0: not arange // k
        token[-1] = 0
    flat = ids[:, :1].expand(-1, k).flatten() if odd == "ids_first_slot" else ids.flatten()
    zr = z.repeat(k, 1) if odd == "z_tiled" else z.repeat_interleave(k, 0)

    def expert(p, s, x):
        w = _decode_shift(p[flat], s[flat], lut)
        return torch.matmul(w, x.float().unsqueeze(-1)).squeeze(-1).to(x.dtype)

    act = situ(expert(w1p, w1s, zr), expert(w3p, w3s, zr), *BETAS)
    y = expert(w2p, w2s, act).float()
    if odd == "rows_mixed":  # each pair gets the next pair's output
        y = y.roll(1, 0)
    if odd == "mask_drops_pairs":  # pairs routed to expert 0 dropped
        weights = weights * (flat != 0)
    acc = (z.float().clone() if odd == "acc_residual"
           else torch.zeros(n, y.shape[-1], dtype=torch.float32))
    return acc.index_add_(0, token, y * weights.unsqueeze(-1)).to(z.dtype)


SORTED_ODD = ("order_not_sort", "order_kept", "weights_unpermuted", "sorted_values_read",
              "mask_drops_pairs")


def sorted_pairs(z, scores, ids, lut, w1p, w1s, w3p, w3s, w2p, w2s, sort=True, odd=None):
    n, k = ids.shape
    weights = routed(scores, ids)
    flat = ids.reshape(-1)
    if odd == "order_not_sort":  # pair 0 twice, the last pair never: no permutation
        order = torch.arange(n * k)
        order[-1] = 0
    elif odd == "sorted_values_read":  # the experts as the sort's values, in the sorted order
        experts, order = torch.sort(flat, stable=True)
    else:
        order = torch.argsort(flat, stable=True) if sort else torch.arange(n * k)
    if odd != "sorted_values_read":
        experts = flat.index_select(0, order)
    token = torch.div(order, k, rounding_mode="floor")
    zp = z.index_select(0, token).unsqueeze(-1)

    def weight(p, s):
        return _decode_broadcast(p.index_select(0, experts), s.index_select(0, experts), lut,
                                 z.dtype)

    hg = torch.bmm(weight(w1p, w1s), zp).squeeze(-1)
    hu = torch.bmm(weight(w3p, w3s), zp).squeeze(-1)
    act = situ(hg, hu, *BETAS).unsqueeze(-1)
    y = torch.bmm(weight(w2p, w2s), act).squeeze(-1)
    w = weights.reshape(-1)
    if odd != "weights_unpermuted":
        w = w.index_select(0, order)
    if odd == "mask_drops_pairs":
        w = w * (experts != 0)
    out = torch.zeros(n, y.shape[-1], dtype=torch.float32)
    out.index_add_(0, token, y.float() * w.unsqueeze(-1))
    return (out, experts) if odd == "order_kept" else out


RESTORES = ("gather", "index", "index_select", "scatter", "index_put")
GROUPED_ODD = ("order_not_inverse", "other_sort_inverse", "descending_inverse", "rows_kept",
               "rows_mixed", "rows_tiled", "weights_twice")


def grouped_pairs(z, scores, ids, lut, w1p, w1s, w3p, w3s, w2p, w2s, restore="gather",
                  sort=True, odd=None):
    """spell11's grouped experts (tests/models/spell11_k3.py): the pairs sorted by expert
    (`sort(stable=True)`, its values the experts; `argsort` for the writes back), the weights
    gathered per pair, `bmm` in z's dtype, the outputs put back in token order (`restore`: a
    gather, an index or an index_select through `argsort(order)`, or a scatter / index_put at
    `order`), combined by `bmm(w [N, 1, k], y [N, k, L])` in fp32; `sort=False`: the pairs in
    token order, nothing to restore. `odd` names a look-alike (`GROUPED_ODD`)."""
    n, k = ids.shape
    weights = routed(scores, ids)
    flat = ids.flatten()
    if not sort:
        experts, order = flat, torch.arange(n * k)
    elif restore in ("scatter", "index_put"):
        order = torch.argsort(flat, stable=True)
        experts = flat[order]
    else:
        experts, order = torch.sort(flat, stable=True)
    zs = z[order // k].unsqueeze(-1)

    def weight(p, s):
        return _decode_broadcast(p[experts], s[experts], lut, z.dtype)

    hg = torch.bmm(weight(w1p, w1s), zs).squeeze(-1)
    hu = torch.bmm(weight(w3p, w3s), zs).squeeze(-1)
    y = torch.bmm(weight(w2p, w2s), situ(hg, hu, *BETAS).unsqueeze(-1)).squeeze(-1)  # [P, L]
    if odd == "rows_mixed":  # each pair gets the next pair's output
        y = y.roll(1, 0)
    if odd == "weights_twice":  # the routing weight applied per pair and again in the combine
        y = y * weights.flatten()[order, None].to(y.dtype)
    kept = y
    back = torch.argsort(order)
    if odd == "order_not_inverse":  # gathered through the order itself
        back = order
    elif odd == "other_sort_inverse":  # the inverse of another sort of the same keys (ties)
        back = torch.argsort(torch.sort(flat, stable=True, descending=True).indices)
    elif odd == "descending_inverse":
        back = torch.argsort(order, descending=True)
    if not sort:
        pass
    elif restore == "gather":
        y = torch.gather(y, 0, back[:, None].expand(-1, y.shape[-1]))
    elif restore == "index":
        y = y[back]
    elif restore == "index_select":
        y = y.index_select(0, back)
    elif restore == "scatter":
        y = torch.empty_like(y).scatter_(0, order[:, None].expand_as(y), y)
    else:
        y = torch.zeros_like(y).index_put_((order,), y)
    y = y.view(k, n, -1).transpose(0, 1) if odd == "rows_tiled" else y.view(n, k, -1)
    out = torch.bmm(weights.unsqueeze(1), y.float()).squeeze(1)
    return (out, kept) if odd == "rows_kept" else out
