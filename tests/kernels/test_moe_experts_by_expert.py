"""moe_experts' FC1 by expert (K3_MOE_BY_EXPERT, stage `fc1e` in kernels/moe_experts.py,
kernels/device/moe_experts_by_expert.py) against the per-pair fp16 FC1 it must equal bit for bit.

On CPU (always run): a torch model of the kernel's pair list (the grouped kernels' ballot scan at
the by-expert CTA's 256 threads: ids repeated across tokens, unselected experts, N·k not a
multiple of the block) and of its chunking (full chunks of `tokens`, then the rest as one
chunk) covers every pair of every expert once, in pair order; that act computed chunk by chunk
with one decode per chunk (`fc1_chunk_model`) is bitwise the per-pair model; the switch's
selection. With the DSL (`dsl`): the stage builds for sm_90a (registers, no hot-loop spill).
On a GPU (`gpu`): act and the op's output bitwise equal to the per-pair fp16 kernels at 8, 16,
33, 64 rows at the TP16 shape and a small odd shape; int32 ids."""

import pytest
import torch
from k3compile.kernels import moe_experts as kernel

from k3compile import settings
from tests.fusions.test_moe_experts_kernel import (
    BETA,
    EXPERTS,
    INTER,
    LATENT,
    LINEAR_BETA,
    TOP_K,
    make_experts,
    make_tokens,
)
from tests.kernel_checks import assert_written, poisoned
from tests.kernels.test_moe_experts_grouped import ballot_pair_list, pair_list_model

gpu = pytest.mark.usefixtures("cuda_kernels")
THREADS = kernel.FC1Config(8, 1, f16=True).threads  # the by-expert CTA at 8 rows and more


# ---- CPU: the pair list and the chunking --------------------------------------------------------


def chunks_model(count: int, tokens: int) -> list[tuple[int, int]]:
    """`FC1ByExpert.kernel`'s chunks (first, size): count // tokens full ones, then the rest."""
    full = count // tokens
    out = [(c * tokens, tokens) for c in range(full)]
    return out + ([(full * tokens, count - full * tokens)] if count % tokens else [])


def routed(n: int, seed: int) -> torch.Tensor:
    """ids [n, k], distinct per row: expert 7 in every row, 3 in the even ones (repeats across
    tokens: more pairs than a chunk), the rest random from the other experts."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(EXPERTS) if e not in (3, 7)])
    ids = pool[torch.rand(n, len(pool), generator=gen).argsort(-1)[:, :TOP_K]]
    ids[:, 0] = 7
    ids[::2, 1] = 3
    return ids


@pytest.mark.parametrize("n", [5, 8, 33, 64])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_pair_list_and_chunks(n, tokens):
    """N·k = 80 and 528 are not multiples of 256; expert 7 has n pairs, 3 ceil(n / 2), others
    one or none (unselected: no chunk)."""
    ids = routed(n, n)
    flat = ids.reshape(-1).tolist()
    assert flat.count(7) == n and flat.count(3) == (n + 1) // 2
    seen = []
    for e in range(EXPERTS):
        pairs = ballot_pair_list(ids, e, THREADS)
        assert pairs == pair_list_model(ids, e)
        chunks = chunks_model(len(pairs), tokens)
        assert all(1 <= size <= tokens for _, size in chunks)
        assert [pairs[f + t] for f, size in chunks for t in range(size)] == pairs
        seen += pairs
    assert sorted(seen) == list(range(n * TOP_K))  # every pair once, over every expert


def cta_experts(n_exp: int, per_cta: int) -> list[list[int]]:
    """`FC1ByExpert.kernel`'s experts of each CTA x: x, x + X, ... below E (grid X = E / per_cta,
    rounded up), per_cta of them at most."""
    grid = -(-n_exp // per_cta)
    return [[x + i * grid for i in range(per_cta) if x + i * grid < n_exp] for x in range(grid)]


@pytest.mark.parametrize("n_exp,per_cta", [(896, 1), (896, 8), (896, 5), (5, 8), (7, 3)])
def test_every_expert_in_one_cta(n_exp, per_cta):
    ctas = cta_experts(n_exp, per_cta)
    assert sorted(e for c in ctas for e in c) == list(range(n_exp))
    assert all(1 <= len(c) <= per_cta for c in ctas)


def f16_group_dot(wq: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """One group's fp16 partial as `decode_dot_f16x2`: 32 decoded fp16 weights wq (times
    2^-14) against z as fp16 (times 2^c), the fma.rn.f16x2 chain per lane (inputs 8w + i on
    the low lane, 8w + i + 4 on the high one, in order w, i), both lanes widened and added."""
    lo, hi = torch.zeros((), dtype=torch.float16), torch.zeros((), dtype=torch.float16)
    for w in range(4):
        for i in range(4):
            a, b = 8 * w + i, 8 * w + i + 4
            # fma.rn: exact product, one rounding (fp16 x fp16 is exact in fp64)
            lo = (wq[a].double() * z2[a].double() + lo.double()).half()
            hi = (wq[b].double() * z2[b].double() + hi.double()).half()
    return lo.float() + hi.float()


def fc1_pair_model(wq, scales, z2s):
    """Per pair (the per-pair kernel): each token's partials over the groups, in order."""
    return [sum((f16_group_dot(wq[g], z2[g]) * scales[g] for g in range(len(wq))),
                torch.zeros(())) for z2 in z2s]


