"""moe_experts by expert (K3_MOE_GROUPED: `fc1g`, `fc2g`, `fin` in kernels/moe_experts.py) against
the op's reference `moe_experts_ref` and torch models of the kernels' own index arithmetic.

On CPU (always run): the MMA fragment model (which lane holds which packed word, pair and k slot
of A; which staged z pair of B; the scale folded as bf16 2^(s - 1 - G_SHIFT), z staged times
2^G_SHIFT) equals the dequantised GEMM, and every A value is exactly the reference's bf16 weight;
the staging's swizzled chunks are a bijection the MMA reads back; the pair list (by expert, in
pair order) equals a python reference. With the DSL (`dsl`): the three stages build for sm_90a
without local memory.
On a GPU (`gpu`): one TP16 rank at 8/16/32/64 rows and between buckets with (a) uniform random
ids, (b) every token on one expert, (c) every pair on its own expert, (d) N below the bucket;
int32 ids; determinism; CUDA-graph replay. Tolerance: the bf16-GEMM rows of tests/conftest.py
(`TOL["bf16"]` elementwise, `bf16_rel_norm` against the model, `vs_reference_rel_norm` against
the reference): the tensor cores sum in another order than the reference's einsum."""

import pytest
import torch
from k3compile.kernels import moe_experts as kernel

from k3compile import settings
from k3compile.math import e2m1_table, mxfp4_dequant
from k3compile.ops.moe_experts import moe_experts_ref
from tests.fusions.test_moe_experts_kernel import (
    BETA,
    EXPERTS,
    INTER,
    LATENT,
    LINEAR_BETA,
    TOP_K,
    decode_model,
    make_experts,
    make_tokens,
)
from tests.kernel_checks import TOL, assert_written, poisoned, rel_err

gpu = pytest.mark.usefixtures("cuda_kernels")


