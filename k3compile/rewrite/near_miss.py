"""Near misses: sites that resemble a pattern but were not rewritten, each with the node and the
condition that failed. One explanation serves two callers:

* the engine, while it rewrites (`failed`: a match failed at an anchor; a refused check or
  kernel is recorded by the engine as `NearMiss(..., "check refused: ...")`);
* the diff tool, where the fusion contract fell short and the engine recorded nothing
  (`explain`: every pattern of the missing op tried, read only, at the layer's anchors in the
  graph the pipeline received);
* stage `fuse`, where a layer's structure shows a big fusion (`k3compile.layers`: a KDA state,
  an attention over a cache, a routing top-k) that may not happen (`probe`: the fusion's
  patterns tried, read only, at the anchors around that node before any pattern runs; kept
  where the fusion did not happen and the engine recorded nothing, so such a layer always has
  a near miss naming a node and a condition).

A site resembles a pattern when the anchor's inputs hold every distinctive op of the pattern and
85% of its ops. The inputs are cut two ways: while rewriting, at the pattern's node count (tight:
few sites qualify, which keeps the record short); where the contract proves a fusion missing, as
deep as the pattern's search graph reaches, breadth first (the tight cut can wander off into the
producers on a wide graph and miss the very site to explain). Reasons name the node (`view_41 (view bfloat16[2, 256] @ layers.0.mlp)`); a
reason's `kind` leaves out node names and sizes, so that sites failing alike group together.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx

from k3compile.rewrite import inductor

_SIZES = re.compile(r"\[[\d, ]*\]|\b\d+\b")
_depths: dict[int, tuple[Any, int]] = {}  # id(pattern) -> (pattern, depth): patterns are unhashable


@dataclasses.dataclass(frozen=True)
class NearMiss:
    pattern: str
    node: str  # the node the match was tried at
    reason: str  # which node and which condition failed
    module: str = ""  # the model's module path at that node, when known
    kind: str = ""  # the reason without node names and sizes (derived when not given)

    def __post_init__(self):
        if not self.kind:
            object.__setattr__(self, "kind", _SIZES.sub("#", self.reason))


def op_name(node: fx.Node) -> str:
    """`mm`, `getitem`, `attn_res_mix_norm`: the op without namespace or overload."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname
    return getattr(t, "__name__", str(t)).split(".")[0]


def op_label(node: fx.Node) -> str:
    """The observer's op naming (`mul.Tensor`, `k3.rms_norm.default`), Python operators by name."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return str(t).replace("aten.", "").replace(".default", "")
    return getattr(t, "__name__", str(t))


def module_path(node: fx.Node) -> str:
    """The model module a node came from (`language_model.model.layers.1.mlp.gate`), or ""."""
    return stack_path(node.meta.get("nn_module_stack"))


# Dynamo's path of a module reached through an unspecialised parent (a module whose attributes
# the step rebinds, as `torch.func.functional_call` does; spell12): `getattr(net.layers, '0')`
_GETATTR = re.compile(r"getattr\(([^()]*), '([^']*)'\)")


def stack_path(stack: dict | None) -> str:
    """The innermost module path of an `nn_module_stack`, or "" (`getattr(a, 'b')` as `a.b`)."""
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    while (spelled := _GETATTR.sub(r"\1.\2", path)) != path:
        path = spelled
    return path.replace("L['self'].", "").replace("L__self___", "")


def cone(node: fx.Node, max_depth: int) -> dict[fx.Node, int]:
    """The node's inputs, transitively, up to max_depth edges away, with their distance."""
    dist, todo = {node: 0}, collections.deque([node])
    while todo:
        n = todo.popleft()
        if dist[n] >= max_depth:
            continue
        for a in n.all_input_nodes:
            if a not in dist:
                dist[a] = dist[n] + 1
                todo.append(a)
    return dist


def cone_ops(nodes: Iterable[fx.Node]) -> collections.Counter:
    return collections.Counter(op_name(n) for n in nodes if n.op == "call_function")


def depth(pattern) -> int:
    """The longest input-to-output path of the pattern's search graph."""
    if (hit := _depths.get(id(pattern))) is not None and hit[0] is pattern:
        return hit[1]
    pattern.expr  # noqa: B018 (traces the search graph)
    d: dict[fx.Node, int] = {}
    for n in pattern._search_gm.graph.nodes:
        d[n] = 1 + max((d[a] for a in n.all_input_nodes), default=-1)
    _depths[id(pattern)] = (pattern, out := max(d.values(), default=0))
    return out


