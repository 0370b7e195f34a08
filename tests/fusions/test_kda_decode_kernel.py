"""KDA decode kernel (`k3::kda_decode`, `k3::fb_kda_decode`) against `kda_decode_ref`.

GPU (marked `gpu`): one K3 TP16 rank (6 heads of 128, conv taps 4) at every batch bucket with
T = 1 and T = 8, other T (conv-state shift when T < taps - 1), other head counts, every config,
several consecutive steps on carried states, and fb_kda_decode; both ops' `norm_fp32` build (fla's
gated norm, one rounding) at B 1, 8, 64 and T 1, 8; A_log and dt_bias in bf16 (each, and both: a
Moonshot model cast to bf16 whole) with that norm. Activations are column slices of
one in-projection row (stride 3206, as the fused GEMM produces them), slots are a permutation
of a larger state pool whose other slots must stay untouched, and the last request of a batch
is a padding row on the scratch slot (-1: the pool's last). Outputs are poisoned beforehand.
fb_kda_decode in one launch (the f_b build) at B 1, 2, 8, 64 and T 1, 8, 16 with its GEMM
forbidden, against its two launches, as one kernel per call (profiler), and refused ranks (two
launches).
fa and W_fb lie on a grid (`on_grid`) where graw is exact in any summation order.

CPU: a model of the kernel's blocking (its work split from `kernel.Tile`, the butterfly sums,
the cluster sum, the ownership of outputs and conv-state writes) against the reference, for
every config, and each output norm against its reference variant, and with bf16 A_log and
dt_bias; the reference's bf16 parameters are their fp32 values exactly; the build flags' cache
keys; refusals; the fallback off the GPU; the f_b build's refusals, key, W_fb sweep, shared
memory budget and the grid's exactness, and a refused rank's two launches off the GPU.
"""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from k3compile.kernels import fb_kda_decode as fb_kernel
from k3compile.kernels import kda_decode as kernel

from k3compile.ops.kda_decode import BUILTIN, ConvRounding, KDAVariant, kda_decode_ref
from k3compile.settings import KERNELS
from tests.kernel_checks import (
    BUCKETS,
    TOL,
    assert_refused,
    assert_written,
    poisoned,
    rel_err,
    strided,
)

K, TAPS = 128, 4
H_TP16 = 96 // 16  # KDA heads per rank at TP16 (k3_arch.md §4.2)
SCALARS = {"lower_bound": -5.0, "l2_eps": 1e-6, "q_scale": K**-0.5, "norm_eps": 1e-5}
# The fp32 state agrees to summation order, except where a conv output's bf16 rounding flips
# (its fp32 sum is an ulp off torch's): one channel then moves by ~2^-9 relative, which moves a
# state row or column by ~1e-4. Indexing errors move it by O(0.1).
STATE_TOL = {"rtol": 1e-3, "atol": 2e-3}
STATE_REL_NORM = 1e-4
FLA_NORM = KDAVariant(norm_fp32=True)  # fla's gated norm, Moonshot's


@pytest.fixture(autouse=True)
def one_launch_fb(monkeypatch):
    """fb_kda_decode's one-launch build is opt-in (K3_KDA_FB): on for this module's tests, whose
    two-launch cases force that path themselves (`two_launches`)."""
    monkeypatch.setattr(KERNELS, "kda_fb", True)


def cfg_id(cfg):
    return f"C{cfg.cluster_n}R{cfg.rows_per_thread}"


def on_grid(x, steps):
    """x rounded to multiples of 1/steps (|x| < 256/steps: exact in bf16). fa on a grid of 1/4 and
    W_fb of 1/64 make every partial sum of fa · W_fbᵀ a multiple of 2^-8 below 2^16: exact in fp32,
    so graw = bf16(the exact sum) whatever the order (our kernel's lanes, gemv, cuBLAS) and a bf16
    rounding flip of graw (which moves α by up to ~8%) cannot differ between the paths."""
    return (x.float() * steps).round().clamp(-255, 255) / steps


