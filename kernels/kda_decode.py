"""CuTe DSL kernel for `k3::kda_decode`: the whole KDA recurrent step of one layer in one launch
(spec §3.1 steps 3-7; `kda_decode_ref` in k3compile/ops/kda_decode.py is the math and the rounding).

    x̃ = bf16(SiLU(conv(x))); q̂ = l2n(q̃)·s; k̂ = l2n(k̃); β = σ(b); α = exp(lb·σ(e^A·(graw+dt)))
    per t: S ← αS; S += k̂·(β(ṽ − Sᵀk̂))ᵀ; o_t = Sᵀq̂
    out = bf16(bf16(w ⊙ rms(bf16(o))) ⊙ bf16(σ(g)))       (`norm_fp32`: bf16(w ⊙ rms(bf16(o)) ⊙ σ(g)),
                                                          fla's FusedRMSNormGated, one rounding;
                                                          `o_fp32` too: bf16(w ⊙ rms(o) ⊙ σ(g)))
    `norm_weight_fp32`: bf16(bf16(w ⊙ rms(o')) ⊙ bf16(σ(g))), the weight multiplied in fp32
    (o' = o with `o_fp32`); `gate_fp32`: bf16(bf16(w ⊙ rms(bf16(o))) ⊙ σ(g)), the built-in norm
    and the gate product in fp32, one rounding; conv ROUNDED: x̃ = bf16(SiLU(bf16(conv(x)))), a
    bf16 conv's rounding; conv PRODUCTS_ROUNDED: x̃ = bf16(SiLU(bf16(Σ_j bf16(x_j·w_j)))), a
    window sum multiplied in bf16 (fp32 sum in tap order)

Each build is one `KDAVariant` (k3compile/ops/kda_decode.py; the op's `variant` argument parsed);
the fields above are its own.

`k3::fb_kda_decode` (kernels/fb_kda_decode.py) runs the f_b build (`fb_rank` R): the gate input is
fa [B, T, R] with W_fb [H·K, R], each CTA computing its head's graw = bf16(fa · W_fbᵀ) (fp32 sums,
one rounding) in the prologue from the head's W_fb rows, copied to shared memory before the PDL
wait. Work split, rounding and measurements: docs/kernels.md, kda_decode.

Constraints:
    * q, k, v, g, graw bf16 [B, T, H·K], b bf16 [B, T, H]: last dim contiguous, any other strides;
      1 <= T <= 16; K = 128 (head dim = key dim = value dim).
    * conv_state bf16 [S, 3·H·K, taps-1] (inner dims contiguous), 2 <= taps <= 8; or, the op's
      `conv_time_major`, [S, taps-1, 3·H·K] (inner dims contiguous; its own build, which reads
      it through the transposed view, the same indexing); recurrent_state
      fp32 [S, H, K, K] (inner dims contiguous, 16-byte-aligned data and slot stride), or, the
      op's `state_v_major`, the same buffer V-major [S, H, V, K] (its own build, which reads it
      through the transposed view: 4-byte loads and stores of the state); or, the op's
      `k_conv_state` / `v_conv_state`, three channel-major conv states bf16 [S, H·K, taps-1]
      (q's, k's, v's; their own build); slots int64
      [B] (negative slots count from the end, as torch indexing does; two requests sharing a slot
      race, as they do in the reference's index_put).
    * conv weights bf16 [H·K, 1, taps] (or all three fp32: the build `conv_weight_fp32`, an fp32
      master read as it is), A_log [H] and dt_bias [H·K] each fp32 or bf16 (loaded as
      fp32, as the reference promotes them), o_norm_weight bf16 [K], all contiguous; lower_bound,
      l2_eps, q_scale, norm_eps are runtime scalars.
    * Output bf16 [B, T, H, K], contiguous.
    * The f_b build: fa bf16 [B, T, R] (last dim contiguous, any other strides: read element by
      element), W_fb bf16 [H·K, R] contiguous with 16-byte-aligned data, a weight (a graph input
      nothing writes during a step: it is read before the PDL wait); R = 8·2^i <= MAX_FB_RANK;
      a CTA's shared memory (`smem_bytes`: the head's W_fb rows, 2·K·R bytes, on top) <=
      SMEM_BYTES (`fb_refusal`; at most 82640 B, T = 16 without a cluster, so never refused at
      K3's sizes).
    * With PDL (settings.KERNELS.pdl) every thread waits first (the f_b build after issuing its
      W_fb copies): everything it reads but the weights was written by the previous step.
"""

