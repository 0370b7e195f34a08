"""Stage `weight_views`: a weight the graph cuts out of a flat storage (FSDP's `FlatParameter`,
Megatron's contiguous buffers: `flat.narrow(0, offset, n).view(out, in)` in the forward) is read
as a graph input of its own, as an `nn.Linear` weight is.

Before (flat a 1-D graph input):       mm(x, permute(view(slice(flat, 0, a, b), [N, K]), [1, 0]))
After  (w a new graph input [N, K]):   mm(x, permute(w, [1, 0]))

The patterns, the fused ops and stage `pack` take a projection's weight as a graph input (a
weight computed in the graph is no weight to them): a spelling that keeps each layer's weights
in one flat Parameter lost every GEMM fusion (spell13, docs/spell13_spelling.md, cause 1), and
a canonical rule cannot help, since a rule cannot add an input to the graph. This stage does:
each distinct contiguous view the graph cuts from a 1-D input by views alone (slice, view,
select, squeeze / unsqueeze, as_strided) becomes a placeholder appended after the graph's own,
and every reader of that view reads the placeholder. The flat input stays where it was (read
whole elsewhere, or by nobody).

The executor's wrapper (`Viewed.wrap`) hands the compiled graph the views at every call: made
once, as `as_strided` of the flat input (its shape, strides and offset from the input's own),
and kept while every flat input stays at its address (one C++ check per call where torch has
it, as `stack_inputs` checks its parts); a flat input that moved (`param.data = t`,
`load_state_dict(assign=True)`) gets its views made again from the new tensor. The views share
the flat storage, so every write to it (`copy_`, `load_state_dict`, an optimiser step) is what
the next step reads: never a stale weight. Stage `pack` leaves a view where it is (it refuses
"a view into a larger storage"): the fused ops read the view's own rows, and a group whose
weights lie back to back in the flat storage already reads them as one matrix.

Taken: a 1-D float, integer or byte input that is no caller's input, not written in place and
not a tensor subclass, where a chain of views with constant arguments ends at a contiguous view
of at least one element that some non-view op reads; a view the graph writes, returns, or reads
through a `split` / `unbind` stays in the graph (its pieces are views of the new input when the
chain before them is taken). Runs first before the stage cache's key (its graph is the key), on
every compile, a cache hit included. Options.weight_views / K3_WEIGHT_VIEWS=0 turn it off.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from k3compile.graph import written_in_place
from k3compile.stages.addresses import Addresses

log = logging.getLogger("k3compile")
aten = torch.ops.aten

# views of one tensor with constant arguments, each one tensor out
VIEWS = frozenset({
    aten.slice.Tensor, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.select.int, aten.alias.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.unsqueeze.default, aten.as_strided.default,
})


@dataclasses.dataclass(frozen=True)
class _Cut:
    """One view of a flat input: where it lies in the input's storage, relative to the input."""

    source: int  # the flat input's position among the graph's inputs
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements past the input's own storage offset


@dataclasses.dataclass
class Viewed:
    """The views the rewritten graph takes as inputs of their own, appended after the original
    graph's `count` inputs, in `cuts` order."""

    count: int
    cuts: list[_Cut]
    fakes: list  # each view's example value
    skipped: list[str] = dataclasses.field(default_factory=list)  # "input: why"

    def __str__(self) -> str:
        sources = len({c.source for c in self.cuts})
        return (f"{len(self.cuts)} views of {sources} flat inputs read as inputs of their own, "
                f"{len(self.skipped)} left as they are")

    def inputs(self, originals: list) -> list:
        """The rewritten graph's example inputs, from the original graph's."""
        return [*originals, *self.fakes]

    def static(self, indices) -> list[int] | None:
        """Inductor's static inputs of the rewritten graph: a view is static where its flat
        input is."""
        if indices is None:
            return None
        indices = list(indices)
        kept = set(indices)
        return indices + [self.count + k for k, c in enumerate(self.cuts) if c.source in kept]

    def views(self, args: list) -> list[torch.Tensor]:
        """Each cut made on the real inputs `args` (the original graph's)."""
        return [args[c.source].as_strided(c.size, c.stride, args[c.source].storage_offset() + c.offset)
                for c in self.cuts]

    def wrap(self, fn):
        """A boxed callable of the original inputs that calls boxed `fn` with the views appended.
        The views are kept while every flat input stays at its address: O(1) Python calls per
        step, whatever the number of views."""
        sources = sorted({c.source for c in self.cuts})
        kept: dict = {}  # "views", "addresses": what the last remake made, and from where

        def call(args: list):
            if not kept or not kept["addresses"].same(args):
                kept.update(views=self.views(args), addresses=Addresses.of(args, sources))
            args.extend(kept["views"])
            new = list(args)
            args.clear()
            return fn(new)

        call._boxed_call = True
        return call


