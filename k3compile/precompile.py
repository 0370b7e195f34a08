"""A warm start that skips Dynamo: the k3 backend's part in torch's caching precompile.

With `TORCH_CACHING_PRECOMPILE=1` (torch's switch, experimental in torch 2.11 and 2.13) Dynamo
saves, per compiled function, its guards and bytecode; a later process that compiles the same
function installs them instead of tracing. Every backend the bytecode calls must leave an
artifact that re-creates its compiled function: `record` stores ours (Dynamo's graph, what the
backend read off it, the options it was given), and `K3Artifact.after_deserialization` rebuilds
the `K3Compiled` from it. Each bucket then compiles at its first call as in any process, from the
stage cache's link where an earlier process left one (k3compile/stage_cache.py), so nothing of
the compile itself is saved here.

    TORCH_CACHING_PRECOMPILE=1 python serve.py       # process 1: compiles, runs, then
        torch.compiler.save_cache_artifacts()        #   writes the packages (Inductor's cache dir)
    TORCH_CACHING_PRECOMPILE=1 python serve.py       # process 2: no Dynamo trace

torch keys a package by the compiled function alone (its qualified name and first line), not by
the backend: a process that compiles one module's `forward` under two backends (k3 and Inductor,
as `k3compile generate` does to compare them) must not use the warm start, or the second
process would install the last-saved backend's code under both.

A graph whose artifact cannot be pickled is logged and left out: torch then skips that function's
package (a warning of its own) and the next process traces it as usual. An artifact of another
format, or one that fails to load, raises `RuntimeError`, on which torch traces afresh.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from typing import Any

import torch
from torch import fx

log = logging.getLogger("k3compile")

FORMAT = 1  # bump when the pickled state changes shape

try:  # torch's precompile context (torch >= 2.9)
    from torch._dynamo.precompile_context import BackendCacheArtifact, PrecompileContext
except ImportError:  # pragma: no cover (no caching precompile in this torch)
    BackendCacheArtifact, PrecompileContext = object, None


def enabled() -> bool:
    """Whether Dynamo saves and loads packages in this process (`TORCH_CACHING_PRECOMPILE=1`)."""
    return PrecompileContext is not None and bool(
        getattr(torch._dynamo.config, "caching_precompile", False))


def record(gm: fx.GraphModule, signature: Any, options: dict | None) -> bool:
    """Leave the artifact Dynamo's package needs for `gm` (it names the backend call by
    `gm._backend_id`). False, with the reason logged, where there is nothing to record."""
    backend_id = getattr(gm, "_backend_id", None)
    if not enabled() or backend_id is None:
        return False
    from k3compile.stage_cache import module_stacks

    try:
        state = {"format": FORMAT, "gm": _graph_bytes(gm), "stacks": module_stacks(gm.graph),
                 "sources": {n.name: n._dynamo_source
                             for n in gm.graph.find_nodes(op="placeholder")
                             if hasattr(n, "_dynamo_source")},
                 "signature": signature, "options": options, "names": _names_used()}
        content = pickle.dumps(state)
        _load(content)  # what cannot load in the next process is not saved
    except Exception as e:  # noqa: BLE001 (a graph or option pickle cannot hold)
        log.warning("k3 precompile: graph %s is not saved for a warm start (%s: %s); the next "
                    "process traces it", backend_id, type(e).__name__, e)
        return False
    PrecompileContext.record_artifact(K3Artifact(key=backend_id, content=content))
    _check_sources_on_load()
    log.info("k3 precompile: graph %s recorded (%d KB)", backend_id, len(content) // 1024)
    return True


def _check_sources_on_load() -> None:
    """Have torch check the source of the code that writes and reads our artifact when it loads
    the package, as it checks the model's: changed, the package is refused before anything is
    installed and the step traced afresh. (A failure inside `after_deserialization` comes too
    late for that: torch 2.11 and 2.13 then fail on "CompilePackage is already initialized".)"""
    from k3compile import backend

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        package = InstructionTranslator.current_tx().output.package
        if package is not None:
            package.add_inlined_source([
                record.__code__, _load.__code__, K3Artifact.after_deserialization.__code__,
                backend.restored.__code__, backend.K3Compiled.__init__.__code__])
    except Exception as e:  # noqa: BLE001 (a private API; without it only FORMAT guards)
        log.debug("k3 precompile: sources not added to the package's checks: %s", e)


class K3Artifact(BackendCacheArtifact):
    """One k3-compiled Dynamo graph, as Dynamo's package stores it."""

    def after_deserialization(self):
        from k3compile.backend import restored

        try:
            gm, state = _load(self.content)
        except Exception as e:
            raise RuntimeError(
                f"k3 precompile: artifact {self.key} does not load ({type(e).__name__}: {e}); "
                f"remove {_packages()} (Dynamo's saved packages) and start again") from e
        _names_past(state["names"])
        RESTORED.append(self.key)
        log.info("k3 precompile: graph %s restored without a Dynamo trace", self.key)
        return restored(gm, state["signature"], state["options"])


