"""Every kernel compiles for the H200 (sm_90a) on a machine without a GPU: at the TP16-rank
shapes with the config of every batch bucket, and at small shapes; the kernels with programmatic
dependent launch also with it on (`settings.KERNELS.pdl`), checked in their PTX; gemv's one-launch
variants (norm prologue, SiTU epilogue, split output) with PDL off and on, and its plain build
byte for byte as before them; kda_decode's norm_fp32 build, its builds for bf16 A_log / dt_bias and
its f_b build (fb_kda_decode in one launch);
moe_route's build for a bf16 router bias; the device-side input check (K3_CHECK_KERNEL).
Needs only the DSL. The default run builds the first case of each kernel and of each gemv variant
(a few seconds a build); the rest are `slow` (CI builds them)."""

import dataclasses
import hashlib
import re
import struct
from importlib.metadata import version

import pytest

pytest.importorskip("cutlass")

from k3compile.kernels import (
    attn_res_mix_norm,
    kda_decode,
    mla_decode,
    mla_lowrank_norm,
    moe_experts,
    moe_route,
    rms_norm,
    situ_gate_up,
)
from k3compile.kernels.common import gemm_tc, gemv
from k3compile.kernels.common.dsl import BUCKETS, cubin_of, cubin_resources, ptx_of

from k3compile.ops.kda_decode import ConvRounding, KDAVariant
from k3compile.settings import KERNELS

pytestmark = pytest.mark.dsl

ARCH = "sm_90a"
# kernels whose build takes `pdl` (moe_experts and mla_decode use PDL between their own launches)
PDL_KERNELS = (attn_res_mix_norm, gemm_tc, gemv, kda_decode, mla_lowrank_norm, moe_route,
               rms_norm, situ_gate_up)
WAIT, TRIGGER = "griddepcontrol.wait;", "griddepcontrol.launch_dependents;"
# what streams a weight before the wait: 16-byte loads of W (gemv), TMA of W slices (gemm_tc)
WEIGHT_STREAM = {gemv: "ld.global.v4", gemm_tc: "cp.async.bulk.tensor"}


def _cases():
    """(kernel module, shape scalars, config): each distinct config of every bucket, once."""
    seen = []
    shapes = [
        (attn_res_mix_norm, (7168, 8, True)),  # pre-attention, 9 sources
        (attn_res_mix_norm, (7168, 8, False)),  # post-attention at a block start
        (attn_res_mix_norm, (7168, 3, True)),
        (attn_res_mix_norm, (7168, 0, True)),  # no completed blocks: add + RMSNorm
        (attn_res_mix_norm, (256, 2, True)),  # tiny config
        (attn_res_mix_norm, (1032, 8, True)),  # uneven split: predicated vectors
        (mla_lowrank_norm, (1536, 512, 64)),
        (mla_lowrank_norm, (256, 64, 16)),
        (rms_norm, (3584,)),
        (rms_norm, (1024,)),
        (moe_route, (896, 16)),
        (moe_route, (64, 4)),
        (situ_gate_up, (384,)),  # shared experts' SiTU at TP16 (768 / 2 per rank)
        (situ_gate_up, (1000,)),  # predicated vectors
        (kda_decode, (1, 6, 4)),  # (T, heads, taps): decode at one TP16 rank
        (kda_decode, (8, 6, 4)),  # DSpark verify rows
        (kda_decode, (2, 6, 4)),  # T < taps - 1: the conv-state shift
        (kda_decode, (5, 4, 2)),  # two taps
        (mla_decode, (1, 6, 512, 64)),  # (T, heads, latent, rope): decode at one TP16 rank
        (mla_decode, (8, 6, 512, 64)),  # verify rows: 48 queries, 3 query groups of 16
        (mla_decode, (3, 2, 256, 32)),  # small latent and rope, one partial query group
    ]
    for module, scalars in shapes:
        for b in BUCKETS:
            case = (module, scalars, module.config(*scalars, b))
            if case not in seen:
                seen.append(case)
    # mla_decode on CUDA cores (config()'s default is tensor cores): T 1 and 8 at one TP16
    # rank, and the small latent
    for scalars in [(1, 6, 512, 64), (8, 6, 512, 64), (3, 2, 256, 32)]:
        seen.append((mla_decode, scalars, mla_decode.config(*scalars, mma=False)))
    # gemm_tc: (n, k, fp32 output, residual) with the config of one bucket: a cluster of 8 over
    # K at 8 tokens, R = 128 rows with the residual at 64, one CTA per tile (S = 1) with fp32
    # output, and partial row tiles and K slices (1000 x 1032)
    for (n, k, b), out_fp32, residual in [((3206, 7168, 8), False, False),
                                          ((7168, 768, 64), False, True),
                                          ((768, 128, 2), True, True),
                                          ((1000, 1032, 16), True, False)]:
        seen.append((gemm_tc, (n, k, out_fp32, residual), gemm_tc.config(n, k, b)))
    # gemv: (n, k, bucket, fp32 output, residual), buckets up to 16; fp32 logits at the router,
    # the residual epilogue at o_proj; 1000 x 1032 has a partial CTA of rows and a vector tail
    for n, k in [(3206, 7168), (2112, 7168), (3584, 7168), (7168, 3584), (896, 7168),
                 (7168, 768), (768, 7168), (1152, 1536), (7168, 384), (768, 128), (1000, 1032)]:
        variants = {(896, 7168): [(False, False), (True, False)],
                    (7168, 768): [(False, False), (False, True), (True, True)]}
        for b in gemv.BUCKETS:
            for out_fp32, residual in variants.get((n, k), [(False, False)]):
                seen.append((gemv, (n, k, b, out_fp32, residual), gemv.config(n, k, b)))
    # moe_experts: (stage, L, I, k, int64 ids) at one TP16 rank (one config for every bucket),
    # int32 ids, the largest L and I = 512 (FC2's whole W2 row in registers), and small shapes
    # with partial lane steps and odd k; FC2 in chunks above I = 512: a TP2 and a TP4 rank
    # (I 1536, 768), an odd chunk count with odd k (1152), k = 1, the largest L and I
    for stage, latent, inter, top_k, ids64 in [
            ("fc1", 3584, 192, 16, True), ("fc2", 3584, 192, 16, True),
            ("fc2", 3584, 192, 16, False), ("fc1", 8192, 512, 16, True),
            ("fc2", 8192, 512, 16, True), ("fc1", 1056, 32, 1, True), ("fc2", 96, 64, 3, False),
            ("fc1", 3584, 1536, 16, True), ("fc2", 3584, 1536, 16, True),
            ("fc2", 3584, 768, 16, True), ("fc2", 1056, 1152, 3, False),
            ("fc2", 96, 768, 1, True), ("fc1", 8192, 3072, 16, True),
            ("fc2", 8192, 3072, 16, True)]:
        for b in BUCKETS:
            case = (moe_experts, (stage, latent, inter, top_k, ids64),
                    moe_experts.config(stage, latent, inter, top_k, b))
            if case not in seen:
                seen.append(case)
    # moe_experts FC1 with cp.async (config()'s choice at one row: 4 warps x 1 row) at the split
    # step alone (L 512) and after a full lane step (L 1536)
    fc1 = moe_experts.FC1Config
    for latent, inter, top_k in [(512, 96, 3), (1536, 64, 4)]:
        seen.append((moe_experts, ("fc1", latent, inter, top_k, True), fc1(4, 1, True)))
    # the packed fp16 decode (K3_MOE_F16): FC1 with the configs of 1 and of 8-64 rows at the
    # TP16 rank, a partial lane step with k = 1, the split step alone, the largest L; FC2 (up
    # to I 512) at the TP16 rank, small with odd k and int32 ids, the largest L and I
    for latent, inter, top_k in [(3584, 192, 16), (1056, 32, 1), (512, 96, 3), (8192, 512, 16)]:
        for b in (1, 8):
            cfg = moe_experts.config("fc1", latent, inter, top_k, b)
            seen.append((moe_experts, ("fc1", latent, inter, top_k, True),
                         dataclasses.replace(cfg, f16=True)))
    for latent, inter, top_k, ids64 in [(3584, 192, 16, True), (96, 64, 3, False),
                                        (8192, 512, 16, True)]:
        cfg = moe_experts.config("fc2", latent, inter, top_k, 8)
        seen.append((moe_experts, ("fc2", latent, inter, top_k, ids64),
                     dataclasses.replace(cfg, f16=True)))
    return seen


def _pdl_cases():
    """Each distinct shape of every PDL kernel once (gemv at bucket 1 only: its bucket sets the
    number of sums, not where the wait goes)."""
    seen, out = set(), []
    for module, scalars, cfg in _cases():
        if module in PDL_KERNELS and (module, scalars) not in seen and (
                module is not gemv or scalars[2] == 1):
            seen.add((module, scalars))
            out.append((module, scalars, cfg))
    return out


def _id(v):
    return v.__name__.rsplit(".")[-1] if hasattr(v, "__name__") else str(v)


