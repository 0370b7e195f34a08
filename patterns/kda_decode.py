"""The KDA recurrent step between the projections and o_proj -> `k3.kda_decode`.

Matches `KimiDeltaAttention.forward` from the q/k/v/g/f_b/b projection outputs on: the conv-state
window (cat, write-back of the last taps-1 inputs into the state buffer), the depthwise conv +
SiLU in fp32, L2-normalised q (scaled) and k, the lower-bounded decay and β, the delta rule over
T tokens on the fp32 recurrent state gathered by `slots` and written back, the per-head RMSNorm
and the sigmoid output gate. The recurrence is unrolled in the graph, so there is one variant per
T in TOKENS, per batch 1 or more (size-1 dims change the graph) and per activation dtype (fp32
models trace no casts), and in bf16 per output norm: the built-in model's (`rms_norm(o) *
sigmoid(g)`, rounded to bf16 after the norm, the weight and the gate) or fla's
`FusedRMSNormGated` (Moonshot's KDA layer: fp32 throughout, one rounding), which fuses into the op
with `KDAVariant(norm_fp32=True)` (in fp32 the two are one graph); o kept fp32 into that norm, one
cast after it (the red-team spelling, spell8), with `o_fp32=True` as well; spell9's JAX/Flax norm
(o kept fp32, the weight multiplied in fp32 before one cast, the gate in bf16 after it) with
`norm_weight_fp32=True, o_fp32=True`. A conv run in bf16 (its output rounded, then the SiLU on
it: the red-team spelling, spell9 after rule `cell_conv`, spell7's `F.conv1d` on a V-major
state) with `conv=ConvRounding.ROUNDED`. A window sum multiplied in bf16 (each tap product
rounded, then the sum: spell10's per-token conv, spell12's `vecdot`; rule `short_conv` writes it
as one `sum(unfold(window, -1, taps, 1) * taps, [-1])`) with `conv=ConvRounding.PRODUCTS_ROUNDED`,
channel-major, one conv state. A mixed-precision codebase's step (spell11 under autocast) with
`gate_fp32` (the built-in norm, then the gate product in fp32, one rounding) and / or fp32 master
conv weights read as they are (`conv_weight_fp32`, a pattern-level name: the op reads the
weights' dtype off its arguments). A variant's name lists its `KDAVariant.names`; the op gets its
`KDAVariant.spec`. Only the variants of the T a graph's KDA sites have are traced (`fits`: the
short conv's output length is T); a T without a variant stays unfused, and its near miss says so.

Before (T=1, ~75 ATen ops): cat, permute, index, cat, slice, index_put, cat, convert, convolution,
    neg, exp, add, div, convert, split, ... pow, sum, add, rsqrt, mul, ... exp, sigmoid, mul, exp,
    index, mul, bmm, sub, mul, mul, add, bmm, index_put, convert, ... rsqrt, mul, sigmoid, mul
After:  o = k3.kda_decode(q, k, v, g, graw, b, conv_state!, recurrent_state!, slots, q_conv_w,
    k_conv_w, v_conv_w, A_log, dt_bias, o_norm_w, lower_bound, l2_eps, q_scale, norm_eps, None,
    None)   (the two state buffers updated in place; their functional copies in the graph go away;
    with three conv states the k and v buffers for the two Nones; a variant's spec after them)
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import fx

from k3compile.canonical.region import half_upcast
from k3compile.canonical.short_conv import products_conv
from k3compile.math import (
    delta_rule_step,
    l2norm,
    rms_norm,
    rms_norm_fp32_weight,
    rms_norm_gated_fp32,
)
from k3compile.ops.kda_decode import BUILTIN, ConvRounding, KDAVariant
from k3compile.rewrite import Pattern, tensor_meta, with_signature

# Tokens per request with a variant: decode (1) up to the DSpark verify block (anchor + 7 drafts).
# Each T is its own pattern (~0.5 s of tracing per variant, once per process, for the T in use).
TOKENS = tuple(range(1, 9))
# Size-1 dims change the graph (einsum and index_put fold them), so batch 1 has its own variants.
BATCHES = (1, 2)
DTYPES = (torch.bfloat16, torch.float32)
H, K, TAPS = 2, 8, 4  # tracing sizes; matching ignores sizes
NAMES = ("q", "k", "v", "g", "graw", "b", "conv_state", "recurrent_state", "slots",
         "q_conv_weight", "k_conv_weight", "v_conv_weight", "A_log", "dt_bias", "o_norm_weight",
         "lower_bound", "l2_eps", "q_scale", "norm_eps")
SCALARS = {"lower_bound": -5.1, "l2_eps": 1.1e-6, "q_scale": 0.37, "norm_eps": 1.3e-5}
# three conv state buffers (one per q / k / v): conv_state holds q's channels, these k's and v's;
# a variant with them takes them after the tensors of NAMES, before the scalars (the tracer takes
# the example inputs of the non-scalar names in order)
THREE_STATES = ("k_conv_state", "v_conv_state")
TENSORS = len(NAMES) - len(SCALARS)


def variant_names(three_states: bool) -> tuple[str, ...]:
    return (*NAMES[:TENSORS], *THREE_STATES, *SCALARS) if three_states else NAMES


def unthree(args: tuple) -> tuple:
    """A variant's arguments in the order of NAMES (without the two extra conv states)."""
    return (*args[:TENSORS], *args[-len(SCALARS):])


