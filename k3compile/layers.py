"""K3 layers found in a graph by what they compute, not by what their modules are called.

A user's K3 names its modules as it likes (Moonshot's MoE is `block_sparse_moe`, a GPT-style
stack is `transformer.h`), so the fusion contract and `k3compile diff` read only two things off a
node: its layer, the first `<container>.<int>` of its module path (`model.layers.3`,
`transformer.h.3`, `blocks.3`; an `experts.5` inside a layer is part of that layer), and what the
layer's nodes compute. The kind is read in the unfused ATen form and in the fused k3 ops that
replace it, so one reading holds before, during and after stage `fuse`:

* KDA: the layer reads and writes a recurrent fp32 state of rank 4 ([slots, H, K, V]), or holds
  k3.kda_decode / k3.fb_kda_decode;
* MLA: a softmax whose reduced dim is the token dim of a cache the layer reads (attention over
  the latent cache), or a k3.mla_* op;
* MoE: a top-k (or sort) routing in the layer, or a k3.moe_* op; the MLP is dense otherwise.

A layer without KDA or MLA attention is no K3 layer. A state is a graph input the graph writes:
functionalisation ends the graph with `copy_(input, new value)`, a fused op declares it mutable.
The model's own final depth mix + norm (after the layers, outside them) is `FINAL`.

A functional model (one module, its weights in a tree or dict read by pure functions: a JAX/Flax
port, tests/models/spell9_k3.py) has no module per layer, so no node's module path names one.
In such a graph (and only there: module paths win wherever any node has a layer)
`attribute` reads the layer off the graph's inputs instead, whose names carry the same
`<container>.<int>` (`params.layers.3.attn.wq.kernel`): a node belongs to the **earliest layer
whose inputs it, or any node computed from it, reads** (an input read through what is computed
from that layer's inputs alone, `w.t()` or `w_norm * w_proj`, is read too). A layer's own computation (from its
first weight read on) is then its; what prepares a layer's input before its first weight read
(the residual add, the AttnRes mix's source stack and norm) is the layer it feeds, as in a
model with a module per layer; shared preparation (positions) goes to the first layer using it;
what feeds no layer (the final mix and norm, lm_head) stays outside. The one op where this and a
module per layer disagree: a layer's last op that reads no weight (MoE's `routed + shared`) lands
in the layer it feeds (FINAL after the last one). Its module path becomes the module of the
layer's input it reads (`params.layers.3.attn.wq`), else the layer's (`params.layers.3`), as the
node's `nn_module_stack` entry `ATTRIBUTED`, which every stage's new nodes inherit as usual.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterable

import torch
from torch import fx

from k3compile.rewrite import near_miss
from k3compile.rewrite.near_miss import NearMiss, module_path, op_name

FINAL = -1  # the pseudo-layer of the model's final mix + norm (and what else lies outside)
OTHER = "other"  # the template of a layer that is no K3 layer

# the first `<container>.<int>` (or `<container>[<int>]`) of a module path
_LAYER = re.compile(r"(?:^|\.)[A-Za-z_]\w*(?:\.|\[['\"]?)(\d+)(?=['\"]?\]|\.|$)")

# fused ops that show a layer's kind (the ATen form they replaced is gone)
KDA_OPS = frozenset({"kda_decode", "fb_kda_decode"})
_SOFTMAX = frozenset({"_softmax", "_safe_softmax", "softmax", "_log_softmax", "logsumexp", "amax"})
_ROUTING = frozenset({"topk", "sort", "argsort"})
# functional writes of a state (their first argument); a read is any other use
_WRITES = frozenset({"index_put", "index_put_", "copy_", "scatter", "slice_scatter",
                     "select_scatter", "index_copy"})


def layer_index(path: str) -> int | None:
    """`model.layers.3.mlp.experts.5` -> 3; None outside every layer."""
    m = _LAYER.search(path)
    return int(m.group(1)) if m else None


def below_layer(path: str) -> str | None:
    """`model.layers.3.mlp.experts.5` -> `mlp.experts.5` ("": the layer's own code); None
    outside every layer."""
    m = _LAYER.search(path)
    return path[m.end():].lstrip("'\"].") if m else None


ATTRIBUTED = "k3_layer"  # the nn_module_stack entry `attribute` writes (a module path, a label)
_SOURCE_PART = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]|\.(\w+)")


def input_path(name: str, source: str | None = None) -> str:
    """A Dynamo graph input's dotted path below the compiled module or argument
    (`params.layers.3.attn.wq.kernel`): from its source where given
    (`L['self']._modules['params']...`; `L['params']['layers.3.wq']` -> `layers.3.wq`;
    `L['args'][0]` -> `0`, no layer), else from its placeholder name
    (`l_self_modules_params_modules_layers_modules_3_..._parameters_kernel_`)."""
    if source:
        parts = [a or b for a, b in _SOURCE_PART.findall(source)][1:]  # below the root
        return ".".join(p for p in parts if p not in ("_modules", "_parameters", "_buffers"))
    return re.sub(r"_(modules|parameters|buffers)_", ".",
                  re.sub(r"^l_self_(modules_)?|^l_", "", name).rstrip("_"))


def dynamo_input_paths(gm: fx.GraphModule) -> list[str]:
    """`input_path` of each placeholder of Dynamo's graph, in order (the ATen graph's inputs)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            source = getattr(n.meta.get("grapharg"), "source", None)
            name = getattr(source, "name", None)
            out.append(input_path(n.name, name() if callable(name) else name))
    return out


