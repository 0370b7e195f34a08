"""tests/gloo.py itself: a rank that hangs gets every rank's stacks into the error, and a hang is
run once more before it fails."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import gloo


def _hang_once(rank: int, marker: str, always: bool):
    """Rank 1 sleeps past the timeout (the first attempt only unless `always`) while rank 0
    waits for it in a barrier."""
    if rank == 1 and (always or not os.path.exists(marker)):
        open(marker, "w").close()
        time.sleep(60)
    dist.barrier()


def test_a_hang_fails_with_every_ranks_stacks(tmp_path):
    with pytest.raises(mp.ProcessRaisedException) as caught:
        gloo.spawn(_hang_once, str(tmp_path / "m"), True, timeout_s=12, retries=0)
    text = str(caught.value)
    assert "Timed out" in text
    # rank 0's dump shows it waiting in the barrier, rank 1's sleeping in the worker before it
    rank0, rank1 = text.split("-- rank 0 stacks at the timeout --")[1].split(
        "-- rank 1 stacks at the timeout --")
    assert "in barrier" in rank0 and "in _hang_once" in rank0
    assert "in _hang_once" in rank1 and "in barrier" not in rank1


def test_a_hang_is_run_once_more(tmp_path):
    with pytest.warns(UserWarning, match="gloo ranks hung .attempt 1., running again"):
        gloo.spawn(_hang_once, str(tmp_path / "m"), False, timeout_s=12)
    assert (tmp_path / "m").exists()