def setitem(buf, index, value):
    """`buf[index] = value` as the functional graph has it: Tensor.__setitem__ strips the value's
    leading size-1 dims first (a view, at batch 1), then index_put."""
    lead = 0
    while lead < value.dim() and value.shape[lead] == 1:
        lead += 1
    if lead:
        value = value.view(value.shape[lead:])
    return torch.index_put(buf, index, value)


def kda_step(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight, k_conv_weight,
             v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps, q_scale, norm_eps):
    """KimiDeltaAttention.forward after the projections (see `_step`)."""
    return _step(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                 k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps,
                 q_scale, norm_eps, silu_written_out=False)


def _step(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight, k_conv_weight,
          v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps, q_scale, norm_eps,
          silu_written_out, variant: KDAVariant = BUILTIN, k_conv_state=None,
          v_conv_state=None):
    """KimiDeltaAttention.forward after the projections, with the state writes made functional
    (as they are in the graph). Returns (new recurrent state, new conv state, o).
    `variant.conv_time_major`: the conv state [S, taps-1, 3W] (vLLM v1's layout), the window
    built on dim 1 and convolved as its transpose. `state_v_major`: the recurrent state
    [S, H, V, K], read and written through its transpose (rule `state_transpose` writes a
    V-major delta rule so). `k_conv_state`, `v_conv_state` (the variant's `three_conv_states`):
    three channel-major conv state buffers, the window's past rows their gathers'
    concatenation, its tail written back by channel slices (rules `conv_states` and
    `conv_merge` write three per-projection convs so); the new conv states are then three
    outputs. `norm_weight_fp32`: the output norm's weight multiplied in fp32 before its one
    rounding, the gate after it (with `o_fp32`: o unrounded into it). `conv`: ROUNDED, the
    conv run in the activations' dtype (rounded), F.silu on its output; PRODUCTS_ROUNDED, the
    conv as a window sum multiplied in that dtype (short_conv's form), F.silu on it.
    `gate_fp32`: the built-in norm, then the gate product in fp32 and one rounding."""
    B, T, _ = q.shape
    nh, hd = recurrent_state.shape[1], recurrent_state.shape[2]
    beta = torch.sigmoid(b.float())
    if variant.conv_time_major:
        window = torch.cat([conv_state[slots], torch.cat([q, k, v], dim=-1)], dim=1)
        conv_state_out = setitem(conv_state, (slots,), window[:, T:])
        window = window.transpose(1, 2)
    elif k_conv_state is not None:
        states = (conv_state, k_conv_state, v_conv_state)
        new = torch.cat([q, k, v], dim=-1).transpose(1, 2)
        window = torch.cat([torch.cat([c[slots] for c in states], 1), new], dim=-1)
        # the tail cut by channel slices, which rule `slice_split` writes as one split
        pieces = window[..., T:].split([nh * hd] * 3, dim=1)
        conv_state_out = tuple(setitem(c, (slots,), x) for c, x in zip(states, pieces))
    else:
        new = torch.cat([q, k, v], dim=-1).transpose(1, 2)
        window = torch.cat([conv_state[slots], new], dim=-1)
        conv_state_out = setitem(conv_state, (slots,), window[..., T:])
    taps = torch.cat([q_conv_weight, k_conv_weight, v_conv_weight])
    if variant.conv is ConvRounding.PRODUCTS_ROUNDED:
        conv = (window.unfold(-1, taps.shape[-1], 1) * taps).sum(-1)
    elif variant.conv is ConvRounding.ROUNDED:
        conv = F.conv1d(window, taps, groups=taps.shape[0])
    else:
        conv = F.conv1d(window.float(), taps.float(), groups=taps.shape[0])
    # silu as torch's op (its decomposition is x / (1 + exp(-x))) or written out as x·σ(x)
    conv = (conv * torch.sigmoid(conv) if silu_written_out else F.silu(conv))
    conv = conv.to(q.dtype).transpose(1, 2)
    cq, ck, cv = conv.split(nh * hd, dim=-1)
    cq = l2norm(cq.float().view(B, T, nh, hd), l2_eps) * q_scale
    ck = l2norm(ck.float().view(B, T, nh, hd), l2_eps)
    cv = cv.float().view(B, T, nh, hd)
    gate = torch.exp(A_log.float()).view(nh, 1) * (graw.float().view(B, T, nh, hd)
                                                    + dt_bias.view(nh, hd))
    decay = torch.exp(lower_bound * torch.sigmoid(gate))
    state = recurrent_state[slots]
    if variant.state_v_major:
        state = state.transpose(-1, -2)
    outs = []
    for t in range(T):
        state, o_t = delta_rule_step(state, cq, ck, cv, beta, decay, t)
        outs.append(o_t)
    state_out = setitem(recurrent_state, (slots,),
                        state.transpose(-1, -2) if variant.state_v_major else state)
    o = torch.stack(outs, dim=1)
    convs = conv_state_out if isinstance(conv_state_out, tuple) else (conv_state_out,)
    if variant.norm_weight_fp32:  # a Flax RMSNorm: the weight in fp32, one cast, the gate after it
        o = o if variant.o_fp32 else o.to(q.dtype)
        return state_out, *convs, rms_norm_fp32_weight(
            o, o_norm_weight, norm_eps, q.dtype) * torch.sigmoid(g.view(B, T, nh, hd))
    if variant.o_fp32:  # o as the fp32 recurrence leaves it, into the fp32 norm; one cast after it
        return state_out, *convs, rms_norm_gated_fp32(
            o, o_norm_weight, g.float().view(B, T, nh, hd), norm_eps).to(q.dtype)
    o = o.to(q.dtype)
    if variant.norm_fp32:
        # fla casts the gate inside: cast, then split into heads (rule `cast_view`)
        return state_out, *convs, rms_norm_gated_fp32(
            o, o_norm_weight, g.float().view(B, T, nh, hd), norm_eps)
    if variant.gate_fp32:  # an fp32 island around the gate: one rounding after its product
        return state_out, *convs, (rms_norm(o, o_norm_weight, norm_eps).float() * torch.sigmoid(
            g.float().view(B, T, nh, hd))).to(q.dtype)
    o = rms_norm(o, o_norm_weight, norm_eps) * torch.sigmoid(g.view(B, T, nh, hd))
    return state_out, *convs, o


