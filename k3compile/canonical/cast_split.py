"""Rule `cast_split`: an upcast of a bf16 / fp16 value, then its split -> the split, then an
upcast of each piece.

A serving file runs SiTU-GLU on its merged gate|up GEMM as `g, u = gate_up.float().chunk(2,
-1)` (tests/models/spell10_k3.py: the dense MLP, the shared experts and the routed experts'
w13), one upcast before the chunk, and cuts its KDA conv output as `q, k, v =
qkv.float().split(...)`. `k3compile/math.py` (`situ`) and the patterns cast each piece
(`gate.float()`, `up.float()`; kda_decode's `cq.float()`, `ck.float()`, `cv.float()`), and rules
`gate_up_split` / `expert_split` take a split read straight off the GEMM; behind the cast, bf16
lost situ_gate_up, moe_experts and kda_decode (in fp32 the cast is none):

    split(convert_element_type(x, fp32), ...) -> [convert_element_type(p, fp32) for p in split(x)]

Exact: a cast is elementwise and a split moves no value; the same values, dtypes and shapes.

Taken: a `split` / `split_with_sizes` (what `chunk` and `split` trace to) read only by its
pieces, whose input is an fp32 upcast of a bf16 / fp16 value read by nothing else. Left alone:
a cast also read whole (it would then be computed twice), a downcast (spell5's bf16 KDA rounds
its fp32 short conv, then splits q|k|v: the kda_decode pattern has that cast before the split;
a first, general version of this rule (session 29) moved it and broke spell5's bf16 KDA), an
integer cast. Session 29's version took only a GEMM's output split in two (gate, up); session 31
takes any source and any number of pieces (spell10's rounded conv output split q|k|v).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CAST, LOW
from k3compile.canonical.region import val as _val
from k3compile.graph import call

aten = torch.ops.aten
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


def _site(node: fx.Node) -> bool:
    cast = node.args[0]
    if not (isinstance(cast, fx.Node) and cast.target is CAST and len(cast.users) == 1):
        return False
    val, src = _val(cast), _val(cast.args[0])
    if val is None or src is None or val.dtype != torch.float32 or src.dtype not in LOW:
        return False
    return bool(node.users) and all(u.target is operator.getitem for u in node.users)


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