RESTORED: list[str] = []  # the graphs this process restored, by backend id


def _names_used() -> int:
    """A bound on the numbers Dynamo's `unique_id` had handed out when this graph was recorded."""
    from torch._dynamo import bytecode_transformation as bt

    return next(bt._unique_id_counter) + 1000


def _names_past(bound: int) -> None:
    """Move this process's `unique_id` counter past `bound`. The package installs globals under
    the first process's names (`__builtins_dict___0`); a call its guards reject makes Dynamo trace
    afresh, and in a new process its counter hands out the same names again: torch 2.11 and 2.13
    then fail on an assertion ("Name '__builtins_dict___0' already exists in scope") where a
    plain process would recompile."""
    import itertools

    from torch._dynamo import bytecode_transformation as bt

    bt._unique_id_counter = itertools.count(max(bound, next(bt._unique_id_counter)))


def _packages() -> str:
    try:
        from torch._dynamo.package import DynamoCache

        return DynamoCache.path_prefix()
    except Exception:  # noqa: BLE001
        return "the dynamo/ folder of Inductor's cache"


def _graph_bytes(gm: fx.GraphModule) -> bytes:
    """Dynamo's graph node by node (torch's GraphPickler): a GraphModule's own pickle re-traces
    its code, which fails on Dynamo's in-place writes (`state[slots] = x`). Node meta is left
    out (fake tensors of this process); the state keeps the module stacks, which the stage
    cache's link key and the reports read."""
    from torch.fx._graph_pickler import GraphPickler, Options

    with _slices_as_pytrees():
        return GraphPickler.dumps(gm, Options(ops_filter=None,
                                              node_metadata_key_filter=lambda _: False))


@contextlib.contextmanager
def _slices_as_pytrees():
    """A slice whose bound is a node (`x[:, :n]`) reaches the pickler as a raw node unless pytree
    walks into slices: torch 2.13's GraphPickler registers them itself, 2.11's does not."""
    from torch.utils import _pytree as pytree

    if slice in pytree.SUPPORTED_NODES:
        yield
        return
    pytree._private_register_pytree_node(
        slice, lambda x: ([x.start, x.stop, x.step], None), lambda x, _: slice(*x))
    try:
        yield
    finally:
        pytree._deregister_pytree_node(slice)


def _load(content: bytes) -> tuple[fx.GraphModule, dict]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    from k3compile.stage_cache import set_module_stacks

    state = pickle.loads(content)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise RuntimeError(f"another format (want {FORMAT})")
    with _slices_as_pytrees():
        gm = GraphPickler.loads(state["gm"], FakeTensorMode())
    gm.recompile()
    set_module_stacks(gm.graph, state["stacks"])
    for n in gm.graph.find_nodes(op="placeholder"):  # AOTAutograd reads them off Dynamo's graph
        if n.name in state["sources"]:
            n._dynamo_source = state["sources"][n.name]
    return gm, state


def save() -> int:
    """Write this process's packages (`torch.compiler.save_cache_artifacts()`); how many k3
    graphs they hold (0 where caching precompile is off)."""
    if not enabled():
        return 0
    count = sum(isinstance(a, K3Artifact)
                for a in PrecompileContext._backend_artifacts_by_key.values())
    torch.compiler.save_cache_artifacts()
    return count


__all__ = ["FORMAT", "RESTORED", "K3Artifact", "enabled", "record", "save"]