def replace(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight, k_conv_weight,
            v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps, q_scale, norm_eps,
            k_conv_state=None, v_conv_state=None, *spec):
    """`k_conv_state`, `v_conv_state`: the three-state variants' k and v conv state buffers;
    `spec`: the op's `variant` argument, the variant's `KDAVariant.spec` (none for the
    default)."""
    o = torch.ops.k3.kda_decode(q, k, v, g, graw, b, conv_state, recurrent_state, slots,
                                q_conv_weight, k_conv_weight, v_conv_weight, A_log, dt_bias,
                                o_norm_weight, lower_bound, l2_eps, q_scale, norm_eps,
                                k_conv_state, v_conv_state, *spec)
    more = (k_conv_state, v_conv_state) if k_conv_state is not None else ()
    return recurrent_state, conv_state, *more, o


# The build flags of kda_decode's kernel (kernels/kda_decode.py) that have run on a GPU against
# the reference at K3's head dim, with the kernel launched: the default build (the yardstick's
# checks), `norm_fp32` and `conv_time_major` (tests/fusions/test_kda_decode_kernel.py calls the
# kernel's entry itself), the V-major, `o_fp32` and rounding builds (their files'
# `test_cuda_op_equals_the_cpu_reference*` through tests/kernel_checks.py
# `assert_cuda_op_equals_cpu`, H100, 2026-12-06, session 29: before it those tests called the op
# without `register_all` and compared the CUDA reference with the CPU one). A site needing any
# other flag stays with Inductor on GPU graphs (`kernel_refusal`) until its GPU test passes so;
# CPU graphs fuse every variant (the reference is the CPU kernel). Three conv states: since
# session 30 the op takes them on torch 2.11 too, and test_kda_decode_three_states.py's GPU test
# passed (H100, 2026-12-06), as did spell8's CUDA plan test with them in this set.
# `conv_products_rounded`: test_kda_decode_products.py's GPU tests passed (H100, session 35).
# `gate_fp32`, `conv_weight_fp32`: test_kda_decode_gate_fp32.py's GPU tests passed (its three
# cases at B, T = 2, 1 and 3, 4, the kernel launched; H100, session 38).
GPU_TESTED_FLAGS = frozenset({"norm_fp32", "conv_time_major", "state_v_major", "o_fp32",
                              "norm_weight_fp32", "conv_rounded", "three_conv_states",
                              "conv_products_rounded", "gate_fp32", "conv_weight_fp32"})


