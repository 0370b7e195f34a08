"""Helpers of the canonical-rule tests: compile a function or module under backend="k3" (executor
aten, `fuse` off unless asked) and keep the graph stage `canonicalize` received and the one it
returned, with the real inputs in placeholder order, so that a test runs both graphs on the same
values (the rewritten graph against the unrewritten one) and reads the canonical form."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx

import k3compile.backend as k3be
from k3compile.observe import Observer
from tests.conftest import rel_err

ATEN_ONLY = {"executor": "aten", "keep_graphs": False, "disabled_stages": ["fuse"]}


@dataclasses.dataclass
class Canonicalized:
    before: fx.GraphModule  # the graph stage canonicalize received
    after: fx.GraphModule  # the graph it returned
    counts: dict[str, int]  # rule -> sites it rewrote
    inputs: list[torch.Tensor]  # the step's real inputs (before it ran), in placeholder order
    output: Any  # what the compiled step returned


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _dynamo_names(module: torch.nn.Module | None, args: dict[str, torch.Tensor]) -> dict:
    """Dynamo's placeholder name of every tensor the step may read (l_x_, l_self_buffers_buf_,
    l_self_modules_sub_parameters_weight_, ...)."""
    names = {f"l_{name}_": t for name, t in args.items()}
    names.update({f"l_args_{i}_": t for i, t in enumerate(args.values())})  # forward(*args)
    for kind, tensors in (("parameters", module.named_parameters() if module else ()),
                          ("buffers", module.named_buffers() if module else ())):
        for path, t in tensors:
            *mods, leaf = path.split(".")
            names["l_self_" + "".join(f"modules_{m}_" for m in mods) + f"{kind}_{leaf}_"] = t
    return names | {k.lower(): t for k, t in names.items()}  # Dynamo lowercases (A_log)


def canonicalize(fn, args: dict[str, torch.Tensor], module: torch.nn.Module | None = None,
                 **options) -> Canonicalized:
    """Compile `fn` (or `module`), call it once on `args` (in that order), keep what the
    canonicalize stage saw and made. `options` update ATEN_ONLY."""
    torch._dynamo.reset()
    graphs = {}

    def keep(event):
        if event.stage == "canonicalize":
            graphs["after" if event.record else "before"] = _copy(event.gm)

    snapshot = {name: t.detach().clone() for name, t in _dynamo_names(module, args).items()}
    step = torch.compile(module if module is not None else fn, backend="k3", fullgraph=True,
                         options={**ATEN_ONLY, **options})
    with Observer.subscribe(keep), torch.no_grad():
        output = step(*args.values())
    compiled = k3be.last_compiled()
    inputs = [snapshot[inp.name] for inp in compiled.inputs]
    counts = next(iter(compiled.observer.notes.values()))["canonicalize"]
    return Canonicalized(graphs["before"], graphs["after"], counts, inputs, output)


def run(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """gm's outputs on copies of inputs, then those copies (the state the graph wrote)."""
    copies = [t.clone() for t in inputs]
    with torch.no_grad():
        outputs = gm(*copies)
    return [*torch.utils._pytree.tree_leaves(outputs), *copies]


def assert_same_values(c: Canonicalized, rel: float = 1e-6) -> None:
    """The rewritten graph computes what the unrewritten one does: outputs and written state,
    same dtypes and shapes, values within `rel` (relative to the largest magnitude)."""
    want, got = run(c.before, c.inputs), run(c.after, c.inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        if w.is_floating_point():
            assert rel_err(g, w) <= rel, rel_err(g, w)
        else:
            assert torch.equal(g, w)


def targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
