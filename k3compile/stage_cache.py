"""Each bucket's stage output on disk, so a second process compiling the same model skips the
stages it would repeat (issue 22, the warm start).

    aten graph -> key -> hit:  the stored graph + report + notes, then the replayed stages
                      -> miss: every stage; the graph before the replayed stages is stored

A compile's cost in a warm process was mostly our stages (canonicalize and fuse: matching 230
traced patterns against the graph) and torch's lowering (Dynamo, AOTAutograd), which this cache
does not touch (docs/decisions.md, session 12). The stages are a pure function of the ATen graph
the pipeline receives, the options, the process's kernel settings and the sources, except where
they read real values: the small constant tables `canonical/mxfp4_dequant` reads off graph
inputs (recorded in `gm.meta["inputs_read"]`, stored by their digest and compared on load), and
the stages that act on the process: `ranks` (a collective), `contract` (warns or raises),
`conv_layout` and `pack` (move the real weights) and `stack_inputs` (reads where they lie).
Those are never cached: they run after every load on the loaded graph (`REPLAYED`), so a hit moves the same weights a miss would. With `verify` on the
stages run the graph on the real weights: no entry is read or written.

Key (the entry's file name is its sha256): the ATen graph as data (`trace_cache.encode_graph`:
ops by qualified name, arguments, node names), each placeholder's dtype, shape, stride and device
(the parameters' metadata, never their values), each node's module path, the bucket, the user
inputs' positions, the options and kernel settings (`settings.fingerprint`), the stages that run,
the package digest (k3compile, patterns, kernels), the process's rank and world size (stage
shard cuts each rank's rows), torch's version, Inductor's and functorch's config hashes and, on
CUDA, the GPU and the ops with a kernel there. A graph the format does not describe (a constant attribute, a
symbolic size) is compiled in each process, never cached.

Entry: `<K3_CACHE_DIR>/stages/<sha256>.json`: format, the full key text, the graph before the
replayed stages (as data, with each node's module path), the digests of the inputs the stages
read, the stages' own node metadata (`meta["k3_*"]`), each skipped stage's record (op
histograms, graph text) and, pickled, the rewrite report and the stages' notes (our dataclasses
of names and numbers; a note holding graph nodes is kept as its text); a sha256 over all of it. Written
through `files.write_atomic`. An entry that is unreadable, of another format or key, fails its
checksum, names an op this torch lacks, or was made from other table values is logged, removed
and rebuilt by running the stages, never used. Node values (`meta["val"]`) are computed again
from the loaded graph's inputs (`graph.fake_value`), as every stage does for the nodes it adds.

Beside a link (`stages/links/<sha256>.json`, keyed by Dynamo's graph: `store_link`),
`stages/kernel_lists/<sha256>.json` keeps the kernels the bucket's first run asked for
(`store_kernels`): a later process skips the record run only where every one is on disk.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import hashlib
import importlib.util
import json
import logging
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from k3compile import read_guard
from k3compile.files import BadEntry, read_entry, write_entry
from k3compile.graph import fake_value
from k3compile.rewrite import inductor, trace_cache
from k3compile.settings import KERNELS, fingerprint

FORMAT = 1
REPLAYED = ("ranks", "contract", "conv_layout", "pack", "stack_inputs")  # they act on the process: run on every compile

log = logging.getLogger("k3compile")

# loaded, stored, rebuilt (bad entries), unstored, missed; linked (a link stored), direct (a
# compile that skipped AOTAutograd)
STATS: Counter[str] = Counter()


@dataclasses.dataclass
class Entry:
    """What a hit hands the pipeline: the graph before the replayed stages and what the skipped
    stages reported."""

    gm: fx.GraphModule
    records: list  # the skipped stages' StageRecords (seconds 0: nothing ran)
    report: Any  # the RewriteReport
    notes: dict[str, Any]
    reads: frozenset[int] = frozenset()  # the inputs whose values the stages read


def root() -> Path | None:
    """The folder of stage outputs (K3_CACHE_DIR/stages), or None where the cache is off."""
    return Path(KERNELS.cache_dir) / "stages" if KERNELS.cache_dir else None


def split(stages: list[tuple[str, Any]]) -> tuple[list, list]:
    """(the stages an entry stands for, the stages every compile runs), in order: the cached
    ones are those before the first replayed stage."""
    first = next((i for i, (name, _) in enumerate(stages) if name in REPLAYED), len(stages))
    return stages[:first], stages[first:]


# ---- key ---------------------------------------------------------------------------------------

def key_text(gm: fx.GraphModule, ctx, stage_names: list[str]) -> str | None:
    """Everything the cached stages' output depends on but the read table values, as one JSON
    text; None where part of it has no stable description."""
    if ctx.options.verify:
        return None  # the stages run the graph on the real weights
    try:
        graph = trace_cache.encode_graph(gm.graph, attrs=True)
        inputs = [_describe_value(n.meta.get("val")) for n in gm.graph.nodes
                  if n.op == "placeholder"]
        constants = {n.target: _describe_constant(getattr(gm, n.target))
                     for n in gm.graph.nodes if n.op == "get_attr"}
    except (trace_cache.Unstorable, AttributeError):
        return None
    return json.dumps({"format": FORMAT, "graph": graph, "inputs": inputs,
                       "constants": constants, "stacks": module_stacks(gm.graph, keys=False),
                       **_context(ctx, stage_names, inputs)}, sort_keys=True)


MAX_CONSTANT = 4096  # elements of a tensor constant the key holds by value


def _describe_constant(v) -> list:
    """A tensor constant of the graph (`torch.tensor([...])` in the model's code, which
    AOTAutograd makes an attribute) by value: the key tells other values apart, and a link's
    graph is rebuilt with it (`_constants`). Large or non-tensor attributes: Unstorable."""
    if not isinstance(v, torch.Tensor) or isinstance(v, torch.nn.Parameter) or \
            v.numel() > MAX_CONSTANT or v.is_quantized or v.layout != torch.strided:
        raise trace_cache.Unstorable("an attribute that is not a small tensor constant")
    with inductor.unset_fake_temporarily():
        values = v.detach().cpu().reshape(-1).tolist()
    return [str(v.dtype), list(v.shape), str(v.device), values]


def _constants(described: dict[str, list]) -> dict[str, torch.Tensor]:
    """The tensors `_describe_constant` described (real, not fake, as AOTAutograd keeps them)."""
    out = {}
    with inductor.unset_fake_temporarily():
        for name, (dtype, shape, device, values) in described.items():
            dtype = getattr(torch, dtype.removeprefix("torch."))
            out[name] = torch.tensor(values, dtype=dtype).reshape(shape).to(device)
    return out


def dynamo_key_text(gm: fx.GraphModule, inputs: list, ctx, stage_names: list[str]) -> str | None:
    """The key of a link entry: Dynamo's graph (its code, each node's module path), the real
    inputs' metadata (with requires_grad and which inputs share storage: AOTAutograd's views and
    aliases depend on them), grad and autocast modes, and what `key_text` holds beside its
    graph. None where the graph holds an attribute (a value the code does not show) or an input
    has no stable description."""
    if ctx.options.verify or any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    try:
        described = [_describe_value(x) for x in inputs]
    except trace_cache.Unstorable:
        return None
    storages: dict[tuple, int] = {}
    shared = [[storages.setdefault((x.untyped_storage().data_ptr(), str(x.device)), i),
               x.storage_offset(),
               x.requires_grad] if isinstance(x, torch.Tensor) else None
              for i, x in enumerate(inputs)]
    return json.dumps({"format": FORMAT, "dynamo": gm.code, "inputs": described,
                       "shared": shared, "stacks": module_stacks(gm.graph, keys=False),
                       "modes": [torch.is_grad_enabled(), torch._C._is_any_autocast_enabled()],
                       **_context(ctx, stage_names, described)}, sort_keys=True)


def _context(ctx, stage_names: list[str], inputs: list) -> dict:
    return {"batch": ctx.batch, "user_inputs": sorted(ctx.user_inputs),
            "options": fingerprint(ctx.options), "stages": stage_names,
            "source": _sources(), "device": _device(inputs), "rank": _rank(),
            "configs": [inductor.inductor_config.get_hash().hex(),
                        torch._functorch.config.get_hash().hex()],
            "torch": [torch.__version__, torch.version.git_version]}


def _sources() -> str:
    """The digest of the package's sources: k3compile/ and the folders the patterns and the
    kernels live in (beside it in a source tree)."""
    folders = []
    for name in ("k3compile.patterns", "k3compile.kernels"):
        spec = importlib.util.find_spec(name)
        for where in (spec.submodule_search_locations or []) if spec else []:
            top = Path(where).resolve()
            folders += [str(top), *(str(d) for d in top.rglob("*")
                                    if d.is_dir() and d.name != "__pycache__")]
    return trace_cache.sources(tuple(sorted(folders)))


def _describe_value(v) -> list:
    if isinstance(v, torch.Tensor):
        if not all(isinstance(d, int) for d in (*v.shape, *v.stride())):
            raise trace_cache.Unstorable("a symbolic size")
        return ["tensor", str(v.dtype), list(v.shape), list(v.stride()), str(v.device)]
    if isinstance(v, (bool, int, float)) or v is None:
        return [type(v).__name__, repr(v)]
    raise trace_cache.Unstorable(f"an input of type {type(v).__name__}")


describe = _describe_value  # an input's metadata as the keys hold it


def module_stacks(graph: fx.Graph, keys: bool = True) -> dict[str, list[list[str]]]:
    """Each node's module stack as [key, path, type name] (the reports name layers by it); the
    keys (Dynamo's, holding a module's id) only where `keys`: the cache key leaves them out."""
    return {n.name: [[str(k), str(path), getattr(t, "__qualname__", str(t))][0 if keys else 1:]
                     for k, (path, t) in n.meta["nn_module_stack"].items()]
            for n in graph.nodes if n.meta.get("nn_module_stack")}


def set_module_stacks(graph: fx.Graph, stacks: dict[str, list]) -> None:
    """`module_stacks(graph)`'s stacks back on the nodes of those names (the type as its name)."""
    for n in graph.nodes:
        if n.name in stacks:
            n.meta["nn_module_stack"] = {s[0]: tuple(s[-2:]) for s in stacks[n.name]}