def fb_graw_model(fa, w):
    """graw as the f_b build sums it (for inputs off the grid): per lane the 8 products of its
    vector in order, then the butterfly over the R/8 lanes (a pairwise tree), one rounding."""
    R = fa.shape[-1]
    prods = fa.float()[..., None, :] * w.float()  # [..., N, R], exact
    parts = prods.view(*prods.shape[:-1], R // 8, 8)
    acc = parts[..., 0]
    for e in range(1, 8):
        acc = acc + parts[..., e]
    while acc.shape[-1] > 1:
        acc = acc[..., 0::2] + acc[..., 1::2]
    return acc[..., 0].bfloat16()


class Inputs:
    """One KDA step's operands at H heads, B requests of T tokens, over a pool of S slots."""

    def __init__(self, gen, B, T, H=H_TP16, taps=TAPS, device="cuda", extra_slots=3):
        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=gen, device=device) * scale

        W = H * K
        self.B, self.T, self.H = B, T, H
        row = randn(B, T, 4 * W + K + H).bfloat16()  # the in-projection: q|k|v|g|f_a|b
        self.q, self.k, self.v, self.g = (row[..., i * W:(i + 1) * W] for i in range(4))
        self.fa, self.b = row[..., 4 * W:4 * W + K], row[..., 4 * W + K:]
        self.fa.copy_(on_grid(self.fa, 4))
        self.fb_weight = on_grid(randn(W, K, scale=K**-0.5), 64).bfloat16()
        self.graw = F.linear(self.fa, self.fb_weight)
        S = B + extra_slots
        self.conv_state = randn(S, 3 * W, taps - 1).bfloat16()
        self.state = randn(S, H, K, K, scale=0.1)
        perm = torch.rand(S - 1, generator=gen, device=device).argsort()[:B]
        if B > 1:
            perm[-1] = -1  # a padding row on the scratch slot
        self.slots = perm
        self.conv_w = [randn(W, 1, taps, scale=0.5).bfloat16() for _ in range(3)]
        self.A_log = torch.log(1 + 15 * torch.rand(H, generator=gen, device=device))
        self.dt_bias = randn(W, scale=0.5)
        self.o_norm_weight = (1 + randn(K, scale=0.1)).bfloat16()

    def new_activations(self, gen):
        """Fresh q|k|v|g|f_a|b rows for the next step (states carried)."""
        fresh = Inputs(gen, self.B, self.T, self.H, self.conv_state.shape[2] + 1,
                       self.q.device, 0)
        for name in ("q", "k", "v", "g", "fa", "b", "graw"):
            setattr(self, name, getattr(fresh, name))
        self.graw = F.linear(self.fa, self.fb_weight)

    def args(self, conv_state, state, *, fb=False):
        first = (self.q, self.k, self.v, self.g, *((self.fa, self.fb_weight) if fb else
                                                  (self.graw,)), self.b)
        return (*first, conv_state, state, self.slots, *self.conv_w, self.A_log, self.dt_bias,
                self.o_norm_weight, *SCALARS.values(), None, None)  # one conv state buffer

    def bf16_params(self, which):
        """A_log, dt_bias or both in bf16, as `model.to(torch.bfloat16)` leaves them."""
        for name in (("A_log", "dt_bias") if which == "both" else (which,)):
            setattr(self, name, getattr(self, name).bfloat16())
        return self

    def untouched(self):
        mask = torch.ones(self.state.shape[0], dtype=torch.bool, device=self.state.device)
        mask[self.slots] = False
        return mask


def compare(got, ref, conv, ref_conv, state, ref_state, inp, conv0, state0):
    assert_written(got)
    torch.testing.assert_close(got.float(), ref.float(), **TOL["bf16"])
    assert rel_err(got, ref) < TOL["bf16_rel_norm"]
    assert torch.equal(conv, ref_conv), "conv_state differs (it is a copy of bf16 inputs)"
    used = inp.slots
    torch.testing.assert_close(state[used], ref_state[used], **STATE_TOL)
    assert rel_err(state[used], ref_state[used]) < STATE_REL_NORM
    mask = inp.untouched()
    assert torch.equal(state[mask], state0[mask]) and torch.equal(conv[mask], conv0[mask])


def check_step(inp, steps=1, gen=None, fb=False, norm_fp32=False, time_major=False):
    """Kernel and reference (of the `norm_fp32` variant) from the same states for `steps`
    consecutive steps; `time_major`: the kernel's conv state is a [S, taps-1, 3W] buffer (its
    time-major build), compared through its transpose."""
    conv, state = inp.conv_state.clone(), inp.state.clone()
    if time_major:  # the buffer is time-major; `conv` is its [S, 3W, taps-1] view
        conv = conv.transpose(1, 2).contiguous().transpose(1, 2)
    ref_conv, ref_state = inp.conv_state.clone(), inp.state.clone()
    for step in range(steps):
        if step:
            inp.new_activations(gen)
        conv0, state0 = conv.clone(), state.clone()
        out = poisoned(inp.B, inp.T, inp.H, K)
        run = fb_kernel.fb_kda_decode_cuda if fb else kernel.kda_decode_cuda
        buffer = conv.transpose(1, 2) if time_major else conv
        spec = KDAVariant(norm_fp32=norm_fp32, conv_time_major=time_major).spec
        got = run(*inp.args(buffer, state, fb=fb), spec, out=out)
        assert got is out, "the kernel did not run (fallback)"
        if fb:  # the reference's bf16 linear, exact on `on_grid` inputs (any summation order)
            inp.graw = exact_graw(inp.fa, inp.fb_weight)
        other = kda_decode_ref(*inp.args(ref_conv.clone(), ref_state.clone()),
                               KDAVariant(norm_fp32=not norm_fp32))
        ref = kda_decode_ref(*inp.args(ref_conv, ref_state), KDAVariant(norm_fp32=norm_fp32))
        compare(got, ref, conv, ref_conv, state, ref_state, inp, conv0, state0)
        assert_own_norm(got, ref, other)


def exact_graw(fa, w):
    """F.linear(fa, w) on `on_grid` inputs: the exact sum (float64) rounded once, checked equal
    to the bf16 linear computed in fp32 (cuBLAS's bf16 GEMM may reduce in bf16)."""
    graw = (fa.double() @ w.double().t()).bfloat16()
    assert torch.equal(graw, F.linear(fa.float(), w.float()).bfloat16()), "fa, W_fb off the grid"
    return graw


def assert_own_norm(got, ref, other):
    """The two output norms differ by ~3.6e-3 (relative norm, measured on the CPU model), under
    TOL["bf16_rel_norm"]: the output must be far closer to its own variant's reference."""
    assert 4 * rel_err(got, ref) < rel_err(got, other), (rel_err(got, ref), rel_err(got, other))


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("B", BUCKETS)
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_tp16_rank(gen, B, T):
    check_step(Inputs(gen, B, T))


@pytest.mark.parametrize("B,T", [(3, 2), (5, 3), (2, 5), (6, 16), (37, 1)])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_other_tokens_and_rows(gen, B, T):
    check_step(Inputs(gen, B, T))