def kernel_refusal(variant: KDAVariant, more: tuple[str, ...] = ()):
    """The GPU graphs' refusal of a variant whose kernel build is untested on a GPU (a function
    of the match, as `Pattern.kernel_refusal` wants), or None. `more`: the pattern variant's
    names that are no `KDAVariant` field (`conv_weight_fp32`)."""
    untested = sorted(n for n in (*variant.names, *more) if n not in GPU_TESTED_FLAGS)
    if not untested:
        return None
    why = f"{', '.join(untested)}: kda_decode's kernel build has not passed a GPU test yet"
    return lambda match: why


def check(match, variant: KDAVariant = BUILTIN, conv_weight_fp32: bool = False) -> str | None:
    """The site's shapes and dtypes as the variant's layouts have them (`variant`: its
    `conv_time_major` and `three_conv_states`; `conv_weight_fp32`: fp32 conv weights beside
    bf16 / fp16 activations)."""
    three_states = variant.three_conv_states
    for name in SCALARS:
        if not isinstance(match.kwargs[name], float):
            return f"{name} is not a compile-time float"
    names = variant_names(three_states)
    meta = {n: tensor_meta(match.kwargs[n]) for n in names if n not in SCALARS}
    if any(t is None for t in meta.values()):
        return "an input has no tensor metadata"
    q, state, conv = meta["q"], meta["recurrent_state"], meta["conv_state"]
    if q.dim() != 3 or state.dim() != 4 or conv.dim() != 3:
        return f"ranks q {q.dim()}, recurrent_state {state.dim()}, conv_state {conv.dim()}"
    nh, hd = state.shape[1], state.shape[2]
    width = nh * hd
    if state.dtype != torch.float32 or state.shape[3] != hd:
        return f"recurrent_state {state.dtype}{list(state.shape)} is not fp32 [S, H, K, K]"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {q.dtype}"
    for name in ("k", "v", "g", "graw"):
        if meta[name].dtype != q.dtype or meta[name].shape[-1] != width:
            return f"{name} {meta[name].dtype}[.., {meta[name].shape[-1]}] != q {q.dtype}[.., {width}]"
    if meta["b"].shape[-1] != nh:
        return f"b width {meta['b'].shape[-1]} != heads {nh}"
    channels, history = (2, 1) if variant.conv_time_major else (1, 2)
    if three_states:
        for name in THREE_STATES:
            if meta[name].dtype != conv.dtype or meta[name].shape != conv.shape:
                return f"{name} {meta[name].dtype}{list(meta[name].shape)} != q's conv state"
    held = width if three_states else 3 * width
    if conv.dtype != q.dtype or conv.shape[channels] != held:
        return (f"conv_state {conv.dtype}{list(conv.shape)} does not hold "
                f"{'q' if three_states else 'q|k|v'} of {q.dtype}[{width}]")
    taps = conv.shape[history] + 1
    for name in ("q_conv_weight", "k_conv_weight", "v_conv_weight"):
        if tuple(meta[name].shape) != (width, 1, taps):
            return f"{name} {list(meta[name].shape)} != [{width}, 1, {taps}]"
        if conv_weight_fp32 and (meta[name].dtype != torch.float32 or q.dtype == torch.float32):
            return f"{name} {meta[name].dtype} beside {q.dtype} activations is no fp32 master"
    if meta["A_log"].shape != (nh,) or meta["dt_bias"].shape != (width,):
        return f"A_log {list(meta['A_log'].shape)} / dt_bias {list(meta['dt_bias'].shape)}"
    if meta["o_norm_weight"].shape != (hd,):
        return f"o_norm_weight {list(meta['o_norm_weight'].shape)} != [{hd}]"
    if meta["slots"].dtype != torch.int64 or meta["slots"].dim() != 1:
        return f"slots {meta['slots'].dtype} rank {meta['slots'].dim()} is not int64 [B]"
    if not math.isclose(match.kwargs["q_scale"], hd**-0.5, rel_tol=1e-6):
        return f"q scale {match.kwargs['q_scale']} != head_dim^-0.5 = {hd**-0.5}"
    return None


