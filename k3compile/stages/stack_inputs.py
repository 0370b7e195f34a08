"""Stage `stack_inputs`: an expert stack whose parts lie back to back in one buffer is one input of
the graph the executor compiles: [p_0 .. p_{E-1}] (E inputs) -> stack [E, ...] (one).

A model whose experts are an `nn.ModuleList` (transformers' spelling) hands the step one graph
input per expert weight: at one TP16 rank's 4 layers 21,616 inputs, and Dynamo, AOTAutograd and
Inductor each pay per input (Inductor: lowering, codegen and the FX graph cache key;
docs/decisions.md, session 14, hhf). Rule `expert_stack` reads each stack as
`k3.expert_stack(parts)`, and stage `pack` moves its parts, once, into one buffer. This stage,
after pack, makes that buffer one placeholder of the graph in place of its E parts: the
`k3.expert_stack` node becomes the placeholder, a part the graph still reads otherwise becomes
`select(stack, 0, e)` (its row), and the part placeholders go. Dynamo's and AOTAutograd's share
(they trace before the stages) stays; Inductor's per-input share goes.

The caller still passes one argument per part (Dynamo's graph is unchanged): `Stacked.wrap` maps
the arguments onto the new graph in O(1) Python calls per step (the buffer as an [E, ...] view
made at compile time; the kept arguments by one `itemgetter`). Issue 20 (never a stale weight):
each call first checks that every part still is at its row's address, in one C++ call where torch
has it (`_tensors_data_ptrs_at_indices_equal`, as CUDA-graph trees check their static inputs; a
Python loop over the parts on builds without it, CPU only). A stack a part of which moved
(`param.data = t`, `load_state_dict(assign=True)`) is from then on `expert_stack(parts)` per call,
what the op does in the graph without this stage: a view where the parts are back to back, a
`torch.stack` copy otherwise (logged once). The view made at compile time holds the buffer alive,
so its address is not reused while it is checked; a stack that moved drops it.

Constraints:
- the parts are placeholders themselves (not views of one), read whole; a stack shares no part
  with another (two `expert_stack` nodes of the same parts share one placeholder);
- at compile the parts' real tensors lie back to back (`back_to_back`) and the first starts
  16-byte aligned (Inductor copies an input it assumed aligned on every call);
- the new placeholder is static for Inductor (`static_input_idxs`) where every part was;
- the rewrite runs on every compile after pack (the stage cache stores the graph before it).
Options.stack_inputs / K3_STACK_INPUTS=0 turn the stage off.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch import fx

from k3compile.graph import call
from k3compile.ops.expert_stack import back_to_back, expert_stack
from k3compile.rewrite.inductor import unset_fake_temporarily
from k3compile.stages.addresses import Addresses

log = logging.getLogger("k3compile")

_STACK = torch.ops.k3.expert_stack.default


@dataclasses.dataclass
class _Stack:
    parts: list[int]  # the parts' positions among the original graph inputs
    pointers: list[int]  # each part's address at compile (its row of the buffer)
    view: torch.Tensor | None  # the buffer as [E, ...]; None once a part moved


@dataclasses.dataclass
class Stacked:
    """How the original graph inputs map onto the rewritten graph's: `order[j]` is the original
    input at new position j, or `~s` for stack s (at the place of its first part)."""

    count: int  # the original graph's inputs
    order: list[int]
    stacks: list[_Stack]
    fakes: list  # each stack's example value (the `expert_stack` node's)
    skipped: list[str] = dataclasses.field(default_factory=list)  # "node: why"

    def __str__(self) -> str:
        parts = sum(len(s.parts) for s in self.stacks)
        return (f"{len(self.stacks)} expert stacks as one input each ({self.count} -> "
                f"{len(self.order)} graph inputs, {parts} parts dropped), {len(self.skipped)} "
                "left as they are")

    def inputs(self, originals: list) -> list:
        """The rewritten graph's example inputs, from the original graph's."""
        return [originals[i] if i >= 0 else self.fakes[~i] for i in self.order]

    def static(self, idxs) -> list[int]:
        """Inductor's `static_input_idxs`, from the original graph's."""
        old = set(idxs or ())
        return [j for j, i in enumerate(self.order)
                if (i in old if i >= 0 else old.issuperset(self.stacks[~i].parts))]

    def wrap(self, fn):
        """A boxed callable of the original inputs that calls boxed `fn` with the new ones."""
        stacks, count = self.stacks, self.count
        # the stacks' values ride behind the arguments: one itemgetter picks the new inputs
        picks = [i if i >= 0 else count + ~i for i in self.order]
        pick = operator.itemgetter(*picks) if len(picks) > 1 else (lambda a: (a[picks[0]],))
        check = _Check(stacks, count)

        def call(args: list):
            if check.addresses.positions and not check.same(args):
                check.moved(args)
            args.extend([s.view if s.view is not None else _restack(args, s) for s in stacks])
            new = list(pick(args))
            args.clear()
            return fn(new)

        call._boxed_call = True
        return call


def _restack(args: list, stack: _Stack) -> torch.Tensor:
    return expert_stack([args[i] for i in stack.parts])


class _Check:
    """Whether every part of a stack still on its view is at its compile-time address."""

    def __init__(self, stacks: list[_Stack], count: int):
        self.stacks, self.count = stacks, count
        self._reset()

    def _reset(self) -> None:
        self.addresses = Addresses(self.count, {
            i: p for s in self.stacks if s.view is not None
            for i, p in zip(s.parts, s.pointers, strict=True)})

    def same(self, args: list) -> bool:
        return self.addresses.same(args)

    def moved(self, args: list) -> None:
        for n, s in enumerate(self.stacks):
            if s.view is not None and any(args[i].data_ptr() != p
                                          for i, p in zip(s.parts, s.pointers, strict=True)):
                s.view = None  # the old buffer may go; this stack restacks per call from now on
                log.warning("k3 stack_inputs: a part of expert stack %d moved (rebound after "
                            "compile); it is read as expert_stack(parts) per call from now on "
                            "(a copy unless its parts are back to back)", n)
        self._reset()


def _parts(node: fx.Node, real: dict) -> list[fx.Node] | str:
    parts = list(node.args[0])
    if not all(isinstance(p, fx.Node) and p.op == "placeholder" and p in real for p in parts):
        return "a part is not a graph input itself"
    values = [real[p] for p in parts]
    if not all(type(v) in (torch.Tensor, torch.nn.Parameter) for v in values):
        return "a part is no plain tensor"
    if not back_to_back(values):
        return "the parts do not lie back to back in one buffer (not packed)"
    if values[0].data_ptr() % 16:
        return "the buffer does not start 16-byte aligned"
    return parts


def stack_placeholders(gm: fx.GraphModule, inputs: list) -> Stacked | None:
    """Rewrite gm (see the module docstring) given the real tensors of its placeholders, in
    order; the mapping of its inputs, or None where no stack was taken."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return None
    real = dict(zip(placeholders, inputs, strict=True))
    position = {p: i for i, p in enumerate(placeholders)}
    taken: dict[fx.Node, tuple] = {}  # part -> the parts of the stack that took it
    stacks: dict[tuple, list[fx.Node]] = {}  # parts -> the expert_stack nodes reading them
    skipped = []
    for node in graph.find_nodes(op="call_function", target=_STACK):
        parts = _parts(node, real)
        key = tuple(parts) if not isinstance(parts, str) else None
        if key is not None and key not in stacks and any(p in taken for p in key):
            parts = "a part belongs to another stack"
        if isinstance(parts, str):
            skipped.append(f"{node.name}: {parts}")
            continue
        stacks.setdefault(key, []).append(node)
        taken.update((p, key) for p in key)
    if not stacks:
        return None
    order, made, fakes, first = [], [], [], {}
    for key in stacks:
        first[key[0]] = key
    for p in placeholders:
        if p in taken and p not in first:
            continue
        if p not in first:
            order.append(position[p])
            continue
        key, nodes = first[p], stacks[first[p]]
        n = len(made)
        with graph.inserting_before(p):
            stack = graph.placeholder(f"k3_stack_{n}")
        stack.meta["val"] = nodes[0].meta["val"]
        stack.meta["k3_parts"] = [position[q] for q in key]  # for the diff tool's input names
        values = [real[q] for q in key]
        with unset_fake_temporarily():  # the stage runs under Inductor's fake mode
            view = expert_stack(values).detach()
        made.append(_Stack([position[q] for q in key], [v.data_ptr() for v in values], view))
        fakes.append(nodes[0].meta["val"])
        order.append(~n)
        for node in nodes:
            node.replace_all_uses_with(stack)
            graph.erase_node(node)
        for e, q in enumerate(key):
            if q.users:
                with graph.inserting_after(stack):
                    row = call(graph, torch.ops.aten.select.int, (stack, 0, e), like=q)
                q.replace_all_uses_with(row)
    for p in taken:
        graph.erase_node(p)
    gm.recompile()
    stacked = Stacked(len(placeholders), order, made, fakes, skipped)
    log.info("k3 stack_inputs: %s", stacked)
    return stacked


def stack_inputs(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage (on with `Options.stack_inputs`), after pack: the mapping goes to the executor
    through `ctx.notes["stack_inputs"]` (None: the graph takes its inputs as it did)."""
    ctx.notes["stack_inputs"] = stack_placeholders(gm, ctx.inputs)
    return gm