def _first_of_each(cases, kind):
    """`cases` as params: the first of each `kind(case)` in the default run, the others `slow`
    (each build costs seconds; CI's slow run builds them all)."""
    seen = set()
    out = []
    for case in cases:
        key = kind(case)
        out.append(pytest.param(*case, marks=[pytest.mark.slow] if key in seen else []))
        seen.add(key)
    return out


def _module(case):
    return case[0]


@pytest.mark.parametrize("module,scalars,cfg", _first_of_each(_cases(), _module), ids=_id)
def test_builds_for_sm90a(module, scalars, cfg, monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)  # a machine without a GPU would target sm_100a
    compiled = module.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path))
    _check_cubin(compiled)
    if module in PDL_KERNELS:  # without PDL the plain kernel: no griddepcontrol at all
        assert "griddepcontrol" not in ptx_of(compiled)


@pytest.mark.parametrize("module,scalars,cfg", _first_of_each(_pdl_cases(), _module), ids=_id)
def test_builds_with_pdl(module, scalars, cfg, monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    compiled = module.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path), pdl=True)
    _check_cubin(compiled)
    ptx = ptx_of(compiled)
    assert TRIGGER in ptx and WAIT in ptx
    before = ptx[:ptx.index(WAIT)]
    # nothing is stored before the wait (the text order of these straight-line preambles)
    stores = [op for op in ("st.global", "red.global", "atom.global") if op in before]
    assert not stores, f"{stores} before the wait"
    if module in WEIGHT_STREAM:
        assert WEIGHT_STREAM[module] in before, "the weight stream does not start before the wait"


@pytest.mark.parametrize("mb,late", [(None, (False, False)), (0.0, (True, True)),
                                     (20.0, (False, True))])
def test_gemm_tc_late_trigger_by_weight_size(mb, late, monkeypatch):
    """The build option by weight size: 768 x 7168 (11 MB) and 4480 x 7168 (64 MB) in bf16;
    none where the trigger stays first or the launch's rows have no PDL, so those builds keep
    their compile keys."""
    monkeypatch.setattr(KERNELS, "gemm_tc_late_trigger_mb", mb)
    monkeypatch.setattr(KERNELS, "pdl_max_rows", 16)
    got = tuple(gemm_tc.trigger_option(n, 7168, 8) for n in (768, 4480))
    assert got == tuple({"late_trigger": True} if on else {} for on in late)
    assert all(gemm_tc.trigger_option(n, 7168, 32) == {} for n in (768, 4480))


@pytest.mark.parametrize("late", [False, True], ids=["start", "late"])
def test_gemm_tc_trigger_position(late, monkeypatch, tmp_path):
    """K3_GEMM_TC_LATE_TRIGGER: the dependents' trigger after the last MMA of the K loop (and
    after the wait); by default it comes first, before the wait."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    compiled = gemm_tc.build(768, 7168, False, False, gemm_tc.config(768, 7168, 8), arch=ARCH,
                             dump_dir=str(tmp_path), pdl=True, late_trigger=late)
    ptx = ptx_of(compiled)
    assert ptx.count(TRIGGER) == 1
    trigger, last_mma = ptx.index(TRIGGER), ptx.rindex("wgmma.mma_async")
    if late:
        assert trigger > last_mma and trigger > ptx.index(WAIT)
    else:
        assert trigger < ptx.index(WAIT) < last_mma


@pytest.mark.parametrize("mma", [True, False], ids=["mma", "fma"])
def test_mla_decode_pdl_build(mma, monkeypatch, tmp_path):
    """mla_decode's merge launch always waits (PDL after the attention); with `pdl` the
    attention waits too, before any load or store of its own: two waits in the PTX, not one."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = mla_decode.config(1, 6, 512, 64, mma=mma)
    for pdl in (False, True):
        (tmp_path / str(pdl)).mkdir()
        compiled = mla_decode.build(1, 6, 512, 64, cfg, arch=ARCH,
                                    dump_dir=str(tmp_path / str(pdl)), pdl=pdl)
        _check_cubin(compiled)
        ptx = ptx_of(compiled)
        assert ptx.count(WAIT) == 1 + pdl and ptx.count(TRIGGER) == 1
        attend = next(f for f in ptx.split(".entry")[1:] if "attend" in f.split("(")[0])
        if pdl:
            first = min(attend.index(op) for op in ("ld.global", "st.global", "cp.async.cg")
                        if op in attend)
            assert attend.index(WAIT) < first


# kda_decode's norm_fp32 build (fla's gated norm, one rounding) at (T, heads, taps): decode and
# verify rows at one TP16 rank with the configs of batch 1 and 64 (clusters of 4 and 1). The mix
# kernel's scores_fp32 needs no build of its own (its scores are that math already).
NORM_FP32 = [((1, 6, 4), 1), ((8, 6, 4), 64), ((1, 6, 4), 64), ((8, 6, 4), 1)]


@pytest.mark.parametrize("scalars,b", _first_of_each(NORM_FP32, lambda case: "kda"), ids=str)
def test_kda_norm_fp32_builds(scalars, b, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills, and the flag reaches the device code: two
    fewer bf16 roundings per output element than the default build (w·norm and σ(g))."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    for sub in ("v", "d"):
        (tmp_path / sub).mkdir()
    variant = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "v"),
                               variant=KDAVariant(norm_fp32=True))
    _check_cubin(variant)
    default = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "d"))
    cvt = "cvt.rn.bf16.f32"
    out_per_thread = -(-kda_decode.tile(cfg).out_vectors(scalars[0]) // cfg.threads) * 8
    assert ptx_of(default).count(cvt) - ptx_of(variant).count(cvt) == 2 * out_per_thread


# The norm rounding of a Flax-style port (tests/models/spell9_k3.py): the norm's weight multiplied
# in fp32 before the one cast to bf16. attn_res_mix_norm's norm_weight_fp32 build (scalars, bucket:
# 9 sources at batch 1, a cluster of 4, and 64; add + norm alone) and mla_lowrank_norm's
# weight_fp32 build (K3's MLA widths at batch 1 and 64).
NORM_WEIGHT_FP32 = [(attn_res_mix_norm, (7168, 8, True), 1),
                    (attn_res_mix_norm, (7168, 8, False), 64),
                    (attn_res_mix_norm, (7168, 0, True), 1),
                    (mla_lowrank_norm, (1536, 512, 64), 1),
                    (mla_lowrank_norm, (1536, 512, 64), 64)]


@pytest.mark.parametrize("module,scalars,b",
                         _first_of_each(NORM_WEIGHT_FP32, lambda case: case[0].__name__), ids=str)
def test_norm_weight_fp32_builds(module, scalars, b, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills, and the flag reaches the device code: the
    default build multiplies the rounded row by the weight in bf16 (the fp32 product of two bf16
    values rounded once is a bf16 `mul.bf16x2`, which the compiler emits: for attn_res_mix_norm
    one per two output elements), the variant multiplies in fp32 and emits none."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = module.config(*scalars, b)
    flag = "norm_weight_fp32" if module is attn_res_mix_norm else "weight_fp32"
    for sub in ("v", "d"):
        (tmp_path / sub).mkdir()
    variant = module.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "v"), **{flag: True})
    _check_cubin(variant)
    default = module.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "d"))
    bf16_mul = re.compile(r"\bmul(\.rn)?\.bf16x2\b")
    plain = len(bf16_mul.findall(ptx_of(default)))
    if module is attn_res_mix_norm:
        assert plain == cfg.vec_per_thread * 8 // 2
    else:  # measured: q's products (4 a thread at batch 1) as bf16x2, c's not always
        assert plain > 0
    assert not bf16_mul.findall(ptx_of(variant))

# kda_decode's o_fp32 build (with norm_fp32: o unrounded into fla's gated norm; the red-team
# spelling, spell8): decode and verify rows at one TP16 rank, batch 1 and 64
O_FP32 = [((1, 6, 4), 1), ((8, 6, 4), 64)]


@pytest.mark.parametrize("scalars,b", _first_of_each(O_FP32, lambda case: "kda"), ids=str)
def test_kda_o_fp32_builds(scalars, b, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills, and the flag reaches the device code: the
    norm_fp32 build less the bf16 rounding of each token's o (VEC value columns per thread)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    for sub in ("v", "d"):
        (tmp_path / sub).mkdir()
    variant = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "v"),
                               variant=KDAVariant(norm_fp32=True, o_fp32=True))
    _check_cubin(variant)
    fp32_norm = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "d"),
                                 variant=KDAVariant(norm_fp32=True))
    cvt = "cvt.rn.bf16.f32"
    assert ptx_of(fp32_norm).count(cvt) - ptx_of(variant).count(cvt) == scalars[0] * kda_decode.VEC


# kda_decode's session-27 rounding builds: `conv_rounded` (the conv rounded to bf16 before its
# SiLU: the red-team spelling, with fla's norm on an fp32 o; spell7's the same on a V-major
# state, session 28) and `norm_weight_fp32` (spell9's Flax norm on an fp32 o, time-major conv
# state, conv rounded too; spell6's the built-in norm on a V-major state, session 29): decode at
# one TP16 rank
ROUNDING = [((1, 6, 4), 1)]


