"""Rule `depth_mix`: the Attention-Residual depth mix's foreign spellings -> the form
`k3compile.math.depth_mix` traces to, which `patterns/attn_res_mix_norm.py` matches:

    sources = torch.stack([*blocks, prefix])              cat(srcs) + view [S, ..., D]
    alpha = softmax(proj(norm(sources)), dim=0)           amax, sub, exp, sum, div over dim 0
    h = (alpha.unsqueeze(-1) * sources.float()).sum(0)    unsqueeze, mul, sum over dim 0, fp32

Anchored on the softmax over the sources (dim 0) and the stacked sources it is computed from,
the rule rewrites
* the stack built as `torch.cat([s.unsqueeze(0) for s in srcs])` -> cat + view, the stack's own
  decomposition (the same values, bit for bit);
* the weighted sum in any spelling that reads only alpha and the sources: an einsum
  (`"s...d,s...->...d"`: permutes + bmm), a Python loop `sum(alpha[i, ..., None] * src_i)` over
  the stack or over the source list, `matmul`, ... The region between alpha and the node where it
  closes (the first node of the sources' trailing shape that every path from alpha runs through)
  is evaluated once on random alpha and sources against the canonical sum before it is replaced:
  an equal region differs from it by summation order only (fp32, checked to 1e-5 relative); a
  weighted sum computed in bf16, or of other weights, fails the check and is left alone.

Not rewritten: sources stacked along another dim (Moonshot's `[N, S, D]` block residual with the
softmax over -1), whose canonical form also needs the scores re-laid out.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from k3compile.canonical import Rule
from k3compile.graph import call

aten, prims = torch.ops.aten, torch.ops.prims
RTOL = 1e-5  # summation order in fp32
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims,
          aten.select.int, aten.slice.Tensor, aten.expand.default, aten.clone.default,
          aten.alias.default, prims.convert_element_type.default, aten.t.default,
          aten.transpose.int}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
             aten.squeeze.dims, aten.clone.default, aten.alias.default}
# what a weighted sum of sources may be spelled with
_SUM_OPS = _VIEWS | {aten.mul.Tensor, aten.add.Tensor, aten.sum.dim_IntList, aten.bmm.default,
                     aten.mm.default, aten.div.Tensor, aten.sub.Tensor}
REACH = 24  # how far back from the softmax the stacked sources may be


def _val(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _shape(node):
    val = _val(node)
    return tuple(val.shape) if val is not None else None


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


# ---- the anchor: softmax over the sources --------------------------------------------------------


def _softmax0(div: fx.Node) -> bool:
    """div is softmax(x, dim=0) as it decomposes: exp(x - amax(x, 0)) / sum(., 0)."""
    if not _is(div, aten.div.Tensor):
        return False
    exp, total = div.args
    return (_is(exp, aten.exp.default) and _is(total, aten.sum.dim_IntList)
            and total.args[0] is exp and list(total.args[1]) == [0]
            and _is(exp.args[0], aten.sub.Tensor) and _is(exp.args[0].args[1], aten.amax.default)
            and list(exp.args[0].args[1].args[1]) == [0])


# ---- the stacked sources ------------------------------------------------------------------------


def _stacked(node: fx.Node, width: int | None = None) -> list[fx.Node] | None:
    """The sources if node is torch.stack(sources) (cat + view) or cat of unsqueeze(0)s."""
    if _is(node, aten.view.default) and _is(node.args[0], aten.cat.default):
        cat = node.args[0]
        srcs = list(cat.args[0])
        if (len(cat.args) == 1 or cat.args[1] == 0) and _shape(node) == (len(srcs),
                                                                           *_shape(srcs[0])):
            return srcs if all(_shape(s) == _shape(srcs[0]) for s in srcs) else None
    if _is(node, aten.cat.default) and (len(node.args) == 1 or node.args[1] == 0):
        parts = list(node.args[0])
        if all(_is(p, aten.unsqueeze.default) and p.args[1] == 0 for p in parts):
            srcs = [p.args[0] for p in parts]
            if all(_shape(s) == _shape(srcs[0]) for s in srcs):
                return srcs
    return None


def _sources(alpha: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(stacked sources [S, ..., D], the sources) that alpha's scores are computed from."""
    seen, frontier = set(), [alpha]
    for _ in range(REACH):
        nxt = []
        for node in frontier:
            for x in node.all_input_nodes:
                if x in seen:
                    continue
                seen.add(x)
                shape = _shape(x)
                if shape and shape[:-1] == _shape(alpha):
                    srcs = _stacked(x)
                    if srcs is not None:
                        return x, srcs
                nxt.append(x)
        frontier = nxt
    return None


def _as_stack(graph: fx.Graph, cat: fx.Node, srcs: list[fx.Node]) -> fx.Node:
    """cat of unsqueeze(0)s -> torch.stack's own cat + view."""
    with graph.inserting_before(cat):
        flat = call(graph, aten.cat.default, (list(srcs),), like=cat)
        stack = call(graph, aten.view.default, (flat, list(_shape(cat))), like=cat)
    cat.replace_all_uses_with(stack)
    return stack


# ---- the weighted sum ---------------------------------------------------------------------------


