"""Tests at world size > 1 on CPU: `spawn(worker, *args, world=2)` runs `worker(rank, *args)` in
`world` fresh processes joined in one gloo process group.

A failing rank prints its traceback at once (before the spawn machinery reports it), and a rank
still inside a collective or a compile after `timeout_s` dumps every thread's stack to stderr, so
a hang on a slow CI machine says where it hung instead of only "Timed out waiting for send". A
rank that failed does not tear its group down: gloo's teardown could wait on a peer that is
itself waiting in a collective, and the spawn machinery ends the peers anyway.
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


def spawn(worker, *args, world: int = 2, timeout_s: int = TIMEOUT_S) -> None:
    """Run `worker(rank, *args)` on every rank of a `world`-process gloo group; raises the first
    rank's error (the spawn machinery's `ProcessRaisedException`).

    The ranks meet through a `FileStore` in a directory of this call's own, not a TCP port: a
    port picked free and bound later can be taken meanwhile by another job's group, whose ranks
    then join this one's (the suspected cause of session 22's hangs with two gloo jobs on one
    machine)."""
    with tempfile.TemporaryDirectory(prefix="k3gloo-") as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_rank, args=(worker, world, store, timeout_s, args), nprocs=world, join=True)


def _rank(rank: int, worker, world: int, store: str, timeout_s: int, args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    faulthandler.dump_traceback_later(timeout_s - 10, exit=False)  # before gloo's own timeout
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