class SiteFacts(NamedTuple):
    """What a graph's KDA sites look like, read once per graph: which variants can fit it."""

    # (T, time-major) of each site: its depthwise short conv's output length (a convolution's,
    # or a window sum's multiplied in bf16), and whether it convolves a transposed window
    sites: frozenset[tuple[int, bool]]
    # V-major (True) if some state gather is read through its transpose; K-major (False) always
    # (a K-major read has no mark of its own)
    state_layouts: frozenset[bool]
    # 1 always; 3 if some short conv's window concatenates three state gathers
    conv_state_counts: frozenset[int]
    # some fp32 [B, T, H, V] tensor that is no upcast is RMS-normalised (`o_fp32`)
    fp32_o_norms: bool
    # some short conv runs in bf16 / fp16 (`conv_rounded`)
    low_precision_convs: bool
    # some short conv is a window sum multiplied in bf16 / fp16 (`conv_products_rounded`)
    product_convs: bool
    # some short conv reads fp32 weights beside an upcast window (`conv_weight_fp32`)
    fp32_weight_convs: bool
    # some fp32 [B, T, H, V] gate product of an upcast and a sigmoid is rounded once (`gate_fp32`)
    fp32_gates: bool


_seen: tuple[fx.Graph | None, SiteFacts | None] = (None, None)  # the graph last read, its facts

CAST = torch.ops.prims.convert_element_type.default