def reach(pattern) -> int:
    return depth(pattern) + 2


def _covers(pattern, have: collections.Counter) -> bool:
    """The one resemblance test: every distinctive op of the pattern, and 85% of its ops."""
    want = pattern.op_signature
    if any(have[k] < want[k] for k in pattern.distinctive):
        return False
    return sum(min(v, have[k]) for k, v in want.items()) >= 0.85 * sum(want.values())


def resembles(pattern, inputs: dict[fx.Node, int]) -> bool:
    """`inputs`: the anchor's cone as deep as the pattern reaches (`cone(anchor, reach(p))`)."""
    return _covers(pattern, cone_ops(inputs))


def _nearest(node: fx.Node, limit: int) -> list[fx.Node]:
    """The engine's cut: the first `limit` nodes of a depth-first walk up the node's inputs."""
    seen, todo, out = {node}, [node], []
    while todo and len(seen) < limit:
        n = todo.pop()
        out.append(n)
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return out


def failed(pattern, node: fx.Node, failure: Any, module: str = "") -> NearMiss | None:
    """The engine's near miss for a failed match at an anchor, or None where the site does not
    resemble the pattern. While rewriting, the cone is cut at the pattern's size (the site's
    inputs counted too: an op with 16 inputs, the KDA step, would otherwise spend the budget on
    them before reaching its prologue's ops): every variant is tried at every anchor, and the
    wider cone of `explain` would record most of them at most sites."""
    budget = sum(pattern.op_signature.values()) + len(pattern.argnames) + 8
    if not _covers(pattern, cone_ops(_nearest(node, budget))):
        return None
    reason, kind, _ = explain_failure(failure, cone(node, reach(pattern)))
    return NearMiss(pattern.name, node.name, reason, module, kind)


# ---- reasons ------------------------------------------------------------------------------------

