"""MXFP4 (OCP microscaling FP4) as stored in K3's routed experts: quantising and random packed
weights. The format and its dequantisation are the reference math's (`k3compile.math`).

`weight_packed` uint8 [out, in/2]: two E2M1 nibbles per byte, the low nibble is the even input.
`weight_scale` uint8 [out, in/32]: one E8M0 exponent per 32 inputs. w = e2m1 * 2^(scale - 127).
"""

from __future__ import annotations

import torch

from k3compile.math import GROUP, e2m1_table


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 of w [..., out, in]: the scale puts each group's amax at or under 6."""
    *lead, out, width = w.shape
    if width % GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {GROUP}, got {width}")
    g = w.float().reshape(*lead, out, width // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)
    table = e2m1_table(w.device)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # nearest code
    codes = codes.reshape(*lead, out, width)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8)


def random_mxfp4(
    shape: tuple[int, ...], std: float, generator: torch.Generator | None = None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed weights whose dequantised values have roughly the given std (E2M1 codes are
    drawn uniformly, std ~3.2, so the scale exponent absorbs the rest)."""
    *lead, out, width = shape
    packed = torch.randint(0, 256, (*lead, out, width // 2), generator=generator, device=device,
                           dtype=torch.int32).to(torch.uint8)
    base = round(torch.log2(torch.tensor(std / 3.2)).item())
    jitter = torch.randint(-1, 2, (*lead, out, width // GROUP), generator=generator, device=device)
    scale = (127 + base + jitter).to(torch.uint8)
    return packed, scale
