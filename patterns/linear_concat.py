"""The linears that read one input -> one GEMM over their concatenated weights, `k3.linear_concat`.

* KDA (spec §3.1 step 1): q, k, v, g, f_a and b projections of the normed hidden state; f_a feeds
  f_b directly, which stays a GEMM on f_a's column slice (vLLM: one in-proj GEMM + the f_b GEMM).
* Gated MLA (§3.2 step 1): q_a and kv_a, the two GEMMs that feed `k3.mla_lowrank_norm` (so the
  `mla_lowrank_norm` pattern must run first), and g_proj, the output gate's GEMM on the same
  input (`linear_concat[mla+g]`; without a g_proj there, `linear_concat[mla]` takes q_a|kv_a).

Weights bind distinct graph nodes (`exclusive`): the same-shaped linears of one input are
otherwise interchangeable to the matcher, which binds them in no particular order. A weight is a
graph input or contiguous rows of one (`select` / `slice` / `view` of a stacked q|k|v parameter
[3, W, D], as code that runs q|k|v as one batched GEMM stores them; rule `gemm` splits that GEMM
per `select`); stage `pack` orders the group by storage and stores it as one buffer.

Before (KDA): 7 x (permute, view, mm, view)         Before (MLA): 2 x (permute, view, mm, view),
After:  y = k3.linear_concat(x, [Wq, Wk, Wv, Wg, Wfa, Wb]);   mla_lowrank_norm(cq, ckv, ...)
        q, k, v, g, fa, b = y.split(...); graw = fa·Wfbᵀ   After: y = k3.linear_concat(x, [Wqa, Wkva])
                                                                  mla_lowrank_norm(y[:, :Q], y[:, Q:])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.graph import input_view, written_in_place
from k3compile.rewrite import Pattern, tensor_meta

KDA_WEIGHTS = ("w_q", "w_k", "w_v", "w_g", "w_fa", "w_b")


def kda_search(x, w_q, w_k, w_v, w_g, w_fa, w_fb, w_b):
    graw = F.linear(F.linear(x, w_fa), w_fb)
    return (graw, F.linear(x, w_q), F.linear(x, w_k), F.linear(x, w_v), F.linear(x, w_g),
            F.linear(x, w_b))


def kda_replace(x, w_q, w_k, w_v, w_g, w_fa, w_fb, w_b):
    weights = [w_q, w_k, w_v, w_g, w_fa, w_b]
    y = torch.ops.k3.linear_concat(x, weights)
    q, k, v, g, fa, b = y.split([w.shape[0] for w in weights], dim=-1)
    # fa is a column slice: as rows of a 2-D view f_b stays one mm (a 3-D slice would go to bmm)
    graw = F.linear(fa.reshape(-1, fa.shape[-1]), w_fb).view(*fa.shape[:-1], -1)
    return graw, q, k, v, g, b


def kda_rows_replace(x, w_q, w_k, w_v, w_g, w_fa, w_fb, w_b):
    """`kda_replace` on flat [N, D] token rows (vLLM's): f_b a plain mm of f_a's column slice."""
    weights = [w_q, w_k, w_v, w_g, w_fa, w_b]
    y = torch.ops.k3.linear_concat(x, weights)
    q, k, v, g, fa, b = y.split([w.shape[0] for w in weights], dim=-1)
    return F.linear(fa, w_fb), q, k, v, g, b


def _mla_fns(flag: tuple):
    """The MLA searches and replacements (plain, +g) on the
    `k3.mla_lowrank_norm` call with these trailing flags (`(True,)`: its `weight_fp32`)."""
    def norm(cq, ckv, w_qn, w_kvn, eps):
        return torch.ops.k3.mla_lowrank_norm(cq, ckv, w_qn, w_kvn, eps, *flag)

    def mla_search(x, w_qa, w_kva, w_qn, w_kvn, eps):
        return norm(F.linear(x, w_qa), F.linear(x, w_kva), w_qn, w_kvn, eps)

    def mla_replace(x, w_qa, w_kva, w_qn, w_kvn, eps):
        y = torch.ops.k3.linear_concat(x, [w_qa, w_kva])
        cq, ckv = y.split([w_qa.shape[0], w_kva.shape[0]], dim=-1)
        return norm(cq, ckv, w_qn, w_kvn, eps)

    def mla_g_search(x, w_qa, w_kva, w_g, w_qn, w_kvn, eps):
        cq, c_kv, k_pe = norm(F.linear(x, w_qa), F.linear(x, w_kva), w_qn, w_kvn, eps)
        return cq, c_kv, k_pe, F.linear(x, w_g)

    def mla_g_replace(x, w_qa, w_kva, w_g, w_qn, w_kvn, eps):
        weights = [w_qa, w_kva, w_g]
        y = torch.ops.k3.linear_concat(x, weights)
        cq, ckv, g = y.split([w.shape[0] for w in weights], dim=-1)
        return (*norm(cq, ckv, w_qn, w_kvn, eps), g)

    return {"": (mla_search, mla_replace), "g": (mla_g_search, mla_g_replace)}


def check_weights(match, names) -> str | None:
    x = tensor_meta(match.kwargs["x"])
    if x is None or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"input dtype {getattr(x, 'dtype', None)} is not a float type"
    for name in names:
        w = tensor_meta(match.kwargs[name])
        if w is None or w.dim() != 2 or w.shape[1] != x.shape[-1] or w.dtype != x.dtype:
            return (f"{name} {getattr(w, 'dtype', None)}{list(getattr(w, 'shape', []))} is not a "
                    f"[N, {x.shape[-1]}] {x.dtype} weight")
        if why := _not_a_weight(name, match.kwargs[name]):
            return why
    return None


def _not_a_weight(name, node) -> str | None:
    """Why node is no weight the group can be stored with: a graph input, or contiguous rows of one
    (q|k|v selected from a stacked [3, W, D] parameter), which stage pack stores back to back.
    A weight computed every step would be concatenated every step."""
    found = input_view(node)
    if found is None:
        return f"{name} is computed in the graph ({node.name}), not a weight input or a view of one"
    root, chain = found
    if root.meta.get("k3_user_input") or written_in_place(root):
        return f"{name} ({node.name}) is a step input or state the graph writes, not a weight"
    if chain and not tensor_meta(node).is_contiguous():
        return f"{name} ({node.name}) is a view of {root.name} that is not contiguous rows"
    return None


def _kda_check(match):
    return check_weights(match, KDA_WEIGHTS)


def _mla_check(match):
    if not isinstance(match.kwargs["eps"], float):
        return "eps is not a compile-time float"
    return check_weights(match, ("w_qa", "w_kva"))


def _mla_g_check(match):
    if not isinstance(match.kwargs["eps"], float):
        return "eps is not a compile-time float"
    return check_weights(match, ("w_qa", "w_kva", "w_g"))


def patterns() -> list[Pattern]:
    def kda_inputs(lead=(2, 1)):
        d, w, r, h = 32, 16, 8, 2
        x = torch.randn(*lead, d, dtype=torch.bfloat16)
        ws = [torch.randn(n, m, dtype=torch.bfloat16)
              for n, m in ((w, d), (w, d), (w, d), (w, d), (r, d), (w, r), (h, d))]
        return [x, *ws]

    def mla_inputs(lead=(2, 1)):
        d, q, c = 32, 24, 16
        x = torch.randn(*lead, d, dtype=torch.bfloat16)
        ws = [torch.randn(q, d), torch.randn(c + 8, d), torch.randn(q), torch.randn(c)]
        return [x, *(w.bfloat16() for w in ws), 1.1e-6]

    def mla_g_inputs(lead=(2, 1)):
        d, q, c, g = 32, 24, 16, 20
        x = torch.randn(*lead, d, dtype=torch.bfloat16)
        ws = [torch.randn(q, d), torch.randn(c + 8, d), torch.randn(g, d), torch.randn(q),
              torch.randn(c)]
        return [x, *(w.bfloat16() for w in ws), 1.1e-6]

    # the MLA variants on [B, T, D] activations, then on [N, D] rows (",rows": vLLM's flattened
    # tokens, where mla_lowrank_norm[...,rows] took plain mm GEMMs)
    forms = (("", (2, 1)), (",rows", (2,)))
    # each also on mla_lowrank_norm's `weight_fp32` call (",weight_fp32", bf16: the norms'
    # weights multiplied in fp32, tests/models/spell9_k3.py); the flag stays on the op
    mla = []
    for flag in ((), (True,)):
        fns, tag = _mla_fns(flag), ",weight_fp32" if flag else ""
        mla += [
            Pattern(name=f"linear_concat[mla+g{suffix}{tag}]", search=fns["g"][0],
                    replace=fns["g"][1], example_inputs=lambda lead=lead: mla_g_inputs(lead),
                    op="k3.linear_concat", check=_mla_g_check,
                    scalars={"eps": 1.1e-6}, distinctive=("mla_lowrank_norm",),
                    exclusive=("w_qa", "w_kva", "w_g"), joint_passes=True)
            for suffix, lead in forms
        ] + [
            Pattern(name=f"linear_concat[mla{suffix}{tag}]", search=fns[""][0],
                    replace=fns[""][1], example_inputs=lambda lead=lead: mla_inputs(lead),
                    op="k3.linear_concat", check=_mla_check,
                    scalars={"eps": 1.1e-6}, distinctive=("mla_lowrank_norm",),
                    exclusive=("w_qa", "w_kva"), joint_passes=True)
            for suffix, lead in forms
        ]
    return [
        Pattern(name="linear_concat[kda]", search=kda_search, replace=kda_replace,
                example_inputs=kda_inputs, op="k3.linear_concat", check=_kda_check,
                distinctive=("mm",), exclusive=KDA_WEIGHTS + ("w_fb",), joint_passes=True),
        *mla,
        # on [N, D] rows (",rows": vLLM's flat tokens, each GEMM a plain mm)
        Pattern(name="linear_concat[kda,rows]", search=kda_search, replace=kda_rows_replace,
                example_inputs=lambda: kda_inputs((2,)), op="k3.linear_concat",
                check=_kda_check, distinctive=("mm",), exclusive=KDA_WEIGHTS + ("w_fb",),
                joint_passes=True),
    ]