@pytest.mark.parametrize("scalars,b", ROUNDING, ids=str)
def test_kda_rounding_builds(scalars, b, monkeypatch, tmp_path):
    """The variants compile for sm_90a without spills, and each flag reaches the device code:
    `conv_rounded` adds bf16 roundings (cvt.rn.bf16.f32, one per conv output) to the build
    without it; `norm_weight_fp32` rounds the normed row times the weight and the gate's sigmoid
    (two per output element) where fla's fp32 norm rounds once at the store."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    rounded = ConvRounding.ROUNDED
    builds = {"red": KDAVariant(norm_fp32=True, o_fp32=True, conv=rounded),
              "red_plain": KDAVariant(norm_fp32=True, o_fp32=True),
              "s7": KDAVariant(norm_fp32=True, o_fp32=True, conv=rounded, state_v_major=True),
              "s6": KDAVariant(conv=rounded, state_v_major=True),
              "s9": KDAVariant(norm_weight_fp32=True, o_fp32=True, conv=rounded,
                               conv_time_major=True),
              "s9_fla": KDAVariant(norm_fp32=True, o_fp32=True, conv=rounded,
                                   conv_time_major=True)}
    cvt = {}
    for name, step in builds.items():
        (tmp_path / name).mkdir()
        built = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / name),
                                 variant=step)
        if name in ("red", "s9", "s7", "s6"):
            _check_cubin(built)
        cvt[name] = ptx_of(built).count("cvt.rn.bf16.f32")
    assert cvt["red"] > cvt["red_plain"]  # measured 10 against 5 a thread at T = 1, bucket 1
    assert cvt["s7"] == cvt["red"]  # the V-major state moves no rounding
    # the built-in norm rounds o, the normed row, its product with the weight and the gate
    # where fla's rounds once at the store
    assert cvt["s6"] > cvt["s7"]
    out_per_thread = -(-kda_decode.tile(cfg).out_vectors(scalars[0]) // cfg.threads) * 8
    assert cvt["s9"] - cvt["s9_fla"] == 2 * out_per_thread


# kda_decode's `conv_products_rounded` build (session 34: the short conv a window sum multiplied
# in bf16, each tap product rounded, spell10's and spell12's bf16 conv): decode at one TP16 rank,
# on the built-in norm (spell10, spell12) and on fla's norm on an fp32 o
PRODUCTS = [((1, 6, 4), 1)]


@pytest.mark.parametrize("scalars,b", PRODUCTS, ids=str)
def test_kda_conv_products_rounded_builds(scalars, b, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills, and the flag reaches the device code: each
    tap product of a conv output is rounded to bf16 before the fp32 sum (LLVM writes the rounded
    product of two bf16 values as one `mul.bf16`, round to nearest even, which is the rounding
    of the exact fp32 product) where `conv_rounded` sums fp32 products by FMAs and rounds only
    the sum."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    products = ConvRounding.PRODUCTS_ROUNDED
    builds = {"products": KDAVariant(conv=products), "sum": KDAVariant(conv=ConvRounding.ROUNDED),
              "products_fla": KDAVariant(norm_fp32=True, o_fp32=True, conv=products)}
    ptx = {}
    for name, step in builds.items():
        (tmp_path / name).mkdir()
        built = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / name),
                                 variant=step)
        if name.startswith("products"):
            _check_cubin(built)
        ptx[name] = ptx_of(built)
    T, taps = scalars[0], scalars[2]
    tl = kda_decode.tile(cfg)
    items = tl.prologue_items()
    passes = sum(items[s][0] != "alpha" for _, s, _ in tl.plan(items))  # a thread's conv items
    products = {n: p.count("mul.bf16") + p.count("mul.rn.bf16") for n, p in ptx.items()}
    assert products["products"] - products["sum"] == T * taps * passes  # measured 28 - 8 = 4 x 5
    fma = {n: p.count("fma.rn.f32") for n, p in ptx.items()}
    assert fma["sum"] - fma["products"] == T * (taps - 1) * passes


# kda_decode's spell11 builds (session 36): `gate_fp32` (the built-in norm, the gate product in
# fp32, one rounding) and `conv_weight_fp32` (fp32 master conv weights read as they are), each and
# both: decode at one TP16 rank (batch 1, clusters of 4), verify rows (batch 64, no cluster)
SPELL11 = [((1, 6, 4), 1), ((8, 6, 4), 64)]


@pytest.mark.parametrize("scalars,b", _first_of_each(SPELL11, lambda case: "kda"), ids=str)
def test_kda_spell11_builds(scalars, b, monkeypatch, tmp_path):
    """The builds compile for sm_90a without spills, and each option reaches the device code:
    `gate_fp32` drops the bf16 rounding of σ(g) (one cvt.rn.bf16.f32 and its cvt back per output
    element of a thread); `conv_weight_fp32` loads each conv tap as 32 bits where the default
    loads 16 (a thread's taps × conv items; the same loads otherwise). Measured at T = 1,
    bucket 1: 8 roundings fewer; 20 16-bit loads become 32-bit (4 taps × 5 passes)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    gate = KDAVariant(gate_fp32=True)
    builds = {"default": {}, "gate": {"variant": gate}, "taps": {"conv_weight_fp32": True},
              "both": {"variant": gate, "conv_weight_fp32": True}}
    ptx = {}
    for name, options in builds.items():
        (tmp_path / name).mkdir()
        built = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / name),
                                 **options)
        if name != "default":
            _check_cubin(built)
        ptx[name] = ptx_of(built)
    count = {n: {op: p.count(op) for op in ("cvt.rn.bf16.f32", "cvt.f32.bf16", "ld.global",
                                            "ld.global.b16", "ld.global.b32")}
             for n, p in ptx.items()}
    tl = kda_decode.tile(cfg)
    out_per_thread = -(-tl.out_vectors(scalars[0]) // cfg.threads) * 8
    items = tl.prologue_items()
    taps = scalars[2] * sum(items[s][0] != "alpha" for _, s, _ in tl.plan(items))
    for plain, gated in (("default", "gate"), ("taps", "both")):
        for op in ("cvt.rn.bf16.f32", "cvt.f32.bf16"):
            assert count[plain][op] - count[gated][op] == out_per_thread, count
    for plain, wide in (("default", "taps"), ("gate", "both")):
        assert count[plain]["ld.global"] == count[wide]["ld.global"], count
        assert count[plain]["ld.global.b16"] - count[wide]["ld.global.b16"] == taps, count
        assert count[wide]["ld.global.b32"] - count[plain]["ld.global.b32"] == taps, count


# kda_decode's time-major build (the conv state [S, taps-1, 3W], vLLM v1's layout): decode and
# verify rows at one TP16 rank, batch 1 (clusters of 4) and 64 (no cluster)
TIME_MAJOR = [((1, 6, 4), 1), ((8, 6, 4), 64)]


@pytest.mark.parametrize("scalars,b", _first_of_each(TIME_MAJOR, lambda case: "kda"), ids=str)
def test_kda_time_major_builds(scalars, b, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills; it is the default's math (the same FMAs
    and roundings) on other conv-state addresses: the state's strides reached the device code."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    for sub in ("v", "d"):
        (tmp_path / sub).mkdir()
    variant = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "v"),
                               variant=KDAVariant(conv_time_major=True))
    _check_cubin(variant)
    default = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "d"))
    tm, cm = ptx_of(variant), ptx_of(default)
    assert tm != cm
    for op in ("fma.rn.f32", "cvt.rn.bf16.f32", "ld.global", "st.global"):
        assert tm.count(op) == cm.count(op), op


# kda_decode's V-major build (the recurrent state [S, H, V, K], fla's transposed layout): decode
# and verify rows at one TP16 rank, batch 1 (clusters of 4) and 64 (no cluster)
V_MAJOR = [((1, 6, 4), 1), ((8, 6, 4), 64)]


@pytest.mark.parametrize("scalars,b", _first_of_each(V_MAJOR, lambda case: "kda"), ids=str)
def test_kda_v_major_builds(scalars, b, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills; it is the default's math (the same FMAs
    and roundings) with the state's strides in the device code: each 16-byte load and store of
    a state row (4 value columns) becomes 4 loads and stores of 4 bytes, K apart."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    for sub in ("v", "d"):
        (tmp_path / sub).mkdir()
    variant = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "v"),
                               variant=KDAVariant(state_v_major=True))
    _check_cubin(variant)
    default = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "d"))
    vm, km = ptx_of(variant), ptx_of(default)
    for op in ("fma.rn.f32", "cvt.rn.bf16.f32", "ld.global.b16", "st.global.b16"):
        assert vm.count(op) == km.count(op), op
    for kind in ("ld", "st"):
        vectors = km.count(f"{kind}.global.v4.b32") - vm.count(f"{kind}.global.v4.b32")
        assert vectors == kda_decode.tile(cfg).R == cfg.rows_per_thread, kind  # one a row
        assert vm.count(f"{kind}.global.b32") - km.count(f"{kind}.global.b32") == 4 * vectors