def _closing(alpha: fx.Node, shape: tuple, limit: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the node every use of alpha runs into, the region between) if it has `shape`, is fp32 and
    the region holds only what a weighted sum is spelled with."""
    region, node = [alpha], alpha.next
    inside = {alpha}
    for _ in range(limit):
        if node.op != "call_function":
            return None
        if any(x in inside for x in node.all_input_nodes):
            if node.target not in _SUM_OPS:
                return None
            region.append(node)
            inside.add(node)
            if _fits(node, shape) and all(u in inside for n in region[:-1] for u in n.users):
                return _past_reshapes(region, shape)
        node = node.next
    return None


def _fits(node: fx.Node, shape: tuple) -> bool:
    return _shape(node) == shape and _val(node).dtype == torch.float32


def _past_reshapes(region: list[fx.Node], shape: tuple) -> tuple[fx.Node, list[fx.Node]]:
    """Extend the region through the reshapes that follow its end (a bmm's [B*T, 1, D] result
    viewed back to [B, T, D]) to the last one of the sources' shape."""
    end, node, tail = len(region), region[-1], []
    while len(node.users) == 1 and next(iter(node.users)).target in _RESHAPES:
        node = next(iter(node.users))
        tail.append(node)
        if _fits(node, shape):
            region += tail
            tail = []
            end = len(region)
    return region[end - 1], region[1:end]


def _canonical(out: fx.Node, alpha: fx.Node, stack: fx.Node) -> bool:
    mul = out.args[0]
    if not (_is(out, aten.sum.dim_IntList) and list(out.args[1]) == [0] and _is(mul, aten.mul.Tensor)):
        return False
    ops = set(mul.args)
    f32 = [x for x in ops if _is(x, prims.convert_element_type.default) and x.args[0] is stack]
    unsq = [x for x in ops if _is(x, aten.unsqueeze.default) and x.args[0] is alpha]
    return bool(unsq) and (stack in ops or bool(f32))


def _inputs(region: list[fx.Node], alpha, stack, srcs) -> list[fx.Node] | None:
    """The nodes outside the region it reads, each a view chain back to the sources; the chain
    nodes in graph order, or None if the region reads anything else."""
    known, chain = {alpha, stack, *srcs, *region}, []
    todo = [x for n in region for x in n.all_input_nodes if x not in known]
    while todo:
        x = todo.pop()
        if x in known:
            continue
        if x.op != "call_function" or x.target not in _VIEWS:
            return None
        known.add(x)
        chain.append(x)
        todo += [y for y in x.all_input_nodes if y not in known]
    order = {n: i for i, n in enumerate(alpha.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def _evaluates_as_sum(out, region, chain, alpha, stack, srcs) -> bool:
    """The region, run on random alpha and sources, equals Σ_s alpha[s] · sources[s] in fp32."""
    gen = torch.Generator().manual_seed(0)
    with unset_fake_temporarily():
        unique = {s: torch.randn(_shape(s), generator=gen).to(_val(s).dtype) for s in srcs}
        env = {stack: torch.stack([unique[s] for s in srcs])}
        env |= unique
        a = torch.randn(_shape(alpha), generator=gen).softmax(0).to(_val(alpha).dtype)
        env[alpha] = a
        for node in [*chain, *region]:
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = node.target(*args, **kwargs)
        want = (a.unsqueeze(-1) * env[stack].float()).sum(0)
        got = env[out]
        if got.shape != want.shape or got.dtype != want.dtype:
            return False
        return float((got - want).abs().max()) <= RTOL * float(want.abs().max().clamp_min(1e-30))


def _weighted_sum(graph: fx.Graph, alpha: fx.Node, stack: fx.Node, srcs: list[fx.Node]) -> int:
    closing = _closing(alpha, _shape(stack)[1:], limit=8 * len(srcs) + 40)
    if closing is None:
        return 0
    out, region = closing
    if _canonical(out, alpha, stack):
        return 0
    chain = _inputs(region, alpha, stack, srcs)
    if chain is None or not _evaluates_as_sum(out, region, chain, alpha, stack, srcs):
        return 0
    with graph.inserting_before(out):
        weights = call(graph, aten.unsqueeze.default, (alpha, -1), like=out)
        values = stack if _val(stack).dtype == torch.float32 else call(
            graph, prims.convert_element_type.default, (stack, torch.float32), like=out)
        terms = call(graph, aten.mul.Tensor, (weights, values), like=out)
        total = call(graph, aten.sum.dim_IntList, (terms, [0]), like=out)
    out.replace_all_uses_with(total)
    return 1


def apply(graph: fx.Graph) -> int:
    rewritten = 0
    for alpha in [n for n in graph.nodes if _softmax0(n)]:
        found = _sources(alpha)
        if found is None:
            continue
        stack, srcs = found
        if _is(stack, aten.cat.default):
            stack = _as_stack(graph, stack, srcs)
            rewritten += 1
        rewritten += _weighted_sum(graph, alpha, stack, srcs)
    return rewritten


RULE = Rule("depth_mix", apply, "AttnRes depth mix: cat of unsqueezed sources -> stack's cat + "
            "view; einsum / loop / matmul weighted sum -> (alpha[..., None] * sources).sum(0)")
