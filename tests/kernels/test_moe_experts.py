"""moe_experts kernels (FC1 + SiTU, FC2 + finalize over packed MXFP4) against the op's reference
`moe_experts_ref` and a torch model of the kernels' own arithmetic.

On CPU (always run): the model's decode (the kernels' integer ops on packed words, the 2^Z_SHIFT
staging, the scale-byte factor) is exactly MXFP4 dequantisation; the model's blocking and
roundings (bf16 hg/hu, act, y; fp32 finalize in order j) agree with the reference at the TP16
shapes, a small odd one and the intermediate sizes of TP4, TP2, TP1 ranks (I 768, 1536, 3072, on
few experts and a small L); FC2's chunks of W2 above I = 512; the refusal reasons; the logged
fallback; the grouped FC1's plan (`expert_runs`) against a plain reference and under fake
tensors (no data-dependent op: capturable), and a model of its tile layout's slots and banks.
On a GPU: one TP16 rank (896 experts, top-16, L 3584, I 192) at every batch bucket and rows
between them, an 8-row verify step whose rows share experts, repeated experts, int32 ids, small
odd shapes (partial lane steps, odd k, an odd number of FC2 chunks, the largest L and I),
determinism, CUDA-graph replay (FC2 launches with PDL); a TP2 rank (I 1536) and a TP4 rank
(I 768) at a few buckets (FC2 in chunks, its act staging above 48 KB of shared memory); FC1
with cp.async (`FC1Config.cp_async`) and grouped by expert (`FC1Config.run`: uniform and skewed
routing, runs longer than the cap, CUDA-graph replay) bit for bit the default FC1 at TP16 and
small shapes."""

from k3compile import settings
import dataclasses
import logging
import re

import pytest
import torch
from k3compile.kernels import moe_experts as kernel
from kernel_checks import BUCKETS, TOL, assert_written, poisoned, rel_err

from k3compile.models import mxfp4
from k3compile.ops.gemm import situ_ref
from k3compile.ops.moe import moe_experts_ref, moe_experts_refusal

gpu = pytest.mark.usefixtures("cuda_kernels")

EXPERTS, TOP_K, LATENT, INTER = 896, 16, 3584, 192  # one TP16 rank
BETA, LINEAR_BETA = 4.0, 25.0

# ---- a torch model of the kernels' arithmetic ---------------------------------------------------


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 bit patterns -> float32 with those bits."""
    return ((x ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)


def decode_model(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., W] -> fp32 [..., 2W] = e2m1 · 2^-126, by the kernels' ops on each 32-bit word:
    the pair (i, i + 4) from t = word << PAIR_SHIFT[i], widened from bf16 by shift and mask."""
    words = packed.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [..., W/4]
    vals = torch.empty(*words.shape, 8, dtype=torch.float32, device=packed.device)
    for i, shift in enumerate(kernel.PAIR_SHIFT):
        t = (words << shift) & 0xFFFFFFFF
        bits = (t & kernel.SIGN_MASK) | ((t >> 6) & kernel.MAG_MASK)
        vals[..., i] = f32_bits((bits << 16) & 0xFFFFFFFF)
        vals[..., i + 4] = f32_bits(bits & 0xFFFF0000)
    return vals.flatten(-2)


def factor_model(scale: torch.Tensor) -> torch.Tensor:
    """A 32-input group's factor from its E8M0 byte, built from bits as the kernels do."""
    return f32_bits((scale.long() + kernel.SCALE_BIAS) << 23)