# kda_decode's three-state build (q's, k's and v's conv states in three buffers [S, W, taps-1],
# fla's ShortConvolution caches): decode and verify rows at one TP16 rank, batch 1 and 64
THREE_STATES = [((1, 6, 4), 1), ((8, 6, 4), 64)]


@pytest.mark.parametrize("scalars,b", _first_of_each(THREE_STATES, lambda case: "kda"), ids=str)
def test_kda_three_states_builds(scalars, b, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills; it is the default's math (the same FMAs,
    roundings, loads and stores) with two more tensor parameters and other conv-state
    addresses (k's and v's rows in their own buffers)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    for sub in ("v", "d"):
        (tmp_path / sub).mkdir()
    variant = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "v"),
                               variant=KDAVariant(three_conv_states=True))
    _check_cubin(variant)
    default = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "d"))
    ts, one = ptx_of(variant), ptx_of(default)
    assert ts != one
    for op in ("fma.rn.f32", "cvt.rn.bf16.f32", "ld.global", "st.global"):
        assert ts.count(op) == one.count(op), op

    def params(ptx):
        entry = ptx[ptx.index(".entry"):]
        return entry[:entry.index(")")].count(".param")

    assert params(ts) == params(one) + 2


# sha256 (first 16 hex digits) of kda_decode cubins (nvidia-cutlass-dsl 4.8.1, CUDA 12 libraries)
# at `config()`: (variant spec, three conv states, (T, heads, taps), bucket, other build options)
# -> digest. Recorded 2026-12-06 (session 35) on main, where the variants were seven bool build
# options, and after they became one `KDAVariant`: the same bytes, PTX too (as were those of the
# 37 variants the patterns trace, each at (1, 6, 4), bucket 1, with PDL)
KDA_CUBINS = {
    ("", False, (1, 6, 4), 1, ()): "b58ac6af21ea8746",
    ("", False, (1, 6, 4), 1, (("pdl", True),)): "ce5f5d20383b84a8",
    ("norm_fp32", False, (1, 6, 4), 1, ()): "1a166968f398185f",
    ("conv_time_major,o_fp32,norm_weight_fp32,conv_rounded", False, (1, 6, 4), 1, ()):
        "6401a3d00ad789c6",
    ("norm_fp32,state_v_major,o_fp32,conv_rounded", False, (1, 6, 4), 1, ()): "33c512778a849a6e",
    ("conv_products_rounded", False, (1, 6, 4), 1, ()): "2622a96bae06daab",
    ("norm_fp32,o_fp32,conv_products_rounded", False, (1, 6, 4), 1, ()): "f55f78590b5f15c7",
    ("", True, (8, 6, 4), 64, ()): "4e33f2cc75d2ac14",
    ("norm_fp32", False, (1, 6, 4), 1, (("fb_rank", 128), ("pdl", True))): "a178636e268b3df8",
    ("conv_time_major", False, (8, 6, 4), 64, (("a_log_bf16", True), ("dt_bias_bf16", True))):
        "fe72ba3e980cc3dd",
}


@pytest.mark.parametrize("key", _first_of_each([(k,) for k in KDA_CUBINS], lambda case: "kda"),
                         ids=lambda k: f"{k[0] or 'default'}{'-three' if k[1] else ''}-{k[2]}-"
                                       f"b{k[3]}{''.join(f'-{o}' for o, _ in k[4])}")
def test_kda_variant_builds_are_unchanged(key, monkeypatch, tmp_path):
    """Each variant's build is byte for byte the one from before the variants were one value
    (the device code reads the `KDAVariant`'s fields where it read the bools)."""
    if version("nvidia-cutlass-dsl") != "4.8.1" or _dsl_cuda_flavour() != "cu12":
        pytest.skip("digests recorded with nvidia-cutlass-dsl 4.8.1 and its CUDA 12 libraries")
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    spec, three, scalars, b, options = key
    compiled = kda_decode.build(*scalars, kda_decode.config(*scalars, b), arch=ARCH,
                                dump_dir=str(tmp_path), variant=KDAVariant.parse(spec, three),
                                **dict(options))
    assert hashlib.sha256(cubin_of(compiled)).hexdigest()[:16] == KDA_CUBINS[key]


# kda_decode's builds for bf16 A_log / dt_bias (a Moonshot model cast to bf16 whole), each and
# both, at one TP16 rank's decode (batch 1: clusters of 4) and verify rows (batch 64: no cluster)
BF16_PARAMS = [(flags, scalars, b) for scalars, b in [((1, 6, 4), 1), ((8, 6, 4), 64)]
               for flags in ({"a_log_bf16": True}, {"dt_bias_bf16": True},
                             {"a_log_bf16": True, "dt_bias_bf16": True})]


@pytest.mark.parametrize("flags,scalars,b", _first_of_each(BF16_PARAMS, lambda case: "kda"),
                         ids=str)
def test_kda_bf16_params_build(flags, scalars, b, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills, and its flags reach the device code: the
    same global loads, some of them now 16-bit, each followed by its conversion to fp32."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    for sub in ("v", "d"):
        (tmp_path / sub).mkdir()
    variant = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "v"), **flags)
    _check_cubin(variant)
    default = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "d"))
    count = {name: {op: ptx_of(c).count(op) for op in ("ld.global", "ld.global.b16",
                                                         "cvt.f32.bf16")}
             for name, c in (("variant", variant), ("default", default))}
    more = count["variant"]["ld.global.b16"] - count["default"]["ld.global.b16"]
    assert more >= len(flags), count
    assert count["variant"]["ld.global"] == count["default"]["ld.global"], count
    assert count["variant"]["cvt.f32.bf16"] - count["default"]["cvt.f32.bf16"] == more, count


# kda_decode's f_b build (fb_kda_decode in one launch) at (T, heads, taps), bucket, R: decode
# and verify rows at one TP16 rank (R = 128) with the configs of batch 1 and 64 (clusters of 4
# and 1), 16 tokens (4 rows unrolled), R = 8 (one lane a row: rows past K at 8 warps), 64
FB = [((1, 6, 4), 1, 128), ((8, 6, 4), 64, 128), ((1, 6, 4), 64, 128), ((8, 6, 4), 1, 128),
      ((16, 6, 4), 1, 128), ((16, 6, 4), 64, 128), ((1, 6, 4), 64, 8), ((2, 4, 4), 8, 64)]


