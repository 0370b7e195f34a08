"""Every CuTe kernel launched once per batch bucket at one K3 TP16 rank's shapes, each launch
checked against its op's torch reference: the workload `compute-sanitizer` watches
(benchmarks/sanitize_h200.sh runs it under memcheck, racecheck and synccheck; issue 20, GPU gates).

    python benchmarks/sanitize.py --list           # the planned (kernel, shape) cases, no GPU
    python benchmarks/sanitize.py [--only k,k] [--buckets 1,8,64] [--shard 0/4] [--out DIR]
    python benchmarks/sanitize.py --canary                # one deliberately out-of-bounds launch
    python benchmarks/sanitize.py --summarize DIR         # errors per kernel from the tools' logs

Cases: every module of kernels/ (KERNELS and the opt-in ones such as mla_decode, registered here
directly) at B in {1, 8, 64}, plus T = 8 verify rows where the op takes them (kda_decode,
fb_kda_decode, mla_decode). Inputs are the GPU tests' where they take a device (the KDA and MLA
`Inputs`, the MXFP4 experts, the W_UV view), built alike otherwise. Each case calls the op
(`torch.ops.k3.<op>`: on CUDA, the kernel) on copies of the states it writes, then the op's
torch reference on other copies, and compares every output and written state row by row (a
request, a token row, a state slot): relative error within `TOL` (bf16: the kernel tests' bound
against a reference that rounds differently; fp32: states and router weights). A case also fails
when the kernel refused and ran the reference (`dsl.fallback_counts` moved): then the sanitizer
watched nothing.

Each case prints `SAN-CASE begin NAME` and, after a device synchronize, `SAN-CASE end NAME STATUS`,
so a sanitizer report printed between them (the tool's output shares this process's stdout) is
the case's. The canary launches kda_decode with a slot 4096 past the state pool: memcheck must
report it, which shows that it sees launches made through TVM-FFI.
"""

from __future__ import annotations