def dot_model(x, packed, scale, chunk=128):
    """x [P, K] · rows of the packed [P, O, K/2] matrices -> fp32 [P, O]: x staged times
    2^Z_SHIFT, fp32 partial sums of 32 products, each times its group factor, summed."""
    out = []
    for p0 in range(0, x.shape[0], chunk):
        xs = x[p0:p0 + chunk].float() * 2.0 ** kernel.Z_SHIFT
        w = decode_model(packed[p0:p0 + chunk])
        p, o, k = w.shape
        partial = (w.view(p, o, k // 32, 32) * xs.view(p, 1, k // 32, 32)).sum(-1)
        out.append((partial * factor_model(scale[p0:p0 + chunk])).sum(-1))
    return torch.cat(out)


def kernels_model(z, ids, weights, w1p, w1s, w3p, w3s, w2p, w2s, beta, linear_beta):
    """The two kernels' math in torch: FC1 sums rounded to bf16 (as the reference's einsums),
    SiTU to bf16, FC2 sums rounded to bf16, weighted fp32 sum in order j, one rounding."""
    n, k = ids.shape
    e = ids.reshape(-1).long()
    zz = z.unsqueeze(1).expand(n, k, z.shape[-1]).reshape(n * k, -1)
    hg = dot_model(zz, w1p[e], w1s[e]).bfloat16()
    hu = dot_model(zz, w3p[e], w3s[e]).bfloat16()
    act = situ_ref(hg, hu, beta, linear_beta)
    y = dot_model(act, w2p[e], w2s[e]).bfloat16().float().view(n, k, -1)
    total = weights[:, 0:1] * y[:, 0]
    for j in range(1, k):
        total = total + weights[:, j:j + 1] * y[:, j]
    return total.bfloat16()


def make_experts(gen, n_exp, latent, inter, device):
    """Random MXFP4 experts with unit-scale sums: hg, hu ~ N(0, |z|), y ~ N(0, |act|)."""
    w1 = mxfp4.random_mxfp4((n_exp, inter, latent), latent ** -0.5, gen, device)
    w3 = mxfp4.random_mxfp4((n_exp, inter, latent), latent ** -0.5, gen, device)
    w2 = mxfp4.random_mxfp4((n_exp, latent, inter), inter ** -0.5, gen, device)
    return (*w1, *w3, *w2)


def make_tokens(gen, n, latent, n_exp, top_k, device, pool=None):
    """z [n, L] bf16, distinct ids per row (from `pool` experts when given), weights summing
    to 1."""
    z = torch.randn(n, latent, generator=gen, device=device).bfloat16()
    choices = pool if pool is not None else n_exp
    order = torch.rand(n, choices, generator=gen, device=device).argsort(-1)[:, :top_k]
    ids = order if pool is None else torch.randperm(n_exp, generator=gen, device=device)[order]
    w = torch.rand(n, top_k, generator=gen, device=device) + 0.1
    return z, ids, w / w.sum(-1, keepdim=True)


# ---- CPU: the model, refusals, the fallback -----------------------------------------------------


@pytest.fixture
def cpu_gen():
    seed = int(torch.randint(1 << 30, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def test_decode_model_is_dequantisation():
    """Every byte value under every scale byte the kernels take: exact."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(64).view(128, 128)  # [out, in/2]
    scale = (torch.arange(128 * 8) % 225).to(torch.uint8).view(128, 8)  # 0 .. 224
    got = decode_model(packed).view(128, 8, 32) * 2.0 ** kernel.Z_SHIFT \
        * factor_model(scale).unsqueeze(-1)
    want = mxfp4.dequantize(packed, scale, mxfp4.e2m1_table(dtype=torch.float32))
    assert torch.equal(got.view(128, 256), want)


@pytest.mark.parametrize("shape", [(20, LATENT, INTER, TOP_K, 3), (7, 96, 64, 3, 5),
                                   (6, 256, 768, 4, 3), (5, 128, 1536, 3, 2),
                                   (4, 96, 3072, 2, 3)],
                         ids=["tp16", "odd", "i768", "i1536", "i3072"])
def test_kernels_model_matches_reference(cpu_gen, shape):
    n_exp, latent, inter, top_k, n = shape
    experts = make_experts(cpu_gen, n_exp, latent, inter, "cpu")
    z, ids, w = make_tokens(cpu_gen, n, latent, n_exp, top_k, "cpu")
    got = kernels_model(z, ids, w, *experts, BETA, LINEAR_BETA)
    ref = moe_experts_ref(z, ids, w, *experts, BETA, LINEAR_BETA)
    torch.testing.assert_close(got.float(), ref.float(), **TOL["bf16"])
    assert rel_err(got, ref) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("inter", [32, 192, 512, 768, 1152, 1536, 2304, 3072])
def test_fc2_chunks_cover_the_row_in_order(inter):
    """FC2's W2 row: whole up to I = 512, else two buffers of CHUNK_VECTORS taking turns; the
    chunks tile the row's I/32 vectors in order (the fp32 sum runs c = 0 .. I/32 - 1)."""
    n_vec = inter // 32
    chunk = kernel._chunk_vectors(n_vec)
    assert chunk == (n_vec if inter <= 512 else kernel.CHUNK_VECTORS)
    assert n_vec % chunk == 0
    order = [c for first in range(0, n_vec, chunk) for c in range(first, first + chunk)]
    assert order == list(range(n_vec))


def _meta(n=4, n_exp=EXPERTS, latent=LATENT, inter=INTER, top_k=TOP_K, **over):
    def t(*shape, dtype=torch.uint8):
        return torch.empty(shape, dtype=dtype, device="meta")

    args = {"z": t(n, latent, dtype=torch.bfloat16), "ids": t(n, top_k, dtype=torch.int64),
            "weights": t(n, top_k, dtype=torch.float32),
            "w1_packed": t(n_exp, inter, latent // 2), "w1_scale": t(n_exp, inter, latent // 32),
            "w3_packed": t(n_exp, inter, latent // 2), "w3_scale": t(n_exp, inter, latent // 32),
            "w2_packed": t(n_exp, latent, inter // 2), "w2_scale": t(n_exp, latent, inter // 32)}
    args.update(over)
    return args


REFUSALS = {
    "z_fp32": (_meta(z=torch.empty(4, LATENT, device="meta")), "z: dtype"),
    "z_row_stride": (_meta(z=torch.empty(4, LATENT + 4, dtype=torch.bfloat16,
                                         device="meta")[:, :LATENT]), "z: strides"),
    "top_k_17": (_meta(top_k=17), "top_k 17"),
    "ids_int16": (_meta(ids=torch.empty(4, TOP_K, dtype=torch.int16, device="meta")), "ids:"),
    "ids_strided": (_meta(ids=torch.empty(TOP_K, 4, dtype=torch.int64, device="meta").t()),
                    "ids:"),
    "weights_bf16": (_meta(weights=torch.empty(4, TOP_K, dtype=torch.bfloat16, device="meta")),
                     "weights:"),
    "latent_not_32": (_meta(latent=3600), "not multiples of 32"),
    "intermediate_3104": (_meta(inter=3104), "intermediate 3104"),
    "intermediate_4096": (_meta(inter=4096), "intermediate 4096"),
    "intermediate_1024": (_meta(inter=1024), "multiple of 384"),  # FC2's chunks of 12 vectors
    "latent_16384": (_meta(latent=16384), "latent 16384"),
    "packed_strided": (_meta(w2_packed=torch.empty(EXPERTS, INTER // 2, LATENT, dtype=torch.uint8,
                                                   device="meta").transpose(1, 2)),
                       "w2_packed:"),
    "scale_int8": (_meta(w1_scale=torch.empty(EXPERTS, INTER, LATENT // 32, dtype=torch.int8,
                                              device="meta")), "w1_scale:"),
    "fc2_shape": (_meta(w2_packed=torch.empty(EXPERTS, LATENT, INTER, dtype=torch.uint8,
                                              device="meta")), "FC2 packed"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusal_reasons(case):
    args, reason = REFUSALS[case]
    why = moe_experts_refusal(**args) or kernel.refusal(**args)  # the op's, then the kernel's
    assert why is not None and reason in why, why
    assert not kernel.can_implement(*args.values())


@pytest.mark.parametrize("shape", [{}, {"n": 64, "top_k": 1}, {"latent": 8192, "inter": 512},
                                   {"latent": 96, "inter": 64, "n_exp": 5, "top_k": 2},
                                   {"inter": 768}, {"inter": 1536}, {"inter": 1152, "top_k": 3},
                                   {"latent": 8192, "inter": 3072}])
def test_accepted_shapes(shape):
    assert kernel.refusal(**_meta(**shape)) is None
    n, top_k = shape.get("n", 4), shape.get("top_k", TOP_K)
    args = _meta(**shape, ids=torch.empty(n, top_k, dtype=torch.int32, device="meta"))
    assert kernel.refusal(**args) is None
    sliced = torch.empty(n, 2 * top_k, dtype=torch.int64, device="meta")[:, :top_k]
    assert kernel.refusal(**_meta(**shape, ids=sliced)) is None  # rows of a top-k buffer


def test_cpu_tensors_fall_back_to_reference(cpu_gen, caplog):
    experts = make_experts(cpu_gen, 6, 64, 32, "cpu")
    z, ids, w = make_tokens(cpu_gen, 3, 64, 6, 2, "cpu")
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = kernel.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA)
    assert "moe_experts" in caplog.text
    assert torch.equal(got, moe_experts_ref(z, ids, w, *experts, BETA, LINEAR_BETA))


# ---- GPU ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp16_experts():
    """One TP16 rank's 896 experts (~1 GB of packed weights), made once per module."""
    return rank_experts_of(INTER)


def rank_experts_of(inter: int):
    """A rank's 896 experts of intermediate size `inter` on the GPU, from a printed seed (module
    fixtures set up before the function-scoped GPU check, so they skip here themselves)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seed = int(torch.randint(1 << 30, ()).item())
    print(f"experts seed {seed}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return make_experts(gen, EXPERTS, LATENT, inter, "cuda")


def check(z, ids, w, experts, out=None):
    out = poisoned(*z.shape) if out is None else out
    got = kernel.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA, out=out)
    assert got is out, "the kernels did not run (fallback)"
    assert_written(out)
    model = _by_rows(kernels_model, z, ids, w, experts)
    torch.testing.assert_close(out.float(), model.float(), **TOL["bf16"])
    assert rel_err(out, model) < TOL["bf16_rel_norm"]
    ref = _by_rows(moe_experts_ref, z, ids, w, experts)
    assert rel_err(out, ref) < TOL["vs_reference_rel_norm"]
    return out


def _by_rows(fn, z, ids, w, experts, rows=16):
    """fn over row chunks (rows are independent tokens): the torch models dequantise every
    selected expert, ~10 GB per matrix for 64 rows of a TP2 rank (I 1536)."""
    return torch.cat([fn(z[i:i + rows], ids[i:i + rows], w[i:i + rows], *experts, BETA,
                         LINEAR_BETA) for i in range(0, len(z), rows)])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [*BUCKETS, 3, 5, 12, 40])
def test_tp16_rows(gen, tp16_experts, n):
    check(*make_tokens(gen, n, LATENT, EXPERTS, TOP_K, "cuda"), tp16_experts)


@pytest.mark.gpu
@gpu
def test_tp16_verify_step_shares_experts(gen, tp16_experts):
    """8 rows (anchor + 7 drafts) routed within 24 experts: most experts serve several rows."""
    check(*make_tokens(gen, 8, LATENT, EXPERTS, TOP_K, "cuda", pool=24), tp16_experts)


@pytest.mark.gpu
@gpu
def test_tp16_repeated_experts(gen, tp16_experts):
    z, ids, w = make_tokens(gen, 6, LATENT, EXPERTS, TOP_K, "cuda")
    ids[:] = ids[0]  # every row the same experts
    ids[1] = ids[1, 0]  # one row k times one expert
    check(z, ids, w, tp16_experts)


@pytest.mark.gpu
@gpu
def test_tp16_int32_ids_and_determinism(gen, tp16_experts):
    z, ids, w = make_tokens(gen, 8, LATENT, EXPERTS, TOP_K, "cuda")
    first = check(z, ids.int(), w, tp16_experts)
    assert torch.equal(first, check(z, ids, w, tp16_experts)), "int32 and int64 ids differ"
    assert torch.equal(first, check(z, ids, w, tp16_experts)), "not deterministic"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(5, 96, 64, 2), (7, 512, 96, 3), (9, 1056, 32, 1),
                                   (6, 1536, 64, 4), (20, 8192, 512, 16), (7, 512, 1152, 3),
                                   (5, 96, 768, 1), (10, 2048, 3072, 8)], ids=str)
def test_other_shapes(gen, shape):
    """Partial lane steps (L/32 = 3, 33 vectors), the W1/W3-split step alone (16) and after a
    full one (48), odd k, k = 1, the largest L and I = 512 (the whole W2 row in registers); above
    it FC2's chunks: an odd count (I 1152: 3) with odd k, two with k = 1, the largest I (8)."""
    n_exp, latent, inter, top_k = shape
    experts = make_experts(gen, n_exp, latent, inter, "cuda")
    for n in (1, 7, 33):  # 33: the 64-row bucket
        check(*make_tokens(gen, n, latent, n_exp, top_k, "cuda"), experts)


@pytest.fixture(scope="module", params=[(2, 1536), (4, 768)], ids=["tp2", "tp4"])
def rank_experts(request):
    """A TP2 or TP4 rank's 896 experts (I = 3072 / W; ~7.4 GB of packed weights at TP2)."""
    return rank_experts_of(request.param[1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 2, 8, 64, 5])
def test_tp_rank_rows(gen, rank_experts, n):
    """TP2 (I 1536: FC2 in 4 chunks, 99 KB of staged act) and TP4 (I 768: 2 chunks, 49 KB)."""
    check(*make_tokens(gen, n, LATENT, EXPERTS, TOP_K, "cuda"), rank_experts)


@pytest.mark.gpu
@gpu
def test_tp_rank_verify_step_and_determinism(gen, rank_experts):
    z, ids, w = make_tokens(gen, 8, LATENT, EXPERTS, TOP_K, "cuda", pool=24)
    first = check(z, ids.int(), w, rank_experts)
    assert torch.equal(first, check(z, ids, w, rank_experts)), "int32 and int64 ids differ"


def replay_and_check(graph, out, z, ids, w, experts):
    """Replay into a poisoned `out` and check it against the model of the kernels."""
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_written(out)
    assert rel_err(out, kernels_model(z, ids, w, *experts, BETA, LINEAR_BETA)) < \
        TOL["bf16_rel_norm"]


@pytest.mark.gpu
@gpu
def test_cuda_graph_replay(gen, tp16_experts):
    z, ids, w = make_tokens(gen, 8, LATENT, EXPERTS, TOP_K, "cuda")
    out = poisoned(*z.shape)
    kernel.moe_experts_cuda(z, ids, w, *tp16_experts, BETA, LINEAR_BETA, out=out)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.moe_experts_cuda(z, ids, w, *tp16_experts, BETA, LINEAR_BETA, out=out)
    for _ in range(3):
        for static, fresh in zip((z, ids, w), make_tokens(gen, 8, LATENT, EXPERTS, TOP_K, "cuda")):
            static.copy_(fresh)
        replay_and_check(graph, out, z, ids, w, tp16_experts)


@pytest.mark.gpu
@gpu
def test_after_the_route_kernel_with_pdl(gen, tp16_experts, monkeypatch):
    """moe_route -> FC1 -> FC2 captured in a CUDA graph with PDL (`common.settings.KERNELS.pdl`): FC1 starts
    while the route kernel ends and must wait for its ids; outputs equal the PDL-off graph's."""
    from k3compile.kernels import moe_route

    logits = torch.randn(8, EXPERTS, generator=gen, device="cuda")
    bias = 0.1 * torch.randn(EXPERTS, generator=gen, device="cuda")
    z = torch.randn(8, LATENT, generator=gen, device="cuda").bfloat16()

    def step(out):
        ids, w = moe_route.moe_route_cuda(logits, bias, TOP_K, 2.5)
        return ids, w, kernel.moe_experts_cuda(z, ids, w, *tp16_experts, BETA, LINEAR_BETA,
                                               out=out)

    outs = {}
    for flag in (True, False):
        monkeypatch.setattr(settings.KERNELS, "pdl", flag)
        monkeypatch.setattr(settings.KERNELS, "pdl_max_rows", 64)  # PDL at every bucket
        out = poisoned(*z.shape)
        step(out)  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ids, w, _ = step(out)
        got = []
        for i in range(3):
            logits.copy_(torch.randn(8, EXPERTS, generator=torch.Generator("cuda").manual_seed(i),
                                     device="cuda"))
            replay_and_check(graph, out, z, ids, w, tp16_experts)
            got.append(out.clone())
        outs[flag] = got
    for on, off in zip(outs[True], outs[False]):
        assert torch.equal(on, off), "PDL changed the results"


@pytest.mark.dsl
def test_fc1_builds_with_pdl(monkeypatch, tmp_path):
    """With PDL FC1 waits before anything else (its ids are the previous kernel's output) and is
    launched as a dependent; FC2 keeps its own PDL edge either way."""
    from k3compile.kernels.common.dsl import ptx_of

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    scalars = ("fc1", LATENT, INTER, TOP_K, True, kernel.config("fc1", LATENT, INTER, TOP_K, 1))
    on, off = tmp_path / "on", tmp_path / "off"
    on.mkdir(), off.mkdir()
    ptx = ptx_of(kernel.build(*scalars, arch="sm_90a", dump_dir=str(on), pdl=True))
    wait = ptx.index("griddepcontrol.wait;")
    assert "ld.global" not in ptx[:wait], "a load before the wait"
    plain = ptx_of(kernel.build(*scalars, arch="sm_90a", dump_dir=str(off)))
    assert "griddepcontrol.wait;" not in plain


# FC1 with cp.async (FC1Config.cp_async): the same math in the same order as the plain FC1
PLAIN_FC1 = kernel.FC1Config(4, 2)
FC1_CP_ASYNC = [kernel.FC1Config(4, 2, True), kernel.FC1Config(4, 1, True),
                kernel.FC1Config(2, 2, True), kernel.FC1Config(8, 1, True)]


def _cfg_id(cfg):
    return f"w{cfg.warps}r{cfg.rows_per_warp}"


@pytest.fixture
def force_fc1(monkeypatch):
    """force_fc1(cfg): FC1 runs with cfg at every bucket (as the benchmark's sweep does)."""
    default = kernel.config

    def force(cfg):
        monkeypatch.setattr(kernel, "config",
                            lambda stage, *a: cfg if stage == "fc1" else default(stage, *a))
    return force


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", FC1_CP_ASYNC, ids=_cfg_id)
@pytest.mark.parametrize("n", [1, 8, 3])
def test_tp16_fc1_cp_async(gen, tp16_experts, force_fc1, cfg, n):
    """Against the model and the reference, and bit for bit the default FC1's output."""
    z, ids, w = make_tokens(gen, n, LATENT, EXPERTS, TOP_K, "cuda")
    force_fc1(PLAIN_FC1)
    plain = check(z, ids, w, tp16_experts)
    force_fc1(cfg)
    assert torch.equal(check(z, ids, w, tp16_experts), plain), "cp.async FC1 differs"


@pytest.mark.gpu
@gpu
def test_tp16_fc1_cp_async_verify_step(gen, tp16_experts, force_fc1):
    """8 rows within 24 experts (pairs share expert rows), int32 ids."""
    z, ids, w = make_tokens(gen, 8, LATENT, EXPERTS, TOP_K, "cuda", pool=24)
    force_fc1(PLAIN_FC1)
    plain = check(z, ids, w, tp16_experts)
    force_fc1(FC1_CP_ASYNC[0])
    assert torch.equal(check(z, ids.int(), w, tp16_experts), plain)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(5, 96, 64, 2), (7, 512, 96, 3), (9, 1056, 32, 1),
                                   (6, 1536, 64, 4), (20, 8192, 512, 16)], ids=str)
def test_other_shapes_fc1_cp_async(gen, force_fc1, shape):
    """cp.async FC1 (the default warps and rows) at a partial lane step (L/32 = 3, 33), the split
    step alone (16) and after a full one (48), the largest L; equal to the default FC1."""
    n_exp, latent, inter, top_k = shape
    experts = make_experts(gen, n_exp, latent, inter, "cuda")
    cfg = dataclasses.replace(kernel.config("fc1", latent, inter, top_k, 8), cp_async=True)
    tokens = [make_tokens(gen, n, latent, n_exp, top_k, "cuda") for n in (1, 7)]
    force_fc1(dataclasses.replace(cfg, cp_async=False))
    plain = [check(*t, experts) for t in tokens]
    force_fc1(cfg)
    for t, want in zip(tokens, plain):
        assert torch.equal(check(*t, experts), want)


@pytest.mark.dsl
@pytest.mark.parametrize("shape", [(3584, 192, 2), (1056, 32, 2), (512, 96, 2)], ids=str)
def test_fc1_cp_async_groups(monkeypatch, tmp_path, shape):
    """One cp.async group per lane step, waited for in order (S - 1 .. 0 still pending); z and
    the scale bytes (ld.global) issued before the first copy; with PDL nothing before the wait."""
    from k3compile.kernels.common.dsl import ptx_of

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    latent, inter, rows = shape
    ptx = ptx_of(kernel.build("fc1", latent, inter, TOP_K, True, kernel.FC1Config(4, rows, True),
                              arch="sm_90a", dump_dir=str(tmp_path), pdl=True))
    m, split = kernel._lane_steps(latent)
    steps = m + split
    assert ptx.count("cp.async.commit_group;") == steps
    waits = [int(x) for x in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)]
    assert waits == list(range(steps - 1, -1, -1))
    first_copy = ptx.index("cp.async.cg.shared.global")
    assert "ld.global" not in ptx[first_copy:], "a register load after the copies"
    assert "ld.global" not in ptx[:ptx.index("griddepcontrol.wait;")]


@pytest.mark.gpu
@gpu
def test_refused_input_falls_back(gen, caplog):
    experts = make_experts(gen, 5, 96, 64, "cuda")
    z, ids, w = make_tokens(gen, 3, 96, 5, 2, "cuda")
    z = z.float()
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = kernel.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA)
    assert "moe_experts" in caplog.text and "z: dtype" in caplog.text
    assert torch.equal(got, moe_experts_ref(z, ids, w, *experts, BETA, LINEAR_BETA))


# FC1 grouped by expert (FC1Config.run): pairs of one expert share a CTA; bit for bit the plain FC1


def runs_reference(ids, n_exp, cap):
    """`expert_runs` written plainly: pairs sorted by (expert, pair); each expert's run cut into
    CTAs of at most `cap` pairs, the count at each CTA's first sorted position."""
    flat = ids.flatten().clamp(0, n_exp - 1).tolist()
    order = sorted(range(len(flat)), key=lambda q: (flat[q], q))
    experts = [flat[q] for q in order]
    count = [0] * len(flat)
    start = 0
    while start < len(flat):
        end = start
        while end < len(flat) and experts[end] == experts[start]:
            end += 1
        for p in range(start, end, cap):
            count[p] = min(cap, end - p)
        start = end
    return torch.tensor([experts, order, count], dtype=torch.int32)


@pytest.mark.parametrize("cap", [2, 4])
@pytest.mark.parametrize("case", ["uniform64", "pool16", "pool20_n5", "one_expert", "clamped",
                                  "int32", "top_k_3", "sliced"])
def test_expert_runs_matches_reference(cpu_gen, case, cap):
    """Runs longer than the cap split into CTAs of `cap` pairs (pool 16: all 64 rows on the same
    16 experts); out-of-range ids clamped as the kernels clamp; the CTAs cover every pair once."""
    n, k, pool = {"uniform64": (64, TOP_K, None), "pool16": (64, TOP_K, 16),
                  "pool20_n5": (5, TOP_K, 20), "one_expert": (7, 1, None),
                  "clamped": (9, 4, None), "int32": (16, TOP_K, 24), "top_k_3": (11, 3, 6),
                  "sliced": (8, 4, None)}[case]
    _, ids, _ = make_tokens(cpu_gen, n, 64, EXPERTS, k, "cpu", pool=pool)
    if case == "one_expert":
        ids[:] = 7
    if case == "clamped":
        ids[0, 0], ids[3, 1], ids[5, 2] = -3, EXPERTS, EXPERTS + 5
    if case == "int32":
        ids = ids.int()
    if case == "sliced":  # rows of a wider top-k buffer
        ids = torch.cat([ids, ids], 1)[:, :k]
    plan = kernel.expert_runs(ids, EXPERTS, cap)
    assert plan.dtype == torch.int32 and plan.shape == (3, n * k)
    assert torch.equal(plan, runs_reference(ids, EXPERTS, cap))
    taken = [int(plan[1, p + t]) for p in range(n * k) for t in range(int(plan[2, p]))]
    assert sorted(taken) == list(range(n * k))


def test_expert_runs_is_capturable():
    """Under fake tensors (shapes only): a data-dependent op (.item(), nonzero, a shape from
    values) would raise here; the plan's shape is fixed by N·k."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for dtype in (torch.int64, torch.int32):
            ids = torch.empty(64, TOP_K, dtype=dtype)
            plan = kernel.expert_runs(ids, EXPERTS, 4)
            assert plan.shape == (3, 64 * TOP_K) and plan.dtype == torch.int32


def _tile_slot(c, i, tile):
    """FC1's tile layout: input i of 32-input group c at this slot of `tile` fp32 values."""
    return 32 * c + (i ^ (c % (32 // tile)))


@pytest.mark.parametrize("latent", [LATENT, 1056, 96, 8192])
@pytest.mark.parametrize("tile", [2, 4])
def test_tile_layout_and_banks(latent, tile):
    """A model of the tile staging (thread u: vector 4(u % 8) + u // 8 of its 32-block) and of
    the math's reads (lane l: group l + 32mm): every input staged once where it is read, and
    each wavefront (128 B: 32 / T lanes of T-value accesses) on distinct banks."""
    nv, threads = latent // 32, 128
    per_wave = 32 // tile  # lanes per 128-byte wavefront

    def conflict_free(slots):  # one warp's slots of one instruction, None: lane idle
        for w0 in range(0, 32, per_wave):  # lanes on one address share it (broadcast)
            live = {s for s in slots[w0:w0 + per_wave] if s is not None}
            assert len({s % per_wave for s in live}) == len(live), slots

    written = set()
    for s in range(-(-(latent // 8) // threads)):
        for warp in range(threads // 32):
            for q in range(8):
                slots = []
                for lane in range(32):
                    u = s * threads + 32 * warp + lane
                    v = u - u % 32 + 4 * (u % 8) + (u % 32) // 8
                    c, i = v // 4, 8 * (v % 4) + q
                    slots.append(_tile_slot(c, i, tile) if v < latent // 8 else None)
                    if v < latent // 8:
                        assert (c, i) not in written
                        written.add((c, i))
                conflict_free(slots)
    assert len(written) == latent
    assert {_tile_slot(c, i, tile) for c, i in written} == set(range(latent))
    for mm in range(-(-nv // 32)):
        for a in range(32):
            conflict_free([_tile_slot(min(lane + 32 * mm, nv - 1), a, tile)
                           for lane in range(32)])


@pytest.mark.dsl
def test_fc1_grouped_ptx(monkeypatch, tmp_path):
    """The grouped FC1 at the TP16 rank with PDL: nothing loaded before the wait (the plan is
    the previous kernels' output); three paths, each staging z behind a CTA barrier: one pair
    (the plain kernel's 8 LDS.128 of z per lane step), tiles of 2 and 4 (32 LDS.64 / LDS.128
    per lane step: 2 per nibble-pair position, for every row and matrix at once)."""
    from k3compile.kernels.common.dsl import ptx_of

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    cfg = kernel.FC1Config(4, 2, run=4)
    ptx = ptx_of(kernel.build("fc1", LATENT, INTER, TOP_K, True, cfg, arch="sm_90a",
                              dump_dir=str(tmp_path), pdl=True))
    assert "ld.global" not in ptx[:ptx.index("griddepcontrol.wait;")]
    m, split = kernel._lane_steps(LATENT)
    steps = m + split
    assert len(re.findall(r"ld\.shared\.v2\.", ptx)) == 32 * steps  # tile of 2
    assert len(re.findall(r"ld\.shared\.v4\.", ptx)) == 8 * steps + 32 * steps  # 1 pair, 4
    assert ptx.count("bar.sync") == 3


FC1_GROUPED = [kernel.FC1Config(4, 2, run=4), kernel.FC1Config(4, 1, run=4),
               kernel.FC1Config(4, 2, run=2), kernel.FC1Config(8, 1, run=4)]


def _grouped_id(cfg):
    return f"w{cfg.warps}r{cfg.rows_per_warp}run{cfg.run}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", FC1_GROUPED, ids=_grouped_id)
@pytest.mark.parametrize("routing", [(16, None), (64, None), (5, None), (64, 16), (16, 20),
                                     (5, 16)], ids=lambda r: f"n{r[0]}pool{r[1]}")
def test_tp16_fc1_grouped(gen, tp16_experts, force_fc1, cfg, routing):
    """Uniform routing (runs of 1-7 pairs at 64 rows) and skewed (every row on the same 16 or
    within 20 experts: runs of up to 64 pairs, split into CTAs of `run`): against the model and
    the reference, and bit for bit the default FC1's output."""
    n, pool = routing
    z, ids, w = make_tokens(gen, n, LATENT, EXPERTS, TOP_K, "cuda", pool=pool)
    plain = check(z, ids, w, tp16_experts)
    force_fc1(cfg)
    assert torch.equal(check(z, ids, w, tp16_experts), plain), "grouped FC1 differs"
    assert torch.equal(check(z, ids.int(), w, tp16_experts), plain), "int32 ids differ"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(5, 96, 64, 2), (7, 512, 96, 3), (9, 1056, 32, 1),
                                   (6, 1536, 64, 4), (20, 8192, 512, 16)], ids=str)
def test_other_shapes_fc1_grouped(gen, force_fc1, shape):
    """Grouped FC1 (the default warps and rows, run 4 and 2) at a partial lane step, the split
    step alone and after a full one, the largest L; few experts: long runs. Equal to default."""
    n_exp, latent, inter, top_k = shape
    experts = make_experts(gen, n_exp, latent, inter, "cuda")
    tokens = [make_tokens(gen, n, latent, n_exp, top_k, "cuda") for n in (1, 7, 33)]
    default = kernel.config("fc1", latent, inter, top_k, 8)
    force_fc1(default)
    plain = [check(*t, experts) for t in tokens]
    for run in (4, 2):
        force_fc1(dataclasses.replace(default, run=run))
        for t, want in zip(tokens, plain):
            assert torch.equal(check(*t, experts), want)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", FC1_GROUPED[:1] + FC1_GROUPED[2:3], ids=_grouped_id)
def test_fc1_grouped_cuda_graph(gen, tp16_experts, force_fc1, cfg):
    """The plan and both kernels captured once at 64 rows, replayed on new routings (uniform,
    then all rows within 16 and 20 experts): each replay bit for bit the default eager output."""
    default = kernel.config("fc1", LATENT, INTER, TOP_K, 64)  # before force_fc1 patches it
    z, ids, w = make_tokens(gen, 64, LATENT, EXPERTS, TOP_K, "cuda")
    force_fc1(cfg)
    out = poisoned(*z.shape)
    kernel.moe_experts_cuda(z, ids, w, *tp16_experts, BETA, LINEAR_BETA, out=out)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.moe_experts_cuda(z, ids, w, *tp16_experts, BETA, LINEAR_BETA, out=out)
    fresh = [make_tokens(gen, 64, LATENT, EXPERTS, TOP_K, "cuda", pool=pool)
             for pool in (None, 16, 20)]
    want = []
    for tokens in fresh:
        force_fc1(default)  # the default FC1, eager
        want.append(check(*tokens, tp16_experts).clone())
    force_fc1(cfg)
    for tokens, expect in zip(fresh, want):
        for static, new in zip((z, ids, w), tokens):
            static.copy_(new)
        replay_and_check(graph, out, z, ids, w, tp16_experts)
        assert torch.equal(out, expect), "grouped FC1 under graph replay differs"
