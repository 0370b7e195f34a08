"""Helpers of the attention pattern tests: the model's own attention modules (tiny config) compiled
under backend="k3" with a chosen set of patterns, stepped against eager; a graph whose
intermediate escapes."""

from __future__ import annotations

import copy

import pytest
import torch
from k3compile.patterns import ORDER
from torch import nn

import k3compile.backend as k3be
from k3compile.models import get_config
from k3compile.models.k3 import GatedMLA, KimiDeltaAttention

CFG = get_config("tiny")
SLOTS, MAX_LEN = 9, 32  # state rows (the last one scratch) and cache length


class Attention(nn.Module):
    """One attention block of the model as a decode step: (x [B, T, D], positions, slots)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.attn = attn

    def forward(self, x, positions, slots):
        if isinstance(self.attn, GatedMLA):
            return self.attn(x, slots, positions)
        return self.attn(x, slots)


def attention(kind: str, dtype: torch.dtype, seed: int = 0) -> Attention:
    """A seeded KDA (layer 1) or Gated MLA (layer 3) block of the tiny model, state allocated."""
    gen = torch.Generator().manual_seed(seed)
    attn = GatedMLA(CFG, 3) if kind == "mla" else KimiDeltaAttention(CFG, 1)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            scale = 0.5 if "conv" in name or p.dim() == 1 else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
    attn = attn.to(dtype).requires_grad_(False)
    if kind == "mla":
        attn.setup_cache(SLOTS, MAX_LEN, "cpu", dtype)
    else:
        attn.dt_bias.data, attn.A_log.data = attn.dt_bias.data.float(), attn.A_log.data.float()
        attn.setup_cache(SLOTS, "cpu", dtype)
    return Attention(attn)


def family(name: str) -> list:
    """The registry's (traced once per process) variants of one pattern module."""
    from k3compile.patterns import all_patterns

    return [p for p in all_patterns() if p.name.split("[")[0] == name]


def compile_with(module: nn.Module, *enabled: str):
    """module under backend="k3" (CPU: executor aten) with only the named pattern families on."""
    disabled = [name for name in ORDER if name not in enabled]
    return torch.compile(module, backend="k3", fullgraph=True,
                         options={"executor": "aten", "disabled_patterns": disabled})


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Thousands of tiny ops: intra-op threads only add barrier waits on 2 shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def states(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in module.named_buffers()}


def step_pair(kind: str, dtype: torch.dtype, batch: int, tokens: int, steps: int, *enabled: str):
    """Run `steps` decode steps of eager and compiled copies of one block; returns
    (outputs eager, outputs compiled, states eager, states compiled, the compiled report)."""
    torch._dynamo.reset()
    eager = attention(kind, dtype)
    model = copy.deepcopy(eager)
    compiled = compile_with(model, *enabled)
    gen = torch.Generator().manual_seed(1)
    want, got = [], []
    slots = torch.arange(batch) * 2  # not 0..B-1: the ops must follow `slots`
    for step in range(steps):
        x = torch.randn(batch, tokens, CFG.hidden_size, generator=gen).to(dtype)
        pos = torch.full((batch,), step * tokens) + torch.arange(batch)
        want.append(eager(x, pos, slots))
        got.append(compiled(x, pos, slots))
    report = next(iter(k3be.last_compiled().observer.reports.values()))
    return want, got, states(eager), states(model), report


def escape(gm: torch.fx.GraphModule, pick) -> torch.fx.GraphModule:
    """gm with one more output: the first call_function node for which pick(node) holds (an
    intermediate that now escapes any pattern around it)."""
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and pick(n))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    out.args = ((*outs, node),)
    gm.recompile()
    return gm
