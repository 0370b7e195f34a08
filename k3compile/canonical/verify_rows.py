"""Rule `verify_rows`: absorbed MLA over flat tokens at T > 1 verify rows (a serving engine's
[num_tokens, ...] activations, spell7) -> the [B, T] form GatedMLA.forward traces to, which
mla_q_absorb, mla_decode and mla_uv_gate match.

With T rows per request the engine runs N = B·T tokens, each with its request's slot (the slot
mapping, `slots.unsqueeze(1).expand(B, T).reshape(-1)`) and its own position
(`(positions.unsqueeze(1) + arange(T)).reshape(-1)`): the cache is written at (mapping, flat
positions) and each token reads its request's whole block, `cache_out[mapping]`. After rules
`token_dim` and `mla_absorbed` that is our canonical attention with N one-row requests, whose
requests share slots: mla_decode must not take it (its kernel writes and reads one request's
block at once). This rule views the tokens back to [B, T]:

    index(index_put(cache, [m, p], rows), [m])     m = slots repeated T times, p = P.flatten()
        -> index(index_put(cache, [view(slots, [B, 1]), P], rows [B, T, W]), [slots])
    the canonical attention of the N-row site, at (B, T): q_b's GEMM input viewed [B, T, Q]
    (as a linear on [B, T, Q] traces), the gate `o * sigmoid(g)` on g viewed [B, T, H·V], the
    output viewed back to the tokens' shape for what reads it.

Exact: the write puts the same rows at the same (slot, position) pairs in the same order (n =
b·T + t both ways), and token (b, t) reads cache_out[slots[b]] masked at P[b, t] both ways; only
the batching of the products changes (the same dot products). Taken only where the N-row site is
the canonical form already (checked against its trace, as `mla_absorbed` does), the mapping's
layout is the slots repeated T > 1 times in order (read by `canonical/layout.py`), and the flat
positions are a [B, T] tensor flattened. T = 1 is rule `slot_mapping`'s.

Left alone: a mapping in another order (the slots tiled, `slots.repeat(T)`), positions not
flattened from [B, T], a non-canonical site, T = 1.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.canonical.layout import layout, merged_dims
from k3compile.canonical.mla_absorb import (
    absorbed,
    cache_reads,
    canonical_rows,
    chain_scale,
    log,
)
from k3compile.canonical.mla_absorbed import all_sizes, canonical_already, check, find_site
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.region import splice
from k3compile.graph import call
from k3compile.rewrite import inductor

aten, prims = torch.ops.aten, torch.ops.prims
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _subs(lay) -> list[list[tuple[int, int]]]:
    return [merged_dims(d) for d in lay.dims]


def _repeats(node) -> tuple[fx.Node, int] | None:
    """(slots, T) where node ([N] or [N, 1]) is a 1-D slots tensor with each slot repeated T > 1
    times in order."""
    lay = layout(node) if isinstance(node, fx.Node) else None
    if lay is None or lay.offset or lay.scale != 1.0 or lay.root is node:
        return None
    val = lay.root.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1 or val.dtype.is_floating_point:
        return None
    B, subs = int(val.shape[0]), _subs(lay)
    if any(subs[1:]) or len(subs[0]) not in (1, 2) or subs[0][-1][1] != 0:
        return None
    T = subs[0][-1][0]
    return (lay.root, T) if T > 1 and subs[0][:-1] == ([(B, 1)] if B > 1 else []) else None


def _zero(node) -> bool:
    """An iota of one element, 0."""
    return getattr(node, "target", None) is prims.iota.default and node.args[0] == 1 \
        and node.kwargs.get("start", 0) == 0


def _positions(node: fx.Node, B: int, T: int) -> fx.Node | None:
    """P [B, T] where node ([N] or [N, 1], maybe + a one-element iota) is P flattened."""
    if node.target is aten.add.Tensor and len(node.args) == 2:
        a, b = node.args
        node = a if _zero(b) else b if _zero(a) else node
    lay = layout(node)
    if lay is None or lay.offset or lay.scale != 1.0 or lay.root is node:
        return None
    if _shape(lay.root) != (B, T) or lay.root.meta["val"].dtype.is_floating_point:
        return None
    subs = _subs(lay)
    return lay.root if subs[0] == [(B * T, 1)] and not any(subs[1:]) else None


def _own(graph: fx.Graph, P: fx.Node) -> fx.Node:
    """A copy of P (and of the aranges it adds) for one site: the layers share the flat positions,
    and mla_decode computes `positions.view(B, 1) + arange(T)` inside its own pattern."""
    aranges = {a: graph.node_copy(a) for a in P.all_input_nodes if a.target is prims.iota.default}
    return graph.node_copy(P, lambda n: aranges.get(n, n))


def _bt_rows(graph: fx.Graph, rows: fx.Node, B: int, T: int) -> fx.Node:
    """rows [N, (1,) W] as [B, T, W]: a last-dim cat of pieces viewed [B, T, .] (mla_decode's
    `cat([c_kv, k_pe], -1)` on [B, T] pieces), else one view."""
    def view(x):
        return call(graph, aten.view.default, (x, [B, T, _shape(x)[-1]]), like=x)

    if rows.target is aten.cat.default and rows.args[1] in (-1, len(_shape(rows)) - 1):
        return call(graph, aten.cat.default, ([view(p) for p in rows.args[0]], -1), like=rows)
    return view(rows)


def _gate(out: fx.Node):
    """(mul, g) where out's one reader is `out * sigmoid(g)` (either order)."""
    if len(out.users) != 1:
        return None
    (mul,) = out.users
    if mul.target is not aten.mul.Tensor or len(mul.args) != 2:
        return None
    other = mul.args[1] if mul.args[0] is out else mul.args[0]
    if getattr(other, "target", None) is not aten.sigmoid.default or _shape(other) != _shape(out):
        return None
    return mul, other.args[0]