def _rank() -> list[int] | None:
    """This process's rank and world size (stage shard cuts each rank's own rows)."""
    dist = torch.distributed
    return [dist.get_rank(), dist.get_world_size()] if dist.is_available() and \
        dist.is_initialized() else None


def _device(inputs: list) -> list:
    """On CUDA, the GPU and the ops with a kernel there (stage fuse defers the others)."""
    if not any(d[0] == "tensor" and d[4].startswith("cuda") for d in inputs):
        return []
    from k3compile.kernels import cuda_ops

    return [torch.cuda.get_device_name(), list(torch.cuda.get_device_capability()),
            sorted(cuda_ops())]


# ---- entries -----------------------------------------------------------------------------------

def path_of(text: str, kind: str = "") -> Path | None:
    """The entry's file for this key text (`kind` "links": a link entry's, in a folder of their
    own)."""
    folder = root()
    if folder is None:
        return None
    return (folder / kind if kind else folder) / f"{hashlib.sha256(text.encode()).hexdigest()}.json"


def lookup(path: Path, text: str, gm: fx.GraphModule, inputs: list) -> Entry | None:
    """The entry at `path` for this key and these inputs' table values, or None (a bad entry is
    logged and removed: the stages run and store it again)."""
    if not path.exists():
        STATS["missed"] += 1
        return None
    try:
        entry = load(path, text, gm, inputs)
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the stages run again
        log.warning("k3 stage cache: entry %s unusable (%s: %s); running the stages", path,
                    type(e).__name__, e)
        STATS["rebuilt"] += 1
        _remove(path)
        return None
    STATS["loaded"] += 1
    return entry