def value_type(node: fx.Node) -> str:
    """`bfloat16[2, 256]`, a tuple of them, or "" (from meta["val"])."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                               for v in val if isinstance(v, torch.Tensor)) + ")"
    return ""


def describe(node: fx.Node, module: str = "") -> str:
    """`view_41 (view bfloat16[2, 256] @ language_model.model.layers.0.mlp)`."""
    kind = op_label(node) if node.op == "call_function" else node.op
    parts = [kind, value_type(node), f"@ {module}" if module else ""]
    return f"{node.name} ({' '.join(p for p in parts if p)})"


def _expected(pattern: Any) -> str:
    fns = getattr(pattern, "fns", None)
    if fns:
        return "/".join(str(f) for f in fns)
    return repr(pattern) if len(repr(pattern)) < 60 else type(pattern).__name__


def _mismatch(node: Any, expected: str) -> tuple[str, str]:
    if isinstance(node, fx.Node):
        site = describe(node, module_path(node))
        return (f"function_mismatch: {site} where the pattern expects {expected}",
                f"function_mismatch: a {op_label(node)} where the pattern expects {expected}")
    return (f"function_mismatch: the constant {node!r} where the pattern expects {expected}",
            f"function_mismatch: a constant where the pattern expects {expected}")


def _one_line(reason: str) -> tuple[str, str]:
    if reason.startswith("args_structure"):  # two printed TreeSpecs, many lines
        text = ("args_structure: the arguments are structured unlike the pattern's (another "
                "list length: another variant's site)")
        return text, text
    reason = " ".join(reason.split())
    reason = reason if len(reason) < 200 else reason[:197] + "..."
    return reason, _SIZES.sub("#", reason)


def _no_anchor(node: fx.Node, pattern: Any) -> tuple[str, str]:
    """A multi-output pattern whose first outputs matched, and another output found no node to
    start at: none of `node`'s users (a matched value the output reads) is the op `pattern`
    reads it with. The users are where the site differs."""
    users = [describe(u, module_path(u)) for u in list(node.users)[:3]]
    users += ["..."] if len(node.users) > 3 else []
    expected, site = _expected(pattern), describe(node, module_path(node))
    reason = (f"no anchor found: an output of the pattern reads {site} by {expected}, which "
              f"none of its users is ({', '.join(users) or 'none'})")
    kind = (f"no anchor found: an output of the pattern reads a {op_label(node)} by {expected}, "
            "which none of its users is")
    return reason, kind


def explain_failure(failure: Any, inputs: dict[fx.Node, int]) -> tuple[str, str, int]:
    """Inductor's FailedMatch as (reason, kind) and how deep the match got before it failed
    (`inputs`: the anchor's cone; FailedMatch prints the whole pattern, this names the node)."""
    head = getattr(failure, "format_string", "").split(":")[0].split(" ")[0] or "no match"
    args, kw = getattr(failure, "args", ()), getattr(failure, "kwargs", {}) or {}
    if head == "function_mismatch" and (len(args) == 2 or {"node", "pattern"} <= set(kw)):
        node, pat = args if len(args) == 2 else (kw["node"], kw["pattern"])
        return (*_mismatch(node, _expected(pat)),
                inputs.get(node, 1) if isinstance(node, fx.Node) else 1)
    if (gap := getattr(failure, "k3_gap", None)) is not None:
        return (*_no_anchor(*gap), inputs.get(gap[0], 1))
    if head == "keyword_mismatch" and isinstance(node := kw.get("node"), fx.Node):
        tail = (f"has {kw['key']}={kw['value']!r}, which the pattern's op does not pass "
                f"(default: {kw['default']})")
        return (f"keyword_mismatch: {describe(node, module_path(node))} {tail}",
                f"keyword_mismatch: a {op_label(node)} {tail}", inputs.get(node, 1))
    if head == "literal_mismatch" and isinstance(node := kw.get("node"), fx.Node):
        tail = f"has {kw['key']}={kw['value']!r} where the pattern's op has {kw['want']!r}"
        return (f"literal_mismatch: {describe(node, module_path(node))} {tail}",
                f"literal_mismatch: a {op_label(node)} {tail}", inputs.get(node, 1))
    if head == "multiple_users" and args:
        fns = set(getattr(args[0], "fns", ()))
        at = getattr(failure, "k3_node", None)  # the graph node it failed at, where known
        if isinstance(at, fx.Node) and at in inputs:
            want = getattr(args[0], "users", None)
            users = ", ".join(u.name for u in at.users)
            tail = (f"users ({users}) where the pattern's has {want}" if isinstance(want, int)
                    else f"users ({users})")
            if isinstance(want, int) and len(at.users) > want:
                tail += ": an intermediate the pattern would absorb is also used outside it"
            reason = f"multiple_users: {describe(at, module_path(at))} has {len(at.users)} {tail}"
            return (reason, f"multiple_users: a {op_label(at)} has {len(at.users)} users",
                    inputs[at])
        for n, d in sorted(inputs.items(), key=lambda kv: kv[1]):
            if d and n.op == "call_function" and n.target in fns and len(n.users) > 1:
                users = ", ".join(u.name for u in n.users)
                tail = "users; an intermediate the pattern would absorb is also used outside it"
                site = describe(n, module_path(n))
                reason = f"multiple_users: {site} has {len(n.users)} {tail} ({users})"
                return reason, f"multiple_users: a {op_label(n)} has {len(n.users)} {tail}", d
        text = (f"multiple_users: a {_expected(args[0])} the pattern would absorb is also used "
                "outside it")
        return text, text, 1
    return (*_one_line(str(failure)), 1)


# ---- where a planned fusion is missing ----------------------------------------------------------

def _outcome(p, m, enabled: Callable[[str], bool], bucket: int | None,
             hits: dict[str, str]) -> str:
    """Why a pattern that matches the site did not fire."""
    if not enabled(p.name):
        return "pattern disabled by options (disabled_patterns)"
    if p.buckets and bucket is not None and not p.buckets[0] <= bucket <= p.buckets[1]:
        return f"bucket {bucket} is outside the pattern's buckets {p.buckets}"
    refused = p.check(m) if p.check else None
    if refused:
        return f"check refused: {refused}"
    taken = sorted({hits[n.name] for n in m.nodes if n.name in hits})
    if taken:
        return f"matches the input graph, but {', '.join(taken)} rewrote part of the site first"
    return "matches the input graph but did not fire"


def explain(nodes: Sequence[fx.Node], family: Sequence, enabled: Callable[[str], bool],
            bucket: int | None, hits: dict[str, str]) -> list[NearMiss]:
    """Why none of `family` (the patterns of one missing op) fired at `nodes` (the layer's nodes
    in the graph the pipeline received: read only, the site as the patterns first saw it).
    Every pattern is tried at every anchor; the attempts that got furthest are kept, one record
    per site and failure, variants folded into the first name. `hits`: rewritten anchor node ->
    pattern (a site the family rewrote is no miss; one another pattern took first is named)."""
    tries = []
    names = {p.name for p in family}
    cones: dict[tuple[fx.Node, int], dict[fx.Node, int]] = {}
    for p in family:
        anchors = p.anchors
        for node in nodes:
            if node.target not in anchors:
                continue
            m = inductor.match(p.expr, node)  # names the node a user count failed at
            if m and any(hits.get(n.name) in names for n in m.nodes):
                continue  # the family did fire here
            if m:
                outcome = _outcome(p, m, enabled, bucket, hits)
                tries.append((1000 + len(m.nodes), p.name, node, (outcome, outcome)))
                continue
            key = (node, reach(p))
            inputs = cones.get(key) or cones.setdefault(key, cone(node, key[1]))
            if resembles(p, inputs):
                reason, kind, how_far = explain_failure(m, inputs)
                tries.append((how_far, p.name, node, (reason, kind)))
    best = max((t[0] for t in tries), default=None)
    sites: dict[tuple[fx.Node, tuple[str, str]], list[str]] = collections.defaultdict(list)
    for how_far, name, node, reason in tries:
        if how_far == best:
            sites[(node, reason)].append(name)
    return [NearMiss(found[0] + (f" (+{len(found) - 1} variants)" if len(found) > 1 else ""),
                     node.name, reason, module_path(node), kind)
            for (node, (reason, kind)), found in sites.items()]


# ---- where the structure shows a fusion ----------------------------------------------------------

def probe(evidence: fx.Node, nodes: Sequence[fx.Node], family: Sequence,
          enabled: Callable[[str], bool], bucket: int | None, shown: str,
          upstream: bool = False) -> NearMiss:
    """Why `family` (the patterns of one fusion) would or would not take the site that
    `evidence` shows (`shown`: what it shows, e.g. "the KDA state write"). Every enabled pattern
    is tried at each of its anchors in `nodes` (the layer) within the pattern's reach of
    `evidence`: downstream (the site reads it: the experts after the routing) or, `upstream`,
    among its inputs (the cache write before the softmax over the cache); read only. The
    attempt that got furthest is the reason, which names the node and the condition. Without
    such an anchor, the reason says so at `evidence`."""
    context = f"{shown} {describe(evidence, module_path(evidence))}"
    live = [p for p in family if enabled(p.name)]
    if not live:
        reason = "every pattern of the fusion is disabled by options (disabled_patterns)"
        return NearMiss(family[0].name, evidence.name, f"{reason}; at {context}",
                        module_path(evidence), f"{reason}; at {shown}")
    tries = []
    for p in live:
        depth, anchors = reach(p), p.anchors
        near = cone(evidence, depth) if upstream else _users(evidence, depth)
        for node in (n for n in nodes if n.target in anchors and n in near):
            m = inductor.match(p.expr, node)
            if m:
                outcome = _outcome(p, m, enabled, bucket, {})
                tries.append((1000 + len(m.nodes), p.name, node, outcome, outcome))
            else:
                reason, kind, how_far = explain_failure(m, cone(node, depth))
                tries.append((how_far, p.name, node, reason, kind))
    if not tries:
        ops = sorted({str(a).replace("aten.", "") for p in live for a in p.anchors})
        reason = (f"no {'/'.join(ops)} node of this layer lies within the pattern's reach of it: "
                  "no site to try (an unknown spelling)")
        return NearMiss(live[0].name, evidence.name, f"{reason}; at {context}",
                        module_path(evidence), f"no anchor within reach; at {shown}")
    best = max(t[0] for t in tries)
    _, name, node, reason, kind = next(t for t in tries if t[0] == best)
    more = len({t[1] for t in tries if t[0] == best}) - 1
    return NearMiss(name + (f" (+{more} variants)" if more else ""), node.name,
                    f"{reason}; at {context}", module_path(node), f"{kind}; at {shown}")


def _users(node: fx.Node, max_depth: int) -> set[fx.Node]:
    """The nodes that read `node`, transitively, up to max_depth edges away (`cone` forwards)."""
    dist, todo = {node: 0}, collections.deque([node])
    while todo:
        n = todo.popleft()
        if dist[n] < max_depth:
            for u in n.users:
                if u not in dist:
                    dist[u] = dist[n] + 1
                    todo.append(u)
    return set(dist)


__all__ = ["NearMiss", "cone", "cone_ops", "describe", "explain", "explain_failure", "failed",
           "module_path", "op_label", "op_name", "probe", "resembles", "value_type"]