def _fp32_weight_conv(conv: fx.Node) -> bool:
    """An fp32 conv of an upcast window whose weight is fp32 and no upcast (an fp32 master read
    as it is: `conv_weight_fp32`)."""
    w = conv.args[1]
    return (half_upcast(conv.args[0]) and isinstance(w, fx.Node) and not half_upcast(w)
            and w.meta["val"].dtype == torch.float32)


def _fp32_gate(mul: fx.Node) -> bool:
    """`bf16(x.float() * sigmoid(g'))` of fp32 [B, T, H, V]: a gate product in fp32 rounded once
    (`gate_fp32`)."""
    v = mul.meta.get("val")
    if not (isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype == torch.float32
            and len(mul.users) == 1 and next(iter(mul.users)).target is CAST):
        return False
    a, b = mul.args[:2]
    return any(isinstance(s, fx.Node) and s.target is torch.ops.aten.sigmoid.default
               and half_upcast(x) for s, x in ((a, b), (b, a)))


def _time_major(conv: fx.Node) -> bool:
    """The conv convolves a transposed window (a time-major conv state's), not the window."""
    x = conv.args[0]
    while isinstance(x, fx.Node) and x.target is CAST:
        x = x.args[0]
    return isinstance(x, fx.Node) and x.target in (torch.ops.aten.permute.default,
                                                   torch.ops.aten.transpose.int)


def _v_major(read: fx.Node) -> bool:
    """A gather of fp32 [B, H, ., .] state rows read through the transpose of its last two dims
    (a V-major state buffer, as rule `state_transpose` leaves it)."""
    v = read.meta.get("val")
    if not (isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype == torch.float32):
        return False
    return any(u.target is torch.ops.aten.permute.default and list(u.args[1]) == [0, 1, 3, 2]
               or u.target is torch.ops.aten.transpose.int and sorted(
                   d % 4 for d in u.args[1:3]) == [2, 3] for u in read.users)


def _gathers(conv: fx.Node) -> int:
    """How many state gathers the conv's window concatenates (0: not a cat of gathers)."""
    x = conv.args[0] if conv.target is torch.ops.aten.convolution.default else \
        products_conv(conv)[0]
    while isinstance(x, fx.Node) and x.target is CAST:
        x = x.args[0]
    past = x.args[0][0] if isinstance(x, fx.Node) and x.target is torch.ops.aten.cat.default \
        else None
    if not (isinstance(past, fx.Node) and past.target is torch.ops.aten.cat.default):
        return 0
    parts = past.args[0]
    return len(parts) if all(p.target is torch.ops.aten.index.Tensor for p in parts) else 0


def _fp32_norm_of_fp32(mean: fx.Node) -> bool:
    """`mean(x·x, -1)` / `mean(x², -1)` of an fp32 [B, T, H, V] x that is no upcast: a norm of
    the recurrent output as the fp32 recurrence leaves it (the `o_fp32` variants' mark; a norm
    of a rounded o reads the upcast)."""
    v, sq = mean.meta.get("val"), mean.args[0]
    if not (isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype == torch.float32
            and isinstance(sq, fx.Node)):
        return False
    square = (sq.target is torch.ops.aten.pow.Tensor_Scalar and sq.args[1] == 2
              or sq.target is torch.ops.aten.mul.Tensor and sq.args[0] is sq.args[1])
    x = sq.args[0]
    return square and isinstance(x, fx.Node) and x.target is not CAST


def site_facts(graph: fx.Graph) -> SiteFacts:
    """The graph's `SiteFacts`, read once for all the variants' `fits`."""
    global _seen
    if _seen[0] is not graph:
        _seen = graph, _read_facts(graph)
    return _seen[1]