# ---- CPU: the fragment model ------------------------------------------------------------------


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 -> its 16 bits as int64."""
    return x.contiguous().view(torch.int16).long() & 0xFFFF


def fragment_model(packed, scale, x):
    """packed [R, D/2] uint8, scale [R, D/32] uint8, x [T, D] bf16 -> fp64 [R, T]: the sums the
    MMAs of `GroupedMMA.mma_step` form, built slot by slot from the kernel's index arithmetic.
    Returns (sums, A values): A[r, d] is the bf16 value the fragment holds for input d, the
    weight times 2^-G_SHIFT (B is x times 2^G_SHIFT)."""
    rows, depth = packed.shape[0], 2 * packed.shape[1]
    decoded = decode_model(packed).view(rows, depth // 32, 32)  # e2m1 · 2^-126 in fp32
    factor = 2.0 ** (scale.double() - 1 - kernel.G_SHIFT)  # bf16 2^(s - 1 - G_SHIFT)
    a_val = (decoded.double() * factor.unsqueeze(-1)).view(rows, depth)
    assert torch.equal(a_val, a_val.bfloat16().double()), "A is not exact in bf16"
    b_val = (x.double() * 2.0 ** kernel.G_SHIFT)
    assert torch.equal(b_val, b_val.bfloat16().double()), "B is not exact in bf16"
    q_steps, _ = kernel.grouped_steps(depth)
    sums = torch.zeros(rows, x.shape[0], dtype=torch.float64)
    seen = torch.zeros(depth, dtype=torch.int64)
    for q in range(q_steps):
        for c in range(4):  # lane % 4: the kernel's weight and staged groups (`step_groups`)
            w_grp, x_grp = kernel.step_groups(q, c, depth // 32)
            for w in range(4):
                for h in range(2):
                    # k slots 2c, 2c+1 <- pair (w, 2h); 2c+8, 2c+9 <- pair (w, 2h+1); a pair
                    # (w, i) is inputs 8w + i (low half) and 8w + i + 4 (high half)
                    for i in (2 * h, 2 * h + 1):
                        for off in (8 * w + i, 8 * w + i + 4):
                            d = 32 * x_grp + off  # the staged input: zero past the depth
                            if d < depth:
                                seen[d] += 1
                                sums += a_val[:, 32 * w_grp + off].unsqueeze(1) * \
                                    b_val[:, d].unsqueeze(0)
    assert torch.equal(seen, torch.ones_like(seen)), "an input missed or taken twice"
    return sums, a_val


@pytest.mark.parametrize("rows,depth", [(16, 3584), (32, 192), (16, 96)], ids=str)
def test_fragment_model_is_the_gemm(rows, depth):
    gen = torch.Generator().manual_seed(rows * depth)
    from k3compile.models import mxfp4

    packed, scale = mxfp4.random_mxfp4((rows, depth), depth ** -0.5, gen)
    x = torch.randn(TILE := kernel.TILE_TOKENS, depth, generator=gen).bfloat16()
    sums, a_val = fragment_model(packed, scale, x)
    w_ref = mxfp4_dequant(packed, scale, e2m1_table(dtype=torch.bfloat16))  # the reference's W
    assert torch.equal(a_val * 2.0 ** kernel.G_SHIFT, w_ref.double()), \
        "A differs from the reference's bf16 weight"
    want = w_ref.double() @ x.double().T
    torch.testing.assert_close(sums, want, rtol=1e-12, atol=1e-12)
    assert sums.shape == (rows, TILE)


def test_scale_range_exact():
    """Scale bytes 50..176 give normal bf16 A values for every code (the documented range)."""
    for s in (50, 127, 176):
        packed = torch.arange(256, dtype=torch.uint8).view(16, 16)  # every byte
        scale = torch.full((16, 1), s, dtype=torch.uint8)
        a = decode_model(packed).double() * 2.0 ** (s - 1 - kernel.G_SHIFT)
        assert torch.equal(a, a.bfloat16().double())
        nonzero = a[a != 0].abs()
        assert nonzero.min() >= 2.0 ** -126 and nonzero.max() < 2.0 ** 128, s
        want = mxfp4_dequant(packed, scale, e2m1_table(dtype=torch.float32)).double()
        assert torch.equal(a * 2.0 ** kernel.G_SHIFT, want)


def staged_chunk(slot, grp, w, pitch):
    """`GroupedMMA.stage_tokens`'s chunk of (slot, group, word)."""
    return slot * pitch + 4 * grp + (w ^ (2 * ((grp // 2) % 2)))


@pytest.mark.parametrize("depth", [3584, 192, 96])
def test_staging_is_a_conflict_free_bijection(depth):
    q_steps, pitch = kernel.grouped_steps(depth)
    chunks = {staged_chunk(s, g, w, pitch) for s in range(kernel.TILE_TOKENS)
              for g in range(4 * q_steps) for w in range(4)}
    assert len(chunks) == kernel.TILE_TOKENS * 16 * q_steps
    assert max(chunks) < kernel.TILE_TOKENS * pitch
    for q in range(q_steps):  # an LDS.128 phase: lanes (g, c) of 8 consecutive lanes
        for w in range(4):
            for first in range(0, 32, 8):
                banks = [(staged_chunk(lane // 4, 4 * q + lane % 4, w, pitch) * 16 % 128) // 16
                         for lane in range(first, first + 8)]
                assert sorted(banks) == list(range(8)), banks


def pair_list_model(ids: torch.Tensor, e: int) -> list[int]:
    """`collect_pairs`: the pairs p = n·k + j with clamp(ids[n, j]) == e, in order of p."""
    flat = ids.reshape(-1).clamp(0, EXPERTS - 1).tolist()
    return [p for p, x in enumerate(flat) if x == e]


def ballot_pair_list(ids: torch.Tensor, e: int, threads=128) -> list[int]:
    """The ballot scheme of `collect_pairs`, step by step: per load v and warp a count, the
    offset of (v, warp) the sum of the counts before it, a lane's place its mask's lanes below."""
    flat = ids.reshape(-1).clamp(0, EXPERTS - 1).tolist()
    n_loads, warps = -(-len(flat) // threads), threads // 32
    counts = [[0] * warps for _ in range(n_loads)]
    masks = {}
    for v in range(n_loads):
        for warp in range(warps):
            hits = [v * threads + 32 * warp + lane < len(flat)
                    and flat[v * threads + 32 * warp + lane] == e for lane in range(32)]
            masks[v, warp] = hits
            counts[v][warp] = sum(hits)
    out = [None] * sum(map(sum, counts))
    total = 0
    for v in range(n_loads):
        for warp in range(warps):
            for lane in range(32):
                if masks[v, warp][lane]:
                    out[total + sum(masks[v, warp][:lane])] = v * threads + 32 * warp + lane
            total += counts[v][warp]
    return out


@pytest.mark.parametrize("n", [8, 33, 64])
def test_pair_list(n):
    gen = torch.Generator().manual_seed(n)
    ids = torch.rand(n, EXPERTS, generator=gen).argsort(-1)[:, :TOP_K]
    ids[: n // 2, 0] = 7  # one expert in half the rows
    for e in (7, int(ids[-1, 3]), 895):
        assert ballot_pair_list(ids, e) == pair_list_model(ids, e)


def test_grouped_selection(monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", False)
    assert not kernel.grouped(8)
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", True)
    assert [kernel.grouped(n) for n in (1, 4, 7, 8, 33, 64, 65)] == \
        [False, False, False, True, True, True, False]
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", 33)  # K3_MOE_GROUPED=33: from 33 rows
    assert [kernel.grouped(n) for n in (8, 32, 33, 64, 65)] == [False, False, True, True, False]


@pytest.mark.parametrize("value,rows", [("0", 0), ("1", 1), ("", 0), ("64", 64), ("on", 1)])
def test_grouped_switch(monkeypatch, value, rows):
    """K3_MOE_GROUPED: a boolean (8-64 rows) or the first row count (a number)."""
    monkeypatch.setenv("K3_MOE_GROUPED", value)
    assert settings.KernelSettings.from_env().moe_grouped == rows


# ---- sm_90a builds ----------------------------------------------------------------------------


@pytest.mark.dsl
@pytest.mark.parametrize("stage,shape", [
    *(pytest.param(stage, (3584, 192, 16, 64), marks=pytest.mark.slow)  # the TP16 shapes: slow
      for stage in ("fc1g", "fc2g", "fin")),
    ("fc1g", (96, 64, 3, 8)), ("fc2g", (96, 64, 3, 8))], ids=str)
def test_builds_for_sm90a(monkeypatch, tmp_path, stage, shape):
    pytest.importorskip("cutlass")
    from k3compile.kernels.common.dsl import cubin_of, cubin_resources, ptx_of

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    latent, inter, top_k, b = shape
    cfg = None if stage == "fin" else kernel.config(stage, latent, inter, top_k, b)
    compiled = kernel.build(stage, latent, inter, top_k, True, cfg, arch="sm_90a",
                            dump_dir=str(tmp_path), pdl=stage == "fc1g")
    res = cubin_resources(cubin_of(compiled))
    assert res["frame"] == 0, res
    ptx = ptx_of(compiled)
    assert "ld.local" not in ptx and "st.local" not in ptx
    if stage != "fin":
        depth = latent if stage == "fc1g" else inter
        mats = 2 if stage == "fc1g" else 1
        blocks = cfg.row_blocks
        # above ROLL_STEPS steps a row, a rolled loop of D = min(prefetch, Q) steps, then the
        # Q % D last; else every step unrolled
        from k3compile.kernels.device.moe_experts_grouped import ROLL_STEPS

        q_steps = kernel.grouped_steps(depth)[0]
        d = min(cfg.prefetch, q_steps)
        steps = d + q_steps % d if q_steps > ROLL_STEPS else q_steps
        assert ptx.count("mma.sync.aligned.m16n8k16") == 8 * steps * mats * blocks


@pytest.mark.dsl
@pytest.mark.parametrize("stage,shape", [
    *(pytest.param(stage, (3584, 192, 16, 64), marks=pytest.mark.slow)  # the TP16 shapes: slow
      for stage in ("fc1g", "fc2g")),
    ("fc1g", (96, 64, 3, 8)), ("fc2g", (96, 64, 3, 8))], ids=str)
def test_carry_builds(monkeypatch, tmp_path, stage, shape):
    """`GroupedConfig.carry` applies at these shapes, builds without a stack frame and runs the
    default build's MMAs (the ring moves loads, not steps)."""
    pytest.importorskip("cutlass")
    import dataclasses

    from k3compile.kernels.common.dsl import cubin_of, cubin_resources, ptx_of
    from k3compile.kernels.device.moe_experts_grouped import GroupedMMA

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    latent, inter, top_k, b = shape
    plain = kernel.config(stage, latent, inter, top_k, b)
    cfg = dataclasses.replace(plain, carry=True)
    assert GroupedMMA(stage == "fc1g", latent, inter, top_k, b, cfg).carries()
    mmas = []
    for i, c in enumerate((plain, cfg)):
        (dump := tmp_path / str(i)).mkdir()
        compiled = kernel.build(stage, latent, inter, top_k, True, c, arch="sm_90a",
                                dump_dir=str(dump), pdl=stage == "fc1g")
        assert cubin_resources(cubin_of(compiled))["frame"] == 0
        mmas.append(ptx_of(compiled).count("mma.sync.aligned.m16n8k16"))
    assert mmas[0] == mmas[1] > 0


# ---- GPU --------------------------------------------------------------------------------------


@pytest.fixture
def grouped_on(monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", True)


@pytest.fixture(scope="module")
def tp16():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seed = int(torch.randint(1 << 30, ()).item())
    print(f"experts seed {seed}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return make_experts(gen, EXPERTS, LATENT, INTER, "cuda")


def check(z, ids, w, experts):
    out = poisoned(*z.shape)
    got = kernel.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA, out=out)
    assert got is out, "the kernels did not run (fallback)"
    assert_written(out)
    ref = torch.cat([moe_experts_ref(z[i:i + 16], ids[i:i + 16], w[i:i + 16], *experts, BETA,
                                     LINEAR_BETA) for i in range(0, len(z), 16)])
    torch.testing.assert_close(out.float(), ref.float(), **TOL["bf16"])
    assert rel_err(out, ref) < TOL["vs_reference_rel_norm"]
    return out


def routing(gen, n, case):
    z, ids, w = make_tokens(gen, n, LATENT, EXPERTS, TOP_K, "cuda")
    if case == "one_expert":  # every token has expert 5 (in its last slot)
        ids = torch.stack([torch.cat([r[r != 5][:TOP_K - 1], r.new_tensor([5])]) for r in ids])
    elif case == "distinct":  # every pair on its own expert (n·k <= 896 only)
        ids = torch.randperm(EXPERTS, generator=gen, device="cuda")[:n * TOP_K].view(n, TOP_K)
    return z, ids.contiguous(), w


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["uniform", "one_expert", "distinct"])
@pytest.mark.parametrize("n", [8, 16, 32, 64, 12, 40])
def test_tp16(gen, tp16, grouped_on, case, n):
    if case == "distinct" and n * TOP_K > EXPERTS:
        n = EXPERTS // TOP_K  # 56 rows: 896 pairs on 896 experts
    check(*routing(gen, n, case), tp16)


@pytest.mark.gpu
@gpu
def test_tp16_int32_ids_and_determinism(gen, tp16, grouped_on):
    z, ids, w = make_tokens(gen, 32, LATENT, EXPERTS, TOP_K, "cuda", pool=24)
    first = check(z, ids.int(), w, tp16)
    assert torch.equal(first, check(z, ids, w, tp16)), "int32 and int64 ids differ"
    assert torch.equal(first, check(z, ids, w, tp16)), "not deterministic"


def with_fields(monkeypatch, **fields):
    """kernel.config's fc1g / fc2g configs with `fields` replaced (fc2g's prefetch via
    `fc2_prefetch`)."""
    import dataclasses

    default = kernel.config
    fc2_prefetch = fields.pop("fc2_prefetch", None)

    def config(stage, *a):
        cfg = default(stage, *a)
        if stage not in ("fc1g", "fc2g"):
            return cfg
        cfg = dataclasses.replace(cfg, **fields)
        return dataclasses.replace(cfg, prefetch=fc2_prefetch) \
            if stage == "fc2g" and fc2_prefetch else cfg

    monkeypatch.setattr(kernel, "config", config)


VARIANT_FIELDS = {"carry": {"carry": True}, "carry_fc2p4": {"carry": True, "fc2_prefetch": 4}}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", list(VARIANT_FIELDS))
@pytest.mark.parametrize("n,case", [(8, "uniform"), (64, "uniform"), (64, "one_expert")])
def test_variant_is_bitwise_the_default(gen, tp16, grouped_on, monkeypatch, variant, n, case):
    """The carried ring only loads the same weights earlier: the same output bit for bit (one_expert: 8 token tiles of expert 5,
    the ring wrapping from tile to tile)."""
    z, ids, w = routing(gen, n, case)
    plain = check(z, ids, w, tp16)
    with_fields(monkeypatch, **VARIANT_FIELDS[variant])
    assert torch.equal(check(z, ids, w, tp16), plain)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(5, 96, 64, 3), (7, 1056, 32, 1), (9, 512, 1152, 4)],
                         ids=str)
def test_other_shapes_carry(gen, grouped_on, monkeypatch, shape):
    """The carried ring at the odd shapes (steps 1-9 a row, rings that do not divide them
    fall back to the plain loads): against the reference."""
    with_fields(monkeypatch, carry=True)
    n_exp, latent, inter, top_k = shape
    experts = make_experts(gen, n_exp, latent, inter, "cuda")
    for n in (8, 13, 64):
        check(*make_tokens(gen, n, latent, n_exp, top_k, "cuda"), experts)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(5, 96, 64, 3), (7, 1056, 32, 1), (9, 512, 1152, 4)],
                         ids=str)
def test_other_shapes(gen, grouped_on, shape):
    """A partial step (L/32 = 3 and 33 groups), k = 1 and 3, I = 1152 (FC2's 36 groups)."""
    n_exp, latent, inter, top_k = shape
    experts = make_experts(gen, n_exp, latent, inter, "cuda")
    for n in (8, 13, 64):
        check(*make_tokens(gen, n, latent, n_exp, top_k, "cuda"), experts)


@pytest.mark.gpu
@gpu
def test_cuda_graph_replay(gen, tp16, grouped_on):
    z, ids, w = make_tokens(gen, 16, LATENT, EXPERTS, TOP_K, "cuda")
    out = poisoned(*z.shape)
    kernel.moe_experts_cuda(z, ids, w, *tp16, BETA, LINEAR_BETA, out=out)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.moe_experts_cuda(z, ids, w, *tp16, BETA, LINEAR_BETA, out=out)
    for _ in range(3):
        for static, fresh in zip((z, ids, w), make_tokens(gen, 16, LATENT, EXPERTS, TOP_K,
                                                          "cuda")):
            static.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_experts_ref(z, ids, w, *tp16, BETA, LINEAR_BETA)
        assert rel_err(out, ref) < TOL["vs_reference_rel_norm"]


def test_benchmark_grouped_modifiers(monkeypatch):
    """benchmarks/moe_experts.py's `+g1p3+g1c1+g2e2+g2c1` set those GroupedConfig fields of fc1g /
    fc2g while the variant is open (and K3_MOE_GROUPED on), and restore both after it. The
    values are none of the defaults', so each assertion fails if its modifier is ignored."""
    import sys

    from tests.conftest import ROOT, load_benchmark

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = load_benchmark("moe_experts")
    before = (kernel.config("fc1g", LATENT, INTER, TOP_K, 64),
              kernel.config("fc2g", LATENT, INTER, TOP_K, 64), settings.KERNELS.moe_grouped)
    with bench.kernel_variant("grouped+g1p3+g1c1+g2e2+g2c1"):
        fc1 = kernel.config("fc1g", LATENT, INTER, TOP_K, 64)
        fc2 = kernel.config("fc2g", LATENT, INTER, TOP_K, 64)
        assert settings.KERNELS.moe_grouped
        assert (fc1.prefetch, fc1.experts_per_cta, fc1.carry) == \
            (3, before[0].experts_per_cta, True)
        assert (fc2.prefetch, fc2.experts_per_cta, fc2.carry) == (before[1].prefetch, 2, True)
    assert (before[0].prefetch, before[0].carry, before[1].experts_per_cta, before[1].carry) \
        == (4, False, 1, False)  # the defaults differ from the modifiers' values
    after = (kernel.config("fc1g", LATENT, INTER, TOP_K, 64),
             kernel.config("fc2g", LATENT, INTER, TOP_K, 64), settings.KERNELS.moe_grouped)
    assert after == before
    sys.modules.pop("moe_experts_bench", None)