import argparse
import functools
import json
import pkgutil
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `tests` (the GPU tests' inputs) from any working directory

from k3compile.kernels import KERNELS

from k3compile import settings
from k3compile.models import get_config
from tests.conftest import TOL as TEST_TOL

CFG = get_config("k3_tp16")
HIDDEN, LATENT = CFG.hidden_size, CFG.routed_expert_hidden_size  # 7168, 3584
KDA_W = CFG.kda_heads_local * CFG.kda_head_dim  # 768
O_IN = CFG.mla_heads_local * CFG.v_head_dim  # 768: o_proj's input width
Q_RANK, KV_RANK, ROPE = CFG.q_lora_rank, CFG.kv_lora_rank, CFG.qk_rope_head_dim
EXPERTS, TOP_K = CFG.num_experts, CFG.num_experts_per_token
EXPERT_INTER = CFG.moe_intermediate_size // CFG.tp_size  # 192
SHARED = CFG.shared_intermediate // CFG.tp_size  # 384
EPS, BETA, LINEAR_BETA, SCALING = CFG.rms_norm_eps, CFG.situ_beta, CFG.situ_linear_beta, 2.5

BUCKETS = (1, 8, 64)
VERIFY = {"kda_decode": (1, 8), "fb_kda_decode": (1, 8), "mla_decode": (1, 8),
          "mla_q_absorb": (1, 8)}  # T = 8 at these B
# Their device code is other cases' kernels (plus cuBLAS, NCCL): `--no-composites` leaves them to
# memcheck (racecheck and synccheck find nothing new there)
COMPOSITES = ("oproj_attn_res_mix_norm", "allreduce_attn_res_mix_norm", "fb_kda_decode")
ONE_ROW = {"mla_uv_gate": "its kernel takes B·T <= 1 row (gemv's gate variant); more rows run "
                          "the reference",
           "oproj_mix": "its one launch takes <= MAX_ROWS (1) rows; more rows take "
                        "oproj_attn_res_mix_norm's two launches (that case)"}
# Largest per-row relative error of a kernel output against its reference, by dtype: bf16 as the
# kernel tests bound a kernel against a reference that rounds differently; fp32 outputs are fp32
# states and router weights, which agree to summation order (the KDA state to ~1e-4).
TOL = {torch.bfloat16: TEST_TOL["vs_reference_rel_norm"], torch.float32: 1e-3}


@dataclass
class Call:
    """One op call: `reference(*args)` computes what `torch.ops.k3.<op>(*args)` does; `mutates`:
    the indices of the arguments it writes in place (compared as outputs too)."""

    op: str
    args: tuple
    reference: Callable
    mutates: tuple[int, ...] = ()
    compare: Callable[[list, list], list[str]] | None = None  # default: `rows_close`
    run: Callable | None = None  # what runs the kernel, where it is not torch.ops.k3.<op>


@dataclass(frozen=True)
class Case:
    kernel: str  # kernels/<kernel>.py
    B: int
    T: int
    shapes: str

    @property
    def name(self) -> str:
        return f"{self.kernel}/B{self.B}" + (f"T{self.T}" if self.T > 1 else "")

    def build(self, gen: torch.Generator, device) -> Call:
        return BUILDERS[self.kernel][0](gen, device, self.B, self.T)


# ---- inputs and references, per kernel -------------------------------------------------------


def _randn(gen, device, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)


def _weight(gen, device, n, k):
    return _randn(gen, device, n, k, scale=k ** -0.5)


def _norm_weight(gen, device, n):
    return 1 + _randn(gen, device, n, scale=0.1)


def _mix(gen, device, rows, n_blocks):
    """The depth mix's operands as the model holds them: blocks are views of one bank."""
    bank = _randn(gen, device, rows, 8, HIDDEN) * torch.linspace(0.5, 3.0, 8, device=device).view(
        1, 8, 1).bfloat16()
    return ([bank[:, j] for j in range(n_blocks)], _norm_weight(gen, device, HIDDEN),
            _randn(gen, device, 1, HIDDEN, scale=3 / HIDDEN ** 0.5),
            _norm_weight(gen, device, HIDDEN), EPS, EPS)


def rms_norm(gen, device, B, T):
    from k3compile.ops.rms_norm import rms_norm_ref

    return Call("rms_norm", (_randn(gen, device, B, LATENT), _norm_weight(gen, device, LATENT),
                             EPS), rms_norm_ref)


def attn_res_mix_norm(gen, device, B, T):
    from k3compile.ops.attn_res_mix_norm import attn_res_mix_norm_ref

    prefix, delta = _randn(gen, device, B, HIDDEN, scale=2), _randn(gen, device, B, HIDDEN)
    return Call("attn_res_mix_norm", (prefix, delta, *_mix(gen, device, B, 8)),
                attn_res_mix_norm_ref)


def oproj_attn_res_mix_norm(gen, device, B, T):
    from k3compile.ops.attn_res_mix_norm import mix_norm_after

    o, w = _randn(gen, device, B, O_IN), _weight(gen, device, HIDDEN, O_IN)
    args = (o, w, _randn(gen, device, B, HIDDEN, scale=2), *_mix(gen, device, B, 3))
    return Call("oproj_attn_res_mix_norm", args,
                lambda o, w, *rest: mix_norm_after(F.linear(o, w), *rest))


def allreduce_attn_res_mix_norm(gen, device, B, T):
    """World size 1 (one GPU): the all-reduce over NCCL is the identity, the mix is the
    attn_res_mix_norm kernel behind a collective."""
    import torch.distributed as dist

    from k3compile.ops.attn_res_mix_norm import mix_norm_after

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    settings.KERNELS.allreduce = "nccl"  # no symmetric-memory rendezvous at world size 1
    partial = _randn(gen, device, B, HIDDEN)
    args = (partial, _randn(gen, device, B, HIDDEN, scale=2), *_mix(gen, device, B, 8),
            dist.group.WORLD.group_name)
    return Call("allreduce_attn_res_mix_norm", args,
                lambda a, *rest: mix_norm_after(a.clone(), *rest[:-1]))


def mla_lowrank_norm(gen, device, B, T):
    from k3compile.ops.mla_lowrank_norm import mla_lowrank_norm_ref

    fused = _randn(gen, device, B, Q_RANK + KV_RANK + ROPE)  # q_a | kv_a in one GEMM's rows
    args = (fused[:, :Q_RANK], fused[:, Q_RANK:], _norm_weight(gen, device, Q_RANK),
            _norm_weight(gen, device, KV_RANK), CFG.mla_norm_eps)
    return Call("mla_lowrank_norm", args, mla_lowrank_norm_ref)


def moe_route(gen, device, B, T):
    from k3compile.ops.moe_route import moe_route_ref

    logits = _randn(gen, device, B, EXPERTS, scale=2, dtype=torch.float32)
    bias = _randn(gen, device, EXPERTS, scale=0.1, dtype=torch.float32)
    return Call("moe_route", (logits, bias, TOP_K, SCALING), moe_route_ref,
                compare=route_compare(logits, bias))


def moe_front(gen, device, B, T):
    from k3compile.ops.moe_front import moe_front_ref

    args = (_randn(gen, device, B, HIDDEN), _weight(gen, device, EXPERTS, HIDDEN),
            _weight(gen, device, LATENT, HIDDEN))
    return Call("moe_front", args, moe_front_ref)


def moe_front_route(gen, device, B, T):
    """The front's two weights as rows of one buffer (as stage pack stores them: the kernel
    takes only that); B > 8 rows runs the two ops (the kernel's row limit)."""
    from k3compile.ops.moe_front import moe_front_ref
    from k3compile.ops.moe_front_route import moe_front_route_ref

    x = _randn(gen, device, B, HIDDEN)
    both = _weight(gen, device, EXPERTS + LATENT, HIDDEN)
    router_w, down_w = both[:EXPERTS], both[EXPERTS:]
    bias = _randn(gen, device, EXPERTS, scale=0.1, dtype=torch.float32)
    logits = moe_front_ref(x, router_w, down_w)[0]
    routed = route_compare(logits, bias)

    def compare(got, want):
        return routed(got[:2], want[:2]) + rows_close(got[2:], want[2:])

    return Call("moe_front_route", (x, router_w, down_w, bias, TOP_K, SCALING),
                moe_front_route_ref, compare=compare)


def situ_gate_up(gen, device, B, T):
    from k3compile.ops.situ_gate_up import situ_gate_up_ref

    args = (_randn(gen, device, B, HIDDEN), _weight(gen, device, SHARED, HIDDEN),
            _weight(gen, device, SHARED, HIDDEN), BETA, LINEAR_BETA)
    return Call("situ_gate_up", args, situ_gate_up_ref)


def norm_linear(gen, device, B, T):
    from k3compile.ops.norm_linear import norm_linear_ref

    args = (_randn(gen, device, B, LATENT), _norm_weight(gen, device, LATENT),
            _weight(gen, device, HIDDEN, LATENT), EPS, _randn(gen, device, B, HIDDEN))
    return Call("norm_linear", args, norm_linear_ref)


def linear_concat(gen, device, B, T):
    """The KDA in-projection's six weights as separate tensors (not packed: the CUDA path
    concatenates them per call), 3206 output columns."""
    from k3compile.ops.linear_concat import linear_concat_ref

    widths = (KDA_W,) * 4 + (CFG.kda_head_dim, CFG.kda_heads_local)
    weights = [_weight(gen, device, n, HIDDEN) for n in widths]
    return Call("linear_concat", (_randn(gen, device, B, HIDDEN), weights), linear_concat_ref)


def linear(gen, device, B, T):
    from k3compile.ops.linear import linear_ref

    return Call("linear", (_randn(gen, device, B, SHARED), _weight(gen, device, HIDDEN, SHARED)),
                linear_ref)


def mla_uv_gate(gen, device, B, T):
    from k3compile.ops.mla_uv_gate import mla_uv_gate_ref
    from tests.kernels.test_gemv import uv_inputs

    o_lat, w_uv, g = uv_inputs(gen, B, device=device)
    return Call("mla_uv_gate", (o_lat, w_uv, g), mla_uv_gate_ref)


def mla_q_absorb(gen, device, B, T):
    from k3compile.ops.mla_q_absorb import mla_q_absorb_ref
    from tests.fusions.test_mla_q_absorb_kernel import make_inputs

    return Call("mla_q_absorb", make_inputs(gen, (B, T), device=device), mla_q_absorb_ref)


def moe_experts(gen, device, B, T):
    from k3compile.ops.moe_experts import moe_experts_ref
    from tests.fusions.test_moe_experts_kernel import make_experts, make_tokens

    experts = make_experts(gen, EXPERTS, LATENT, EXPERT_INTER, device)
    z, ids, w = make_tokens(gen, B, LATENT, EXPERTS, TOP_K, device)

    def reference(z, ids, w, *rest, rows=16):  # rows apart: each dequantises its experts
        return torch.cat([moe_experts_ref(z[i:i + rows], ids[i:i + rows], w[i:i + rows], *rest)
                          for i in range(0, z.shape[0], rows)])

    return Call("moe_experts", (z, ids, w, *experts, BETA, LINEAR_BETA), reference)


def kda_decode(gen, device, B, T):
    from k3compile.ops.kda_decode import kda_decode_ref
    from tests.fusions.test_kda_decode_kernel import Inputs

    inp = Inputs(gen, B, T, device=device)
    return Call("kda_decode", inp.args(inp.conv_state, inp.state), kda_decode_ref, mutates=(6, 7))


def fb_kda_decode(gen, device, B, T):
    """The reference takes graw from the same GEMM the kernel path runs (`router.linear`; its
    kernels are checked in the `linear` cases): one bf16 flip of graw moves the decay by up to
    ~8% in a channel (tests/fusions/test_kda_decode_kernel.py)."""
    from k3compile.kernels.common import router

    from k3compile.ops.kda_decode import kda_decode_ref
    from tests.fusions.test_kda_decode_kernel import Inputs

    inp = Inputs(gen, B, T, device=device)

    def reference(q, k, v, g, fa, fb_weight, *rest):
        graw = router.linear(fa.reshape(-1, fa.shape[-1]), fb_weight).view(*fa.shape[:2], -1)
        return kda_decode_ref(q, k, v, g, graw, *rest)

    return Call("fb_kda_decode", inp.args(inp.conv_state, inp.state, fb=True), reference,
                mutates=(7, 8))


def input_check(gen, device, B, T):
    """validate's device check + redirect (not a torch.library op: the case calls the kernel's
    host entry); valid slots and positions, so the mask stays 0 and every input passes."""
    from k3compile.kernels import input_check as kernel
    from k3compile.validate import Limit, redirect_ref

    limits = (Limit(0, "slots", "slots", 0, B + 2, "state rows", True, B + 2),
              Limit(1, "positions", "positions", 0, 4096 - T, "cache length", True))
    slots = torch.randperm(B + 2, generator=torch.Generator().manual_seed(B))[:B].to(device)
    positions = torch.randint(0, 4096 - T, (B, T) if T > 1 else (B,), generator=gen,
                              device=device)
    rows = torch.full((), B, dtype=torch.int64, device=device)
    mask = torch.zeros((), dtype=torch.int64, device=device)
    checked = (slots, positions)

    def run(rows, mask, *args):
        if (launch := kernel.redirect(limits, checked)) is None:  # refused (logged), or no GPU
            if rows.is_cuda:
                raise RuntimeError("input_check refused these inputs (see the log)")
            launch = functools.partial(redirect_ref, limits)
        return launch(rows, mask, *args)

    return Call(kernel.OP, (rows, mask, *checked),
                lambda *a: redirect_ref(limits, *a), mutates=(1,), run=run)


def mla_decode(gen, device, B, T):
    from k3compile.ops.mla_decode import mla_decode_ref
    from tests.fusions.test_mla_decode_kernel import Inputs

    inp = Inputs(gen, B, T, device=device)
    return Call("mla_decode", inp.args(inp.cache), mla_decode_ref, mutates=(4,))


# kernel -> (builder, the shapes it launches at, for --list)
BUILDERS: dict[str, tuple[Callable[..., Call], str]] = {
    "rms_norm": (rms_norm, f"x [B, {LATENT}]"),
    "attn_res_mix_norm": (attn_res_mix_norm, f"prefix, delta [B, {HIDDEN}], 8 blocks"),
    "oproj_attn_res_mix_norm": (oproj_attn_res_mix_norm,
                                f"o [B, {O_IN}] x W_o [{HIDDEN}, {O_IN}], 3 blocks"),
    # K3_KERNELS_EXTRA=oproj_mix: the same op in one launch (the gemv's last CTA mixes)
    "oproj_mix": (oproj_attn_res_mix_norm, f"o [B, {O_IN}] x W_o [{HIDDEN}, {O_IN}], 3 blocks, "
                                           f"one launch"),
    "allreduce_attn_res_mix_norm": (allreduce_attn_res_mix_norm,
                                    f"partial [B, {HIDDEN}], world 1, 8 blocks"),
    "mla_lowrank_norm": (mla_lowrank_norm, f"[B, {Q_RANK} + {KV_RANK + ROPE}] column slices"),
    "moe_route": (moe_route, f"logits fp32 [B, {EXPERTS}], top {TOP_K}"),
    "moe_front": (moe_front, f"x [B, {HIDDEN}] x [{EXPERTS} + {LATENT}, {HIDDEN}]"),
    "moe_front_route": (moe_front_route, f"x [B, {HIDDEN}] x [{EXPERTS} + {LATENT}, {HIDDEN}], "
                                         f"top {TOP_K}"),
    "situ_gate_up": (situ_gate_up, f"x [B, {HIDDEN}] x 2 x [{SHARED}, {HIDDEN}]"),
    "norm_linear": (norm_linear, f"u [B, {LATENT}] x [{HIDDEN}, {LATENT}] + residual"),
    "linear_concat": (linear_concat, f"x [B, {HIDDEN}] x 6 weights, 3206 columns"),
    "linear": (linear, f"x [B, {SHARED}] x [{HIDDEN}, {SHARED}]"),
    "mla_uv_gate": (mla_uv_gate, f"o_lat [B, 1, {CFG.mla_heads_local}, {KV_RANK}]"),
    "mla_q_absorb": (mla_q_absorb, f"cq [B, T, {Q_RANK}], {CFG.mla_heads_local} heads"),
    "moe_experts": (moe_experts, f"z [B, {LATENT}], {EXPERTS} MXFP4 experts of {EXPERT_INTER}"),
    # K3_KERNELS_EXTRA=moe_one_launch: the same op, FC1 + FC2 in one launch up to 8 rows (the
    # two launches at 64; registered here, it is also what the moe_experts case runs)
    "moe_one_launch": (moe_experts, (f"z [B, {LATENT}], {EXPERTS} MXFP4 experts of "
                                     f"{EXPERT_INTER}, one launch")),
    "kda_decode": (kda_decode, f"{CFG.kda_heads_local} heads of 128, pool of B + 3 slots"),
    "fb_kda_decode": (fb_kda_decode, "kda_decode + fa [B, T, 128] x W_fb"),
    "mla_decode": (mla_decode, f"{CFG.mla_heads_local} heads, cache [B + 3, 4160, 576]"),
    # K3_CHECK_KERNEL=1: validate's device check in one launch
    "input_check": (input_check, "slots [B] of B + 2 rows, positions [B, T] of 4096"),
}


# ---- comparing --------------------------------------------------------------------------------


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative error ‖got − want‖ / ‖want‖ of each leading row (a request, a state slot)."""
    g, w = (t.double().reshape(max(t.shape[0], 1) if t.dim() else 1, -1) for t in (got, want))
    return (g - w).norm(dim=1) / w.norm(dim=1).clamp_min(1e-30)


def rows_close(got: list, want: list) -> list[str]:
    """Problems with outputs `got` against the reference's `want` (empty: they agree)."""
    problems = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape or g.dtype != w.dtype:
            problems.append(f"output {i}: {g.dtype} {tuple(g.shape)}, reference {w.dtype} "
                            f"{tuple(w.shape)}")
        elif not g.dtype.is_floating_point:
            if (diff := int((g != w).sum())):
                problems.append(f"output {i}: {diff} of {g.numel()} elements differ")
        elif (bad := int((~g.isfinite() & w.isfinite()).sum())):
            problems.append(f"output {i}: {bad} non-finite elements where the reference has none")
        elif g.numel():
            err = row_errors(g, w)
            tol = TOL.get(g.dtype, TOL[torch.float32])
            if (worst := float(err.max())) > tol:
                problems.append(f"output {i}: row {int(err.argmax())} off by {worst:.3g} "
                                f"(tolerance {tol:g})")
    return problems


def route_compare(logits, bias, tie=1e-6):
    """moe_route: ids valid and distinct; where the top-k cut is clear of a tie, the same set as
    the reference's with the same weights (per expert id)."""

    def compare(got, want):
        (ids, w), (ref_ids, ref_w) = got, want
        if (ids < 0).any() or (ids >= logits.shape[-1]).any():
            return ["ids out of range"]
        if ids.numel() and not (ids.sort(-1).values.diff(dim=-1) > 0).all():
            return ["an expert chosen twice"]
        keys = (torch.sigmoid(logits) + bias).sort(-1, descending=True).values
        clear = (keys[:, TOP_K - 1] - keys[:, TOP_K]) > tie
        ids, order = ids[clear].sort(-1)
        ref_ids, ref_order = ref_ids[clear].sort(-1)
        return rows_close([ids, w[clear].gather(-1, order)],
                          [ref_ids, ref_w[clear].gather(-1, ref_order)])

    return compare


# ---- running ---------------------------------------------------------------------------------


def _states(call: Call) -> tuple:
    """The arguments with copies of the ones the op writes."""
    return tuple(a.clone() if i in call.mutates else a for i, a in enumerate(call.args))


def _flat(out, args, call: Call) -> list:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return outs + [args[i] for i in call.mutates]


def run_call(call: Call) -> tuple[list[str], dict[str, int]]:
    """The op on copies of its states, then its reference on others: the problems found and the
    reference fallbacks counted during the op's call."""
    from k3compile.kernels.common.dsl import fallback_counts

    got_args, ref_args = _states(call), _states(call)
    before = fallback_counts()
    got = (call.run or getattr(torch.ops.k3, call.op))(*got_args)
    if got_args[0].is_cuda:
        torch.cuda.synchronize()
    fell = {f"{op} ({why})": n - before.get((op, why), 0)
            for (op, why), n in fallback_counts().items() if n > before.get((op, why), 0)}
    want = call.reference(*ref_args)
    compare = call.compare or rows_close
    return compare(_flat(got, got_args, call), _flat(want, ref_args, call)), fell


def run_case(case: Case, device="cuda", seed=0) -> dict:
    """Build, run and check one case; every failure is caught and reported, never raised."""
    t0 = time.perf_counter()
    result = {"case": case.name, "kernel": case.kernel, "B": case.B, "T": case.T}
    try:
        gen = torch.Generator(device).manual_seed(seed)
        problems, fell = run_call(case.build(gen, device))
        if fell and device == "cuda":
            problems.append("the kernel refused and ran the reference: " + "; ".join(fell))
        result.update(status="fail" if problems else "ok", problems=problems, fallbacks=fell)
    except Exception as e:  # noqa: BLE001  (a case's crash is its result; the run goes on)
        result.update(status="error", problems=[f"{type(e).__name__}: {e}"[:500]], fallbacks={})
    if device == "cuda":
        try:
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a sticky CUDA error: every later case fails too)
            result.update(status="error", problems=result["problems"] + [f"sync: {e}"[:300]])
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def kernel_modules() -> list[str]:
    """Every kernels/<name>.py: KERNELS, then the opt-in modules (not yet in KERNELS)."""
    import k3compile.kernels as pkg

    found = {m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.ispkg}
    return list(KERNELS) + sorted(found - set(KERNELS))