def _apply_one(graph: fx.Graph, read: fx.Node, pos: fx.Node) -> str | None:
    write = read.args[0]
    cache, (s_index, p_index), rows = write.args[:3]
    found = _repeats(read.args[1][0])
    if found is None or _repeats(s_index) != found:
        return "the cache is not read and written by the slots repeated T > 1 times"
    slots, T = found
    B = int(slots.meta["val"].shape[0])
    P = _positions(p_index, B, T)
    if P is None:
        return "the positions are not a [B, T] tensor flattened"
    site = find_site(read, pos)
    if isinstance(site, str):
        return site
    site, q = site
    scale = chain_scale(site)
    # the op histogram is blind to sizes: the head count is the one the values confirm
    z = next((z for z in all_sizes(site, q)
              if canonical_already(site, z, scale) and check(site, z, scale) is None), None)
    if z is None:
        return "the N-row attention is not the canonical form"
    zb = dataclasses.replace(z, B=B, T=T)
    # traced before the graph changes: a failure leaves it as it was
    mm = _query_gemm(z.q)
    q_in = mm if mm is not None else z.q
    vals = [q_in.meta["val"], site.weight.meta["val"], read.meta["val"][:B],
            P.meta["val"]]
    with torch._guards.detect_fake_mode(vals) or contextlib.nullcontext():
        gm = inductor.fwd_only_joint(absorbed(zb, scale), vals)
    with graph.inserting_before(read):
        P = _own(graph, P)
        column = call(graph, aten.view.default, (slots, [B, 1]), like=write)
        new_write = call(graph, aten.index_put.default,
                         (cache, [column, P], _bt_rows(graph, rows, B, T)), like=write)
        new_read = call(graph, aten.index.Tensor, (new_write, [slots]), like=read)
    write.replace_all_uses_with(new_write)
    if mm is not None:
        _read_bt(graph, mm, B, T)
    inputs = [q_in, site.weight, new_read, P]
    # its own ending: the [B, T, H·V] copy is read back through views of the N-row output
    new = splice(graph, gm, inputs, site.out, rule="verify_rows")
    _readers_read(graph, site.out, new, B, T)
    canonical_rows(graph, P)
    graph.eliminate_dead_code()
    return None


def _query_gemm(q: fx.Node) -> fx.Node | None:
    """The q_b GEMM (mm of a 2-D input) q is, or is a view of."""
    mm = q.args[0] if q.target in VIEWS else q
    return mm if mm.target is aten.mm.default and len(_shape(mm.args[0]) or ()) == 2 else None


def _read_bt(graph: fx.Graph, mm: fx.Node, B: int, T: int) -> None:
    """The GEMM reads its input through [B, T, Q], as a linear on [B, T, Q] traces
    (`view(x, [B·T, Q])`), for mla_q_absorb."""
    x = mm.args[0]
    with graph.inserting_before(mm):
        x3 = call(graph, aten.view.default, (x, [B, T, _shape(x)[-1]]), like=mm)
        flat = call(graph, aten.view.default, (x3, [B * T, _shape(x)[-1]]), like=mm)
    mm.replace_input_with(x, flat)


def _readers_read(graph: fx.Graph, out: fx.Node, new: fx.Node, B: int, T: int) -> None:
    """out's readers read new [B, T, H·V] viewed back; the output gate on [B, T, H·V] first."""
    gate = _gate(out)
    if gate is None:
        with graph.inserting_before(out.next):
            back = call(graph, aten.view.default, (new, list(_shape(out))), like=out)
        out.replace_all_uses_with(back)
        return
    mul, g = gate
    with graph.inserting_before(mul):
        g3 = call(graph, aten.view.default, (g, list(_shape(new))), like=g)
        gated = call(graph, aten.mul.Tensor,
                     (new, call(graph, aten.sigmoid.default, (g3,), like=mul)), like=mul)
        back = call(graph, aten.view.default, (gated, list(_shape(mul))), like=mul)
    mul.replace_all_uses_with(back)


def apply(graph: fx.Graph) -> int:
    """View every canonical N-row MLA site whose rows are T > 1 verify rows back to [B, T]."""
    done = 0
    for read, pos in list(cache_reads(graph)):
        if read._erased:
            continue
        try:
            why = _apply_one(graph, read, pos)
        except Exception as e:  # noqa: BLE001 (a site the rule cannot read stays as it is)
            log.warning("k3 verify_rows: %s left alone: %s: %s", read.name, type(e).__name__, e)
            why = "raised"
        if why is not None:
            log.debug("k3 verify_rows: %s left alone: %s", read.name, why)
        done += why is None
    if done:
        inductor.stable_topological_sort(graph)
    return done


RULE = Rule("verify_rows", apply, "canonical MLA over N = B·T flat tokens (slots repeated T > 1 "
                                  "times, flat positions) -> the [B, T] attention")
