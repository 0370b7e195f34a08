"""Stage `contract`, the fusion contract: each layer template declares the fused ops it expects;
after the other stages, plan vs actual per layer. A shortfall warns, or raises with `strict`.

Templates (spec §5): `dense` (KDA + dense SiTU MLP, K3's layer 0), `kda_moe`, `mla_moe`, `last`
(the last layer: MLA + MoE, as mla_moe) and `final`, the model's own final depth mix + norm (it
belongs to no layer), reported with the rest of the model's own ops (embedding, lm_head) as
pseudo-layer FINAL. Layers and templates are read off the graph's structure, not its module
names (`k3compile.layers`), on the graph as it entered stage `fuse` (the notes' "layers": the
plan comes from what the model computes, not from what the fusions made of it); a graph in
which no K3 layer is found says so and is never "met".
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import torch
from torch import fx

from k3compile.layers import FINAL, OTHER, Layers, find_layers, layer_index
from k3compile.rewrite import NEUTRAL, NearMiss, module_path

log = logging.getLogger("k3compile")

# The plan as data: template -> fused op -> count per layer. Grows with the pattern set.
_MOE_PLAN = {"moe_front": 1, "moe_route": 1, "moe_experts": 1, "norm_linear": 1,
             "situ_gate_up": 1}  # + the shared down GEMM, a k3.linear (NEUTRAL)

# Attention half (spec §5.2 rows 2-4): fused in-proj GEMM, the recurrent step with f_b's GEMM in
# its prologue, or the MLA chain.
_KDA_PLAN = {"linear_concat": 1, "fb_kda_decode": 1}
_MLA_PLAN = {"linear_concat": 1, "mla_lowrank_norm": 1, "mla_q_absorb": 1, "mla_decode": 1,
             "mla_uv_gate": 1}

# the post-attention mix takes o_proj in its prologue (spec §5.2 rows 5-6)
_POST = {"oproj_attn_res_mix_norm": 1}

PLANS: dict[str, dict[str, int]] = {
    # layer 0's pre-attention mix has no source: plain norm; + the down GEMM, a k3.linear
    "dense": {"rms_norm": 1, **_KDA_PLAN, **_POST, "situ_gate_up": 1},
    "kda_moe": {"attn_res_mix_norm": 1, **_KDA_PLAN, **_POST, **_MOE_PLAN},
    "mla_moe": {"attn_res_mix_norm": 1, **_MLA_PLAN, **_POST, **_MOE_PLAN},
    "last": {"attn_res_mix_norm": 1, **_MLA_PLAN, **_POST, **_MOE_PLAN},  # K3's last layer is MLA
    # no K3 layer is MLA + dense, a user's model may be; its pre-attention mix or plain norm
    # depends on its place in the AttnRes blocks, so it is left out
    "mla_dense": {**_MLA_PLAN, **_POST, "situ_gate_up": 1},
    "final": {"attn_res_mix_norm": 1},  # the model's final depth mix + norm, after every layer
}

NO_LAYER = "no K3 layer found"  # the report of a graph without a KDA or MLA layer

# a fused op that takes a planned op's place, and the planned ops it may stand for, in the order
# they are filled: at W > 1 the collective variant is the post-attention mix (o_proj stays a
# GEMM before it, spec §5.2 row 5's GEMM + all-reduce), and also the pre-attention mix of a
# layer after a dense one (the dense MLP's down GEMM ends in an all-reduce too)
SATISFIES = {"allreduce_attn_res_mix_norm": ("oproj_attn_res_mix_norm", "attn_res_mix_norm")}
# a fused op that is several planned ops at once (option front_route: the front and the routing)
COMBINES = {"moe_front_route": ("moe_front", "moe_route")}

# Ops that are one GEMM each, not a fusion: `k3.linear` is a plain x·Wᵀ that no fusion took (our
# skinny GEMM on CUDA). Which GEMMs it takes depends on the device (a fusion deferred there leaves
# its GEMMs to it) and on the world size (o_proj at W > 1), so the plans, which declare fusions,
# leave it out: never planned, never a shortfall, not counted as a fused op; reported as GEMMs.
# (`NEUTRAL` lives in k3compile.rewrite, whose near misses it also concerns.)

# k3 ops that schedule rather than compute: side-stream fork / join (events) and the L2 prefetch
SCHEDULE = frozenset({"stream_fork", "stream_join", "prefetch_l2", "expert_stack"})  # + a view

# ATen ops that launch no kernel of their own (views, metadata, getitem of multi-output ops)
_NO_KERNEL = {"view", "reshape", "_unsafe_view", "permute", "unsqueeze", "squeeze", "expand",
              "slice", "select", "split", "split_with_sizes", "t", "transpose", "getitem",
              "alias", "detach", "sym_size", "_to_copy"}


class ContractError(AssertionError):
    pass


@dataclasses.dataclass
class LayerReport:
    layer: int
    template: str
    expected: dict[str, int]
    actual: collections.Counter
    other_ops: collections.Counter  # ATen compute ops left to Inductor
    # planned ops the backend chose not to fuse on this device (no kernel there yet): reported,
    # not a shortfall
    deferred: frozenset[str] = frozenset()

    @property
    def shortfall(self) -> dict[str, int]:
        return {op: n - self.actual[op] for op, n in self.expected.items()
                if self.actual[op] < n and op not in self.deferred}

    @property
    def fused_ops(self) -> int:
        """The layer's fused compute ops: not its plain GEMMs (NEUTRAL) nor the stream and
        prefetch bookkeeping (SCHEDULE: events and an L2 hint, no compute of the model's)."""
        return sum(n for op, n in self.actual.items() if op not in NEUTRAL | SCHEDULE)

    @property
    def gemm_ops(self) -> int:
        """The layer's NEUTRAL ops: plain GEMMs, outside the plan."""
        return sum(self.actual[op] for op in NEUTRAL)


@dataclasses.dataclass
class ContractReport:
    layers: list[LayerReport]

    @property
    def found(self) -> bool:
        """Whether the graph holds a K3 layer at all (KDA or MLA attention)."""
        return any(lr.template not in (OTHER, "final") for lr in self.layers)

    @property
    def unrecognised(self) -> list[int]:
        """Layers of a K3 graph that are no K3 layer: a spelling the classifier does not read."""
        return [lr.layer for lr in self.layers if lr.template == OTHER]

    @property
    def met(self) -> bool:
        return self.found and not self.unrecognised and all(not lr.shortfall for lr in self.layers)

    @property
    def status(self) -> str:
        return NO_LAYER if not self.found else "met" if self.met else "NOT met"


def _op_name(node: fx.Node) -> str:
    if not isinstance(node.target, torch._ops.OpOverload):
        return getattr(node.target, "__name__", str(node.target))  # operator.getitem -> getitem
    return node.target._opname


def layer_templates(graph: fx.Graph) -> dict[int, str]:
    """layer -> template, read off the graph's structure (`k3compile.layers`)."""
    return find_layers(graph).templates()


def layer_ops(graph: fx.Graph, templates: dict[int, str] | None = None
              ) -> dict[int, tuple[collections.Counter, collections.Counter]]:
    """layer -> (k3 ops, other compute ops); what lies outside the layers (the final mix + norm,
    lm_head, ...) under FINAL where the graph has the final norm (a whole model)."""
    templates = layer_templates(graph) if templates is None else templates
    fused = collections.defaultdict(collections.Counter)
    other = collections.defaultdict(collections.Counter)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        layer = layer_index(module_path(node))
        if layer is None:  # outside the layers: embedding, the final mix + norm, lm_head
            layer = FINAL if FINAL in templates else None
        if layer is None:
            continue
        target = str(node.target)
        if target.startswith("k3."):
            fused[layer][target.split(".")[1]] += 1
        else:
            name = _op_name(node)
            if name not in _NO_KERNEL:
                other[layer][name] += 1
    return {layer: (_stand_in(fused[layer], PLANS.get(t, {})), other[layer])
            for layer, t in templates.items()}


def _stand_in(ops: collections.Counter, plan: dict[str, int]) -> collections.Counter:
    """`ops` with each stand-in op (SATISFIES) counted as the planned ops it takes the place of:
    it fills its targets' shortfalls in order, and any left over counts as its first target."""
    out = collections.Counter({op: n for op, n in ops.items()
                               if op not in SATISFIES and op not in COMBINES})
    for op, targets in COMBINES.items():
        for target in targets:
            if ops[op]:
                out[target] += ops[op]
    for op, targets in SATISFIES.items():
        left = ops[op]
        for target in targets:
            take = min(left, max(plan.get(target, 0) - out[target], 0))
            if take:
                out[target] += take
                left -= take
        if left:
            out[targets[0]] += left
    return out


def contract(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage: plan vs actual on the final graph, in the notes as "contract" (the backend's
    `contracts`); a shortfall warns, or raises with `Options.strict`."""
    ctx.notes["contract"] = check_contract(gm.graph, ctx.report, ctx.options.strict,
                                           ctx.notes.get("layers"))
    return gm


def check_contract(graph: fx.Graph, rewrites=None, strict: bool = False,
                   layers: Layers | None = None) -> ContractReport:
    """Plan vs actual per layer of `graph`; `rewrites` (a RewriteReport) names the ops deferred
    on this device (reported, not a shortfall); `layers`: the layers as read before fusion
    (default: read off `graph`, whose fused ops show the kinds too)."""
    templates = (layers or find_layers(graph)).templates()
    ops = layer_ops(graph, templates)
    deferred = frozenset(rewrites.deferred) if rewrites is not None else frozenset()
    layers = [LayerReport(layer, t, PLANS.get(t, {}), *ops[layer], deferred=deferred)
              for layer, t in templates.items()]
    report = ContractReport(layers)
    if deferred & {op for lr in layers for op in lr.expected}:
        log.info("k3: left unfused on this device (no kernel yet): %s", sorted(deferred))
    if not report.met:
        msg = "k3 fusion contract not met: " + "; ".join(
            [f"layer {lr.layer} ({lr.template}) missing {lr.shortfall}"
             + _why(lr, rewrites) for lr in layers if lr.shortfall]
            + [f"layer {i} is no K3 layer (no KDA or MLA attention found)"
               for i in report.unrecognised])
        if not report.found:
            msg = f"k3 fusion contract: {NO_LAYER} (no layer with KDA or MLA attention)"
        if strict:
            raise ContractError(msg)
        log.warning(msg)
    return report


def _why(lr: LayerReport, rewrites) -> str:
    """A near miss in the layer for each missing op, so that the warning names why each did not
    fire: of a missing op's records, a refused check first (the whole pattern matched, its check
    said no: the most telling), else the first. A fusion built on another (fb_kda_decode on
    kda_decode) is explained by the misses of the op it builds on."""
    misses = getattr(rewrites, "near_misses", ())
    named: dict[str, tuple[tuple[bool, bool], NearMiss]] = {}
    for miss in misses:
        family = miss.pattern.split("[")[0].split(" ")[0]
        where = layer_index(miss.module) if miss.module else lr.layer
        if where != lr.layer:
            continue
        for op in lr.shortfall:
            if op == family or op.endswith("_" + family):
                rank = (op == family, miss.reason.startswith("check refused"))
                if op not in named or rank > named[op][0]:
                    named[op] = rank, miss
    parts = []
    for op in lr.shortfall:
        if op in named:
            miss = named[op][1]
            reason = miss.reason if len(miss.reason) < 240 else miss.reason[:237] + "..."
            parts.append(f"near miss {miss.pattern}: {reason}")
    return f" ({'; '.join(parts)})" if parts else ""


def format_contract(report: ContractReport, batch) -> str:
    lines = [f"fusion plan vs actual (batch bucket {batch}): {report.status}"]
    lines.append(f"  {'layer':>5} {'template':<8} {'fused ops':>9} {'k3.linear':>9} "
                 f"{'left to Inductor':>16}  plan")
    for lr in report.layers:
        plan = ", ".join(f"{op} {lr.actual[op]}/{n}" + (" deferred" if op in lr.deferred else "")
                         for op, n in lr.expected.items())
        name = "model" if lr.layer == FINAL else lr.layer
        lines.append(f"  {name:>5} {lr.template:<8} {lr.fused_ops:>9} {lr.gemm_ops:>9} "
                     f"{sum(lr.other_ops.values()):>16}  {plan}")
    return "\n".join(lines)