def attribute(graph: fx.Graph, paths: list[str]) -> int:
    """Where no node's module path names a layer: each node's layer read off the inputs it and
    what is computed from it read (module docstring), written as its module stack's entry
    `ATTRIBUTED`; `paths`: the dotted path of each placeholder, in order. Returns the number of
    nodes placed (0: module paths name layers, or no input's path does)."""
    calls = [n for n in graph.nodes if n.op == "call_function"]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(paths) or any(layer_index(module_path(n)) is not None
                                              for n in calls):
        return 0
    # a layer's inputs and what is computed from them alone (`w.t()`, `cat([wq, wk])`,
    # `w_norm * w_proj`): node -> (layer, the module of the input); layer -> the layer's path
    owner, layer_path = {}, {}
    for node, path in zip(placeholders, paths):
        if (m := _LAYER.search(path)) is not None:
            index = int(m.group(1))
            owner[node] = index, path.rpartition(".")[0]
            layer_path.setdefault(index, path[:m.end()].lstrip("."))
    if not owner:
        return 0
    for n in calls:
        read = [owner[a] for a in n.all_input_nodes if a in owner]
        if read and all(a in owner or a.op == "call_function" and not a.all_input_nodes
                        for a in n.all_input_nodes):
            owner[n] = min(read)
    rank: dict[fx.Node, int] = {}
    for n in reversed(calls):
        reads = [owner[a][0] for a in [n, *n.all_input_nodes] if a in owner]
        fed = [rank[u] for u in n.users if u in rank]
        if reads or fed:
            rank[n] = min(reads + fed)
    for n, index in rank.items():
        module = next((owner[a][1] for a in [n, *n.all_input_nodes]
                       if a in owner and owner[a][0] == index), layer_path[index])
        n.meta["nn_module_stack"] = {**(n.meta.get("nn_module_stack") or {}),
                                     ATTRIBUTED: (module, "read off the weights")}
    return len(rank)


def nodes_by_layer(graph: fx.Graph) -> dict[int | None, list[fx.Node]]:
    """The graph's call_function nodes by layer (None: outside every layer), in graph order."""
    out: dict[int | None, list[fx.Node]] = collections.defaultdict(list)
    for n in graph.nodes:
        if n.op == "call_function":
            out[layer_index(module_path(n))].append(n)
    return out


@dataclasses.dataclass(frozen=True)
class Layer:
    index: int
    attention: str | None  # "kda", "mla", or None: no K3 attention found
    moe: bool
    # kind ("kda", "mla", "moe") -> the node that showed it: the state write, the softmax over
    # the cache, the routing top-k, or the fused op
    evidence: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Layers:
    """What `find_layers` read off a graph: node names only, so it outlives the graph's edits."""

    layers: dict[int, Layer]
    final: bool  # the model's own final mix + norm follows the layers

    @property
    def found(self) -> bool:
        return any(lr.attention for lr in self.layers.values())

    def templates(self) -> dict[int, str]:
        """layer -> the contract's template (`FINAL`: "final" where the model's final mix +
        norm follows the layers); a layer without K3 attention is `OTHER`."""
        k3 = [i for i, lr in self.layers.items() if lr.attention]
        out = {i: _template(lr, k3, self.final) for i, lr in sorted(self.layers.items())}
        if self.final and k3:
            out[FINAL] = "final"
        return out