import math
from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.kda_decode import BUILTIN, KDAVariant, kda_decode_ref

from .common.dsl import (
    BUCKETS,
    bucket,
    compile_kernel,
    fake_stream,
)
from .common.launch import Kernel

OP = "kda_decode"
HEAD_DIM = 128
MAX_TOKENS = 16
MAX_TAPS = 8
MAX_FB_RANK = 128  # f_b build: fa's width R (K3's f_a rank); sFa and the unrolled sums grow with it
VEC = 4  # fp32 state columns per thread: one 16-byte vector of a state row
SMEM_BYTES = 227 * 1024  # per CTA on sm_90 (the DSL opts each kernel in to the device's maximum)


@dataclass(frozen=True)
class Config:
    cluster_n: int  # C: CTAs per (request, head), each owning K / C value columns
    rows_per_thread: int = 16  # R: state rows per thread (R x 4 fp32 registers)

    @property
    def threads(self) -> int:
        return tile(self).threads


@dataclass(frozen=True)
class Tile:
    """Which state, shared-memory and output elements a thread owns. Pure Python on ints, so the
    kernel (on DSL integers) and the CPU model of the blocking (on ints) share it."""

    K: int
    C: int
    R: int

    @property
    def vc(self) -> int:  # value columns per CTA
        return self.K // self.C

    @property
    def rw(self) -> int:  # lanes (row groups) sharing a column group
        return self.K // self.R

    @property
    def cw(self) -> int:  # column groups per warp
        return 32 // self.rw

    @property
    def warps(self) -> int:
        return self.vc // (VEC * self.cw)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def valid(self) -> bool:
        return (self.R in (4, 8, 16, 32) and self.K % self.C == 0 and self.vc % 8 == 0
                and self.K % self.R == 0 and self.rw <= 32
                and self.vc % (VEC * self.cw) == 0 and 1 <= self.warps <= 32)

    def thread(self, tidx):
        """tidx -> (rg, lc0): the thread's row group (rows rg + rw·i) and first local column."""
        lane = tidx % 32
        return lane // self.cw, (tidx // 32 * self.cw + lane % self.cw) * VEC

    def bfly_offsets(self) -> list[int]:
        """Lane offsets of the butterfly over the row groups of a column group."""
        return [self.cw << s for s in range(int(math.log2(self.rw)))]

    def prologue_items(self):
        """(kind, first item, end): conv of q and k (all K channels), of v (the CTA's columns),
        decay α (all K key channels). Item i of a kind is its channel i (local for v)."""
        K, vc = self.K, self.vc
        return (("q", 0, K), ("k", K, 2 * K), ("v", 2 * K, 2 * K + vc),
                ("alpha", 2 * K + vc, 3 * K + vc))

    def plan(self, items) -> list[tuple[int, int, bool]]:
        """How the CTA's threads sweep work items: pass `it` gives item it·threads + tidx to
        thread tidx. Returns (it, index into items, whether every thread of the pass falls in
        that kind) for each pass and kind that overlap."""
        n, end = self.threads, max(hi for _, _, hi in items)
        return [(it, s, lo <= it * n and hi >= (it + 1) * n)
                for it in range(-(-end // n)) for s, (_, lo, hi) in enumerate(items)
                if lo < (it + 1) * n and hi > it * n]

    def conv_write_items(self):
        """(q|k|v index, first item, end) of the conv-state channels this CTA writes: its
        columns rank·vc + i of each of q, k, v."""
        return tuple((s, s * self.vc, (s + 1) * self.vc) for s in range(3))

    def out_vectors(self, T: int) -> int:
        """Output 16-byte vectors (8 bf16) per CTA: item -> token item // (vc/8), local column
        (item % (vc/8))·8."""
        return T * self.vc // 8


def tile(cfg: Config, K: int = HEAD_DIM) -> Tile:
    return Tile(K, cfg.cluster_n, cfg.rows_per_thread)


def config(tokens: int, n_heads: int, taps: int, batch_bucket: int) -> Config:
    """Clusters of 4 CTAs per (request, head) up to 4 requests, 2 up to 16, 1 above (aiming at
    >= ~100 CTAs while each keeps 64 state registers per thread). Untuned."""
    del tokens, n_heads, taps
    return Config(4 if batch_bucket <= 4 else 2 if batch_bucket <= 16 else 1)


def smem_bytes(tokens: int, cfg: Config, fb_rank: int = 0) -> int:
    """A CTA's shared memory: sQ, sK, sA (T, K), sV, sO (T, vc), sBeta (T,), sRed (C·warps, T),
    all fp32, 16 bytes of alignment slack each; the f_b build adds sFa (T, R) fp32 and sWfb
    (K, R) bf16, the head's rows of W_fb (32 KB at R = 128)."""
    tl, T, K = tile(cfg), tokens, HEAD_DIM
    words = 3 * T * K + 2 * T * tl.vc + T + cfg.cluster_n * tl.warps * T
    out = 4 * words + 16 * 7
    if fb_rank:
        out += 4 * T * fb_rank + 2 * K * fb_rank + 16 * 2
    return out


def configs(K: int = HEAD_DIM) -> list[Config]:
    """Every valid config (for sweeps)."""
    return [c for c in (Config(n, r) for n in (1, 2, 4, 8) for r in (8, 16, 32))
            if tile(c, K).valid()]


def can_implement(*args) -> bool:
    return refusal(*args) is None


def refusal(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
            k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound=None,
            l2_eps=None, q_scale=None, norm_eps=None, k_conv_state=None, v_conv_state=None,
            variant: str = "") -> str | None:
    """Why the kernel cannot take these inputs (the op's arguments: `variant` its spec), or
    None. Metadata only (fake tensors work); data alignment is checked at launch. Of the
    variant only the layouts matter here: the rest are compile-time options of the build."""
    bf16, f32 = torch.bfloat16, torch.float32
    layout = KDAVariant.parse(variant, k_conv_state is not None)
    conv_time_major = layout.conv_time_major
    if q.dim() != 3 or recurrent_state.dim() != 4 or conv_state.dim() != 3:
        return (f"ranks q {q.dim()}, recurrent_state {recurrent_state.dim()}, conv_state "
                f"{conv_state.dim()} (want 3, 4, 3)")
    B, T, W = q.shape
    S, H, K = recurrent_state.shape[:3]
    if K != HEAD_DIM or recurrent_state.shape[3] != K or W != H * K:
        return f"recurrent_state {tuple(recurrent_state.shape)}, q width {W} (want K = {HEAD_DIM})"
    if not 1 <= T <= MAX_TOKENS:
        return f"{T} tokens per request (want 1..{MAX_TOKENS})"
    for name, t, width in (("q", q, W), ("k", k, W), ("v", v, W), ("g", g, W),
                           ("graw", graw, W), ("b", b, H)):
        if t.dtype != bf16 or tuple(t.shape) != (B, T, width) or t.stride(-1) != 1:
            return (f"{name}: {t.dtype} {tuple(t.shape)} {t.stride()} (want bf16 [{B}, {T}, "
                    f"{width}], last dim contiguous)")
    if recurrent_state.dtype != f32 or recurrent_state.stride()[1:] != (K * K, K, 1) or \
            recurrent_state.stride(0) % 4:
        major = "V-major " if layout.state_v_major else ""
        return (f"recurrent_state: {recurrent_state.dtype} {recurrent_state.stride()} (want fp32 "
                f"{major}[S, H, {K}, {K}], inner dims contiguous, slot stride a multiple of 4)")
    three = k_conv_state is not None or v_conv_state is not None
    if three and (conv_time_major or k_conv_state is None or v_conv_state is None):
        return "three conv states: k's and v's both, channel-major (no time-major build)"
    conv = conv_state.transpose(1, 2) if conv_time_major else conv_state  # [S, 3W, taps-1]
    taps = conv.shape[2] + 1
    if not 2 <= taps <= MAX_TAPS:
        return f"{taps} conv taps (want 2..{MAX_TAPS})"
    inner = (1, 3 * W) if conv_time_major else (taps - 1, 1)
    held = W if three else 3 * W
    for name, state in (("conv_state", conv_state), ("k_conv_state", k_conv_state),
                        ("v_conv_state", v_conv_state))[:3 if three else 1]:
        c = state.transpose(1, 2) if conv_time_major else state
        if c.dtype != bf16 or tuple(c.shape) != (S, held, taps - 1) or c.stride()[1:] != inner:
            want = f"[{S}, taps-1, {held}]" if conv_time_major else f"[{S}, {held}, taps-1]"
            return (f"{name}: {state.dtype} {tuple(state.shape)} {state.stride()} "
                    f"(want bf16 {want}, inner dims contiguous)")
    if slots.dtype != torch.int64 or tuple(slots.shape) != (B,) or (B and slots.stride(0) != 1):
        return f"slots: {slots.dtype} {tuple(slots.shape)} (want contiguous int64 [{B}])"
    taps_dtype = q_conv_weight.dtype if q_conv_weight.dtype in (bf16, f32) else bf16
    for name, t, dtype, shape in (
            ("q_conv_weight", q_conv_weight, taps_dtype, (W, 1, taps)),
            ("k_conv_weight", k_conv_weight, taps_dtype, (W, 1, taps)),
            ("v_conv_weight", v_conv_weight, taps_dtype, (W, 1, taps)),
            ("A_log", A_log, (f32, bf16), (H,)), ("dt_bias", dt_bias, (f32, bf16), (W,)),
            ("o_norm_weight", o_norm_weight, bf16, (K,))):
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in dtypes or tuple(t.shape) != shape or not t.is_contiguous():
            want = " or ".join(map(str, dtypes))
            return f"{name}: {t.dtype} {tuple(t.shape)} (want contiguous {want} {list(shape)})"
    return None


def fb_refusal(fa, fb_weight, q) -> str | None:
    """Why the f_b build cannot take fa and W_fb beside q [B, T, H·K] (the rest as `refusal`),
    or None. Metadata only; W_fb's data alignment is checked at launch."""
    B, T, W = q.shape
    R = fa.shape[-1]
    if fa.dtype != torch.bfloat16 or fa.dim() != 3 or tuple(fa.shape[:2]) != (B, T) or \
            fa.stride(-1) != 1:
        return (f"fa: {fa.dtype} {tuple(fa.shape)} {fa.stride()} (want bf16 [{B}, {T}, R], "
                "last dim contiguous)")
    if R % 8 or (R // 8) & (R // 8 - 1) or not 8 <= R <= MAX_FB_RANK:
        return f"f_a rank {R} (want 8·2^i <= {MAX_FB_RANK}: R/8 lanes share a W_fb row)"
    if fb_weight.dtype != torch.bfloat16 or tuple(fb_weight.shape) != (W, R) or \
            not fb_weight.is_contiguous():
        return (f"fb_weight: {fb_weight.dtype} {tuple(fb_weight.shape)} {fb_weight.stride()} "
                f"(want contiguous bf16 [{W}, {R}])")
    cfg = config(T, W // HEAD_DIM, 0, bucket(B))
    if (need := smem_bytes(T, cfg, R)) > SMEM_BYTES:
        return (f"shared memory {need} B at {T} tokens, f_a rank {R} (want <= {SMEM_BYTES}: the "
                "head's W_fb rows are staged there)")
    return None


def call_refusal(tensors, q, recurrent_state, out) -> str | None:
    """What only a CUDA call can refuse: devices, and `out` [B, T, H, K] bf16 contiguous."""
    if not all(t.is_cuda and t.device == q.device for t in tensors):
        return "inputs not all on one CUDA device"
    if out is not None and (
            out.dtype != torch.bfloat16 or not out.is_contiguous()
            or tuple(out.shape) != (*q.shape[:2], *recurrent_state.shape[1:3])
            or out.data_ptr() % 16):
        return f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
    return None


def prepare(tokens: int, n_heads: int, taps: int = 4, buckets=BUCKETS,
            variant: KDAVariant = BUILTIN, a_log_bf16=False, dt_bias_bf16=False,
            conv_weight_fp32=False) -> None:
    """Compile the kernel of every batch bucket for these scalars (call before graph capture)."""
    for b in buckets:
        compiled(tokens, n_heads, taps, b, variant, a_log_bf16, dt_bias_bf16,
                 conv_weight_fp32=conv_weight_fp32)


def compiled(tokens: int, n_heads: int, taps: int, batch_bucket: int,
             variant: KDAVariant = BUILTIN, a_log_bf16: bool = False,
             dt_bias_bf16: bool = False, fb_rank: int = 0, conv_weight_fp32: bool = False):
    """The cached kernel; each build option enters the key only when set, the variant only
    where it is not the default (the default's key and build are those from before the
    variants)."""
    options = {k: v for k, v in (("a_log_bf16", a_log_bf16), ("dt_bias_bf16", dt_bias_bf16),
                                 ("fb_rank", fb_rank), ("conv_weight_fp32", conv_weight_fp32))
               if v}
    if variant != BUILTIN:
        options["variant"] = variant
    return KERNEL.compiled(tokens, n_heads, taps, config(tokens, n_heads, taps, batch_bucket),
                           rows=batch_bucket, **options)


def build(tokens, n_heads, taps, cfg, arch=None, dump_dir=None, pdl=False,
          variant: KDAVariant = BUILTIN, a_log_bf16=False, dt_bias_bf16=False, fb_rank=0,
          conv_weight_fp32=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL; `variant`:
    the step's `KDAVariant`, whose layouts set the fake tensors' strides here: a time-major
    conv state is passed as the [S, 3W, taps-1] view of a [S, taps-1, 3W] buffer, strides
    (., 1, 3W); a V-major recurrent state as the [S, H, K, V] view of a [S, H, V, K] buffer,
    strides (., K·K, 1, K); three conv states as three [S, W, taps-1], q's, k's and v's, where
    the default takes one [S, 3W, taps-1]; the rest are the device code's; `a_log_bf16`,
    `dt_bias_bf16`: that parameter in bf16, e.g. a Moonshot model cast to bf16 whole;
    `conv_weight_fp32`: the three conv weights fp32 (fp32 masters read as they are: the device
    code loads them as it loads bf16 ones, converted to fp32);
    `fb_rank` R > 0: the f_b build, taking fa [B, T, R] and W_fb [H·K, R] where the default
    takes graw)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from .device.kda_decode import KDADecode

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    T, H, K = tokens, n_heads, HEAD_DIM
    W = H * K
    n = cute.sym_int()

    def act(width):  # [B, T, width] column slices: last dim contiguous, any row strides
        return make_fake_tensor(bf16, (n, T, width), stride=(cute.sym_int64(), cute.sym_int64(),
                                                             1), assumed_align=2)

    def weight(dtype, shape, stride, align=None):
        return make_fake_tensor(dtype, shape, stride=stride,
                                assumed_align=align or dtype.width // 8)

    conv_w = [weight(f32 if conv_weight_fp32 else bf16, (W, 1, taps), (taps, taps, 1))
              for _ in range(3)]
    kda = KDADecode(T, H, taps, cfg, pdl, variant, fb_rank)
    conv_time_major, three_states = variant.conv_time_major, variant.three_conv_states
    gate_input = [act(fb_rank), weight(bf16, (W, fb_rank), (fb_rank, 1), 16)] if fb_rank else [
        act(W)]  # fa and W_fb (W_fb's rows 16-byte vectors: assumed_align 16), or graw
    def conv_state(width):
        return make_fake_tensor(bf16, (cute.sym_int(), width, taps - 1),
                                stride=(cute.sym_int64(), *((1, width) if conv_time_major
                                                            else (taps - 1, 1))), assumed_align=2)

    entry = kda.with_fb if fb_rank else kda.three_states if three_states else kda
    return compile_kernel(
        entry, act(W), act(W), act(W), act(W), *gate_input, act(H),
        *([conv_state(W) for _ in range(3)] if three_states else [conv_state(3 * W)]),
        make_fake_tensor(f32, (cute.sym_int(), H, K, K),
                         stride=(cute.sym_int64(divisibility=4), K * K,
                                 *((1, K) if variant.state_v_major else (K, 1))),
                         assumed_align=16),
        make_fake_tensor(cutlass.Int64, (n,), stride=(1,), assumed_align=8), *conv_w,
        weight(bf16 if a_log_bf16 else f32, (H,), (1,)),
        weight(bf16 if dt_bias_bf16 else f32, (W,), (1,)), weight(bf16, (K,), (1,)),
        make_fake_tensor(bf16, (n, T, H, K), stride=(T * H * K, H * K, K, 1), assumed_align=16),
        f32(-5.0), f32(1e-6), f32(K ** -0.5), f32(1e-5), fake_stream(), arch=arch,
        dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def kda_decode_cuda(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                    k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                    l2_eps, q_scale, norm_eps, k_conv_state=None, v_conv_state=None,
                    variant: str = "", *, out=None):
    """CUDA implementation of k3::kda_decode (the op's arguments in its order; the k and v conv
    states default to None for direct callers): the kernel, or the reference if refused (reason
    logged). `out` [B, T, H, K] bf16 contiguous is written only when the kernel runs."""
    args = (q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
            k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight)
    B, T = q.shape[:2]
    step = KDAVariant.parse(variant, k_conv_state is not None)

    def launch():
        H, K = recurrent_state.shape[1:3]
        o = q.new_empty((B, T, H, K)) if out is None else out
        # views, so written: the channel-major view of a time-major buffer, the K-major view of
        # a V-major one
        conv = conv_state.transpose(1, 2) if step.conv_time_major else conv_state
        state = recurrent_state.transpose(-1, -2) if step.state_v_major else recurrent_state
        convs = [conv] if k_conv_state is None else [conv, k_conv_state, v_conv_state]
        if B:
            compiled(T, H, conv.shape[2] + 1, bucket(B), step, A_log.dtype == torch.bfloat16,
                     dt_bias.dtype == torch.bfloat16,
                     conv_weight_fp32=q_conv_weight.dtype == torch.float32)(
                *args[:6], *convs, state, *args[8:], o, float(lower_bound), float(l2_eps),
                float(q_scale), float(norm_eps))
        return o

    more = (k_conv_state, v_conv_state) if k_conv_state is not None else ()
    return KERNEL.run(lambda: refusal(*args, k_conv_state=k_conv_state,
                                      v_conv_state=v_conv_state, variant=variant)
                      or call_refusal((*args, *more), q, recurrent_state, out),
                      lambda: kda_decode_ref(*args, lower_bound, l2_eps, q_scale, norm_eps,
                                             k_conv_state, v_conv_state, step),
                      launch, recurrent_state)


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", kda_decode_cuda)
