"""A graph the backend compiles in about two seconds, with one real fusion: an RMSNorm (module
`norm`, K3's order: `k3compile.math.rms_norm`) under tanh, every pattern but `rms_norm` off so
none is traced. The progress and logging tests compile it and compare it with eager."""

from __future__ import annotations

import torch
from k3compile.patterns import ORDER

from k3compile import math as k3math

OPTIONS = {"executor": "aten", "disabled_patterns": [n for n in ORDER if n != "rms_norm"]}


class Norm(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(0.5 + torch.rand(width, generator=gen),
                                         requires_grad=False)

    def forward(self, x):
        return k3math.rms_norm(x, self.weight, 1e-5)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Norm()

    def forward(self, x):
        return self.norm(x).tanh()


def compile_and_check(**options) -> torch.nn.Module:
    """Compile a fresh model (batch 2, one static bucket), run it once and check it equals eager;
    returns the eager model."""
    torch._dynamo.reset()
    model = Model()
    step = torch.compile(model, backend="k3", fullgraph=True, options={**OPTIONS, **options})
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    got, want = step(x), model(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    return model
