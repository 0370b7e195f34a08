"""Routed MXFP4 experts dispatched over their (token, slot) pairs, as serving engines write them,
and look-alikes (tests/canonical/test_expert_rows.py, test_pair_order.py):

* `token_major`: spell6's form (tests/models/spell6_k3.py): the pairs in token order, z repeated
  k times (`repeat_interleave`), the experts gathered by the flat ids and dequantised to fp32 by
  `repeat_interleave(2)` and a [0, 4] shift, fp32 `matmul` GEMMs rounded to z's dtype, the
  weighted rows summed back by an fp32 `index_add_`.
* `sorted_pairs`: spell7's form (tests/models/spell7_k3.py, vLLM's): the pairs sorted by expert
  (`argsort(flat_ids, stable=True)`), token `order // k`, `index_select` gathers, a broadcast
  nibble shift, `bmm` in z's dtype, an fp32 `index_add_`; `sort=False`: the pairs in token order
  (`order = arange`).

`odd` names a look-alike (`TOKEN_MAJOR_ODD`, `SORTED_ODD`)."""

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