def _read_facts(graph: fx.Graph) -> SiteFacts:
    convs = [n for n in graph.nodes if n.target is torch.ops.aten.convolution.default
             and isinstance(v := n.meta.get("val"), torch.Tensor) and v.dim() == 3]
    products = [n for n in graph.nodes if n.target is torch.ops.aten.sum.dim_IntList
                and products_conv(n) is not None]
    reads = (n for n in graph.nodes if n.target is torch.ops.aten.index.Tensor)
    return SiteFacts(
        sites=frozenset((int(n.meta["val"].shape[-1]), n in convs and _time_major(n))
                        for n in convs + products),
        state_layouts=frozenset({False} | {True for n in reads if _v_major(n)}),
        conv_state_counts=frozenset({1} | {_gathers(n) for n in convs + products} - {0}),
        fp32_o_norms=any(_fp32_norm_of_fp32(n) for n in graph.nodes
                         if n.target is torch.ops.aten.mean.dim),
        low_precision_convs=any(n.meta["val"].dtype != torch.float32 for n in convs),
        product_convs=bool(products),
        fp32_weight_convs=any(_fp32_weight_conv(n) for n in convs),
        fp32_gates=any(_fp32_gate(n) for n in graph.nodes
                       if n.target is torch.ops.aten.mul.Tensor))


def _fits(T: int, variant: KDAVariant, conv_weight_fp32: bool = False):
    def fits(graph: fx.Graph) -> str | None:
        facts = site_facts(graph)
        found = facts.sites
        if conv_weight_fp32 and found and not facts.fp32_weight_convs:
            return "no short conv reads fp32 weights beside an upcast window (fp32 masters')"
        if variant.gate_fp32 and found and not facts.fp32_gates:
            return "no fp32 [B, T, H, V] gate product is rounded once (an fp32 gate's)"
        if variant.conv is ConvRounding.ROUNDED and found and not facts.low_precision_convs:
            return "no short conv runs in bf16 / fp16 (a rounded conv's)"
        if variant.conv is ConvRounding.PRODUCTS_ROUNDED and found and not facts.product_convs:
            return "no short conv is a window sum multiplied in bf16 / fp16"
        if variant.o_fp32 and found and not facts.fp32_o_norms:
            return "no fp32 [B, T, H, V] tensor that is no upcast is RMS-normalised (an fp32 o's)"
        if variant.state_v_major and found and True not in facts.state_layouts:
            return "no state gather is read through its transpose (a V-major state's)"
        if variant.three_conv_states and found and 3 not in facts.conv_state_counts:
            return "no short conv's window concatenates three conv state gathers"
        if (T, variant.conv_time_major) in found or not found:
            return None  # no short conv: every variant is tried (a near miss per layer)
        rows = sorted({t for t, _ in found})
        if T in rows:
            major = "time" if variant.conv_time_major else "channel"
            return f"no KDA site convolves a {major}-major conv state's window"
        return (f"the KDA sites have T = {rows} tokens per request; kda_decode unrolls "
                f"its recurrence for T in {TOKENS[0]}..{TOKENS[-1]}")
    return fits