@pytest.mark.parametrize("scalars,b,R", _first_of_each(FB, lambda case: "fb"), ids=str)
@pytest.mark.parametrize("pdl", [False, True])
def test_kda_fb_builds(scalars, b, R, pdl, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills; the head's W_fb rows go to shared memory
    by 16-byte cp.async (K·R/8 copies over the CTA's threads), not by loads into registers (the
    same 16-byte global loads as the default build: the state's), and are summed over lanes by
    shuffles; with PDL every copy is issued before the wait and awaited after it, and nothing is
    loaded from global memory (fa, slots, states) or stored before the wait."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = kda_decode.config(*scalars, b)
    for sub in ("v", "d"):
        (tmp_path / sub).mkdir()
    variant = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "v"),
                               pdl=pdl, fb_rank=R)
    _check_cubin(variant)
    default = kda_decode.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "d"), pdl=pdl)
    ptx = ptx_of(variant)
    v4 = [sum(ptx_of(c).count(op) for op in ("ld.global.v4", "ld.global.nc.v4"))
          for c in (variant, default)]
    assert v4[0] == v4[1], v4
    copy = "cp.async.cg.shared.global"
    assert ptx.count(copy) == -(-kda_decode.HEAD_DIM * R // 8 // cfg.threads)
    assert all(f"{copy} [%r" in line and line.rstrip().endswith("16, 16;")
               for line in ptx.splitlines() if copy in line)
    assert ptx.count("cp.async.commit_group") == 1 and ptx.count("cp.async.wait_group") == 1
    shfl = "shfl.sync.bfly"
    assert (ptx.count(shfl) > ptx_of(default).count(shfl)) == (R > 8)
    if pdl:
        before, after = ptx[:ptx.index(WAIT)], ptx[ptx.index(WAIT):]
        assert not [op for op in ("st.global", "st.shared", "ld.global") if op in before]
        assert copy not in after and "cp.async.commit_group" in before
        assert "cp.async.wait_group" in after


# the device-side input check (kernels/input_check.py, K3_CHECK_KERNEL) for three limit
# structures at (B, T): the slot input alone, + positions [B], + positions [B, T] int32 and ids
# (verify rows; 512 elements: 256 threads, two a thread)
def _input_check_limits(kind: str, B: int, T: int):
    import torch

    from k3compile.validate import Limit

    slots = (Limit(0, "slots", "slots", 0, 64, "rows", True, 64),
             torch.zeros(B, dtype=torch.int64))
    positions = (Limit(1, "positions", "positions", 0, 4096 - T, "cache", True),
                 torch.zeros(B, dtype=torch.int64) if kind == "positions" else
                 torch.zeros(B, T, dtype=torch.int32))
    ids = (Limit(2, "input_ids", "ids", 0, 163839, "vocab", True),
           torch.zeros(B, T, dtype=torch.int64))
    pairs = {"slots": [slots], "positions": [slots, positions],
             "verify": [ids, positions, slots]}[kind]
    return [lim for lim, _ in pairs], [t for _, t in pairs]


INPUT_CHECK = [("slots", 1, 1), ("positions", 8, 1), ("verify", 64, 8), ("verify", 2, 8),
               ("slots", 64, 1)]
# warp-synchronous instructions (every lane of the mask must run them) and CTA barriers
_COLLECTIVES = ("shfl.sync", "redux.sync", "vote.sync", "match.sync", "bar.warp.sync",
                "bar.sync", "barrier.sync")
_BRANCH = re.compile(r"@!?%p\d+\s+bra\s+(\$\w+);")


def skippable_collectives(ptx: str) -> list[str]:
    """The collectives and barriers of `ptx` that a forward conditional branch jumps over (a
    divergent one leaves some lanes or threads out, and the others wait for them forever).
    `bra.uni`, which the compiler marks warp-uniform, and backward (loop) branches are skipped."""
    seen, open_, out = set(), set(), []
    for line in ptx.splitlines():
        line = line.strip()
        if line.endswith(":"):
            seen.add(line[:-1])
            open_.discard(line[:-1])
        elif m := _BRANCH.match(line):
            if m[1] not in seen:
                open_.add(m[1])
        elif open_ and line.startswith(_COLLECTIVES):
            out.append(line)
    return out


def test_skippable_collectives_finds_a_shuffle_lane_0_runs_alone():
    """The PTX of input_check's first 2-warp block_or (warp_idx() inside `if lane == 0`): lane 0
    waited at the shuffle, the other lanes at the barrier (the H200 hang of 2026-12-05)."""
    hung = """
    redux.sync.or.b32 	%r7, %r22, %r23;
    @%p12 bra 	$L__BB0_6;
    shfl.sync.idx.b32 	%r26, %r25, 0, 31, -1;
    st.shared.b32 	[%r28], %r7;
$L__BB0_6:
    bar.sync 	0;"""
    fixed = hung.replace("    @%p12 bra 	$L__BB0_6;\n", "") + "\n@%p12 bra $L__BB0_9;\n$L__BB0_9:"
    loop = "$L__BB0_2:\n  shfl.sync.bfly.b32 %r1, %r2, 1, 31, -1;\n  @%p10 bra $L__BB0_2;"
    assert skippable_collectives(hung) == ["shfl.sync.idx.b32 	%r26, %r25, 0, 31, -1;"]
    assert skippable_collectives(fixed) == [] and skippable_collectives(loop) == []


def _warps(case):
    return case[1] * case[2] > 32  # kind, B, T: more than one warp


@pytest.mark.parametrize("kind,B,T", _first_of_each(INPUT_CHECK, _warps), ids=str)
@pytest.mark.parametrize("pdl", [False, True])
def test_input_check_builds(kind, B, T, pdl, monkeypatch, tmp_path):
    """One CTA, no spills; the failed checks reduced by one `redux.sync.or` per warp (one barrier
    before it for the duplicate check's shared values, one after it past one warp), no shuffle,
    reduction or barrier that a branch lets some threads skip; with PDL nothing is loaded or
    stored before the wait, without it no griddepcontrol at all. The default run builds one
    warp and several (the first 2-warp build hung on the H200 while every 1-warp one passed)."""
    from k3compile.kernels import input_check

    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    limits, checked = _input_check_limits(kind, B, T)
    assert input_check.refusal(limits, checked) is None
    specs = input_check.specs_of(limits, checked)
    cfg = input_check.config(specs)
    compiled = input_check.build(specs, cfg, arch=ARCH, dump_dir=str(tmp_path), pdl=pdl)
    _check_cubin(compiled)
    ptx = ptx_of(compiled)
    assert ptx.count("redux.sync.or.b32") == 1
    assert ptx.count("bar.sync") == 1 + (cfg.threads > 32)
    assert skippable_collectives(ptx) == []
    if pdl:
        assert TRIGGER in ptx and WAIT in ptx
        before = ptx[:ptx.index(WAIT)]
        assert not [op for op in ("ld.global", "st.global", "st.shared") if op in before]
    else:
        assert "griddepcontrol" not in ptx


# moe_experts' stages whose warps meet in shared memory: FC1 with the fp16 staging (`stage_z2`:
# each warp's |z| maximum written by its lane 0, at the configs of 1 and of 8-64 rows), FC2 plain
# and fp16 (the k act maxima), at the TP16 rank. Session 23: `stage_z2` read `warp_idx()` (a
# full-warp shuffle) inside its lane-0 branch, input_check's deadlock of session 22; the compiler
# merged that read with the kernel's own at entry, so the old PTX passes too, byte for byte
# the new one, but nothing guaranteed the merge
MOE_SHARED = [("fc1", 1, True), ("fc1", 8, True), ("fc2", 8, False), ("fc2", 8, True)]


@pytest.mark.parametrize("stage,b,f16", MOE_SHARED, ids=str)
def test_moe_experts_builds_have_no_skippable_collectives(stage, b, f16, monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    scalars = (stage, 3584, 192, 16, True)
    cfg = dataclasses.replace(moe_experts.config(*scalars[:4], b), f16=f16)
    compiled = moe_experts.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path))
    _check_cubin(compiled)
    ptx = ptx_of(compiled)
    assert "bar.sync" in ptx and "shfl.sync" in ptx  # the check has something to look at
    assert skippable_collectives(ptx) == []


# moe_experts' `out_fp32` (the finalize's fp32 sum stored unrounded, for spellings that feed it to
# the latent norm in fp32): FC2 with the whole W2 row and in chunks (I 1536), plain and fp16, and
# the grouped sum; the store is 32-bit where the plain build's is 16-bit
MOE_OUT_FP32 = [("fc2", 192, False), ("fc2", 1536, False), ("fc2", 192, True), ("fin", 192, False)]


