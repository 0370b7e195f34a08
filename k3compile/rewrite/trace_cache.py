"""Traced pattern graphs on disk, so a second process matches without tracing again (issue 22).

Each process traced every pattern variant its graphs could match (make_fx through the
decompositions; Inductor's joint passes for the einsum patterns): 165 traces for the tiny
model; all 213 variants took 14.2 s to trace, 1.8 s to load (session 11, 2 shared CPU cores).
A trace depends only on code and inputs' metadata, so `Pattern.expr` traces through
`cached(trace_fn, name)`: a valid entry is loaded, else the trace runs and is stored. The
matcher's pattern (`fx_to_pattern`) is still made from the graph in each process, by torch's own
`gen_pattern_and_search_gm`.

Key (the entry's file name is its sha256): the pattern's name; its search function's module and
qualified name and what it closes over (a variant's flags and sizes; a closed-over object with
no stable description means no entry); the trace route; the flat example inputs (dtype, shape,
stride, device of each tensor; the value of each scalar); the source of the `k3compile` package
and of every module in the search function's folder (`patterns/`: search functions call
`k3compile.math`, other patterns and k3 ops' fake kernels); Inductor's and functorch's config
hashes (the decomposition table and the joint passes read them); torch's version and commit.

Entry: `<K3_CACHE_DIR>/patterns/<name>/<sha256>.json`, JSON of the format, the full key text, the
graph and the graph's sha256. The graph is data, not code: per node its op, name, target and
arguments; targets are ATen/custom op overloads (by qualified name) or `operator.getitem`, values
are numbers, strings, None, dtypes, devices, layouts, memory formats, nested lists/tuples and
other nodes. A trace holding anything else is not stored (it is traced again in each process).
Written to a temporary file and renamed (a reader sees a whole entry or none; processes tracing
one pattern at once, TP ranks, each write a whole entry: no lock, a trace costs well under a
second). An entry that is
unreadable, of another format or key, fails its checksum or names an op this torch lacks is
logged, removed and traced again, never used. Node metadata (`meta["val"]`) is not kept, only
each tensor node's traced shape (`inductor.TRACED_SHAPE`, format 2): the matcher compares a
site's reshapes with the pattern's by them (`inductor.disagreement`); the near-miss probes read
only the graph's structure.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import operator
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from k3compile.files import BadEntry, read_entry, write_entry
from k3compile.rewrite import inductor
from k3compile.settings import KERNELS

try:  # no Python code generated until the module is called (the matcher reads only the graph)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # pragma: no cover (a torch without it)
    _GraphModule = fx.GraphModule

FORMAT = 2  # 2: the graph's tensor shapes beside it (session 37)
PACKAGE = Path(__file__).resolve().parent.parent  # k3compile/

log = logging.getLogger("k3compile.rewrite")

STATS: Counter[str] = Counter()  # loaded, traced, stored, rebuilt (bad entries), unstored


class Unstorable(Exception):
    """A traced graph holding a value or target the entry format does not describe."""


def root() -> Path | None:
    """The folder of traced patterns (K3_CACHE_DIR/patterns), or None where the cache is off."""
    return Path(KERNELS.cache_dir) / "patterns" if KERNELS.cache_dir else None


def cached(trace_fn: Callable[..., fx.GraphModule], name: str) -> Callable[..., fx.GraphModule]:
    """`trace_fn` (fwd_only, fwd_only_fake, fwd_only_joint) for pattern `name`, through the
    disk cache: the signature torch's `gen_pattern_and_search_gm` calls it with."""

    def trace(fn, args, **kwargs):
        folder = root()
        text = key_text(name, fn, trace_fn, args, kwargs) if folder is not None else None
        if text is None:
            return trace_fn(fn, args, **kwargs)
        path = folder / _safe(name) / f"{hashlib.sha256(text.encode()).hexdigest()}.json"
        if path.exists():
            try:
                gm = load(path, text)
                STATS["loaded"] += 1
                return gm
            except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is traced again
                log.warning("k3 pattern %s: trace cache entry %s unusable (%s: %s); tracing "
                            "again", name, path, type(e).__name__, e)
                STATS["rebuilt"] += 1
                path.unlink(missing_ok=True)
        gm = trace_fn(fn, args, **kwargs)
        STATS["traced"] += 1
        store(path, text, gm, name)
        return gm

    return trace