def _template(lr: Layer, k3: list[int], final: bool) -> str:
    if lr.attention == "kda":
        return "kda_moe" if lr.moe else "dense"
    if lr.attention == "mla" and lr.moe:
        # K3's last layer is MLA; a model cut to its first layers may end on a KDA layer
        return "last" if final and lr.index == max(k3) and lr.index != min(k3) else "mla_moe"
    return "mla_dense" if lr.attention == "mla" else OTHER


def find_layers(graph: fx.Graph) -> Layers:
    by_layer = nodes_by_layer(graph)
    states = state_inputs(graph)
    layers = {i: classify(i, nodes, states) for i, nodes in by_layer.items() if i is not None}
    k3 = [by_layer[i] for i, lr in layers.items() if lr.attention]
    return Layers(layers, bool(k3) and _has_final(by_layer.get(None, []), k3))


def state_inputs(graph: fx.Graph) -> list[fx.Node]:
    """The graph inputs some node writes (a mutable argument of its schema), in input order."""
    written = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None:
            continue
        for arg, value in zip(schema.arguments, n.args):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.update(v for v in _leaves(value) if v.op == "placeholder")
    return [n for n in graph.nodes if n in written]


def classify(index: int, nodes: list[fx.Node], states: list[fx.Node]) -> Layer:
    """One layer's kinds, read off its nodes (`states`: the graph's written inputs)."""
    evidence = {}
    for kind, n in _fused_evidence(nodes):
        evidence.setdefault(kind, n.name)
    touched = [s for s in states if any(s in n.all_input_nodes for n in nodes)]
    if "mla" not in evidence and (sm := _attention_over(nodes, touched)) is not None:
        evidence["mla"] = sm.name
    if not evidence.keys() & {"kda", "mla"} and (w := _recurrent_write(nodes, touched)) is not None:
        evidence["kda"] = w.name
    if "moe" not in evidence and (r := next((n for n in nodes if op_name(n) in _ROUTING), None)):
        evidence["moe"] = r.name
    attention = "kda" if "kda" in evidence else "mla" if "mla" in evidence else None
    return Layer(index, attention, "moe" in evidence, evidence)


def _fused_evidence(nodes: list[fx.Node]) -> Iterable[tuple[str, fx.Node]]:
    for n in nodes:
        if not str(n.target).startswith("k3."):
            continue
        name = op_name(n)
        if name in KDA_OPS:
            yield "kda", n
        elif name.startswith("mla_"):
            yield "mla", n
        elif name.startswith("moe_"):
            yield "moe", n


def _recurrent_write(nodes: list[fx.Node], touched: list[fx.Node]) -> fx.Node | None:
    """The layer's write of a recurrent fp32 state [slots, H, K, V] (its first read if the write
    lies elsewhere), or None."""
    recurrent = {s for s in touched if _is_recurrent(_val(s))}
    users = [n for n in nodes if not recurrent.isdisjoint(n.all_input_nodes)]
    writes = [n for n in users if op_name(n) in _WRITES and n.args and n.args[0] in recurrent]
    return (writes or users or [None])[0]


