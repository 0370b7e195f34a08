"""Stage `writeback` hands a fused KDA op its bf16 A_log / dt_bias without the graph's upcast
(`fuse.drop_self_upcasts`): the op upcasts them itself (exactly), and the casts were a launch
each per KDA layer and step in a bf16 model (Moonshot's, the blind spelling)."""

from __future__ import annotations

import torch
from k3compile.patterns import kda_decode

import k3compile.ops  # noqa: F401
from k3compile.rewrite.inductor import fwd_only_fake
from k3compile.stages.fuse import drop_self_upcasts
from tests.fusions.attention_checks import family

NAMES = list(kda_decode.NAMES)
A, DT = NAMES.index("A_log"), NAMES.index("dt_bias")


def _graph(dtypes=(torch.bfloat16, torch.bfloat16)):
    variant = next(p for p in family("kda_decode") if p.name.startswith("kda_decode[T=1,B=n"))
    args = variant.example_inputs()
    args[A], args[DT] = args[A].to(dtypes[0]), args[DT].to(dtypes[1])
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def step(*ts):
        full = list(args)
        for i, t in zip(tensors, ts, strict=True):
            full[i] = t
        full[A], full[DT] = full[A].float(), full[DT].float()
        return torch.ops.k3.kda_decode(*full, None, None)

    gm = fwd_only_fake(step, [args[i] for i in tensors])
    return gm, args, tensors


def _op(gm):
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.k3.kda_decode.default]
    return op


def test_the_upcasts_go_and_the_values_stay():
    gm, args, tensors = _graph()
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert {_op(gm).args[A], _op(gm).args[DT]} <= set(casts)
    assert drop_self_upcasts(gm.graph) == 2
    op = _op(gm)
    assert op.args[A].op == "placeholder" and op.args[DT].op == "placeholder"
    assert not any(n.target is torch.ops.prims.convert_element_type.default and n in casts
                   for n in gm.graph.nodes)
    gm.recompile()
    state = [args[i].clone() for i in tensors]
    got = gm(*state)
    want_args = list(args)
    want_args[A], want_args[DT] = args[A].float(), args[DT].float()
    want = torch.ops.k3.kda_decode(*want_args, None, None)
    assert torch.equal(got, want)
    for name in ("conv_state", "recurrent_state"):  # the in-place updates are the same too
        i = NAMES.index(name)
        assert torch.equal(state[tensors.index(i)], want_args[i])


def test_an_fp32_parameter_has_no_cast_to_drop():
    gm, _, _ = _graph((torch.float32, torch.float64))
    assert drop_self_upcasts(gm.graph) == 0  # fp64 -> fp32 rounds: kept
    assert _op(gm).args[DT].target is torch.ops.prims.convert_element_type.default