def store(path: Path, text: str, gm: fx.GraphModule, inputs: list, records: list, report,
          notes: dict) -> bool:
    """Write the entry for the graph the cached stages made (False: not describable)."""
    try:
        body = json.dumps({
            "graph": trace_cache.encode_graph(gm.graph, attrs=True),
            "stacks": module_stacks(gm.graph),
            "meta": _k3_meta(gm.graph), "reads": _reads(gm, inputs),
            "records": [[r.name, dict(r.ops_before), dict(r.ops_after), r.graph_after]
                        for r in records],
            # the rewrites hold graph nodes, for stage verify only (never run with the cache)
            "state": base64.b64encode(pickle.dumps(
                (dataclasses.replace(report, rewrites=[]), _plain_notes(notes)))).decode()})
        write_entry(path, FORMAT, text, body)
    except Exception as e:  # noqa: BLE001 - an entry not written costs a compile, never a failure
        log.debug("k3 stage cache: bucket not cached (%s: %s)", type(e).__name__, e)
        STATS["unstored"] += 1
        return False
    STATS["stored"] += 1
    return True


def _plain_notes(notes: dict) -> dict:
    """The notes as stored: each as it is where it pickles (names and numbers: the layers, the
    rules' counts), else as its text (the streams' and prefetches' lists hold graph nodes; no
    reader takes them after their stage)."""
    out = {}
    for name, note in notes.items():
        try:
            pickle.dumps(note)
            out[name] = note
        except Exception:  # noqa: BLE001 - fx nodes, ops: not data
            out[name] = repr(note)
    return out


