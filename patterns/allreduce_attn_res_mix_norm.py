"""The attention output's all-reduce fused into the post-attention depth mix + RMSNorm ->
`k3.allreduce_attn_res_mix_norm` (tensor parallelism, world size > 1).

Runs after `attn_res_mix_norm` and matches its op fed by the all-reduce of the o_proj partial
sums (the prefix add `prefix + a`, or `a` itself where a block starts). One kernel then does the
reduction, the prefix update, the mix and the norm; at world size 1 the graph has no collective
and `attn_res_mix_norm` alone is the fused op.

Before: a = wait_tensor(all_reduce(partial, "sum", group)); x, p = k3.attn_res_mix_norm(prefix, a, ..)
After:  p, x = k3.allreduce_attn_res_mix_norm(partial, prefix, [blocks], ..., group)
"""

from __future__ import annotations

import itertools

import torch
from k3compile.patterns.attn_res_mix_norm import KINDS, MAX_BLOCKS, SHAPE

from k3compile.rewrite import Pattern, tensor_meta, with_signature

GROUP = "__k3_group__"  # traced in place of the process group's name, matched as a wildcard
_c10d = torch.ops._c10d_functional


def check(match) -> str | None:
    partial = tensor_meta(match.kwargs["partial"])
    if partial is None or partial.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"partial dtype {getattr(partial, 'dtype', None)} is not a float type"
    if not isinstance(match.kwargs["group_name"], str):
        return "the all-reduce's group is not a constant name"
    return None


def _variant(n_blocks: int, with_prefix: bool, dtype: torch.dtype = torch.bfloat16,
             scores_fp32: bool = False) -> Pattern:
    blocks = [f"block{i}" for i in range(n_blocks)]
    names = ["partial", *(["prefix"] if with_prefix else []), *blocks,
             "w_mix_norm", "w_mix_proj", "w_norm", "mix_eps", "norm_eps", "group_name"]
    np_ = 1 if with_prefix else 0

    def split(args):
        prefix = args[1] if with_prefix else None
        return args[0], prefix, list(args[1 + np_:1 + np_ + n_blocks]), *args[1 + np_ + n_blocks:]

    extra = (True,) if scores_fp32 else ()  # the mix's scores in fp32 (Moonshot's)

    def search(*args):
        partial, prefix, blks, wmn, wmp, wn, me, ne, group = split(args)
        a = _c10d.wait_tensor(_c10d.all_reduce(partial, "sum", GROUP))
        if with_prefix:
            prefix_out, x = torch.ops.k3.attn_res_mix_norm(prefix, a, blks, wmn, wmp, wn, me, ne,
                                                           *extra)
            return x, prefix_out
        # a block starts: `a` is also the next prefix, so it is an output (it has other users)
        return torch.ops.k3.attn_res_mix_norm(a, None, blks, wmn, wmp, wn, me, ne, *extra)[1], a

    def replace(*args):
        partial, prefix, blks, wmn, wmp, wn, me, ne, group = split(args)
        prefix_out, x = torch.ops.k3.allreduce_attn_res_mix_norm(partial, prefix, blks, wmn, wmp,
                                                                 wn, me, ne, group, *extra)
        return x, prefix_out

    def example_inputs():
        act = [torch.randn(SHAPE, dtype=dtype) for _ in range(1 + np_ + n_blocks)]
        d = SHAPE[-1]
        w = [torch.randn(d, dtype=dtype), torch.randn(1, d, dtype=dtype), torch.randn(d, dtype=dtype)]
        return [*act, *w, 1.1e-5, 1.3e-5, GROUP]

    return Pattern(
        name=f"allreduce_attn_res_mix_norm[blocks={n_blocks},{'prefix' if with_prefix else 'new_block'}"
             f"{'' if dtype == torch.bfloat16 else ',' + str(dtype).split('.')[-1]}"
             f"{',scores_fp32' if scores_fp32 else ''}]",
        search=with_signature(search, names), replace=with_signature(replace, names),
        example_inputs=example_inputs, op="k3.allreduce_attn_res_mix_norm", check=check,
        scalars={"mix_eps": 1.1e-5, "norm_eps": 1.3e-5}, strings={"group_name": GROUP},
        fake_trace=True, distinctive=("all_reduce", "attn_res_mix_norm"),
    )


def patterns() -> list[Pattern]:
    return [_variant(n, p, t, f) for (t, f), n, p in
            itertools.product(KINDS, range(MAX_BLOCKS, 0, -1), (True, False))]
