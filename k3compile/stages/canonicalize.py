"""Stage `canonicalize`: every canonical-form rule (`k3compile.canonical`), in order, so that the
patterns of stage `fuse` meet one spelling of each K3 computation whatever spelling the user's
model chose. What each rule rewrote is in the notes as "canonicalize" (rule -> sites) and logged.

The placeholders of the inputs the caller passes each step (ids, positions, slots, activations;
not parameters or buffers) carry `meta["k3_user_input"]`: rules that need a weight read it.

A rule that raises is undone (the graph before it restored), reported as reverted and logged;
the compile goes on without it.

With `Options.verify` (K3_VERIFY=1) each rule that rewrote something is checked on the whole
graph: the graph before and after the rule run on copies of the compile's real inputs, and every
output and every input the graph writes (the state buffers) must agree in dtype, shape and value
(within `TOLERANCE` of the dtype). A rule that fails is undone (the graph before it restored) and
reported as reverted (`RewriteReport.reverted`, pattern `canonical.<rule>`, a warning); the
rules after it run on the restored graph.
"""

from __future__ import annotations

import logging

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from k3compile.canonical import all_rules
from k3compile.rewrite import Reverted

log = logging.getLogger("k3compile")

# relative error (max |a - b| / max |b|) a canonical rewrite may add, by dtype: the patterns'
# verify tolerances (k3compile.rewrite.Pattern.tolerance)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-9}


def canonicalize(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    gm.meta["real_inputs"] = ctx.inputs  # the placeholders' real tensors (constant tables)
    mark_user_inputs(gm.graph, ctx.user_inputs)
    verify = ctx.options.verify and _runnable(gm, ctx.inputs)
    skipped = set(ctx.options.disabled_rules)
    while (counts := _apply(gm, ctx, skipped, verify)) is None:
        pass  # a rule raised: the pass again from the start, without it
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ctx.notes["canonicalize"] = counts
    if any(counts.values()):
        log.info("k3 canonicalize (batch %s): %s", ctx.batch,
                 ", ".join(f"{name} {n}" for name, n in counts.items() if n))
    return gm


def _apply(gm: fx.GraphModule, ctx, skipped: set[str], verify: bool) -> dict[str, int] | None:
    """Every rule not in `skipped`, in order; None where one raised (then the graph is as it was
    before the pass, the rule reported and added to `skipped`). A copy of the graph is O(graph),
    and a model with per-expert parameters has tens of thousands of placeholders: without
    verify one copy is taken, before the first rule (rules are deterministic: running the ones
    before a raising rule again remakes their rewrites); under verify, one before each rule that
    runs after the graph changed (`saved`: the graph before the rule, to undo it)."""
    counts = {}
    start = saved = None
    for rule in all_rules():
        if rule.name in skipped:
            if rule.name not in ctx.options.disabled_rules:
                counts[rule.name] = 0  # raised in an earlier pass
            continue
        if verify and saved is None:
            saved = _copy(gm.graph)
        elif not verify and start is None:
            start = _copy(gm.graph)
        try:
            counts[rule.name] = rule.apply(gm.graph)
        except Exception as e:  # noqa: BLE001 (a rule's bug costs its rewrites, not the compile)
            gm.graph = saved if verify else start
            ctx.report.reverted.append(Reverted(f"canonical.{rule.name}", "(graph)", "",
                                                f"raised {type(e).__name__}: {e}"))
            log.warning("k3 canonicalize: rule %s raised %s: %s; its rewrites are undone and "
                        "the compile goes on without them", rule.name, type(e).__name__, e)
            skipped.add(rule.name)
            if verify:  # the graph is the one before it: go on from there
                counts[rule.name], saved = 0, None
                continue
            return None
        if not counts[rule.name] or not verify:
            continue  # `saved` is still the graph
        gm.recompile()
        if (error := _disagreement(gm, saved, ctx.inputs)) is not None:
            gm.graph = saved
            ctx.report.reverted.append(Reverted(f"canonical.{rule.name}", "(graph)", "", error))
            log.warning("k3 verify: canonical rule %s reverted: %s", rule.name, error)
            counts[rule.name] = 0
        saved = None  # the graph changed, or is the copy itself again
    return counts


def mark_user_inputs(graph: fx.Graph, user_inputs: frozenset[int]) -> None:
    """`meta["k3_user_input"]` on the placeholders of the inputs the caller passes each step: a
    rule that needs a weight (a parameter) never takes one of them for it."""
    for i, node in enumerate(n for n in graph.nodes if n.op == "placeholder"):
        node.meta["k3_user_input"] = i in user_inputs


def _runnable(gm: fx.GraphModule, inputs: list) -> bool:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs) or any(
            isinstance(x, torch.Tensor) and (x.is_meta or isinstance(
                x, torch._subclasses.fake_tensor.FakeTensor)) for x in inputs):
        log.warning("k3 verify: the canonical rules are not checked (no real inputs for the "
                    "%d graph inputs)", len(placeholders))
        return False
    return True


def _copy(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph(owning_module=graph.owning_module)
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _run(gm: fx.GraphModule, inputs: list) -> list:
    """Outputs, then every input afterwards (the graph writes state buffers in place)."""
    args = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    outs = torch.utils._pytree.tree_leaves(gm(*args))
    return [*outs, *args]


def _disagreement(gm: fx.GraphModule, before: fx.Graph, inputs: list) -> str | None:
    """Why the graph now computes something else than `before` did on `inputs`, or None (run
    for real: the stage runs inside Inductor's compile, under its fake-tensor mode)."""
    with unset_fake_temporarily(), torch.no_grad():
        return _compare(gm, before, inputs)


def _compare(gm: fx.GraphModule, before: fx.Graph, inputs: list) -> str | None:
    try:
        got = _run(gm, inputs)
        reference = fx.GraphModule(gm, before)
        want = _run(reference, inputs)
    except Exception as e:  # noqa: BLE001 (a rewrite that cannot run is as bad as a wrong one)
        return f"raised {type(e).__name__}: {e}"
    if len(got) != len(want):
        return f"{len(got)} outputs and inputs for {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.dtype != w.dtype or g.shape != w.shape:
            return (f"value {i}: {getattr(g, 'dtype', type(g))}{list(getattr(g, 'shape', []))} "
                    f"where the graph had {w.dtype}{list(w.shape)}")
        if not w.is_floating_point():
            if not torch.equal(g, w):
                return f"value {i}: {w.dtype} values differ"
            continue
        gd, wd = g.double(), w.double()
        finite = wd.isfinite()
        if not (torch.equal(finite, gd.isfinite())
                and torch.equal(gd[~finite].nan_to_num(0.0), wd[~finite].nan_to_num(0.0))):
            return f"value {i}: NaN or infinities moved"
        if not finite.any():
            continue
        gd, wd = gd[finite], wd[finite]
        err = (gd - wd).abs().max().item() / max(wd.abs().max().item(), 1e-30)
        if not err <= TOLERANCE.get(w.dtype, 1e-4):
            return f"value {i}: relative error {err:.3g} (tolerance {TOLERANCE.get(w.dtype, 1e-4)})"
    return None
