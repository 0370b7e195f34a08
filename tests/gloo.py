"""Tests at world size > 1 on CPU: `spawn(worker, *args, world=2)` runs `worker(rank, *args)` in
`world` fresh processes joined in one gloo process group.

A failing rank prints its traceback at once (before the spawn machinery reports it), and a rank
still inside a collective or a compile after `timeout_s - 10` dumps every thread's stack to a file
of its own, which `spawn` puts in the error it raises: a hang says where each rank was instead of
only "Timed out waiting for send" (CI keeps the error, not the ranks' stderr). A rank that failed
does not tear its group down: gloo's teardown could wait on a peer that is itself waiting in a
collective, and the spawn machinery ends the peers anyway.

A hang is run once more (`retries`), with a warning that holds the stacks: stop 43's CI run hung
in test_shard (rank 0 in stage `ranks`' all-gather for 900 s, rank 1's stack lost) where that test
had passed in every local run (six in a row, 18-22 s each); a second hang fails.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# generous: a diffsuite rank compiles several buckets between two collectives, and on a loaded
# 2-core machine one rank's compile ran past 300 s while the other waited (test_shard, session 13)
TIMEOUT_S = 900

# a failed rank's error is written for the parent at once; its exit is then forced after this long
EXIT_GRACE_S = 30


def free_port() -> int:
    """A port free now, for a launcher that must be given one (torchrun's --master-port). Racy:
    another job may take it before the launcher binds it; `spawn` needs no port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, *args, world: int = 2, timeout_s: int = TIMEOUT_S, retries: int = 1) -> None:
    """Run `worker(rank, *args)` on every rank of a `world`-process gloo group; raises the first
    rank's error (the spawn machinery's `ProcessRaisedException`) with every rank's stacks where
    one timed out. A timeout is run again up to `retries` times, warning with the stacks.

    The ranks meet through a `FileStore` in a directory of this call's own, not a TCP port: a
    port picked free and bound later can be taken meanwhile by another job's group, whose ranks
    then join this one's (the suspected cause of session 22's hangs with two gloo jobs on one
    machine)."""
    for attempt in range(retries + 1):
        with tempfile.TemporaryDirectory(prefix="k3gloo-") as tmp:
            store = os.path.join(tmp, "store")
            try:
                mp.spawn(_rank, args=(worker, world, tmp, store, timeout_s, args), nprocs=world,
                         join=True)
                return
            except mp.ProcessRaisedException as e:
                if "Timed out" not in str(e):
                    raise
                stacks = _stacks(tmp, world)
                if attempt == retries:
                    raise mp.ProcessRaisedException(f"{e}\n{stacks}", e.error_index,
                                                    e.error_pid) from e
                warnings.warn(f"gloo ranks hung (attempt {attempt + 1}), running again:\n"
                              f"{stacks}", stacklevel=2)


def _stacks(tmp: str, world: int) -> str:
    """Every rank's stack dump (`faulthandler`, written before gloo's timeout), each cut to its
    first 6000 characters (a thread's innermost frames come first)."""
    parts = []
    for rank in range(world):
        path = os.path.join(tmp, f"stacks{rank}.txt")
        text = Path(path).read_text() if os.path.exists(path) else ""
        parts.append(f"-- rank {rank} stacks at the timeout --\n{text[:6000] or '(none written)'}")
    return "\n".join(parts)


def _rank(rank: int, worker, world: int, tmp: str, store: str, timeout_s: int,
          args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    stacks = open(os.path.join(tmp, f"stacks{rank}.txt"), "w")  # noqa: SIM115 (open until exit)
    faulthandler.dump_traceback_later(timeout_s - 10, exit=False, file=stacks)  # before gloo's
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))  # a hang fails
    try:
        worker(rank, *args)
    except BaseException:
        print(f"rank {rank} of {world} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        _exit_soon(EXIT_GRACE_S)
        raise
    else:
        # every rank done before any tears down: a rank that tore gloo down while another still
        # had a collective in flight aborted once ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _exit_soon(seconds: float) -> None:
    """End this process `seconds` from now whatever it is doing then. A failed rank raises into
    the spawn machinery, which writes the error for the parent and exits; but interpreter shutdown
    can block (a non-daemon thread, a process group's teardown waiting on a peer still inside a
    collective), and then the parent, which reports the first rank to exit, waits for the peer's
    collective timeout (900 s) and reports the peer's "Timed out waiting for send" instead of this
    rank's error: one reading of the test_shard timeout in session 15's CI, whose log was cut."""
    timer = threading.Timer(seconds, os._exit, (1,))
    timer.daemon = True
    timer.start()