def _source(w) -> str | None:
    """Why a graph input's real value is no flat storage to cut weights from, or None."""
    if type(w) not in (torch.Tensor, torch.nn.Parameter):
        return "not a plain tensor (a subclass, or no tensor)"
    if w.is_meta:
        return "a meta tensor holds no data"
    if torch.is_grad_enabled() and w.requires_grad:
        return "it requires grad in grad mode"
    return None


def _cut_ends(p: fx.Node) -> list[fx.Node] | None:
    """The last node of each chain of VIEWS from p (constant arguments) that a non-view op reads;
    nodes past a chain's end are left to the graph. None where p or a view of it is written in
    place (a storage the step writes holds no weights)."""
    ends, stack = [], [p]
    while stack:
        node = stack.pop()
        if written_in_place(node):
            return None
        for user in node.users:
            view = (user.op == "call_function" and user.target in VIEWS and user.args[0] is node
                    and not any(isinstance(a, fx.Node)
                                for a in (*user.args[1:], *user.kwargs.values())))
            if view:
                stack.append(user)
            elif node is not p and node not in ends:
                ends.append(node)
    return ends


def _cut(end: fx.Node, source: int, base) -> _Cut | None:
    """`end`'s place in its flat input, read off its example value; None where it is not one
    contiguous run of elements of the input (or is the whole input, or empty), or has a
    symbolic size (read before anything else, so that no guard is made)."""
    val = end.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    size, stride = tuple(val.shape), tuple(val.stride())
    ints = (*size, *stride, val.storage_offset(), *base.shape, base.storage_offset())
    if not all(type(n) is int for n in ints):
        return None
    if val.numel() in (0, base.numel()) or not val.is_contiguous():
        return None
    return _Cut(source, size, stride, val.storage_offset() - base.storage_offset())


def _contiguous_cut(end: fx.Node, p: fx.Node, source: int, base) -> tuple[fx.Node, _Cut] | None:
    """(node, its cut): `end` or, where `end` is no contiguous run (a column slice of a weight:
    MLA's W_UK out of kv_b), the nearest view before it in its chain that is."""
    node = end
    while node is not p:
        if (cut := _cut(node, source, base)) is not None:
            return node, cut
        node = node.args[0]
    return None


def view_inputs(gm: fx.GraphModule, ctx) -> Viewed | None:
    """Rewrite gm's flat-storage views as inputs (see the module docstring), appending their real
    values to `ctx.inputs`; the mapping for the executor, or None where none is taken."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(ctx.inputs):
        return None
    found = Viewed(len(placeholders), [], [])
    taken: dict[_Cut, fx.Node] = {}
    outputs = set(graph.find_nodes(op="output")[0].all_input_nodes)
    order = {n: k for k, n in enumerate(graph.nodes)}
    for i, p in enumerate(placeholders):
        base = p.meta.get("val")
        if i in ctx.user_inputs or not isinstance(base, torch.Tensor) or base.dim() != 1:
            continue
        # node -> its cut (two chains may be cut at one view they share)
        cuts = dict(c for e in _cut_ends(p) or () if e not in outputs
                    and (c := _contiguous_cut(e, p, i, base)) is not None)
        if not cuts:
            continue
        if (why := _source(ctx.inputs[i])) is not None:
            found.skipped.append(f"{p.name} {list(base.shape)}: {why}")
            continue
        for end, cut in sorted(cuts.items(), key=lambda c: order[c[0]]):
            if cut not in taken:
                taken[cut] = _placeholder(graph, placeholders, found, cut, ctx)
        for end, cut in sorted(cuts.items(), key=lambda c: order[c[0]], reverse=True):  # deepest first
            end.replace_all_uses_with(taken[cut])
            _erase_unread(graph, end, p)
    if not taken:
        return None
    gm.recompile()
    log.info("k3 weight_views: %s%s", found, "".join(f"\n  skipped {s}" for s in found.skipped))
    return found


def _erase_unread(graph: fx.Graph, node: fx.Node, p: fx.Node) -> None:
    """Erase `node` and the views before it that nothing reads any more, back to p."""
    while node is not p and node.op == "call_function" and not node.users:
        before = node.args[0]
        graph.erase_node(node)
        node = before


def _placeholder(graph: fx.Graph, placeholders: list[fx.Node], found: Viewed, cut: _Cut,
                 ctx) -> fx.Node:
    w = ctx.inputs[cut.source]
    with unset_fake_temporarily():
        value = w.as_strided(cut.size, cut.stride, w.storage_offset() + cut.offset)
    fake_mode = placeholders[cut.source].meta["val"].fake_mode
    fake = fake_mode.from_tensor(value, static_shapes=True)
    last = graph.find_nodes(op="placeholder")[-1]
    with graph.inserting_after(last):
        node = graph.placeholder(f"{placeholders[cut.source].name}_view{len(found.cuts)}")
    node.meta["val"] = fake
    ctx.inputs.append(value)
    found.cuts.append(cut)
    found.fakes.append(fake)
    return node


def weight_views(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage: the mapping goes to the executor through `ctx.viewed`."""
    ctx.viewed = view_inputs(gm, ctx)
    return gm