def _variant(T: int, B: int, dtype: torch.dtype, silu_written_out: bool = False,
             variant: KDAVariant = BUILTIN, conv_weight_fp32: bool = False) -> Pattern:
    """`conv_weight_fp32`: the conv weights fp32 beside bf16 / fp16 activations (fp32 masters
    read as they are: the conv's upcast of them traces to nothing); no `KDAVariant` field, as
    the op reads the weights' dtype off its arguments."""
    three_states = variant.three_conv_states
    taps_dtype = torch.float32 if conv_weight_fp32 else dtype

    def example_inputs():
        W = H * K
        act = [torch.randn(B, T, W, dtype=dtype) for _ in range(5)]
        b = torch.randn(B, T, H, dtype=dtype)
        conv = (3, TAPS - 1, 3 * W) if variant.conv_time_major else (3, 3 * W, TAPS - 1)
        if three_states:
            conv = (3, W, TAPS - 1)
        state = [torch.randn(conv, dtype=dtype),
                 torch.randn(3, H, K, K, dtype=torch.float32), torch.tensor([0, 2][:B])]
        weights = [torch.randn(W, 1, TAPS, dtype=taps_dtype) for _ in range(3)]
        weights += [torch.randn(H), torch.randn(W), torch.randn(K, dtype=dtype)]
        more = [torch.randn(conv, dtype=dtype) for _ in THREE_STATES] if three_states else []
        return [*act, b, *state, *weights, *more, *SCALARS.values()]

    # written out: the same step; its op computes silu as torch does (an ulp apart)
    names = variant_names(three_states)
    search = with_signature(lambda *a: _step(*unthree(a), silu_written_out=silu_written_out,
                                             variant=variant,
                                             **dict(zip(THREE_STATES, a[TENSORS:-len(SCALARS)]))
                                             if three_states else {}), names)
    spec = (variant.spec,) if variant.spec else ()
    more = ("conv_weight_fp32",) if conv_weight_fp32 else ()
    flags = "".join(f",{n}" for n in (*(("silu_written_out",) if silu_written_out else ()),
                                       *variant.names, *more))
    return Pattern(
        name=f"kda_decode[T={T},B={'1' if B == 1 else 'n'},"
             f"{str(dtype).removeprefix('torch.')}{flags}]",
        search=search, replace=with_signature(
            lambda *a: replace(*unthree(a), *(a[TENSORS:-len(SCALARS)] or (None, None)), *spec),
            names) if spec or three_states else replace,
        example_inputs=example_inputs, op="k3.kda_decode",
        check=lambda match: check(match, variant, conv_weight_fp32), scalars=dict(SCALARS),
        kernel_refusal=kernel_refusal(variant, more),
        distinctive=("unfold" if variant.conv is ConvRounding.PRODUCTS_ROUNDED else "convolution",
                     "index_put", "bmm", "rsqrt"), joint_passes=True,
        fits=_fits(T, variant, conv_weight_fp32),
    )


def patterns() -> list[Pattern]:
    # fla's fp32 output norm differs from ours only where the activations round (not in fp32);
    # a variant is traced only for the (T, state layouts) a graph's sites have (`fits`); three
    # conv states only channel-major (the layout the spellings that keep three have); o
    # unrounded into the norm (`o_fp32`) only with fla's fp32 norm, in bf16 / fp16
    # unrounded o into a Flax norm (`norm_weight_fp32`, spell9's) and a conv run in bf16
    # (ROUNDED) in bf16 / fp16 only, with torch's F.silu, one conv state buffer; the rounded
    # conv also on a V-major state (spell7's), the Flax norm K-major only; a window sum
    # multiplied in bf16 (PRODUCTS_ROUNDED: spell10's, spell12's) as the rounded conv, on a
    # channel-major conv state, K-major recurrent state, the built-in or fla's norm
    return [_variant(t, b, d, w, KDAVariant((n or o) and not f, m, s, c, o, f, conv=r))
            for r, f, o, c, s, m, n, w, t, b, d in
            itertools.product(ConvRounding, (False, True), (False, True), (False, True),
                              (False, True), (False, True), (False, True), (False, True),
                              TOKENS, BATCHES, DTYPES)
            if not ((n or o) and d == torch.float32) and not (o and n) and not (c and m)
            and not ((f or r is not ConvRounding.FP32) and (d == torch.float32 or w or c))
            and not (f and s) and not (f and (n or not o))
            and not (r is ConvRounding.PRODUCTS_ROUNDED and (f or m or s))] + [
        # fp32 master conv weights read as they are (`conv_weight_fp32`) and / or an fp32 gate
        # island around the built-in norm (`gate_fp32`): spell11's mixed precision; bf16 / fp16
        # only (in fp32 each is the built-in graph), the fp32 conv, one channel-major conv state,
        # K-major recurrent state
        _variant(t, b, d, False, KDAVariant(gate_fp32=g), conv_weight_fp32=cw)
        for g, cw in ((False, True), (True, False), (True, True))
        for t in TOKENS for b in BATCHES for d in DTYPES if d != torch.float32]
