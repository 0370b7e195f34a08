"""Foreign spellings of K3's routed experts, written as other K3 code writes them (not as
`k3compile/math.py` does): MXFP4 dequantisation by LUT gathers of other layouts, by bit
arithmetic on the nibble, with scales as `2 ** (s - 127)`, `torch.ldexp` or a 256-entry E8M0
table; experts as an `nn.ModuleList` of per-expert modules selected by `stack(...)[ids]`; the
per-token expert GEMMs as `bmm` / `matmul`. Used by tests/canonical/test_mxfp4_dequant.py and
test_expert_stack.py."""

from __future__ import annotations

import torch
from torch import nn

from k3compile.math import E2M1_VALUES, GROUP


def _e2m1_lut(device=None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def _e8m0_lut(device=None) -> torch.Tensor:
    return torch.exp2(torch.arange(256, dtype=torch.float32, device=device) - 127.0)


def _groups(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (x.shape[-1] // GROUP, GROUP))


# --- dequant spellings: (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32], dtype) ----

def dequant_lut_stack(packed, scale, dtype, lut):
    """A 16-entry fp32 table indexed by `packed >> 4` / `packed & 15`, stacked on a new last axis
    and reshaped; scales `2.0 ** (s - 127)` repeated per element; cast at the end."""
    lo = lut[(packed & 15).long()]
    hi = lut[(packed >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], -1)
    scales = 2.0 ** (scale.float() - 127)
    return (vals * scales.repeat_interleave(GROUP, dim=-1)).to(dtype)


def dequant_codes_first(packed, scale, dtype, lut):
    """Nibble codes interleaved first (slice assignment into a code tensor), one table gather,
    exp2 of an int16 scale, repeat_interleave (the style of K3 reference dequantisers)."""
    codes = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.long,
                        device=packed.device)
    codes[..., 0::2] = (packed & 0x0F).long()
    codes[..., 1::2] = (packed >> 4).long()
    vals = lut[codes]
    factor = torch.exp2(scale.to(torch.int16).float() - 127.0)
    return (vals * factor.repeat_interleave(GROUP, dim=-1)).to(dtype)


def _e2m1_bits(nibble: torch.Tensor) -> torch.Tensor:
    """E2M1 by its bits: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0)."""
    sign = (nibble >> 3) & 1
    exp = (nibble >> 1) & 3
    mant = (nibble & 1).float()
    normal = (1.0 + 0.5 * mant) * torch.exp2(exp.float() - 1.0)
    mag = torch.where(exp == 0, 0.5 * mant, normal)
    return torch.where(sign == 1, -mag, mag)


def dequant_bits_ldexp(packed, scale, dtype, lut=None):
    """Bit arithmetic on each nibble, interleaved through a `view(..., 2)` of a pair tensor,
    `torch.ldexp` by the scale's exponent per group of 32."""
    pair = torch.stack([_e2m1_bits(packed & 0xF), _e2m1_bits(packed >> 4)], dim=-1)
    vals = pair.view(*packed.shape[:-1], packed.shape[-1] * 2)
    out = torch.ldexp(_groups(vals), (scale.int() - 127).unsqueeze(-1))
    return out.flatten(-2).to(dtype)


def dequant_e8m0_table(packed, scale, dtype, lut):
    """The E2M1 table in the output dtype and a 256-entry E8M0 table for the scales."""
    lut = lut.to(dtype)
    vals = torch.stack((lut[(packed & 15).long()], lut[(packed >> 4).long()]), -1).flatten(-2)
    factor = _e8m0_lut(packed.device)[scale.long()].to(dtype)
    return (_groups(vals) * factor[..., None]).flatten(-2)


DEQUANTS = {
    "lut_stack": dequant_lut_stack,
    "codes_first": dequant_codes_first,
    "bits_ldexp": dequant_bits_ldexp,
    "e8m0_table": dequant_e8m0_table,
}


# --- experts as a ModuleList ------------------------------------------------------------------

class MXFP4Proj(nn.Module):
    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight_packed = nn.Parameter(
            torch.zeros(out_features, in_features // 2, dtype=torch.uint8), requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.zeros(out_features, in_features // GROUP, dtype=torch.uint8), requires_grad=False)


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = MXFP4Proj(inter, hidden)
        self.up_proj = MXFP4Proj(inter, hidden)
        self.down_proj = MXFP4Proj(hidden, inter)


class ListExperts(nn.Module):
    """transformers-style routed experts: `experts.{e}.gate_proj.weight_packed`, ...; the routed
    ones selected by stacking the list and indexing it with the top-k ids, LUT dequant, then
    per-token `bmm` (or `matmul`, W·x or x·Wᵀ) GEMMs, SiTU, and the fp32 weighted sum."""

    def __init__(self, num_experts: int, hidden: int, inter: int, beta: float = 4.0,
                 linear_beta: float = 25.0, gemm: str = "bmm", dequant: str = "lut_stack"):
        super().__init__()
        self.experts = nn.ModuleList(Expert(hidden, inter) for _ in range(num_experts))
        self.register_buffer("fp4_values", _e2m1_lut(), persistent=False)
        self.beta, self.linear_beta, self.gemm = beta, linear_beta, gemm
        self.dequant = DEQUANTS[dequant]

    def _weights(self, proj: str, ids: torch.Tensor, dtype) -> torch.Tensor:
        packed = torch.stack([getattr(e, proj).weight_packed for e in self.experts])[ids]
        scale = torch.stack([getattr(e, proj).weight_scale for e in self.experts])[ids]
        return self.dequant(packed, scale, dtype, self.fp4_values)  # [N, k, out, in]

    def _apply(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[N, k, out, in] x [N, k, in] -> [N, k, out]"""
        n, k, out, width = w.shape
        if self.gemm == "bmm":
            y = torch.bmm(w.reshape(n * k, out, width), x.reshape(n * k, width, 1))
            return y.view(n, k, out)
        if self.gemm == "x_first":  # x·Wᵀ
            return torch.matmul(x.unsqueeze(-2), w.transpose(-1, -2)).squeeze(-2)
        return torch.matmul(w, x.unsqueeze(-1)).squeeze(-1)

    def forward(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        zk = z.unsqueeze(1).expand(n, k, z.shape[-1])
        gate = self._apply(self._weights("gate_proj", ids, z.dtype), zk)
        up = self._apply(self._weights("up_proj", ids, z.dtype), zk)
        g, u = gate.float(), up.float()
        act = (self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
               * (self.linear_beta * torch.tanh(u / self.linear_beta))).to(z.dtype)
        y = self._apply(self._weights("down_proj", ids, z.dtype), act)
        return (weights.unsqueeze(-1) * y.float()).sum(1).to(z.dtype)
