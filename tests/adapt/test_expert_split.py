"""The release's checkpoint at TP 2: each rank loads its half of every routed expert's
intermediate (`moonshot.from_pretrained(path, group=)`: w1/w3 rows, w2 columns, packed bytes and
E8M0 scales alike) and `adapt(model, group=)` sums the ranks' expert outputs; the rest of the
model is replicated. Two gloo processes on CPU (`tests/gloo.spawn`); a
tiny `KimiK3ForConditionalGeneration` checkpoint (fp32, 3 layers, MXFP4 experts) in the
release's layout (tests/adapt/test_kimi_k3.py).

TP 2 against TP 1: the eager adapted step and the compiled decode (experts fused into
`k3.moe_experts` on each rank's half) give the TP 1 logits and tokens; a rank holds half the
expert bytes. Refused: a split model adapted without its group, an intermediate that does not
split in whole groups of 32.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests import gloo
from tests.conftest import TOL

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
from tests.adapt import test_kimi_k3
from tests.adapt.test_kimi_k3 import k3_model
from tests.adapt.test_mxfp4_load import expert_linears

k3_checkpoint = test_kimi_k3.k3_checkpoint  # the fixture, shared


def _expert_bytes(model) -> int:
    return sum(t.numel() for m in expert_linears(model) for t in (m.weight_packed, m.weight_scale))


def _worker(rank: int, path: str, out_dir: str):
    import k3compile.backend as k3be
    from k3compile.adapt import adapt, moonshot
    from tests.adapt.test_moonshot import compile_step, step_greedy

    kw = {"max_batch": 4, "max_seq_len": 32}
    full = moonshot.from_pretrained(path, dtype=torch.float32)
    part = moonshot.from_pretrained(path, dtype=torch.float32, group=dist.group.WORLD)
    result = {"tp1": step_greedy(adapt(full, **kw)),
              "bytes": (_expert_bytes(part), _expert_bytes(full))}
    step = adapt(part, group=dist.group.WORLD, **kw)
    result["eager"] = step_greedy(step)
    step.reset_cache()
    result["compiled"] = step_greedy(step, decode=compile_step(step))
    (report,) = k3be.last_compiled().contracts.values()
    result["moe_experts"] = [lr.actual["moe_experts"] for lr in report.layers]
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_tp2_expert_split_gives_the_tp1_logits(k3_checkpoint, tmp_path, capsys):
    path, _ = k3_checkpoint(torch.float32, layers=3)
    gloo.spawn(_worker, str(path), str(tmp_path), world=2)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        for kind in ("eager", "compiled"):
            errs = [((g - w).abs().max() / w.abs().max()).item()
                    for g, w in zip(r[kind], r["tp1"], strict=True)]
            with capsys.disabled():
                print(f"\nrank {rank} {kind}: max rel err vs TP 1 {max(errs):.1e}")
            # TP 2 regroups each expert's down-projection sum: fp32 rounding
            assert max(errs) <= TOL["tp_fp32"], (rank, kind, errs)
            assert [t.argmax(-1).tolist() for t in r[kind]] == \
                [t.argmax(-1).tolist() for t in r["tp1"]], (rank, kind)
        assert r["bytes"][0] * 2 == r["bytes"][1]
        assert r["moe_experts"] == [0, 1, 1, 0]


def test_split_experts_need_their_group(moonshot, k3_checkpoint):
    from k3compile.adapt import adapt, compressed

    model = compressed.shard_experts(k3_model(moonshot, layers=2), rank=1, world=2)
    expert = model.language_model.model.layers[1].block_sparse_moe.experts[0]
    assert expert.w1.weight.shape == (64, 128) and expert.w2.weight.shape == (128, 64)  # dense
    with pytest.raises(ValueError, match="holds expert part 1 of 2, adapted as rank 0 of 1"):
        adapt(model)
    with pytest.raises(ValueError, match="of 128 does not split over 3 ranks"):
        compressed.shard_experts(k3_model(moonshot, layers=2), rank=0, world=3)
    packed = moonshot.from_pretrained(k3_checkpoint()[0])
    with pytest.raises(ValueError, match="over 8 ranks in whole groups of 32"):
        compressed.shard_experts(packed, rank=0, world=8)  # 16 columns: half a scale group