def plan(only=None, buckets=BUCKETS, composites=True) -> list[Case]:
    cases = []
    for kernel in kernel_modules():
        if (kernel not in BUILDERS or (only and kernel not in only)
                or (not composites and kernel in COMPOSITES)):
            continue
        rows = [b for b in buckets if b == 1] if kernel in ONE_ROW else buckets
        shapes = BUILDERS[kernel][1]
        cases += [Case(kernel, b, 1, shapes) for b in rows]
        cases += [Case(kernel, b, 8, shapes) for b in VERIFY.get(kernel, ()) if b in buckets]
    return cases


def register_every_kernel() -> list[str]:
    """KERNELS through `register_all`, and the opt-in modules directly."""
    import importlib

    from k3compile.kernels import register_all

    names = register_all()
    for extra in set(kernel_modules()) - set(names):
        importlib.import_module(f"k3compile.kernels.{extra}").register()
        names.append(extra)
    return names


def canary() -> None:
    """kda_decode with a slot 4096 past its pool: reads and writes far outside the state buffers,
    which memcheck must report (the process may then die of the error: expected)."""
    call = kda_decode(torch.Generator("cuda").manual_seed(0), "cuda", 1, 1)
    args = list(call.args)
    args[8] = torch.tensor([args[7].shape[0] + 4096], device="cuda")  # slots
    print("SAN-CASE begin canary/kda_decode", flush=True)
    torch.ops.k3.kda_decode(*args)
    torch.cuda.synchronize()
    print("SAN-CASE end canary/kda_decode launched", flush=True)