@pytest.mark.parametrize("stage,inter,f16", MOE_OUT_FP32, ids=str)
def test_moe_experts_out_fp32_builds(stage, inter, f16, monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    scalars = (stage, 3584, inter, 16, True)
    cfg = None if stage == "fin" else dataclasses.replace(
        moe_experts.config(stage, 3584, inter, 16, 8), f16=f16)
    builds = {}
    for out_fp32 in (False, True):
        (dump := tmp_path / ("fp32" if out_fp32 else "bf16")).mkdir()
        compiled = moe_experts.build(*scalars, cfg, arch=ARCH, dump_dir=str(dump),
                                     out_fp32=out_fp32)
        _check_cubin(compiled)
        builds[out_fp32] = ptx_of(compiled)
    plain, fp32 = builds[False], builds[True]
    assert skippable_collectives(fp32) == []
    if stage == "fin":  # 8 values a thread: vectors of 16 bytes
        assert "st.global.v4.b32" in fp32 or "st.global.v4.f32" in fp32
        assert "st.global.v4.b32" in plain and "st.global.v4.f32" not in plain
    else:  # one value a thread
        assert re.search(r"st\.global\.(f32|b32)", fp32) and not re.search(r"st\.global\.b16", fp32)
        assert re.search(r"st\.global\.b16", plain)


# moe_route's build for a bf16 router bias (a Moonshot model cast to bf16 whole): at the K3 router
# (896 experts, top-16; one float4 a thread) and E 1024, k 32 (two a thread), PDL off and on
BF16_BIAS = [((896, 16), False), ((1024, 32), False), ((896, 16), True), ((1024, 32), True)]


@pytest.mark.parametrize("scalars,pdl", _first_of_each(BF16_BIAS, lambda case: "route"), ids=str)
def test_moe_route_bf16_bias_build(scalars, pdl, monkeypatch, tmp_path):
    """The variant compiles for sm_90a without spills, and the flag reaches the device code: the
    same global loads, the bias's now 8-byte vectors of four bf16 (one per float4 of logits),
    each element then converted to fp32."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg = moe_route.config(*scalars, 1)
    for sub in ("v", "d"):
        (tmp_path / sub).mkdir()
    variant = moe_route.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "v"), pdl=pdl,
                              bias_bf16=True)
    _check_cubin(variant)
    default = moe_route.build(*scalars, cfg, arch=ARCH, dump_dir=str(tmp_path / "d"), pdl=pdl)
    count = {name: {op: ptx_of(c).count(op) for op in ("ld.global", "ld.global.v4.b16",
                                                         "cvt.f32.bf16")}
             for name, c in (("variant", variant), ("default", default))}
    assert count["default"]["ld.global.v4.b16"] == count["default"]["cvt.f32.bf16"] == 0, count
    assert count["variant"]["ld.global"] == count["default"]["ld.global"], count
    assert count["variant"]["ld.global.v4.b16"] == cfg.vec_per_thread, count
    assert count["variant"]["cvt.f32.bf16"] == 4 * cfg.vec_per_thread, count


# gemv's one-launch variants (n, k, fp32 output, residual, fusion), every bucket: the norm
# prologue at the routed-latent up-projection (with the shared experts' residual), SiTU at the
# shared experts and dense layer 0 (I = 2112 per rank), the split front [W_r; W_d]; small shapes
# with partial CTAs, vector tails and a split inside a CTA; the gate epilogue at MLA's W_UV
GEMV_VARIANTS = [(7168, 3584, False, False, gemv.NORM), (7168, 3584, False, True, gemv.NORM),
                 (1000, 1032, True, True, gemv.NORM), (768, 7168, False, False, gemv.SITU),
                 (4224, 7168, False, False, gemv.SITU), (2000, 1032, False, False, gemv.SITU),
                 (4480, 7168, True, False, gemv.Fusion(split=896)),
                 (1000, 1032, True, False, gemv.Fusion(split=333)),
                 (768, 512, False, False, gemv.Fusion(gate=128)),  # W_UV, 6 heads of 128
                 (192, 1032, False, False, gemv.Fusion(gate=64))]
# sha256 (first 16 hex digits) of plain gemv cubins built by nvidia-cutlass-dsl 4.8.1: (n, k,
# bucket, fp32 output, residual, pdl) -> digest. Re-recorded 2026-12-01 when the kernel class moved
# to kernels/device/gemv.py: the entry symbol carries the class's module path; the PTX is
# otherwise identical to the previous builds' (every gemv build of this file compared)
PLAIN_GEMV_CUBINS = {
    (3584, 7168, 1, False, False, False): "88bd508b025c41db",
    (7168, 3584, 1, False, True, False): "81b8c990c27ae82d",
    (896, 7168, 1, True, False, False): "fa363077833aaebd",
    (1000, 1032, 16, True, True, False): "b2792e1d32ae0728",
    (3584, 7168, 1, False, False, True): "df1dbae26b5ba99a",
    (7168, 3584, 1, False, True, True): "ba8bf5a1f284a300",
    (896, 7168, 1, True, False, True): "c11428dc46f55ab1",
    (1000, 1032, 16, True, True, True): "eb63bce5be83bd72",
}
# the same builds with the DSL's CUDA 13 libraries (the H200 machine's carry), measured there
# 2026-12-01: the toolkit that assembles the cubin differs, so do its bytes
PLAIN_GEMV_CUBINS_CU13 = {
    (3584, 7168, 1, False, False, False): "decf3087d8b84d5e",
    (7168, 3584, 1, False, True, False): "5bc223e558f9ffc4",
    (896, 7168, 1, True, False, False): "731be21d54ba7da4",
    (1000, 1032, 16, True, True, False): "4a0b008906f85de4",
    (3584, 7168, 1, False, False, True): "b7ef11978909dfee",
    (7168, 3584, 1, False, True, True): "9960d6c583313909",
    (896, 7168, 1, True, False, True): "0384261a7e1c2788",
    (1000, 1032, 16, True, True, True): "7a5dc5fcbf99aed6",
}


def _dsl_cuda_flavour() -> str:
    from importlib.metadata import distributions

    names = {d.metadata["Name"] for d in distributions()}
    return "cu13" if "nvidia-cutlass-dsl-libs-cu13" in names else "cu12"


def _variant_id(v):
    return f"{v[0]}x{v[1]}-{'fp32' if v[2] else 'bf16'}{'-r' if v[3] else ''}-" + (
        "norm" if v[4].norm else "situ" if v[4].situ else f"gate{v[4].gate}" if v[4].gate
        else f"split{v[4].split}")


def _fusion_kind(case):
    fusion = case[0][4]
    return fusion.norm, fusion.situ, bool(fusion.split), bool(fusion.gate), *case[1:]


@pytest.mark.parametrize("variant,b", _first_of_each(
    [(v, b) for b in gemv.BUCKETS for v in GEMV_VARIANTS], lambda c: _fusion_kind(c)[:4]),
    ids=lambda v: _variant_id(v) if isinstance(v, tuple) else str(v))
def test_gemv_variants_build(variant, b, monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    n, k, out_fp32, residual, fusion = variant
    cfg = gemv.config(n, k, b, fusion)
    compiled = gemv.build(n, k, b, out_fp32, residual, cfg, arch=ARCH, dump_dir=str(tmp_path),
                          fusion=fusion)
    _check_cubin(compiled)
    ptx = ptx_of(compiled)
    assert "griddepcontrol" not in ptx and "kernel_fused" in ptx


@pytest.mark.parametrize("variant", _first_of_each([(v,) for v in GEMV_VARIANTS], _fusion_kind),
                         ids=_variant_id)
def test_gemv_variants_build_with_pdl(variant, monkeypatch, tmp_path):
    """The PDL rule in every variant: W (and the norm weight) load before the wait, x after it,
    nothing stored before it."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    n, k, out_fp32, residual, fusion = variant
    cfg = gemv.config(n, k, 1, fusion)
    compiled = gemv.build(n, k, 1, out_fp32, residual, cfg, arch=ARCH, dump_dir=str(tmp_path),
                          pdl=True, fusion=fusion)
    _check_cubin(compiled)
    ptx = ptx_of(compiled)
    assert TRIGGER in ptx and WAIT in ptx
    before, after = ptx.split(WAIT)
    assert not [op for op in ("st.global", "red.global", "atom.global") if op in before]
    vectors = -(-(k // 8) // cfg.threads)  # per thread and row
    assert before.count("ld.global.v4") == (cfg.rows_per_cta + fusion.norm) * vectors
    assert "ld.global" in after  # x


@pytest.mark.parametrize("key", _first_of_each([(k,) for k in PLAIN_GEMV_CUBINS],
                                               lambda case: case[0][-1]), ids=str)
def test_plain_gemv_build_is_unchanged(key, monkeypatch, tmp_path):
    """With every variant flag off the build is byte for byte the one from before the variants
    (the variants compile from a second entry, `Gemv.fused`)."""
    if version("nvidia-cutlass-dsl") != "4.8.1":
        pytest.skip("digests recorded with nvidia-cutlass-dsl 4.8.1")
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    n, k, b, out_fp32, residual, pdl = key
    compiled = gemv.build(n, k, b, out_fp32, residual, gemv.heuristic_config(n, k, b),
                          arch=ARCH, dump_dir=str(tmp_path), pdl=pdl)
    assert "kernel_fused" not in ptx_of(compiled)
    table = PLAIN_GEMV_CUBINS_CU13 if _dsl_cuda_flavour() == "cu13" else PLAIN_GEMV_CUBINS
    assert hashlib.sha256(cubin_of(compiled)).hexdigest()[:16] == table[key]


# gemv configs the tuned table may pick (`benchmarks/gemv.py --sweep`): R > 1 at one row, T = 512
# and persistent grids (C CTAs per SM looping over row blocks), plain at TP16 shapes and the odd
# one (partial blocks, a vector tail), each variant with a config that fits it: ((n, k, bucket,
# fp32 output, residual), config, fusion)
GEMV_TUNED = [((3206, 7168, 1, False, False), gemv.Config(1, 256, 2), gemv.PLAIN),
              ((896, 7168, 1, True, False), gemv.Config(2, 512, 1), gemv.PLAIN),
              ((2112, 7168, 2, False, False), gemv.Config(4, 512), gemv.PLAIN),
              ((7168, 768, 16, False, True), gemv.Config(2, 128, 1), gemv.PLAIN),
              ((1000, 1032, 16, True, True), gemv.Config(1, 128, 2), gemv.PLAIN),
              ((1000, 1032, 4, True, True), gemv.Config(8, 128), gemv.PLAIN),
              ((7168, 3584, 4, False, True), gemv.Config(2, 256, 1), gemv.NORM),
              ((768, 7168, 2, False, False), gemv.Config(2, 256, 1), gemv.SITU),
              ((4480, 7168, 1, True, False), gemv.Config(1, 256, 2), gemv.Fusion(split=896)),
              ((768, 512, 2, False, False), gemv.Config(2, 128, 1), gemv.Fusion(gate=128))]


def _tuned_id(v):
    if isinstance(v, gemv.Config):
        return f"R{v.rows_per_cta}T{v.threads}C{v.ctas_per_sm}"
    if isinstance(v, gemv.Fusion):
        return "plain" if v == gemv.PLAIN else _variant_id((0, 0, 0, 0, v)).split("-")[-1]
    return "x".join(map(str, v))


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("scalars,cfg,fusion", _first_of_each(
    GEMV_TUNED, lambda c: (c[1].ctas_per_sm > 0, c[2] == gemv.PLAIN)), ids=_tuned_id)
def test_gemv_tuned_configs_build(scalars, cfg, fusion, pdl, monkeypatch, tmp_path):
    """No spills; with PDL the first row block's W (and the norm weight) load before the wait,
    nothing is stored before it, and a persistent grid's loop loads both register sets (the
    next blocks' W) after it."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    n, k, b, out_fp32, residual = scalars
    assert gemv.fits(cfg, k, b, fusion)
    compiled = gemv.build(n, k, b, out_fp32, residual, cfg, arch=ARCH, dump_dir=str(tmp_path),
                          pdl=pdl, fusion=fusion)
    _check_cubin(compiled)
    ptx = ptx_of(compiled)
    blocks = -(-n // cfg.rows_per_cta)  # with SiTU: (N / 2) / (R / 2)
    persistent = gemv.grid_size(blocks, cfg) < blocks
    assert persistent == (cfg.ctas_per_sm > 0)
    if not pdl:
        assert "griddepcontrol" not in ptx
        return
    before = ptx[:ptx.index(WAIT)]
    assert not [op for op in ("st.global", "red.global", "atom.global") if op in before]
    vectors = -(-(k // 8) // cfg.threads)
    assert before.count("ld.global.v4") == (cfg.rows_per_cta + fusion.norm) * vectors
    loads_after = ptx[ptx.index(WAIT):].count("ld.global.v4")  # x, and the loop's W
    assert loads_after >= (2 * cfg.rows_per_cta * vectors if persistent else 1)


def _sweep_builds():
    """Every `gemv.configs()` entry at the TP16 shapes and the odd one, buckets 1 and 16, once
    per distinct build shape (K, bucket, R, T, persistent)."""
    seen, out = set(), []
    for n, k in [(3206, 7168), (7168, 3584), (896, 7168), (7168, 768), (1152, 1536),
                 (7168, 384), (768, 128), (1000, 1032)]:
        for b in (1, 16):
            for cfg in gemv.configs(n, k, b):
                key = (k, b, cfg.rows_per_cta, cfg.threads, cfg.ctas_per_sm > 0)
                if key not in seen:
                    seen.add(key)
                    out.append(pytest.param((n, k, b), cfg, marks=pytest.mark.slow))
    return out


@pytest.mark.parametrize("shape,cfg", _sweep_builds(), ids=str)
def test_gemv_sweep_configs_build_without_spills(shape, cfg, monkeypatch, tmp_path):
    """What the sweep times builds for sm_90a without spills, and fits CTAs per SM as asked
    (registers x threads x C within the register file)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    n, k, b = shape
    compiled = gemv.build(n, k, b, False, False, cfg, arch=ARCH, dump_dir=str(tmp_path))
    _check_cubin(compiled)
    regs = cubin_resources(cubin_of(compiled))["regs"]
    assert -(-regs // 8) * 8 * cfg.threads * max(cfg.ctas_per_sm, 1) <= 65536, f"{regs} registers"


def _check_cubin(compiled):
    assert callable(compiled)
    cubin = cubin_of(compiled)
    assert cubin and cubin[:4] == b"\x7fELF", "no device binary"
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    # e_flags hold the SM in bits 0-7 (older CUDA ELF ABI) or 8-15 (the CUDA 13 toolkit's)
    assert 90 in (flags & 0xFF, (flags >> 8) & 0xFF), f"not an sm_90 cubin (e_flags {flags:#x})"
    res = cubin_resources(cubin)
    assert res["frame"] == 0, f"register spills / local memory: {res}"
    assert 0 < res["regs"] <= 255


def test_configs_are_whole_warps():
    for module, scalars, cfg in _cases():
        threads = getattr(cfg, "threads", 32 * getattr(cfg, "rows_per_cta", 1))
        assert threads % 32 == 0 and 32 <= threads <= 1024, (module.__name__, scalars, cfg)


def test_device_classes_are_module_level():
    """The CuTe kernel classes import on their own (kernels/device/), for unit tests and tools;
    the host modules import them only in `build`."""
    import importlib

    for host_name, name, cls in [
            ("rms_norm", "rms_norm", "RMSNorm"), ("situ_gate_up", "situ_gate_up", "SiTU"),
            ("mla_lowrank_norm", "mla_lowrank_norm", "MLALowRankNorm"),
            ("moe_route", "moe_route", "MoERoute"),
            ("attn_res_mix_norm", "attn_res_mix_norm", "AttnResMixNorm"),
            ("kda_decode", "kda_decode", "KDADecode"), ("mla_decode", "mla_decode", "MLADecode"),
            ("mla_decode", "mla_decode_mma", "MLADecodeMMA"),
            ("moe_experts", "moe_experts", "FC1"), ("moe_experts", "moe_experts", "FC2"),
            ("moe_one_launch", "moe_one_launch", "MoEOneLaunch"),
            ("common.gemv", "gemv", "Gemv"), ("common.gemm_tc", "gemm_tc", "GemmTC"),
            ("input_check", "input_check", "InputCheck")]:
        module = importlib.import_module(f"k3compile.kernels.device.{name}")
        assert isinstance(getattr(module, cls), type), name
        host = importlib.import_module(f"k3compile.kernels.{host_name}")
        assert not hasattr(host, cls), f"{name}: the host module holds no device class"


# gemm_tc's one-launch variants (n, k, bucket, fusion, config or None for `config()`): the split
# front [W_r; W_d] of one TP16 rank at 8 and 64 tokens, a split inside a partial row tile with a
# partial K slice; SiTU at the shared experts' [W_g; W_u] (I = 384) at 8 and 64 tokens, at
# dense layer 0's I = 2112, with a partial K slice (I = 544: 17 half tiles), and R = 128 (half
# tiles of 64 rows) over a cluster of 2
GEMM_TC_VARIANTS = [(4480, 7168, 8, gemm_tc.Fusion(split=896), None),
                    (4480, 7168, 64, gemm_tc.Fusion(split=896), None),
                    (1000, 1032, 16, gemm_tc.Fusion(split=333), None),
                    (768, 7168, 8, gemm_tc.SITU, None), (768, 7168, 64, gemm_tc.SITU, None),
                    (4224, 7168, 16, gemm_tc.SITU, None), (1088, 1032, 4, gemm_tc.SITU, None),
                    (768, 7168, 32, gemm_tc.SITU, gemm_tc.Config(128, 32, 4, 2))]


def _tc_variant_id(v):
    if isinstance(v, gemm_tc.Fusion):
        return "situ" if v.situ else f"split{v.split}"
    if isinstance(v, gemm_tc.Config):
        return f"R{v.tile_rows}T{v.tile_tokens}st{v.stages}S{v.splits}"
    return str(v)


def _tc_variant_build(n, k, b, fusion, cfg, tmp_path, pdl=False):
    cfg = cfg or gemm_tc.config(n, k, b, fusion)
    assert gemm_tc.smem_bytes(cfg) <= gemm_tc.SMEM_BYTES and b <= cfg.tile_tokens
    compiled = gemm_tc.build(n, k, bool(fusion.split), False, cfg, arch=ARCH,
                             dump_dir=str(tmp_path), pdl=pdl, fusion=fusion)
    _check_cubin(compiled)
    return cfg, ptx_of(compiled)


@pytest.mark.parametrize("n,k,b,fusion,cfg", _first_of_each(
    GEMM_TC_VARIANTS, lambda c: bool(c[3].situ)), ids=_tc_variant_id)
def test_gemm_tc_variants_build(n, k, b, fusion, cfg, monkeypatch, tmp_path):
    """Each variant builds from its own entry: with SiTU the W slice of a stage comes as two
    half-tile TMAs (gate rows, up rows), so each K slice issues 3 TMAs instead of 2, and the
    epilogue reads both sums of a pair from every cluster peer; the split stores to two
    outputs."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg, ptx = _tc_variant_build(n, k, b, fusion, cfg, tmp_path)
    assert "griddepcontrol" not in ptx and "kernel_fused" in ptx
    tma = ptx.count("cp.async.bulk.tensor")
    assert tma == (6 if fusion.situ else 4), tma  # (W + x) in the prologue and in the loop
    # the epilogue's unrolled passes over this CTA's share of the tile (pairs with SiTU)
    share = (cfg.tile_rows // (2 if fusion.situ else 1)) // cfg.splits
    passes = -(-share * cfg.tile_tokens // gemm_tc.THREADS)
    if cfg.splits > 1:
        sums = ptx.count("ld.shared::cluster")
        assert sums == passes * (2 if fusion.situ else 1) * cfg.splits, sums
    assert ptx.count("st.global") == passes * (2 if fusion.split else 1)


@pytest.mark.parametrize("n,k,b,fusion,cfg", _first_of_each(
    [c for c in GEMM_TC_VARIANTS if c[2] == 8], lambda c: bool(c[3].situ)), ids=_tc_variant_id)
def test_gemm_tc_variants_build_with_pdl(n, k, b, fusion, cfg, monkeypatch, tmp_path):
    """The PDL rule in each variant: W's half tiles (SiTU) or tiles stream before the wait,
    nothing is stored before it."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    _, ptx = _tc_variant_build(n, k, b, fusion, cfg, tmp_path, pdl=True)
    assert TRIGGER in ptx and WAIT in ptx
    before = ptx[:ptx.index(WAIT)]
    assert not [op for op in ("st.global", "red.global", "atom.global") if op in before]
    assert before.count("cp.async.bulk.tensor") == (2 if fusion.situ else 1)


# sha256 (first 16 hex digits) of plain gemm_tc cubins built by nvidia-cutlass-dsl 4.8.1 with its
# CUDA 12 libraries, at the `_cases` shapes and their configs: (n, k, bucket, fp32 output,
# residual, pdl) -> digest. Recorded 2026-12-04 (session 21) before and after the one-launch
# variants (`GemmTC.fused`): the same bytes, PTX too
PLAIN_GEMM_TC_CUBINS = {
    (3206, 7168, 8, False, False, False): "8c7eb91dd5f694ff",
    (3206, 7168, 8, False, False, True): "1f32bdd8f35715e8",
    (7168, 768, 64, False, True, False): "45e65e4d4de9182a",
    (7168, 768, 64, False, True, True): "4a710ca88d47b40b",
    (768, 128, 2, True, True, False): "6257c830534b4416",
    (768, 128, 2, True, True, True): "053b532eb02df014",
    (1000, 1032, 16, True, False, False): "ea358cfbdc3f21a0",
    (1000, 1032, 16, True, False, True): "b55f25f856efc2e2",
}


@pytest.mark.parametrize("key", _first_of_each([(k,) for k in PLAIN_GEMM_TC_CUBINS],
                                               lambda case: case[0][-1]), ids=str)
def test_plain_gemm_tc_build_is_unchanged(key, monkeypatch, tmp_path):
    """The plain build is byte for byte the one from before the variants (they compile from a
    second entry, `GemmTC.fused`)."""
    if version("nvidia-cutlass-dsl") != "4.8.1" or _dsl_cuda_flavour() != "cu12":
        pytest.skip("digests recorded with nvidia-cutlass-dsl 4.8.1 and its CUDA 12 libraries")
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    n, k, b, out_fp32, residual, pdl = key
    compiled = gemm_tc.build(n, k, out_fp32, residual, gemm_tc.config(n, k, b), arch=ARCH,
                             dump_dir=str(tmp_path), pdl=pdl)
    assert "kernel_fused" not in ptx_of(compiled)
    assert hashlib.sha256(cubin_of(compiled)).hexdigest()[:16] == PLAIN_GEMM_TC_CUBINS[key]


# sha256 (first 16 hex digits) of gemm_tc's split and SiTU cubins (nvidia-cutlass-dsl 4.8.1, CUDA
# 12 libraries) at their `config()`: (n, k, bucket, fusion, pdl) -> digest. Recorded 2026-12-04
# (session 21) before and after the norm variant (`GemmTC.normed`): the same bytes
FUSED_GEMM_TC_CUBINS = {
    (4480, 7168, 8, gemm_tc.Fusion(split=896), False): "b39fe3b7ce240c12",
    (768, 7168, 8, gemm_tc.SITU, True): "8e0aaa57768e9c3e",
    (1000, 1032, 16, gemm_tc.Fusion(split=333), True): "14d444a1ebd30c35",
    (768, 7168, 64, gemm_tc.SITU, False): "1f701c1fa3f4461b",
}


@pytest.mark.parametrize("key", _first_of_each([(k,) for k in FUSED_GEMM_TC_CUBINS],
                                               lambda case: case[0][3].situ),
                         ids=lambda k: _tc_variant_id(k[3]) + f"-{k[0]}x{k[1]}-b{k[2]}-pdl{k[4]}")
def test_split_and_situ_gemm_tc_builds_are_unchanged(key, monkeypatch, tmp_path):
    """The split and SiTU builds are byte for byte the ones from before the norm variant (it
    compiles from a third entry, `GemmTC.normed`, with its own storage)."""
    if version("nvidia-cutlass-dsl") != "4.8.1" or _dsl_cuda_flavour() != "cu12":
        pytest.skip("digests recorded with nvidia-cutlass-dsl 4.8.1 and its CUDA 12 libraries")
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    n, k, b, fusion, pdl = key
    compiled = gemm_tc.build(n, k, bool(fusion.split), False, gemm_tc.config(n, k, b, fusion),
                             arch=ARCH, dump_dir=str(tmp_path), pdl=pdl, fusion=fusion)
    assert "kernel_norm" not in ptx_of(compiled)
    assert hashlib.sha256(cubin_of(compiled)).hexdigest()[:16] == FUSED_GEMM_TC_CUBINS[key]


# gemm_tc's norm variant (n, k, bucket, residual, config or None for `config()`): the latent
# up-projection at its tuned 8-row config (R = 64, S = 2, 8 stages) with the shared experts'
# residual; 2 rows (S = 4); a partial row tile and K slice; 32 tokens over R = 128, two CTAs
# (x̂ of 32 x 1792 resident: 112 KB); 64 tokens of a short K over R = 128, one CTA
GEMM_TC_NORMS = [(7168, 3584, 8, True, None), (7168, 3584, 2, False, None),
                 (1000, 1032, 2, True, None),
                 (7168, 3584, 32, False, gemm_tc.Config(128, 32, 2, 2)),
                 (1000, 1032, 64, False, gemm_tc.Config(128, 64, 2, 1))]


def _norm_id(v):
    return _tc_variant_id(v) if isinstance(v, gemm_tc.Config) else str(v)


def _norm_build(n, k, b, residual, cfg, tmp_path, pdl=False):
    cfg = cfg or gemm_tc.config(n, k, b, gemm_tc.NORM)
    assert gemm_tc.smem_bytes(cfg) + gemm_tc.norm_smem_bytes(cfg, k) <= gemm_tc.SMEM_BYTES
    compiled = gemm_tc.build(n, k, False, residual, cfg, arch=ARCH, dump_dir=str(tmp_path),
                             pdl=pdl, fusion=gemm_tc.NORM)
    _check_cubin(compiled)
    return cfg, ptx_of(compiled)


@pytest.mark.parametrize("n,k,b,residual,cfg", _first_of_each(
    GEMM_TC_NORMS, lambda c: c[2] == 8), ids=_norm_id)
def test_gemm_tc_norm_builds(n, k, b, residual, cfg, monkeypatch, tmp_path):
    """The norm variant builds from its own entry: one TMA per K slice (W alone: x̂ is
    resident), in the prologue and in the loop; rstd from 16-byte loads of x as the rms_norm
    kernel sums them (a butterfly per row and rms_norm warp, one per row over those warps'
    totals); then x̂ of the CTA's K slices written once (8 bf16 per item, x·rstd and ·g each
    rounded to bf16, one 16-byte shared store at the swizzled chunk), one async-proxy fence
    and a barrier before the main loop; the plain epilogue (with the residual: one more load
    per pass)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    cfg, ptx = _norm_build(n, k, b, residual, cfg, tmp_path)
    assert "griddepcontrol" not in ptx and "kernel_norm" in ptx
    assert ptx.count("cp.async.bulk.tensor") == 2  # W in the prologue and in the loop
    assert ptx.count("rsqrt.approx") == 1
    warps = gemm_tc.norm_rms_config(k, cfg.tile_tokens).threads // 32
    slots = -(-warps // 4)  # the rms_norm kernel's warps each of the 4 warps plays
    assert ptx.count("shfl.sync.bfly") == 5 * (slots * cfg.tile_tokens + 1)
    assert ptx.count("fence.proxy.async.shared::cta") == 1
    slices = gemm_tc.norm_weight_vectors(cfg, k) // 8  # the CTA's K slices, at most
    items = -(-slices * cfg.tile_tokens * 8 // gemm_tc.THREADS)  # 16-byte chunks a thread
    # one 16-byte store per item, and the norm weight's copy into shared memory
    assert ptx.count("st.shared.v4.b32") == items + 1 and "st.shared.b16" not in ptx
    # two roundings of each of an item's 8 values (pairs may round as one bf16x2 conversion)
    assert ptx.count("cvt.rn.bf16.f32") + 2 * ptx.count("cvt.rn.bf16x2.f32") >= 2 * 8 * items
    share = cfg.tile_rows // cfg.splits
    stores = -(-share * cfg.tile_tokens // gemm_tc.THREADS)
    assert ptx.count("st.global") == stores


@pytest.mark.parametrize("n,k,b,residual,cfg", _first_of_each(
    [c for c in GEMM_TC_NORMS if c[2] <= 8], lambda c: c[2] == 8), ids=_norm_id)
def test_gemm_tc_norm_builds_with_pdl(n, k, b, residual, cfg, monkeypatch, tmp_path):
    """The PDL rule: only W's TMAs before the wait; x (the rstd and x̂ loads), the norm
    weight, the residual and every store after it."""
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    _, ptx = _norm_build(n, k, b, residual, cfg, tmp_path, pdl=True)
    assert TRIGGER in ptx and WAIT in ptx
    before = ptx[:ptx.index(WAIT)]
    assert not [op for op in ("st.global", "red.global", "atom.global", "ld.global")
                if op in before]
    assert before.count("cp.async.bulk.tensor") == 1
