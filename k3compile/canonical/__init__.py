"""Canonical forms: the rules that stage `canonicalize` applies before `fuse`, so that the patterns
are written against one spelling of each K3 computation, not against our model's.

A user's K3 spells the same math many ways (a short conv as `F.conv1d` or as a window sum; a state
write as `index_put`, `copy_` or slice assignment; a projection as `mm`, `bmm`, `matmul` or
`einsum`; ...). Each rule rewrites the spellings of one computation into its canonical form, the
form `k3compile/math.py` (and so our model and every pattern's search) traces to. A rule is small,
named, and only ever replaces a subgraph by one that computes the same values with the same dtype
and shape; its tests (`tests/canonical/test_<rule>.py`) show each spelling it takes (positive) and
look-alikes it must leave alone (negative), numerically against the unrewritten graph.

`ORDER` is the order the stage applies them in (a later rule may rely on an earlier one's form).
Each module `k3compile/canonical/<name>.py` defines `RULE`, a `Rule`; most state only what they
match and what they write, and leave the walk over the graph to `rewrite_sites`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

from torch import fx

from k3compile.rewrite import inductor

ORDER: tuple[str, ...] = ("index_expand", "put_rows", "scatter_rows", "paged_write", "token_dim", "state_write", "cache_block",
                          "slot_mapping",
                          "causal_mask", "sdpa_math",
                          "baddbmm_mask",
                          "position_grid",
                          "mla_upcast",
                          "mla_absorb",
                          "mla_absorbed", "verify_rows", "layer_positions", "table_lookup", "nibble_unpack",
                          "mxfp4_dequant",
                          "cast_split", "pair_restore", "pair_order", "expert_rows",
                          "expert_slots", "expert_pick", "expert_gather", "expert_stack", "expert_gemm",
                          "expert_split", "scatter_sum", "expert_combine", "gemm", "lowrank_view", "conv_crop",
                          "conv_roll",
                          "window_stack", "short_conv", "conv_einsum", "cell_conv", "split_rows", "token_column", "token_windows",
                          "delta_chunk", "token_select",
                          "proj_split",
                          "logsigmoid_exp", "head_repeat",
                          "token_view",
                          "qkv_split",
                          "self_dot",
                          "split_heads",
                          "unbind_split", "cast_pieces", "square", "norm_keepdim",
                          "norm_rms",
                          "rms_forms",
                          "norm_square", "l2_norm", "norm_scale", "sigmoid", "situ_forms",
                          "head_split", "bias_view",
                          "addcmul_split",
                          "baddbmm_split", "head_rows", "state_matvec", "state_transpose", "token_unsqueeze", "delta_einsum", "heads_first",
                          "norm_round", "conv_states", "conv_merge",
                          "proj_groups",
                          "gate_up_split",
                          "index_slice",
                          "where_scatter",
                          "depth_mix", "slice_split", "group_limit", "noop_view", "cast_select", "cast_view", "sigmoid_round",
                          "cast_merge", "cast_cat",
                          "broadcast",
                          "take_along",
                          "sort_topk",
                          "topk_sorted", "route_mask", "view_chains", "view_add", "reshape_fold",
                          "stack_cat", "token_rows", "combine_rows", "cast_squeeze", "router_input",
                          "permute_fold",
                          "expert_dense", "equal_split",
                          "token_linear")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One canonicalisation. `apply(graph)` rewrites every site it finds in place and returns how
    many it rewrote; it leaves every new node with `meta["val"]` (`k3compile.graph.call`) and the
    module stack of the node it replaces, so per-layer tools still place it."""

    name: str
    apply: Callable[[fx.Graph], int]
    summary: str  # one line: spellings in -> canonical form out


def rewrite_sites(graph: fx.Graph, match: Callable, write: Callable, *, targets=None,
                  reverse: bool = False, traced: bool = False, tidy: bool = True,
                  sort: bool = False) -> int:
    """The walk every rule shares; returns how many sites were rewritten.

    Visits each node the graph held when it started (last first with `reverse`), less those
    erased since and, with `targets`, those that call none of them. `match(node)` returns the
    node's site (None or False: it is none) and `write(graph, node, site)` rewrites it, returning
    None (one site rewritten) or how many it rewrote (a bool: one or none). `traced`: the rule
    splices traced graphs, which need the graph's module (no module: nothing to do), and `write`
    takes a fourth argument, a dict its sites share (one trace per shape). After any rewrite,
    `sort` re-sorts the graph topologically (a splice read nodes defined after its site) and
    `tidy` removes the dead code."""
    if traced and graph.owning_module is None:
        return 0
    shared = ({},) if traced else ()
    done = 0
    for node in reversed(list(graph.nodes)) if reverse else list(graph.nodes):
        if node._erased or targets is not None and (node.op != "call_function"
                                                    or node.target not in targets):
            continue
        site = match(node)
        if site is None or site is False:
            continue
        wrote = write(graph, node, site, *shared)
        done += 1 if wrote is None else wrote
    if done and sort:
        inductor.stable_topological_sort(graph)
    if done and tidy:
        graph.eliminate_dead_code()
    return done


@functools.cache
def all_rules() -> tuple[Rule, ...]:
    """Every rule, in `ORDER`."""
    return tuple(importlib.import_module(f"{__name__}.{name}").RULE for name in ORDER)


__all__ = ["ORDER", "Rule", "all_rules", "rewrite_sites"]