@pytest.mark.parametrize("fb", [False, True], ids=["graw", "fb"])
@pytest.mark.parametrize("B,T", [(1, 1), (8, 1), (64, 1), (2, 2), (3, 8)])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_time_major_conv_state(gen, B, T, fb):
    """The time-major build (a [S, taps-1, 3W] conv state, vLLM v1's layout; fb: our GEMM, then
    it) against the reference over two steps, states and untouched slots included."""
    check_step(Inputs(gen, B, T), steps=2, gen=gen, fb=fb, time_major=True)


@pytest.mark.parametrize("H", [1, 4])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_other_head_counts(gen, H):
    check_step(Inputs(gen, 3, 8, H))


@pytest.mark.parametrize("cfg", kernel.configs(), ids=cfg_id)
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_every_config(gen, cfg, monkeypatch):
    monkeypatch.setattr(kernel, "config", lambda *_: cfg)
    for T in (1, 2, 8):
        check_step(Inputs(gen, 3, T))


@pytest.mark.parametrize("B,T", [(1, 1), (8, 8), (64, 1)])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_consecutive_steps(gen, B, T):
    check_step(Inputs(gen, B, T), steps=4, gen=gen)


@pytest.mark.parametrize("B,T", [(1, 1), (1, 8), (16, 1), (4, 8)])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_fb_kda_decode(gen, B, T):
    check_step(Inputs(gen, B, T), steps=2, gen=gen, fb=True)


@pytest.mark.parametrize("fb", [False, True], ids=["kda_decode", "fb_kda_decode"])
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_norm_fp32(gen, B, T, fb):
    """fla's gated norm (Moonshot's, fp32 with one rounding): the kernel's norm_fp32 build
    against the reference's norm_fp32, two steps on carried states."""
    check_step(Inputs(gen, B, T), steps=2, gen=gen, fb=fb, norm_fp32=True)


@pytest.mark.parametrize("fb", [False, True], ids=["kda_decode", "fb_kda_decode"])
@pytest.mark.parametrize("B,T", [(1, 1), (8, 8), (64, 1)])
@pytest.mark.parametrize("which", ["A_log", "dt_bias", "both"])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_bf16_params(gen, which, B, T, fb):
    """A_log / dt_bias in bf16 (Moonshot's model cast to bf16 whole; with its norm_fp32): the
    kernel's build for them against the reference, which promotes them to fp32 as the kernel
    loads them, two steps on carried states."""
    check_step(Inputs(gen, B, T).bf16_params(which), steps=2, gen=gen, fb=fb, norm_fp32=True)


def no_gemm(monkeypatch):
    """fb_kda_decode's two-launch path (its GEMM) fails the test if taken."""
    def gemm(*_):
        raise AssertionError("fb_kda_decode took its two launches")
    monkeypatch.setattr(fb_kernel, "linear", gemm)


def two_launches(monkeypatch):
    """fb_kda_decode refuses its one-launch build: the GEMM, then kda_decode."""
    monkeypatch.setattr(fb_kernel, "fb_refusal", lambda *_: "forced by the test")


@pytest.mark.parametrize("T", [1, 8, 16])
@pytest.mark.parametrize("B", [1, 2, 8, 64])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_fb_one_launch(gen, B, T, monkeypatch):
    """The f_b build (graw in each CTA's prologue, from the in-projection's column slice of fa
    and the head's W_fb rows staged in shared memory before the PDL wait) at one TP16 rank
    (R = 128) against the reference, two steps on carried states; T up to MAX_TOKENS (16: the
    most shared memory, 82640 B without a cluster)."""
    no_gemm(monkeypatch)
    inp = Inputs(gen, B, T)
    assert inp.fa.stride()[:2] != (T * K, K), "fa is a column slice of the in-projection"
    assert fb_kernel.fb_refusal(inp.fa, inp.fb_weight, inp.q) is None
    check_step(inp, steps=2, gen=gen, fb=True)


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_fb_one_launch_contiguous_fa(gen, monkeypatch):
    """f_a in rows of its own (16-byte-aligned) is taken too."""
    no_gemm(monkeypatch)
    inp = Inputs(gen, 2, 1)
    inp.fa = inp.fa.contiguous()
    check_step(inp, fb=True)


@pytest.mark.parametrize("B,T", [(1, 1), (8, 8), (64, 1)])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_fb_paths_agree(gen, B, T, monkeypatch):
    """One launch and two launches (GEMM, then kda_decode) on the same inputs and states: the
    same graw (exact sums on the grid), so outputs and states agree (in fact bit for bit)."""
    inp = Inputs(gen, B, T)
    results = []
    for one in (True, False):
        with monkeypatch.context() as m:
            if one:
                no_gemm(m)
            else:
                two_launches(m)
            conv, state = inp.conv_state.clone(), inp.state.clone()
            out = poisoned(B, T, inp.H, K)
            assert fb_kernel.fb_kda_decode_cuda(*inp.args(conv, state, fb=True), out=out) is out
            results.append((out, conv, state))
    (o1, c1, s1), (o2, c2, s2) = results
    assert_written(o1, o2)
    torch.testing.assert_close(o1.float(), o2.float(), **TOL["bf16"])
    assert torch.equal(c1, c2)
    torch.testing.assert_close(s1, s2, **STATE_TOL)


