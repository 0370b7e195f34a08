"""Stage `contract`, the fusion contract: each layer template declares the fused ops it expects;
after the other stages, plan vs actual per layer. A shortfall warns, or raises with `strict`.

Templates (spec §5): `dense` (layer 0: KDA + dense SiTU MLP), `kda_moe`, `mla_moe`, `last` (the
last layer: MLA + MoE, as mla_moe) and `final`, the model's own final depth mix + norm
(`language_model.model.norm`: it belongs to no layer), reported with the rest of the model's
own ops (embedding, lm_head) as pseudo-layer FINAL.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re

import torch
from torch import fx

from k3compile.rewrite import NEUTRAL, module_path

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
    "final": {"attn_res_mix_norm": 1},  # the model's final depth mix + norm, after every layer
}
FINAL = -1  # the pseudo-layer of the model's final mix + norm (k3compile.diff: outside the layers)

# a fused op that takes the planned op's place: at W > 1 the collective variant is the
# post-attention mix (o_proj stays a GEMM before it, spec §5.2 row 5's GEMM + all-reduce)
SATISFIES = {"allreduce_attn_res_mix_norm": "oproj_attn_res_mix_norm"}

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

_LAYER = re.compile(r"layers\.(\d+)\.")
_MOE = re.compile(r"\.mlp\.(gate|experts|routed_expert_\w+)(\.|$)")
# MLA's own submodules; after fusion the q_a/kv_a GEMMs are gone but the fused ops keep the
# norms' (or kv_b's) paths
_MLA = re.compile(r"\.self_attn\.(q_a_\w+|kv_a_\w+|q_b_proj|kv_b_proj)(\.|$)")


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
    def met(self) -> bool:
        return all(not lr.shortfall for lr in self.layers)


def _op_name(node: fx.Node) -> str:
    if not isinstance(node.target, torch._ops.OpOverload):
        return getattr(node.target, "__name__", str(node.target))  # operator.getitem -> getitem
    return node.target._opname


def _is_final(path: str) -> bool:
    return path.startswith("language_model.model.norm") or "output_attn_res" in path


def _layer_of(node: fx.Node) -> int | None:
    m = _LAYER.search(module_path(node) + ".")
    return int(m.group(1)) if m else None


def layer_templates(graph: fx.Graph) -> dict[int, str]:
    paths = collections.defaultdict(set)
    for node in graph.nodes:
        layer = _layer_of(node)
        if layer is not None:
            paths[layer].add(module_path(node))
    # `last` owns the final mix + norm; a bare stack of layers (benchmarks) has none
    final = any(_is_final(module_path(n)) for n in graph.nodes)
    last = max(paths, default=-1) if final else -1
    out = {}
    for layer, ps in sorted(paths.items()):
        mla = any(_MLA.search(p) for p in ps)
        moe = any(_MOE.search(p) for p in ps)
        # K3's last layer is MLA; a model cut to its first layers (`K3Config.with_layers`) may
        # end on a KDA layer, which keeps its own template
        out[layer] = "last" if layer == last and layer > 0 and mla else (
            "dense" if not moe else "mla_moe" if mla else "kda_moe")
    if final:
        out[FINAL] = "final"
    return out


def layer_ops(graph: fx.Graph) -> dict[int, tuple[collections.Counter, collections.Counter]]:
    """layer -> (k3 ops, other compute ops); what lies outside the layers (the final mix + norm,
    lm_head, ...) under FINAL where the graph has the final norm (a whole model)."""
    templates = layer_templates(graph)
    fused = collections.defaultdict(collections.Counter)
    other = collections.defaultdict(collections.Counter)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        layer = _layer_of(node)
        if layer is None:  # outside the layers: embedding, the final mix + norm, lm_head
            layer = FINAL if FINAL in templates else None
        if layer is None:
            continue
        target = str(node.target)
        if target.startswith("k3."):
            op = target.split(".")[1]
            fused[layer][SATISFIES.get(op, op)] += 1
        else:
            name = _op_name(node)
            if name not in _NO_KERNEL:
                other[layer][name] += 1
    return {layer: (fused[layer], other[layer]) for layer in templates}


def contract(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage: plan vs actual on the final graph, in the notes as "contract" (the backend's
    `contracts`); a shortfall warns, or raises with `Options.strict`."""
    ctx.notes["contract"] = check_contract(gm.graph, ctx.report, ctx.options.strict)
    return gm


def check_contract(graph: fx.Graph, rewrites=None, strict: bool = False) -> ContractReport:
    """Plan vs actual per layer of `graph`; `rewrites` (a RewriteReport) names the ops deferred
    on this device (reported, not a shortfall)."""
    templates = layer_templates(graph)
    ops = layer_ops(graph)
    deferred = frozenset(rewrites.deferred) if rewrites is not None else frozenset()
    layers = [LayerReport(layer, t, PLANS.get(t, {}), *ops[layer], deferred=deferred)
              for layer, t in templates.items()]
    report = ContractReport(layers)
    if deferred & {op for lr in layers for op in lr.expected}:
        log.info("k3: left unfused on this device (no kernel yet): %s", sorted(deferred))
    if not report.met:
        msg = "k3 fusion contract not met: " + "; ".join(
            f"layer {lr.layer} ({lr.template}) missing {lr.shortfall}" for lr in layers if lr.shortfall)
        if strict:
            raise ContractError(msg)
        log.warning(msg)
    return report


def format_contract(report: ContractReport, batch) -> str:
    lines = [f"fusion plan vs actual (batch bucket {batch}): {'met' if report.met else 'NOT met'}"]
    lines.append(f"  {'layer':>5} {'template':<8} {'fused ops':>9} {'k3.linear':>9} "
                 f"{'left to Inductor':>16}  plan")
    for lr in report.layers:
        plan = ", ".join(f"{op} {lr.actual[op]}/{n}" + (" deferred" if op in lr.deferred else "")
                         for op, n in lr.expected.items())
        name = "model" if lr.layer == FINAL else lr.layer
        lines.append(f"  {name:>5} {lr.template:<8} {lr.fused_ops:>9} {lr.gemm_ops:>9} "
                     f"{sum(lr.other_ops.values()):>16}  {plan}")
    return "\n".join(lines)