# ---- the tools' logs -----------------------------------------------------------------------

_META = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY",
         "Target application returned", "Saved host backtrace", "Host Frame", "Device Frame")


def parse_log(text: str) -> dict:
    """A sanitizer log (its reports interleaved with this script's SAN-CASE lines) ->
    {"cases": {case: [report, ...]}, "outside": [...], "api": [...], "summary": [...]}: each
    report its first line and the first `at ...` frame line after it."""
    out: dict = {"cases": {}, "outside": [], "api": [], "summary": []}
    current, last = None, None
    for line in text.splitlines():
        if m := re.match(r"SAN-CASE (begin|end) (\S+)", line):
            current = m.group(2) if m.group(1) == "begin" else None
            last = None
            continue
        m = re.match(r"========= (\S.*)", line)
        if not m:
            frame = re.match(r"=========\s+(at .*)", line)
            if frame and last is not None and "where" not in last:
                last["where"] = frame.group(1).strip()[:200]
            continue
        message = m.group(1).strip()
        if message.startswith(("ERROR SUMMARY", "RACECHECK SUMMARY")):
            out["summary"].append(message)
            last = None
        elif message.startswith(_META):
            last = None
        elif message.startswith("Program hit"):
            last = {"message": message[:300], "case": current}
            out["api"].append(last)
        else:
            last = {"message": message[:300]}
            (out["cases"].setdefault(current, []) if current else out["outside"]).append(last)
    return out