def fc1_chunk_model(wq, scales, z2s, tokens):
    """By expert: chunks of `tokens` (`chunks_model`), each group's weights taken once per chunk
    and dotted with every token of it; the same per-token chain."""
    out = [None] * len(z2s)
    for first, size in chunks_model(len(z2s), tokens):
        acc = [torch.zeros(()) for _ in range(size)]
        for g in range(len(wq)):
            w = wq[g]  # decoded once for the chunk
            for t in range(size):
                acc[t] = acc[t] + f16_group_dot(w, z2s[first + t][g]) * scales[g]
        out[first:first + size] = acc
    return out


@pytest.mark.parametrize("tokens", [2, 4])
def test_chunked_math_is_the_per_pair_math(tokens):
    """5 tokens of one expert (more than a chunk; a partial last chunk): bitwise equal sums."""
    gen = torch.Generator().manual_seed(tokens)
    groups = 3
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    wq = (e2m1[torch.randint(8, (groups, 32), generator=gen)]
          * (1 - 2 * torch.randint(2, (groups, 32), generator=gen))).half()
    scales = 2.0 ** torch.randint(-4, 4, (groups,), generator=gen).float()
    z2s = [(torch.randn(groups, 32, generator=gen) * 2 ** 8).half() for _ in range(5)]
    want = fc1_pair_model(wq, scales, z2s)
    got = fc1_chunk_model(wq, scales, z2s, tokens)
    assert all(torch.isfinite(a) for a in want)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # and the model is not blind: another chain order changes some sum
    swapped = [z.flip(-1) for z in z2s]
    assert any(not torch.equal(a, b) for a, b in zip(want, fc1_pair_model(wq.flip(-1), scales,
                                                                          swapped)))