@pytest.mark.parametrize("B,T", [(1, 1), (64, 8)])
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_fb_is_one_kernel(gen, B, T):
    """k3::fb_kda_decode launches one kernel per call (issue 21: no f_b GEMM of its own)."""
    inp = Inputs(gen, B, T)
    args = inp.args(inp.conv_state.clone(), inp.state.clone(), fb=True)
    torch.ops.k3.fb_kda_decode(*args)  # compiled, and any first-call work done
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        torch.ops.k3.fb_kda_decode(*args)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
@pytest.mark.parametrize("R", [100, 120])
def test_fb_refused_rank_takes_two_launches(gen, caplog, R):
    """f_a rank 100 (not a multiple of 8) and 120 (not 8·2^i): the one-launch build refuses it
    (logged), the GEMM and the kda_decode kernel run and equal the reference."""
    inp = Inputs(gen, 2, 1)
    inp.fa, inp.fb_weight = inp.fa[..., :R], inp.fb_weight[:, :R].contiguous()
    assert "f_a rank" in fb_kernel.fb_refusal(inp.fa, inp.fb_weight, inp.q)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        check_step(inp, fb=True)
    assert f"f_a rank {R}" in caplog.text and "two launches" in caplog.text


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_empty_batch(gen):
    inp = Inputs(gen, 0, 1, extra_slots=2)
    assert kernel.kda_decode_cuda(*inp.args(inp.conv_state, inp.state)).shape == (0, 1, 6, K)


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_refused_input_falls_back(gen, caplog):
    inp = Inputs(gen, 2, 1)
    args = list(inp.args(inp.conv_state.clone(), inp.state.clone()))
    args[0] = strided(args[0])  # q with a strided last dim: the reference takes it, the kernel not
    assert not kernel.can_implement(*args)
    ref_args = list(inp.args(inp.conv_state.clone(), inp.state.clone()))
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = kernel.kda_decode_cuda(*args)
    assert "kda_decode" in caplog.text
    assert torch.equal(got, kda_decode_ref(*ref_args))


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's blocking, modelled in torch


def _butterfly(part, tl):
    """part [threads, 4] partial column sums -> every lane's butterfly total, as the kernel's
    shuffles compute it (lane l adds lane l ^ offset's value, offsets from the tile)."""
    lanes = torch.arange(32)
    p = part.view(tl.warps, 32, -1)
    for off in tl.bfly_offsets():
        p = p + p[:, lanes ^ off]
    return p.reshape(part.shape)


def _items(tl, items):
    """(kind, index within the kind) of every work item as the kernel's threads take them."""
    for it, s, full in tl.plan(items):
        kind, lo, hi = items[s]
        for tidx in range(tl.threads):
            item = it * tl.threads + tidx
            assert lo <= item < hi or not full
            if lo <= item < hi:
                yield kind, item - lo


def _prologue(inp, args, tl, rank, req, h, old_conv):
    """Shared memory after the prologue, checking its items cover every entry once."""
    q, k, v, _, graw, b = args[:6]
    wq, wk, wv, A_log, dt_bias = args[9:14]
    T, W, taps = inp.T, inp.H * K, old_conv.shape[-1] + 1
    sizes = {"q": K, "k": K, "v": tl.vc, "alpha": K}
    seen = {kind: [0] * n for kind, n in sizes.items()}
    for kind, c in _items(tl, tl.prologue_items()):
        seen[kind][c] += 1
    assert all(c == 1 for counts in seen.values() for c in counts), seen
    sm = {}
    for s, (x, w) in enumerate(((q, wq), (k, wk), (v, wv))):
        first = h * K + (rank * tl.vc if s == 2 else 0)
        ch = slice(first, first + (tl.vc if s == 2 else K))
        window = torch.cat([old_conv[s * W:(s + 1) * W][ch].float(), x[req, :, ch].float().t()],
                           dim=-1)  # [channels, taps - 1 + T]
        acc = torch.stack([(window[:, t:t + taps] * w[ch, 0].float()).sum(-1)
                           for t in range(T)])
        sm["qkv"[s]] = F.silu(acc).bfloat16().float()  # [T, channels]
    for name, scale in (("q", args[17]), ("k", 1.0)):  # q_scale
        x = sm[name]
        sm[name] = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + args[16]) * scale
    gate = torch.exp(A_log[h].float()) * (graw[req, :, h * K:(h + 1) * K].float()
                                  + dt_bias[h * K:(h + 1) * K])
    sm["alpha"] = torch.exp(args[15] * torch.sigmoid(gate))  # lower_bound
    sm["beta"] = torch.sigmoid(b[req, :, h].float())
    return sm


def _recurrence(sm, tile_state, tl, T):
    """The thread tiles through the T tokens; returns (sO [T, vc], Σo'² per token)."""
    rg_lc = [tl.thread(t) for t in range(tl.threads)]
    rows = torch.tensor([[rg + tl.rw * i for i in range(tl.R)] for rg, _ in rg_lc])
    cols = torch.tensor([[lc + j for j in range(kernel.VEC)] for _, lc in rg_lc])
    owned = torch.zeros(K, tl.vc, dtype=torch.int)
    owned.index_put_((rows[:, :, None], cols[:, None, :]), torch.tensor(1, dtype=torch.int),
                     accumulate=True)
    assert torch.equal(owned, torch.ones_like(owned)), "state tiles do not partition the slice"
    first = torch.tensor([rg == 0 for rg, _ in rg_lc])
    St = tile_state[rows[:, :, None], cols[:, None, :]]  # [threads, R, 4]
    sO = torch.full((T, tl.vc), float("nan"))
    ss = torch.zeros(T)
    for t in range(T):
        kk, qq = sm["k"][t][rows][..., None], sm["q"][t][rows][..., None]
        St = St * sm["alpha"][t][rows][..., None]
        kv = _butterfly((St * kk).sum(1), tl)
        truth = torch.zeros(tl.vc).index_add_(0, cols.flatten(), (St * kk).sum(1).flatten())
        assert torch.allclose(kv, truth[cols], rtol=1e-5, atol=1e-5), "butterfly lanes"
        u = sm["beta"][t] * (sm["v"][t][cols] - kv)
        St = St + kk * u[:, None, :]
        o = _butterfly((St * qq).sum(1), tl).bfloat16().float()
        sO[t, cols[first].flatten()] = o[first].flatten()
        ss[t] = o[first].pow(2).sum()
    tile_state[rows[:, :, None], cols[:, None, :]] = St
    return sO, ss