def summarize(folder: Path) -> str:
    """summary.txt / summary.json in `folder` from its <tool>_<shard>.log and .json files."""
    results, reports = {}, {}
    for path in sorted(folder.glob("*_[0-9]*.json")):
        tool = path.stem.split("_")[0]
        for r in json.loads(path.read_text()):
            results.setdefault(tool, {})[r["case"]] = r
    for path in sorted(folder.glob("*_[0-9]*.log")):
        tool = path.stem.split("_")[0]
        parsed = parse_log(path.read_text(errors="replace"))
        merged = reports.setdefault(tool, {"cases": {}, "outside": [], "api": [], "summary": []})
        for case, found in parsed["cases"].items():
            merged["cases"].setdefault(case, []).extend(found)
        for key in ("outside", "api", "summary"):
            merged[key] += parsed[key]
    lines = []
    for tool in sorted(set(results) | set(reports)):
        res, rep = results.get(tool, {}), reports.get(tool, {"cases": {}, "outside": [],
                                                             "api": [], "summary": []})
        lines.append(f"== {tool}")
        if tool == "canary":
            caught = rep["cases"].get("canary/kda_decode", [])
            lines.append(f"canary (kda_decode, slot out of range): {len(caught)} reports "
                         + ("-- the sanitizer sees CuTe launches through TVM-FFI" if caught else
                            "-- NOT SEEN: the sanitizer may miss TVM-FFI launches"))
            lines += [f"  {r['message']} | {r.get('where', '')}" for r in caught[:3]]
            continue
        by_kernel: dict[str, list[int]] = {}  # kernel -> [cases, ok, value failures, reports]
        for case, r in res.items():
            row = by_kernel.setdefault(r["kernel"], [0, 0, 0, 0])
            row[0] += 1
            row[1] += r["status"] == "ok"
            row[2] += r["status"] != "ok"
        for case, found in rep["cases"].items():
            by_kernel.setdefault(case.split("/")[0], [0, 0, 0, 0])[3] += len(found)
        lines.append(f"{'kernel':30s} cases  ok  failed  {tool} reports")
        for kernel, (n, ok, bad, found) in by_kernel.items():
            lines.append(f"{kernel:30s} {n:5d} {ok:3d} {bad:7d}  {found:7d}")
        for case, r in res.items():
            if r["status"] != "ok":
                lines.append(f"  {case}: {r['status']}: {'; '.join(r['problems'])[:300]}")
        for case, found in rep["cases"].items():
            lines += [f"  {case}: {r['message']} | {r.get('where', '')}" for r in found[:3]]
        lines += [f"  outside any case: {r['message']} | {r.get('where', '')}"
                  for r in rep["outside"][:5]]
        if rep["api"]:
            lines.append(f"  CUDA API errors reported: {len(rep['api'])} (first: "
                         f"{rep['api'][0]['message'][:150]})")
        lines += [f"  {s}" for s in rep["summary"]]
    text = "\n".join(lines)
    (folder / "summary.txt").write_text(text + "\n")
    (folder / "summary.json").write_text(json.dumps(
        {"results": results, "reports": reports}, indent=1, default=str))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print the planned cases (no GPU)")
    ap.add_argument("--only", help="comma-separated kernels")
    ap.add_argument("--buckets", default=",".join(map(str, BUCKETS)))
    ap.add_argument("--shard", default="0/1", help="i/N: every N-th kernel from the i-th")
    ap.add_argument("--no-composites", action="store_true",
                    help=f"leave out {', '.join(COMPOSITES)}")
    ap.add_argument("--time-budget", type=float, default=float("inf"),
                    help="seconds; later cases are reported as not run")
    ap.add_argument("--out", help="folder for <tag>.json, the results")
    ap.add_argument("--tag", default="cases")
    ap.add_argument("--canary", action="store_true")
    ap.add_argument("--summarize", metavar="DIR")
    opts = ap.parse_args(argv)
    if opts.summarize:
        print(summarize(Path(opts.summarize)))
        return 0
    only = set(opts.only.split(",")) if opts.only else None
    cases = plan(only, tuple(int(b) for b in opts.buckets.split(",")), not opts.no_composites)
    i, n = (int(x) for x in opts.shard.split("/"))
    mine = [k for k in dict.fromkeys(c.kernel for c in cases)][i::n]
    cases = [c for c in cases if c.kernel in mine]
    if opts.list:
        for c in cases:
            print(f"{c.name:34s} {c.kernel:28s} B={c.B:<3d} T={c.T}  {c.shapes}")
        if missing := [k for k in kernel_modules() if k not in BUILDERS]:
            print(f"kernels without a case: {missing}")
        for kernel, why in ONE_ROW.items():
            print(f"{kernel}: B = 1 only ({why})")
        return 0
    if opts.canary:
        register_every_kernel()
        canary()
        return 0
    print(f"registered: {register_every_kernel()}", flush=True)
    t0, results = time.perf_counter(), []
    out = Path(opts.out) / f"{opts.tag}.json" if opts.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        if time.perf_counter() - t0 > opts.time_budget:
            results.append({"case": case.name, "kernel": case.kernel, "B": case.B, "T": case.T,
                            "status": "not run (time budget)", "problems": [], "fallbacks": {}})
            continue
        print(f"SAN-CASE begin {case.name}", flush=True)
        r = run_case(case)
        results.append(r)
        print(f"SAN-CASE end {case.name} {r['status']} {r['seconds']} s "
              f"{'; '.join(r['problems'])[:300]}", flush=True)
        if out:  # after every case: a run killed by its time limit keeps what it did
            out.write_text(json.dumps(results, indent=1))
    if out:
        out.write_text(json.dumps(results, indent=1))
    failed = [r["case"] for r in results if r["status"] != "ok"]
    print(f"{len(results) - len(failed)} of {len(results)} cases ok"
          + (f"; not ok: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
