"""Tensor parallelism on CPU: a TP=2 model over gloo, its weights cut from a TP=1 model by
`shard_state_dict`, gives the TP=1 logits over several decode steps (verify rows included).

Also checks the functional collectives the model uses (`all_reduce`, and `all_gather_tensor`
with gather_dim=-1 for the vocab-split lm_head) directly on gloo.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from model_checks import TOL, rel_err

from k3compile.models import build_model, get_config
from k3compile.models.loader import shard_state_dict
from tests import gloo

TP = 2
STEPS = [1, 3, 1]  # tokens per request per step



def _check_collectives(rank: int, group) -> list[str]:
    problems = []
    parts = [torch.arange(6.0).view(2, 3) + 10 * r for r in range(TP)]
    gathered = funcol.all_gather_tensor(parts[rank], gather_dim=-1, group=group) * 1
    if not torch.equal(gathered, torch.cat(parts, -1)):
        problems.append(f"all_gather_tensor(gather_dim=-1) gave {gathered.tolist()}")
    reduced = funcol.all_reduce(parts[rank], "sum", group) * 1
    if not torch.equal(reduced, sum(parts)):
        problems.append(f"all_reduce gave {reduced.tolist()}")
    return problems


def _worker(rank: int, out_dir: str):
    group = dist.group.WORLD
    result = {"problems": _check_collectives(rank, group), "errors": []}
    cfg = get_config("tiny")
    full = build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=32)
    part = build_model(cfg.with_tp(TP), dtype=torch.float32, group=group, max_batch=4,
                       max_seq_len=32, seed=123)
    part.load_state_dict(shard_state_dict(full.state_dict(), part.config, rank))
    gen = torch.Generator().manual_seed(7)
    positions, slots = torch.tensor([0, 4, 9]), torch.tensor([1, 3, 0])
    for T in STEPS:
        ids = torch.randint(0, cfg.vocab_size, (3, T), generator=gen)
        ref = full(ids, positions, slots)
        got = part(ids, positions, slots) * 1  # `* 1` waits on an async collective result
        if got.shape != ref.shape:
            result["problems"].append(f"logits shape {tuple(got.shape)} != {tuple(ref.shape)}")
            break
        result["errors"].append(rel_err(got, ref))
        positions = positions + T
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_tp2_matches_tp1_over_decode_steps(tmp_path):
    gloo.spawn(_worker, str(tmp_path), world=TP)
    # both models fp32: the sums only regroup, but rounding compounds through the steps as in
    # the whole-model comparison against float64
    tol = TOL["float32_decode"]
    for rank in range(TP):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert not result["problems"], f"rank {rank}: {result['problems']}"
        assert len(result["errors"]) == len(STEPS)
        assert max(result["errors"]) <= tol, f"rank {rank}: logit errors {result['errors']}"