def blocking_model(inp, args, cfg, norm_fp32=False):
    """The kernel's algorithm in torch, CTA by CTA; updates args' state buffers like the kernel
    and returns the output (`norm_fp32`: the fp32 output norm, one rounding). Asserts every
    output and conv-state element is written once."""
    q, k, v, g = args[:4]
    conv_state, state, slots, o_norm_weight, norm_eps = args[6], args[7], args[8], args[14], \
        args[18]
    tl = kernel.tile(cfg)
    B, T, H, W = inp.B, inp.T, inp.H, inp.H * K
    keep = conv_state.shape[-1]
    out = torch.full((B, T, H, K), float("nan"), dtype=torch.bfloat16)
    for req in range(B):
        slot = int(slots[req]) % state.shape[0]
        old_conv = conv_state[slot].clone()  # the cluster barrier precedes every write
        conv_written = torch.zeros(3 * W, dtype=torch.int)
        for h in range(H):
            sO, ss = [], torch.zeros(T)
            for rank in range(tl.C):
                sm = _prologue(inp, args, tl, rank, req, h, old_conv)
                cols = slice(rank * tl.vc, (rank + 1) * tl.vc)
                o_rank, ss_rank = _recurrence(sm, state[slot, h][:, cols], tl, T)
                sO.append(o_rank)
                ss += ss_rank
            rstd = torch.rsqrt(ss / K + norm_eps)
            for rank in range(tl.C):
                n_out = tl.out_vectors(T)
                for item in range(-(-n_out // tl.threads) * tl.threads):
                    if item >= n_out:
                        continue
                    t, lc = item // (tl.vc // 8), item % (tl.vc // 8) * 8
                    col = rank * tl.vc + lc
                    assert out[req, t, h, col:col + 8].isnan().all(), "output written twice"
                    normed, w = sO[rank][t, lc:lc + 8] * rstd[t], o_norm_weight[col:col + 8]
                    gate = g[req, t, h * K + col:][:8]
                    if norm_fp32:
                        y = normed * w.float() * torch.sigmoid(gate.float())
                    else:
                        y = w * normed.bfloat16() * torch.sigmoid(gate)
                    out[req, t, h, col:col + 8] = y
                for s, c in _items(tl, tl.conv_write_items()):
                    ch = s * W + h * K + rank * tl.vc + c
                    window = torch.cat([old_conv[ch], (q, k, v)[s][req, :, ch % W]])
                    conv_state[slot, ch] = window[T:T + keep]
                    conv_written[ch] += 1
        assert torch.equal(conv_written, torch.ones_like(conv_written)), "conv channels"
    assert not out.isnan().any(), "output not written"
    return out


def _cpu_gen():
    seed = int(torch.randint(1 << 30, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def test_tiles_are_valid():
    assert kernel.configs(), "no config"
    for b in BUCKETS:
        cfg = kernel.config(1, H_TP16, TAPS, b)
        assert kernel.tile(cfg).valid() and cfg.threads % 32 == 0
    for cfg in kernel.configs():
        tl = kernel.tile(cfg)
        assert 32 <= tl.threads <= 1024 and tl.rw * tl.cw == 32
        assert len(tl.bfly_offsets()) == int(math.log2(tl.rw))


# R = 16 (the configs config() picks) at every cluster size by default, the other R `slow`
@pytest.mark.parametrize("cfg", [
    pytest.param(c, marks=[] if c.rows_per_thread == 16 else [pytest.mark.slow])
    for c in kernel.configs()], ids=cfg_id)
def test_blocking_model_matches_reference(cfg):
    gen = _cpu_gen()
    for T in (1, 2, 8):
        inp = Inputs(gen, 3, T, H=2, device="cpu")
        conv, state = inp.conv_state.clone(), inp.state.clone()
        ref_conv, ref_state = inp.conv_state.clone(), inp.state.clone()
        conv0, state0 = conv.clone(), state.clone()
        got = blocking_model(inp, inp.args(conv, state), cfg)
        ref = kda_decode_ref(*inp.args(ref_conv, ref_state))
        torch.testing.assert_close(got.float(), ref.float(), **TOL["bf16"])
        assert rel_err(got, ref) < TOL["bf16_rel_norm"]
        assert torch.equal(conv, ref_conv)
        used = inp.slots
        torch.testing.assert_close(state[used], ref_state[used], **STATE_TOL)
        assert rel_err(state[used], ref_state[used]) < STATE_REL_NORM
        mask = inp.untouched()
        assert torch.equal(state[mask], state0[mask]) and torch.equal(conv[mask], conv0[mask])


@pytest.mark.parametrize("norm_fp32", [False, True], ids=["norm_bf16", "norm_fp32"])
def test_blocking_model_takes_its_output_norm(norm_fp32):
    """Each output norm of the kernel (the config of batch 1) against its reference variant,
    and far from the other variant's (which it differs from by under TOL["bf16_rel_norm"])."""
    gen = _cpu_gen()
    for T in (1, 8):
        inp = Inputs(gen, 3, T, H=2, device="cpu")
        got = blocking_model(inp, inp.args(inp.conv_state.clone(), inp.state.clone()),
                             kernel.config(T, 2, TAPS, 1), norm_fp32)
        ref, other = (kda_decode_ref(*inp.args(inp.conv_state.clone(), inp.state.clone()),
                                     KDAVariant(norm_fp32=v)) for v in (norm_fp32, not norm_fp32))
        torch.testing.assert_close(got.float(), ref.float(), **TOL["bf16"])
        assert rel_err(got, ref) < TOL["bf16_rel_norm"]
        assert_own_norm(got, ref, other)


@pytest.mark.parametrize("which", ["A_log", "dt_bias", "both"])
def test_blocking_model_takes_bf16_params(which):
    """The kernel loads bf16 A_log / dt_bias and computes the gate in fp32: its model against the
    reference with the same bf16 parameters (the config of batch 1, fla's norm)."""
    gen = _cpu_gen()
    for T in (1, 8):
        inp = Inputs(gen, 3, T, H=2, device="cpu").bf16_params(which)
        got = blocking_model(inp, inp.args(inp.conv_state.clone(), inp.state.clone()),
                             kernel.config(T, 2, TAPS, 1), True)
        ref = kda_decode_ref(*inp.args(inp.conv_state.clone(), inp.state.clone()), FLA_NORM)
        torch.testing.assert_close(got.float(), ref.float(), **TOL["bf16"])
        assert rel_err(got, ref) < TOL["bf16_rel_norm"]


def test_reference_takes_bf16_params_as_their_fp32_values():
    """bf16 A_log and dt_bias are promoted, not computed in bf16: the reference (the op's CPU
    implementation, and what the kernel is checked against) with them equals it with the same
    values in fp32, bit for bit, output and states."""
    gen = _cpu_gen()
    inp = Inputs(gen, 3, 2, H=2, device="cpu").bf16_params("both")
    outs = []
    for cast in (lambda t: t, torch.Tensor.float):
        args = list(inp.args(inp.conv_state.clone(), inp.state.clone()))
        args[12], args[13] = cast(args[12]), cast(args[13])
        outs.append((kda_decode_ref(*args, FLA_NORM), args[6], args[7]))
    assert outs[1][0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_build_flags_enter_the_key_only_when_set(monkeypatch):
    """The cached kernel's key without the variants is the key from before them (fp32 A_log and
    dt_bias, the built-in step), so existing compiled kernels keep it; each build option adds
    itself, a variant other than the built-in step its `KDAVariant` (one key per variant)."""
    keys = []
    monkeypatch.setattr(kernel.KERNEL, "compiled", lambda *a, **kw: keys.append((a, kw)))
    kernel.compiled(1, 6, 4, 1)
    kernel.compiled(1, 6, 4, 1, KDAVariant(), False, False)
    kernel.compiled(1, 6, 4, 1, FLA_NORM, True, False)
    kernel.compiled(1, 6, 4, 1, KDAVariant(), False, True)
    time_major = KDAVariant(conv_time_major=True)
    kernel.compiled(1, 6, 4, 1, time_major)
    products = KDAVariant(conv=ConvRounding.PRODUCTS_ROUNDED)
    kernel.compiled(1, 6, 4, 1, products)
    cfg = kernel.config(1, 6, 4, 1)
    assert keys == [((1, 6, 4, cfg), {"rows": 1})] * 2 + [
        ((1, 6, 4, cfg), {"rows": 1, "variant": FLA_NORM, "a_log_bf16": True}),
        ((1, 6, 4, cfg), {"rows": 1, "dt_bias_bf16": True}),
        ((1, 6, 4, cfg), {"rows": 1, "variant": time_major}),
        ((1, 6, 4, cfg), {"rows": 1, "variant": products})]


def test_fb_rank_enters_the_key_only_when_set(monkeypatch):
    """The f_b build is a kernel of its own (key fb_rank = R); without it the key is as before."""
    keys = []
    monkeypatch.setattr(kernel.KERNEL, "compiled", lambda *a, **kw: keys.append((a, kw)))
    kernel.compiled(1, 6, 4, 1, KDAVariant(), False, False, 0)
    kernel.compiled(1, 6, 4, 1, KDAVariant(), False, False, 128)
    kernel.compiled(8, 6, 4, 64, FLA_NORM, False, False, 64)
    cfg1, cfg64 = kernel.config(1, 6, 4, 1), kernel.config(8, 6, 4, 64)
    assert keys == [((1, 6, 4, cfg1), {"rows": 1}), ((1, 6, 4, cfg1), {"rows": 1, "fb_rank": 128}),
                    ((8, 6, 4, cfg64), {"rows": 64, "fb_rank": 64, "variant": FLA_NORM})]


@pytest.mark.parametrize("R", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("cfg", kernel.configs(), ids=cfg_id)
def test_fb_graw_rows_are_covered_once(cfg, R):
    """The f_b build's sweep (`KDADecode.fb_graw`: step, warp, lane -> row c, vector v) reads
    every (row, vector) of the head's W_fb once, and one lane (v = 0) stores each row's sums."""
    tl = kernel.tile(cfg)
    L = R // 8
    rows = 32 // L * tl.warps
    seen = torch.zeros(K, L, dtype=torch.int)
    stores = torch.zeros(K, dtype=torch.int)
    for step in range(-(-K // rows)):
        for warp in range(tl.warps):
            for lane in range(32):
                c, v = step * rows + warp * (32 // L) + lane // L, lane % L
                if c < K:
                    seen[c, v] += 1
                    stores[c] += v == 0
    assert torch.equal(seen, torch.ones_like(seen)) and torch.equal(stores, torch.ones_like(stores))


def test_grid_inputs_make_graw_exact():
    """On the grid (`on_grid`) the f_b build's order, fp32 F.linear and the float64 sum round to
    the same graw; off it, the build's order is within the bf16 tolerance of F.linear."""
    inp = Inputs(_cpu_gen(), 4, 8, H=2, device="cpu")
    exact = (inp.fa.double() @ inp.fb_weight.double().t()).bfloat16()
    assert torch.equal(fb_graw_model(inp.fa, inp.fb_weight), exact)
    assert torch.equal(F.linear(inp.fa.float(), inp.fb_weight.float()).bfloat16(), exact)
    assert torch.equal(F.linear(inp.fa, inp.fb_weight), exact)
    fa, w = torch.randn(64, K).bfloat16(), (torch.randn(256, K) / K**0.5).bfloat16()
    torch.testing.assert_close(fb_graw_model(fa, w).float(), F.linear(fa, w).float(),
                               **TOL["bf16"])


def test_fb_refusals():
    """The one-launch build's limits (`kda_decode.fb_refusal`): fa bf16 with its last dim
    contiguous (any row stride: the in-projection's slice), W_fb contiguous bf16 [H·K, R],
    R = 8·2^i <= 128. fb_kda_decode's own refusal is kda_decode's either way."""
    inp = Inputs(_cpu_gen(), 2, 3, H=2, device="cpu")
    fa, w, q = inp.fa, inp.fb_weight, inp.q
    assert fa.stride(1) == 4 * 2 * K + K + 2 and fb_kernel.fb_refusal(fa, w, q) is None
    assert fb_kernel.fb_refusal(fa.contiguous(), w, q) is None
    for R in (8, 16, 32, 64):
        assert fb_kernel.fb_refusal(fa[..., :R], w[:, :R].contiguous(), q) is None
    for R in (100, 120, 24, 4, 256):
        wide = torch.zeros(*fa.shape[:2], R, dtype=torch.bfloat16)
        why = fb_kernel.fb_refusal(wide, torch.zeros(2 * K, R, dtype=torch.bfloat16), q)
        assert why and f"f_a rank {R}" in why, why

    def refused(fa_, w_, words):
        why = fb_kernel.fb_refusal(fa_, w_, q)
        assert why and words in why, why

    refused(fa.float(), w, "fa:")
    refused(strided(fa), w, "fa:")
    refused(fa[:1], w, "fa:")
    refused(fa, w.float(), "fb_weight:")
    refused(fa, w.t().contiguous().t(), "fb_weight:")
    refused(fa, w[:K], "fb_weight:")
    args = inp.args(inp.conv_state, inp.state, fb=True)
    assert fb_kernel.refusal(*args) is None
    bad = list(args)
    bad[4] = torch.zeros(*fa.shape[:2], 120, dtype=torch.bfloat16)
    bad[5] = torch.zeros(2 * K, 120, dtype=torch.bfloat16)
    assert fb_kernel.refusal(*bad) is None, "a rank the one launch refuses: still our kernels"
    long = Inputs(_cpu_gen(), 1, kernel.MAX_TOKENS + 1, H=1, device="cpu")
    why = fb_kernel.refusal(*long.args(long.conv_state, long.state, fb=True))
    assert why and "tokens" in why


def test_fb_refused_rank_off_gpu_takes_two_launches(caplog):
    """fb_kda_decode with a rank its one launch refuses: the refusal is logged (two launches),
    which off the GPU run their references; the values are the op's reference's."""
    inp = Inputs(_cpu_gen(), 2, 2, H=2, device="cpu")
    inp.fa, inp.fb_weight = inp.fa[..., :120], inp.fb_weight[:, :120].contiguous()
    conv, state = inp.conv_state.clone(), inp.state.clone()
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = fb_kernel.fb_kda_decode_cuda(*inp.args(conv, state, fb=True))
    assert "f_a rank 120" in caplog.text and "two launches" in caplog.text
    ref_conv, ref_state = inp.conv_state.clone(), inp.state.clone()
    inp.graw = F.linear(inp.fa, inp.fb_weight)
    assert torch.equal(got, kda_decode_ref(*inp.args(ref_conv, ref_state)))
    assert torch.equal(conv, ref_conv) and torch.equal(state, ref_state)



def test_fb_shared_memory_fits_every_accepted_shape(monkeypatch, caplog):
    """The f_b build stages the head's W_fb rows (K x R bf16, 32 KB at R = 128) and fa in shared
    memory: every T, bucket and R it takes fits the 227 KB a CTA may use (the most: 16 tokens
    without a cluster, 82640 B); past the budget `fb_refusal` says why and fb_kda_decode takes
    its two launches (logged), whose values are the op's reference's."""
    ranks = (8, 16, 32, 64, 128)
    need = {(T, b, R): kernel.smem_bytes(T, kernel.config(T, H_TP16, TAPS, b), R)
            for T in range(1, kernel.MAX_TOKENS + 1) for b in BUCKETS for R in ranks}
    assert max(need.values()) == need[(16, 64, 128)] == 82640 <= kernel.SMEM_BYTES
    plain = kernel.smem_bytes(1, kernel.config(1, H_TP16, TAPS, 1))
    assert need[(1, 1, 128)] - plain == 4 * 128 + 2 * K * 128 + 32  # sFa, sWfb, their padding
    inp = Inputs(_cpu_gen(), 2, kernel.MAX_TOKENS, H=1, device="cpu")
    assert fb_kernel.fb_refusal(inp.fa, inp.fb_weight, inp.q) is None
    monkeypatch.setattr(kernel, "SMEM_BYTES", need[(kernel.MAX_TOKENS, 2, 128)] - 1)
    why = fb_kernel.fb_refusal(inp.fa, inp.fb_weight, inp.q)
    assert why and "shared memory" in why and f"{kernel.MAX_TOKENS} tokens" in why, why
    conv, state = inp.conv_state.clone(), inp.state.clone()
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = fb_kernel.fb_kda_decode_cuda(*inp.args(conv, state, fb=True))
    assert "shared memory" in caplog.text and "two launches" in caplog.text
    ref_conv, ref_state = inp.conv_state.clone(), inp.state.clone()
    assert torch.equal(got, kda_decode_ref(*inp.args(ref_conv, ref_state)))
    assert torch.equal(conv, ref_conv) and torch.equal(state, ref_state)


def test_refusals():
    inp = Inputs(_cpu_gen(), 2, 1, H=2, device="cpu")
    args = list(inp.args(inp.conv_state, inp.state))
    assert kernel.refusal(*args) is None
    assert kernel.refusal(*args, variant="norm_fp32") is None  # a build of its own
    for i, t in ((12, inp.A_log), (13, inp.dt_bias)):  # each a build of its own in bf16
        assert kernel.refusal(*args[:i], t.bfloat16(), *args[i + 1:]) is None
        assert_refused(kernel.refusal, args, i, t.half(), ("A_log:", "dt_bias:")[i - 12])
    fb = list(inp.bf16_params("both").args(inp.conv_state, inp.state, fb=True))
    assert fb_kernel.refusal(*fb, variant="norm_fp32") is None
    assert_refused(lambda *a: kernel.refusal(*a, variant="norm_fp32"), args, 0, inp.q.float(),
                   "q:")

    def refused(i, value, words):
        assert_refused(kernel.refusal, args, i, value, words)

    refused(0, inp.q.float(), "q:")
    refused(7, inp.state[:, :, :64, :64], "K = 128")
    refused(7, inp.state.double(), "recurrent_state:")
    refused(7, inp.state.transpose(2, 3), "recurrent_state:")
    refused(6, inp.conv_state.transpose(1, 2).contiguous().transpose(1, 2), "conv_state:")
    refused(6, torch.zeros(inp.state.shape[0], 3 * 2 * K, 8, dtype=torch.bfloat16), "taps")
    refused(8, inp.slots.int(), "slots:")
    refused(4, inp.graw[..., 1:], "graw:")
    refused(12, inp.A_log[:1], "A_log:")
    refused(14, inp.o_norm_weight.float(), "o_norm_weight:")
    long = Inputs(_cpu_gen(), 1, kernel.MAX_TOKENS + 1, H=1, device="cpu")
    why = kernel.refusal(*long.args(long.conv_state, long.state))
    assert why and "tokens" in why


def test_off_gpu_runs_the_reference(caplog):
    inp = Inputs(_cpu_gen(), 2, 2, H=2, device="cpu")
    conv, state = inp.conv_state.clone(), inp.state.clone()
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = kernel.kda_decode_cuda(*inp.args(conv, state))
    assert "kda_decode" in caplog.text
    ref_conv, ref_state = inp.conv_state.clone(), inp.state.clone()
    assert torch.equal(got, kda_decode_ref(*inp.args(ref_conv, ref_state)))
    assert torch.equal(conv, ref_conv) and torch.equal(state, ref_state)


@pytest.mark.parametrize("kda_fb", [False, 4], ids=["off", "from_4"])
def test_fb_two_launches_by_default(kda_fb, caplog, monkeypatch):
    """Without K3_KDA_FB, or below its bucket (2 requests, K3_KDA_FB=4), fb_kda_decode takes the
    GEMM and then kda_decode, logging no refusal (it is the setting, not a fallback); off the GPU
    they run their references: the op's values."""
    monkeypatch.setattr(KERNELS, "kda_fb", kda_fb)
    inp = Inputs(_cpu_gen(), 2, 2, H=2, device="cpu")
    conv, state = inp.conv_state.clone(), inp.state.clone()
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = fb_kernel.fb_kda_decode_cuda(*inp.args(conv, state, fb=True))
    assert "two launches" not in caplog.text
    ref_conv, ref_state = inp.conv_state.clone(), inp.state.clone()
    inp.graw = F.linear(inp.fa, inp.fb_weight)
    assert torch.equal(got, kda_decode_ref(*inp.args(ref_conv, ref_state)))
    assert torch.equal(conv, ref_conv) and torch.equal(state, ref_state)


@pytest.mark.parametrize("kda_fb,batch,variant,wanted", [
    (0, 8, BUILTIN, False), (1, 1, BUILTIN, True), (8, 1, BUILTIN, False),
    (8, 5, BUILTIN, True),  # bucket 8
    (8, 64, KDAVariant(norm_fp32=True), True), (1, 8, KDAVariant(conv_time_major=True), False)])
def test_fb_one_launch_by_bucket_and_variant(kda_fb, batch, variant, wanted, monkeypatch):
    """K3_KDA_FB=N asks for the one-launch build from the bucket of N requests on, for the two
    variants the build has (the built-in step, fla's fp32 norm)."""
    monkeypatch.setattr(KERNELS, "kda_fb", kda_fb)
    assert fb_kernel.one_launch_wanted(batch, variant) is wanted