# ---- key ---------------------------------------------------------------------------------------

def key_text(name: str, fn, trace_fn, args, kwargs) -> str | None:
    """Everything a trace depends on, as one JSON text; None where part of it has no stable
    description (an input that is neither a tensor nor a plain scalar, a closed-over object, a
    function without source): then the pattern is traced in each process."""
    try:
        inputs = [_describe_input(a) for a in args]
        folders: set[str] = set()
        function = _describe_fn(fn, folders)
        source = sources(tuple(sorted(folders)))
        configs = [inductor.inductor_config.get_hash().hex(),
                   torch._functorch.config.get_hash().hex()]
    except (Unstorable, AttributeError, OSError):
        return None
    decomp = kwargs.get("get_decomp_fn")
    return json.dumps({
        "format": FORMAT, "pattern": name,
        "fn": function,
        "route": getattr(trace_fn, "__name__", repr(trace_fn)),
        "decomp": getattr(decomp, "__qualname__", None) if decomp is not None else None,
        "inputs": inputs, "source": source,
        "configs": configs,
        "torch": [torch.__version__, torch.version.git_version]}, sort_keys=True)


def _describe_input(a) -> Any:
    if isinstance(a, torch.Tensor):
        return ["tensor", str(a.dtype), list(a.shape), list(a.stride()), str(a.device),
                a.requires_grad]
    if isinstance(a, (bool, int, float, str)) or a is None:
        return [type(a).__name__, repr(a)]
    raise Unstorable(f"input of type {type(a).__name__}")


def _describe_fn(fn, folders: set[str], depth: int = 3) -> list:
    """fn's module and name and, recursively, what it closes over (a variant factory's flags and
    sizes, the function `with_signature` wrapped); adds the folder of each function's source
    file to `folders` (the search function lives in patterns/, its wrapper not). Unstorable
    where a closed-over value has no stable description."""
    if isinstance(fn, functools.partial) or not hasattr(fn, "__code__"):
        raise Unstorable(f"search function of type {type(fn).__name__}")
    folders.add(str(Path(fn.__code__.co_filename).resolve().parent))
    out = [f"{fn.__module__}.{fn.__qualname__}"]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(v, "__code__") and depth:
            out.append([name, _describe_fn(v, folders, depth - 1)])
        elif _plain(v):
            out.append([name, repr(v)])
        else:
            raise Unstorable(f"closed-over {name} of type {type(v).__name__}")
    return out


