"""Tensor parallelism under backend="k3" (2 gloo processes on CPU): the attention output's
all-reduce is fused with the post-attention mix + norm (`k3.allreduce_attn_res_mix_norm`, whose
CPU implementation does the all-reduce), and the compiled TP=2 model equals the eager one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests import gloo

# two processes compile the whole tiny model; the default run's TP2 compile: stages/test_prefetch
pytestmark = pytest.mark.slow

TP = 2



def _worker(rank: int, out_dir: str):
    import k3compile.backend as k3be
    from k3compile.models import build_model, get_config
    from tests.conftest import rel_err

    cfg = get_config("tiny").with_tp(TP)
    kw = dict(dtype=torch.float32, group=dist.group.WORLD, max_batch=4, max_seq_len=32)
    eager, model = build_model(cfg, **kw), build_model(cfg, **kw)
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    errors = []
    for i, T in enumerate((1, 1, 1)):  # one graph: each compile costs ~30 s per rank here
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, cfg.vocab_size, (3, T) if T > 1 else (3,), generator=gen)
        pos, slots = torch.full((3,), 8 * i), torch.tensor([2, 0, 1])
        errors.append(rel_err(step(ids, pos, slots) * 1, eager(ids, pos, slots) * 1))
    counts = {}
    for c in k3be._compiled:
        for report in c.observer.reports.values():
            for hit in report.hits:
                key = hit.pattern.split("[")[0]
                counts[key] = counts.get(key, 0) + 1
    prints = [n.get("ranks") for c in k3be._compiled for n in c.observer.notes.values()]
    torch.save({"errors": errors, "counts": counts, "prints": prints},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_tp2_compiled_equals_eager_with_fused_allreduce(tmp_path):
    from tests.conftest import TOL

    gloo.spawn(_worker, str(tmp_path), world=TP)
    layers = 6  # tiny: every layer's post-attention mix follows the attention all-reduce
    for rank in range(TP):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert max(result["errors"]) <= TOL["aten_cpu"], result["errors"]
        # every post-attention mix, plus layer 1's pre-attention mix: the dense layer-0 MLP's
        # output is an all-reduce too, so its reduction fuses into the next mix
        assert result["counts"].get("allreduce_attn_res_mix_norm", 0) == layers + 1, result["counts"]
    # stage `ranks`: both ranks fingerprinted their graphs and found them equal
    prints = [torch.load(tmp_path / f"rank{rank}.pt")["prints"] for rank in range(TP)]
    assert prints[0] and all(prints[0]) and prints[0] == prints[1], prints
