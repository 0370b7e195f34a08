"""Rule `cast_split`: a dtype cast of a merged projection's output, then its split -> the split,
then a cast of each piece.

A serving file runs SiTU-GLU on its merged gate|up GEMM as `g, u = gate_up.float().chunk(2,
-1)` (tests/models/spell10_k3.py: the dense MLP, the shared experts and the routed experts'
w13), one upcast before the chunk. `k3compile/math.py` (`situ`) and the patterns cast each half
(`gate.float()`, `up.float()`), and rules `gate_up_split` / `expert_split` take a split read
straight off the GEMM; behind the cast, bf16 lost situ_gate_up and moe_experts (in fp32 the
cast is none):

    split(convert_element_type(x, fp32), ...) -> [convert_element_type(p, fp32) for p in split(x)]

Exact: a cast is elementwise and a split moves no value; the same values, dtypes and shapes.

Taken: a `split` / `split_with_sizes` (what `chunk` and `split` trace to) into two pieces (gate,
up) whose input is an fp32 upcast of a bf16 / fp16 GEMM output (mm / bmm / addmm, through
layout ops), read by nothing else. Left alone: a cast also read whole (it would then be computed
twice), a cast of anything but a GEMM (spell5's bf16 KDA rounds its fp32 short conv and splits
q|k|v: the kda_decode pattern has that cast before the split), a downcast, an integer cast, a
split into more pieces.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import val as _val
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten
CAST = torch.ops.prims.convert_element_type.default
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
GEMMS = {aten.mm.default, aten.bmm.default, aten.addmm.default}
LOW = (torch.bfloat16, torch.float16)
LAYOUT = RESHAPES | {aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
                     aten.clone.default}


def _gemm(node) -> bool:
    """node is a GEMM's output, through layout ops (an einsum's bmm read back)."""
    while isinstance(node, fx.Node) and node.target in LAYOUT:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.target in GEMMS


def _site(node: fx.Node) -> bool:
    cast = node.args[0]
    if not (isinstance(cast, fx.Node) and cast.target is CAST and len(cast.users) == 1
            and _gemm(cast.args[0])):
        return False
    val, src = _val(cast), _val(cast.args[0])
    if val is None or src is None or val.dtype != torch.float32 or src.dtype not in LOW:
        return False
    return len(node.users) == 2 and all(u.target is operator.getitem for u in node.users)


def _write(graph: fx.Graph, split: fx.Node, _) -> None:
    cast = split.args[0]
    with graph.inserting_before(split):
        first = call(graph, split.target, (cast.args[0], *split.args[1:]), split.kwargs,
                     like=split)
    for item in list(split.users):
        with graph.inserting_before(item):
            piece = call(graph, operator.getitem, (first, item.args[1]), like=item)
            new = call(graph, CAST, (piece, *cast.args[1:]), cast.kwargs, like=item)
        item.replace_all_uses_with(new)
        graph.erase_node(item)
    graph.erase_node(split)
    graph.erase_node(cast)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets=SPLITS)


RULE = Rule("cast_split", apply, "split(x.to(dtype)) -> [p.to(dtype) for p in split(x)]")