def _k3_meta(graph: fx.Graph) -> dict[str, dict]:
    """The stages' own node metadata (`meta["k3_*"]`: streams, prefetches, shards), as data."""
    return {n.name: {k: trace_cache.encode_value(v) for k, v in n.meta.items()
                     if k.startswith("k3_")}
            for n in graph.nodes if any(k.startswith("k3_") for k in n.meta)}


def load(path: Path, text: str, gm: fx.GraphModule, inputs: list) -> Entry:
    """The entry's graph on `gm`'s placeholders' values, its records and state; BadEntry where
    it must not be used."""
    body = read_entry(path, FORMAT, text)
    body = json.loads(body)
    if (changed := [i for i, digest in body["reads"].items()
                    if _digest(inputs[int(i)]) != digest]):
        raise BadEntry(f"the tables the stages read differ (inputs {changed})")
    graph = trace_cache.decode_graph(body["graph"])
    _annotate(graph, [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"],
              body["stacks"], body["meta"], _attributes(gm, graph))
    # no metadata of gm's (the cold compile's holds the stages' notes to themselves): the
    # GraphModule a later process hands Inductor is then the cold one's, to its FX graph cache
    out = fx.GraphModule(gm, graph)
    from k3compile.observe import StageRecord  # observe imports the pipeline's stages' types

    records = [StageRecord(name, 0.0, Counter(before), Counter(after), text)
               for name, before, after, text in body["records"]]
    report, notes = pickle.loads(base64.b64decode(body["state"]))
    return Entry(out, records, report, notes, frozenset(int(i) for i in body["reads"]))


def reloaded(path: Path, text: str, given: fx.GraphModule, inputs: list,
             gm: fx.GraphModule) -> fx.GraphModule:
    """The graph of the entry just stored, as `lookup` will load it (gm where it cannot be)."""
    try:
        return load(path, text, given, inputs).gm
    except Exception as e:  # noqa: BLE001 - the stages' own graph is as good, only keyed otherwise
        log.debug("k3 stage cache: entry %s not reloaded (%s: %s)", path, type(e).__name__, e)
        return gm


def _annotate(graph: fx.Graph, values: list, stacks: dict[str, list],
              meta: dict[str, dict], constants: dict[str, torch.Tensor]) -> None:
    """Node values from the placeholders' `values` (those of the graph the pipeline received),
    in order, each node's module stack ([key, path, type], or [path, type] as a key holds them)
    and the stages' own metadata."""
    mine = [n for n in graph.nodes if n.op == "placeholder"]
    if len(values) != len(mine):
        raise BadEntry(f"{len(mine)} placeholders for {len(values)} inputs")
    for n, v in zip(mine, values, strict=True):
        n.meta["val"] = v
    fake_mode = None
    for n in graph.nodes:
        if n.op == "call_function":
            n.meta["val"] = fake_value(n.target, n.args, n.kwargs)
        elif n.op == "get_attr":  # a tensor constant, fake in the inputs' mode as AOT has it
            fake_mode = fake_mode or torch._guards.detect_fake_mode(values) or FakeTensorMode()
            n.meta["val"] = fake_mode.from_tensor(constants[n.target])
    set_module_stacks(graph, stacks)
    env = {n.name: n for n in graph.nodes}
    for name, data in meta.items():
        env[name].meta.update({k: trace_cache.decode_value(v, env) for k, v in data.items()})


_INCOMPLETE = "k3_values_missing"  # meta of a graph `aten_graph` decoded: what `complete` needs

# ---- links: Dynamo's graph -> the stage entry, without AOTAutograd ------------------------------

def store_link(path: Path, text: str, aten_text: str, direct: dict | None, why: str | None):
    """Link Dynamo's graph (key `text`) to the stage entry of the ATen graph AOTAutograd made of
    it (whose key text `aten_text` holds that graph); `direct`: how to run the loaded graph
    without AOTAutograd (None: AOTAutograd's wrappers are needed, `why`)."""
    try:
        write_entry(path, FORMAT, text, json.dumps({"aten": aten_text, "direct": direct,
                                                    "why": why}))
    except OSError as e:  # an entry not written costs a compile, never a failure
        log.debug("k3 stage cache: link not stored (%s)", e)
        return
    STATS["linked"] += 1


def link(path: Path, text: str) -> dict | None:
    """The link entry at `path` for this key, or None (a bad one is logged and removed); its
    "aten_key": the stage key's text parsed."""
    if not path.exists():
        return None
    try:
        body = json.loads(read_entry(path, FORMAT, text))
        body["aten_key"] = json.loads(body["aten"])
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, AOTAutograd runs
        log.warning("k3 stage cache: link %s unusable (%s: %s)", path, type(e).__name__, e)
        STATS["rebuilt"] += 1
        _remove(path)
        return None
    return body


def _remove(path: Path) -> None:
    """Remove a bad entry where it can be: a folder in its place or a read-only cache leaves it
    (the next lookup finds it bad again; storing over it fails quietly), never a failed compile."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("k3 stage cache: %s not removed (%s: %s)", path, type(e).__name__, e)


def store_kernels(path: Path, text: str, builds: list) -> None:
    """For the link at `path` (key `text`): the kernels the bucket's first run asked for
    (`launch.Build`s, pickled), so a later process checks they are all on disk before it skips
    the record run (the pipeline's `_kernels_stored`)."""
    try:
        write_entry(_kernels_path(path), FORMAT, text,
                    base64.b64encode(pickle.dumps(list(builds))).decode())
    except Exception as e:  # noqa: BLE001 - a list not kept costs the next process a record run
        log.debug("k3 stage cache: kernel list not stored (%s: %s)", type(e).__name__, e)


def stored_kernels(path: Path, text: str) -> list | None:
    """The kernels `store_kernels` kept for the link at `path`, or None (none kept, or an entry
    that cannot be read: removed where it can be; the record run finds what is needed)."""
    from k3compile.kernels.common.launch import Build

    where = _kernels_path(path)
    try:
        if not where.exists():
            return None
        builds = pickle.loads(base64.b64decode(read_entry(where, FORMAT, text)))
        if not isinstance(builds, list) or not all(isinstance(b, Build) for b in builds):
            raise BadEntry("not a list of kernels")
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the record run runs
        log.debug("k3 stage cache: kernel list %s unusable (%s: %s)", where, type(e).__name__, e)
        _remove(where)
        return None
    return builds


def _kernels_path(link_path: Path) -> Path:
    """The kernel list of the link at `link_path`: its name, in a folder of their own (the
    links' folder holds links only)."""
    return link_path.parent.parent / "kernel_lists" / link_path.name


def aten_graph(aten_text: str, values: list, key: dict | None = None) -> fx.GraphModule:
    """The ATen graph a stage key holds (`key`: the text parsed already), on the placeholders'
    `values` (Dynamo's inputs, as fake tensors): the graph AOTAutograd handed the stages when
    the link was stored. Only the placeholders have values: the other nodes' values and module
    paths are computed by `complete`, where a stage or an analysis needs them. A warm bucket
    whose stage entry loads needs none of them, and fake-running its ~1600 nodes was most of
    such a bucket's compile (0.6 of 0.7 s, one TP16 rank's 4 layers on the CPU)."""
    key = key if key is not None else json.loads(aten_text)
    graph = trace_cache.decode_graph(key["graph"])
    # a non-tensor input's value as the graph had it (AOTAutograd leaves a size's unset)
    values = [v if d[0] == "tensor" else ast.literal_eval(d[1])
              for v, d in zip(values, key["inputs"], strict=True)]
    for n, v in zip([n for n in graph.nodes if n.op == "placeholder"], values, strict=True):
        n.meta["val"] = v
    root = torch.nn.Module()
    for name, t in _constants(key.get("constants", {})).items():
        setattr(root, name, t)  # AOTAutograd's tensor constants, where the graph reads them
    gm = fx.GraphModule(root, graph)
    gm.meta[_INCOMPLETE] = (values, key["stacks"])
    return gm


def _attributes(root: torch.nn.Module, graph: fx.Graph) -> dict[str, torch.Tensor]:
    """The tensor constants `graph`'s get_attr nodes read, from `root`; BadEntry where one is
    missing (an entry whose constants the given graph does not hold)."""
    try:
        return {n.target: getattr(root, n.target) for n in graph.nodes if n.op == "get_attr"}
    except AttributeError as e:
        raise BadEntry(f"a constant the entry reads is missing ({e})") from None


def complete(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with every node's value and module path, where `aten_graph` left them out."""
    if (missing := gm.meta.pop(_INCOMPLETE, None)) is not None:
        _annotate(gm.graph, *missing, {}, _attributes(gm, gm.graph))
    return gm


def _reads(gm: fx.GraphModule, inputs: list) -> dict[str, str]:
    """The digest of each graph input whose real value a stage read (its index -> digest)."""
    return {str(i): _digest(inputs[i]) for i in sorted(gm.meta.get("inputs_read", ()))}


_digest = read_guard.digest


def stats() -> dict[str, int]:
    return dict(STATS)