def _plain(v) -> bool:
    """A value whose repr describes it in every process: a scalar, a string, a dtype, or a
    tuple / list of those (a variant's extra op arguments, e.g. `(True,)`)."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype)):
        return True
    return isinstance(v, (tuple, list)) and all(_plain(x) for x in v)


@functools.cache
def sources(folders: tuple[str, ...]) -> str:
    """One digest of the `k3compile` package's Python sources and those of `folders` (the search
    function's own, e.g. patterns/)."""
    h = hashlib.sha256()
    files = sorted(PACKAGE.rglob("*.py")) + [f for d in folders for f in sorted(Path(d).glob("*.py"))]
    for f in files:
        h.update(str(f.relative_to(f.parent.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def package_digest() -> str:
    """The digest of the `k3compile` package's Python sources (ops, stages, rewrites)."""
    return sources(())


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


# ---- entries -----------------------------------------------------------------------------------

def store(path: Path, text: str, gm: fx.GraphModule, name: str) -> bool:
    """Write gm's entry (False: a graph the format does not describe, or an unwritable folder)."""
    try:
        graph = encode_graph(gm.graph)
        shapes = {n.name: list(s) for n in gm.graph.nodes
                  if (s := inductor.traced_shape(n)) is not None}
        body = json.dumps({"graph": graph, "shapes": shapes})  # kwargs in order: matched
        write_entry(path, FORMAT, text, body, field="graph")
    except (Unstorable, OSError) as e:
        log.debug("k3 pattern %s: trace not cached (%s: %s)", name, type(e).__name__, e)
        STATS["unstored"] += 1
        return False
    STATS["stored"] += 1
    return True


def load(path: Path, text: str) -> fx.GraphModule:
    """The traced graph of a whole, checked entry for this key text; BadEntry otherwise."""
    body = json.loads(read_entry(path, FORMAT, text, field="graph"))
    graph = decode_graph(body["graph"])
    shapes = body["shapes"]
    for n in graph.nodes:
        if n.name in shapes:
            n.meta[inductor.TRACED_SHAPE] = tuple(int(s) for s in shapes[n.name])
    return _GraphModule(torch.nn.Module(), graph)


# ---- the graph as data -------------------------------------------------------------------------

_ENUMS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


def encode_graph(graph: fx.Graph, attrs: bool = False) -> list:
    """The graph as data; `attrs`: get_attr nodes too, by name (the caller keeps their values:
    the stage cache's constants), else they make it Unstorable."""
    return [[n.op, n.name, _encode_target(n, attrs), _encode(n.args), _encode(n.kwargs)]
            for n in graph.nodes]


def _encode_target(n: fx.Node, attrs: bool = False) -> Any:
    if n.op in ("placeholder", "output"):
        return n.target
    if n.op == "get_attr" and attrs and isinstance(n.target, str):
        return ["attr", n.target]
    if n.op != "call_function":
        raise Unstorable(f"a {n.op} node")
    if n.target is operator.getitem:
        return ["getitem"]
    if isinstance(n.target, torch._ops.OpOverload):
        return ["op", n.target._schema.name, n.target._overloadname]
    raise Unstorable(f"target {n.target!r}")


def _encode(v: Any) -> Any:
    if isinstance(v, fx.Node):
        return {"node": v.name}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return {"float": repr(v)}  # inf and nan too, exactly
    if isinstance(v, (list, tuple)):  # fx's immutable_list too
        return {"list" if isinstance(v, list) else "tuple": [_encode(x) for x in v]}
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"dict": {k: _encode(x) for k, x in v.items()}}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    for kind, cls in _ENUMS.items():
        if isinstance(v, cls):
            return {kind: str(v).removeprefix("torch.")}
    raise Unstorable(f"value of type {type(v).__name__}")


def decode_graph(nodes: list) -> fx.Graph:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs in nodes:
        args, kwargs = _decode(args, env), _decode(kwargs, env)
        if op == "call_function":
            target = _decode_target(target)
        elif op == "get_attr" and isinstance(target, list) and target[:1] == ["attr"]:
            target = target[1]
        elif op not in ("placeholder", "output"):
            raise BadEntry(f"node op {op!r}")
        node = graph.create_node(op, target, tuple(args), kwargs, name=name)
        if node.name != name:
            raise BadEntry(f"duplicate node name {name!r}")
        env[name] = node
    graph.lint()
    return graph


def _decode_target(target: Any) -> Callable:
    if target == ["getitem"]:
        return operator.getitem
    if not (isinstance(target, list) and len(target) == 3 and target[0] == "op"):
        raise BadEntry(f"target {target!r}")
    namespace, _, op = target[1].partition("::")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), target[2] or "default")
    except (AttributeError, RuntimeError) as e:
        raise BadEntry(f"no op {target[1]}.{target[2]} in this torch ({e})") from None


def _decode(v: Any, env: dict[str, fx.Node]) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if not isinstance(v, dict) or len(v) != 1:
        raise BadEntry(f"value {v!r}")
    (kind, x), = v.items()
    if kind == "node":
        if x not in env:
            raise BadEntry(f"node {x!r} used before it is defined")
        return env[x]
    if kind == "float":
        return float(x)
    if kind in ("list", "tuple"):
        out = [_decode(y, env) for y in x]
        return out if kind == "list" else tuple(out)
    if kind == "dict":
        return {k: _decode(y, env) for k, y in x.items()}
    if kind == "device":
        return torch.device(x)
    if kind in _ENUMS:
        value = getattr(torch, x, None)
        if not isinstance(value, _ENUMS[kind]):
            raise BadEntry(f"{kind} {x!r}")
        return value
    raise BadEntry(f"value kind {kind!r}")


encode_value, decode_value = _encode, _decode  # node metadata as data (k3compile/stage_cache.py)


def stats() -> dict[str, int]:
    return dict(STATS)