def test_by_expert_selection(monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", False)
    monkeypatch.setattr(settings.KERNELS, "moe_by_expert", False)
    monkeypatch.setattr(settings.KERNELS, "moe_f16", None)
    assert not any(kernel.by_expert(n, LATENT) for n in (1, 8, 16, 64))
    monkeypatch.setattr(settings.KERNELS, "moe_by_expert", True)
    # auto fp16 decode: from the bucket of 16 rows (9 rows are in it); never above 64 rows
    assert [kernel.by_expert(n, LATENT) for n in (1, 8, 9, 16, 33, 64, 65)] == \
        [False, False, True, True, True, True, False]
    monkeypatch.setattr(settings.KERNELS, "moe_f16", True)
    assert [kernel.by_expert(n, LATENT) for n in (1, 2, 8)] == [False, True, True]
    monkeypatch.setattr(settings.KERNELS, "moe_f16", False)
    assert not kernel.by_expert(32, LATENT)
    monkeypatch.setattr(settings.KERNELS, "moe_f16", True)
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", True)  # the grouped kernels go first
    assert [kernel.by_expert(n, LATENT) for n in (4, 8, 64)] == [True, False, False]


# ---- sm_90a builds ----------------------------------------------------------------------------


@pytest.mark.dsl
@pytest.mark.parametrize("shape,ids64", [((3584, 192, 16, 64), True), ((96, 64, 3, 8), False)],
                         ids=str)
def test_builds_for_sm90a(monkeypatch, tmp_path, shape, ids64):
    """The TP16 build (a few seconds) and a small odd one with int32 ids: the registers of 3 CTAs
    of 256 threads per SM (80: `by_expert_config` caps them), a stack frame of at most 6 words
    (ptxas spills loop invariants there, reloaded once per expert: 2 words at the TP16 shape
    with 1 expert per CTA, 6 with 8), the
    decode's fma.rn.f16x2 in the chunk bodies (2 + 1 tokens: 3 x 16 per weight vector)."""
    pytest.importorskip("cutlass")
    from k3compile.kernels.common.dsl import cubin_of, cubin_resources, ptx_of

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    latent, inter, top_k, b = shape
    cfg = kernel.by_expert_config(kernel.FC1Config(8, 1, f16=True), b)
    compiled = kernel.build("fc1e", latent, inter, top_k, ids64, cfg, arch="sm_90a",
                            dump_dir=str(tmp_path), pdl=True)
    res = cubin_resources(cubin_of(compiled))
    assert res["regs"] <= 80 and res["frame"] <= 24, res
    ptx = ptx_of(compiled)
    assert "ld.local" not in ptx and "st.local" not in ptx
    m, split = kernel._lane_steps(latent)
    vectors = 2 * m + split  # per lane and row: W1 and W3 steps, the split step
    chunk_tokens = sum(range(1, cfg.tokens + 1))  # the full chunk and the smaller ones
    assert ptx.count("fma.rn.f16x2") == 16 * vectors * chunk_tokens


# ---- GPU: bitwise the per-pair fp16 kernels -----------------------------------------------------


@pytest.fixture
def f16(monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", False)
    monkeypatch.setattr(settings.KERNELS, "moe_f16", True)


def run_both(monkeypatch, z, ids, w, experts):
    """The op's output and act with FC1 per pair, then by expert (K3_MOE_BY_EXPERT); both ran."""
    outs, acts = [], []
    n, latent = z.shape
    w1, s1, w3, s3 = experts[:4]
    b = kernel.bucket(n)
    for on in (False, True):
        monkeypatch.setattr(settings.KERNELS, "moe_by_expert", on)
        assert kernel.by_expert(n, latent) == on
        out = poisoned(*z.shape)
        got = kernel.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA, out=out)
        assert got is out, "the kernels did not run (fallback)"
        assert_written(out)
        outs.append(out)
        cfg = kernel.config("fc1", latent, w1.shape[1], ids.shape[-1], b)
        stage = "fc1e" if on else "fc1"
        if on:
            cfg = kernel.by_expert_config(cfg, b)
        act = poisoned(n * ids.shape[-1], w1.shape[1])
        kernel.KERNEL.compiled(stage, latent, w1.shape[1], ids.shape[-1],
                               ids.dtype == torch.int64, cfg, rows=b)(
            z, ids, kernel._words(w1), s1.view(-1, latent // 32), kernel._words(w3),
            s3.view(-1, latent // 32), act, BETA, LINEAR_BETA)
        torch.cuda.synchronize()
        assert_written(act)
        acts.append(act)
    assert torch.equal(acts[0], acts[1]), "act differs from the per-pair fp16 FC1"
    assert torch.equal(outs[0], outs[1]), "the output differs from the per-pair fp16 kernels"


@pytest.fixture(scope="module")
def tp16():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(30)
    return make_experts(gen, EXPERTS, LATENT, INTER, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("per_cta", [1, 8])
@pytest.mark.parametrize("n", [8, 16, 33, 64])
def test_tp16_bitwise(gen, tp16, f16, monkeypatch, n, per_cta):
    monkeypatch.setattr(kernel, "BY_EXPERT_EXPERTS", per_cta)
    z, ids, w = make_tokens(gen, n, LATENT, EXPERTS, TOP_K, "cuda")
    run_both(monkeypatch, z, ids, w, tp16)
    # few experts: every token's pairs on 24 of them (chunks full and partial)
    z, ids, w = make_tokens(gen, n, LATENT, EXPERTS, TOP_K, "cuda", pool=24)
    run_both(monkeypatch, z, ids.int(), w, tp16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [8, 16, 33, 64])
def test_small_odd_shape_bitwise(gen, f16, monkeypatch, n):
    """L 96 (3 groups: a lane step past NV), I 64, k 3, 5 experts (many pairs per expert)."""
    experts = make_experts(gen, 5, 96, 64, "cuda")
    run_both(monkeypatch, *make_tokens(gen, n, 96, 5, 3, "cuda"), experts)