def _is_recurrent(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() == 4 and val.dtype == torch.float32


def _attention_over(nodes: list[fx.Node], touched: list[fx.Node]) -> fx.Node | None:
    """A softmax of the layer over a cache's token dim: its input computed (in this layer) from
    the cache, its reduced dim at least the cache's token count (L, or L + T where the new
    tokens' keys are concatenated to the cached ones). The token count of [slots, ..., C] is its
    largest middle dim; the depth mix's softmax over its few sources never reaches it."""
    inside = set(nodes)
    for cache in touched:
        val = _val(cache)
        if not isinstance(val, torch.Tensor) or val.dim() < 3:
            continue
        tokens = max(val.shape[1:-1])
        downstream = _downstream(cache, inside)
        for n in nodes:
            if n in downstream and any(r >= tokens for r in _softmax_sizes(n)):
                return n
    return None


def _downstream(source: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    seen, todo = set(), [source]
    while todo:
        for u in todo.pop().users:
            if u in inside and u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _softmax_sizes(n: fx.Node) -> list[int]:
    """The sizes of the dims a softmax-like reduction reduces (amax, softmax, a sum of exp,
    SDPA's key length); [] for any other node."""
    name = op_name(n)
    if "scaled_dot_product" in name and len(n.args) > 1:
        key = _val(n.args[1])
        return [key.shape[-2]] if isinstance(key, torch.Tensor) and key.dim() >= 2 else []
    exp_sum = name == "sum" and n.args and isinstance(n.args[0], fx.Node) \
        and op_name(n.args[0]) == "exp"
    if name not in _SOFTMAX and not exp_sum:
        return []
    x = _val(n.args[0]) if n.args else None
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return []
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", list(range(x.dim())))
    dims = [dims] if isinstance(dims, int) else list(dims) or list(range(x.dim()))
    return [x.shape[d] for d in dims if isinstance(d, int)]


def _has_final(outside: list[fx.Node], layers: list[list[fx.Node]]) -> bool:
    """A norm outside the layers, after their first nodes: the model's final mix + norm (the
    embedding comes before every layer; a bare stack of layers has nothing after them)."""
    order = {n: i for i, n in enumerate(outside[0].graph.nodes)} if outside else {}
    start = max(order.get(nodes[0], -1) for nodes in layers) if order else 0
    return any(order[n] > start and _is_norm(n) for n in outside)


def _is_norm(n: fx.Node) -> bool:
    name = op_name(n)
    return name == "rsqrt" or (str(n.target).startswith("k3.") and "norm" in name)


# ---- big fusions the structure calls for ---------------------------------------------------------

# kind -> its big fusions, each a group of ops any one of which is the fusion: the first is
# matched on the unfused graph, the others build on it (fb_kda_decode: kda_decode with f_b's
# GEMM in its prologue)
BIG_FUSIONS: dict[str, tuple[tuple[str, ...], ...]] = {
    "kda": (("kda_decode", "fb_kda_decode"),),
    "mla": (("mla_decode",),),
    "moe": (("moe_route", "moe_front_route"), ("moe_experts",)),
}
# kind -> what its evidence node is, and whether the big fusion's anchor lies upstream of it
SHOWN = {"kda": ("the KDA state write", False), "mla": ("the MLA softmax over the cache", True),
         "moe": ("the MoE routing", False)}


@dataclasses.dataclass(frozen=True)
class Probe:
    layer: int
    ops: tuple[str, ...]  # the fusion (any one of them)
    miss: NearMiss  # why it would not happen, tried before stage fuse


def probe_fusions(graph: fx.Graph, layers: Layers, patterns, enabled, bucket,
                  wanted: Callable[[int, tuple[str, ...]], bool] = lambda i, ops: True
                  ) -> list[Probe]:
    """Before stage `fuse`: for every big fusion a layer's structure calls for (and `wanted`),
    why its patterns would not take the site (`near_miss.probe` at the evidence node;
    `patterns`: every pattern)."""
    by_name = {n.name: n for n in graph.nodes}
    by_layer = nodes_by_layer(graph)
    out = []
    for i, lr in layers.layers.items():
        for kind, name in lr.evidence.items():
            node = by_name[name]
            if str(node.target).startswith("k3."):
                continue  # fused already (a graph compiled twice)
            for ops in BIG_FUSIONS[kind]:
                family = [p for p in patterns if p.op.split(".")[-1] == ops[0]]
                if family and wanted(i, ops):
                    miss = near_miss.probe(node, by_layer[i], family, enabled, bucket,
                                           *SHOWN[kind])
                    out.append(Probe(i, ops, miss))
    return out


def unexplained(probes: list[Probe], graph: fx.Graph, misses: list[NearMiss],
                deferred: dict[str, str]) -> list[NearMiss]:
    """After stage `fuse`: the probes of fusions that did not happen in their layer and of
    which the engine recorded no near miss there (`misses`); a deferred op (no kernel on this
    device) says so."""
    fused = {i: {op_name(n) for n in nodes} for i, nodes in nodes_by_layer(graph).items()}
    seen = {(layer_index(m.module), m.pattern.split("[")[0].split(" ")[0]) for m in misses}
    out = []
    for p in probes:
        if fused.get(p.layer, set()) & set(p.ops) or any((p.layer, op) in seen for op in p.ops):
            continue
        why = next((f"left unfused on this device: {deferred[op]}" for op in p.ops
                    if op in deferred), None)
        out.append(p.miss if why is None else dataclasses.replace(
            p.miss, reason=f"{why}; {p.miss.reason}", kind=f"{why}; {p.miss.kind}"))
    return out


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _leaves(value) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for x in value for v in _leaves(x)]
    return []


__all__ = ["ATTRIBUTED", "BIG_FUSIONS", "FINAL", "KDA_OPS", "OTHER", "Layer", "Layers", "Probe",
           "attribute", "below_layer", "classify", "dynamo_input_paths", "find_layers",
           "input_path", "layer_index", "nodes_by_layer", "probe_fusions", "state_inputs",
           "unexplained"]
