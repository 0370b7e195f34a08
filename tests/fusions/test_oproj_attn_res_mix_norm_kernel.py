"""k3::oproj_attn_res_mix_norm's one launch (K3_KERNELS_EXTRA=oproj_mix): the o_proj gemv whose
last CTA plays the attn_res_mix_norm kernel's grid. CPU (needs the DSL): it builds for sm_90a as
one kernel without spills, refuses what it cannot take, and the extra is known. GPU (marked
`gpu`): at one TP16 rank's o_proj (7168 x 768) and 9 sources, a, prefix_out and x equal the two
launches' (gemv, then the mix kernel) bit for bit at 1, 2 and 8 rows (MAX_ROWS lifted by a
patch), with a prefix and where a block starts, with and without PDL; x close to the op's
reference; back-to-back launches and CUDA-graph replays (the counter resets); refused calls
take the two launches."""

import logging
import math
import re
import tempfile

import pytest
import torch
from k3compile.kernels import oproj_attn_res_mix_norm as kernel

from k3compile import settings
from k3compile.ops.attn_res_mix_norm import attn_res_mix_norm_ref, mix_norm_after
from tests.kernel_checks import (
    TOL,
    assert_written,
    check_extra_replaces,
    no_fallback,
    on_gpu,
    rel_err,
)

D, K, EPS = 7168, 768, 1e-5  # hidden; one TP16 rank's heads x v_dim


def make_inputs(gen, n, n_blocks=8, with_prefix=True, device="cuda"):
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    bank = (randn(n, 8, D) * torch.linspace(0.5, 3.0, 8, device=device).view(1, 8, 1)).bfloat16()
    return [randn(n, K).bfloat16(), (randn(D, K) / math.sqrt(K)).bfloat16(),
            randn(n, D, scale=2.0).bfloat16() if with_prefix else None,
            [bank[:, j] for j in range(n_blocks)], (1 + randn(D, scale=0.2)).bfloat16(),
            randn(1, D, scale=3 / math.sqrt(D)).bfloat16(), (1 + randn(D, scale=0.2)).bfloat16(),
            EPS, EPS]


# ---- CPU: the build, the refusals, the switch ---------------------------------------------------


@pytest.mark.parametrize("rows,n_blocks,with_prefix,pdl",
                         [(1, 8, True, True), (2, 8, False, False), (8, 0, True, False)])
def test_builds_for_sm90a_as_one_kernel(rows, n_blocks, with_prefix, pdl):
    """One entry in the PTX (the gemv and the mix in one launch), the PDL wait only with PDL, the
    counter, an L2 prefetch of each mix input, no local memory, and registers that keep >= 4
    CTAs of the gemv per SM (128 x 128 threads)."""
    pytest.importorskip("cutlass")
    from k3compile.kernels.common.dsl import cubin_of, cubin_resources, ptx_of

    cfg, mix_cfg = kernel.configs(D, K, rows, n_blocks, with_prefix)
    with tempfile.TemporaryDirectory() as d:
        built = kernel.build(D, K, rows, n_blocks, with_prefix, cfg, mix_cfg, arch="sm_90a",
                             dump_dir=d, pdl=pdl)
        ptx, res = ptx_of(built), cubin_resources(cubin_of(built))
    assert len(re.findall(r"\.entry ", ptx)) == 1
    assert ("griddepcontrol.wait;" in ptx) == pdl
    assert "atom.global.acq_rel.add" in ptx  # the last-CTA counter
    assert ptx.count("prefetch.global.L2") == n_blocks + int(with_prefix) + (3 if n_blocks else 1)
    assert res["frame"] == 0 and res["regs"] <= 128, res


def test_refusals():
    gen = torch.Generator().manual_seed(0)
    meta = lambda t: t if not isinstance(t, torch.Tensor) else torch.empty_like(t, device="meta")
    args = [[meta(b) for b in a] if isinstance(a, list) else meta(a)
            for a in make_inputs(gen, 1, 8, True, device="cpu")]
    assert kernel.refusal(*args) is None
    assert kernel.refusal(*[torch.empty(kernel.MAX_ROWS + 1, K, dtype=torch.bfloat16,
                                        device="meta"), *args[1:]]).startswith(
        f"{kernel.MAX_ROWS + 1} rows")
    assert "o_proj" in kernel.refusal(args[0].float(), *args[1:])
    nine = [*args[:3], args[3] + args[3][:1], *args[4:]]  # 10 sources
    assert "mix: 10 sources" in kernel.refusal(*nine)
    # the mix's norm weight in fp32 (spell9): only the two launches have a build for it
    assert kernel.refusal(*args, True, True).startswith("norm_weight_fp32")


def test_the_extra_replaces_the_two_launches(monkeypatch):
    """K3_KERNELS_EXTRA=oproj_mix names a module; its register() makes the one launch the op's
    CUDA implementation (the two-launch one restored afterwards)."""
    from k3compile.ops.oproj_attn_res_mix_norm import oproj_attn_res_mix_norm as op

    check_extra_replaces(monkeypatch, "oproj_mix", op, kernel.oproj_mix_cuda,
                         kernel.oproj_attn_res_mix_norm_cuda, kernel.register)


# ---- GPU ----------------------------------------------------------------------------------------


def two_launches(args):
    """What the one launch computes bit for bit: gemv over W_o, then the mix kernel on its a."""
    from k3compile.kernels.attn_res_mix_norm import attn_res_mix_norm_cuda
    from k3compile.kernels.common import gemv

    with no_fallback():
        a = gemv.gemv_cuda(args[0], args[1])
        return mix_norm_after(a, args[2], args[3], *args[4:9], mix_norm=attn_res_mix_norm_cuda)


def check(got, args):
    prefix_out, x = got
    assert_written(prefix_out, x)
    want = two_launches(args)
    assert torch.equal(prefix_out, want[0]), "prefix_out differs from the two launches"
    assert torch.equal(x, want[1]), "x differs from the two launches"
    ref = mix_norm_after(torch.nn.functional.linear(args[0], args[1]), args[2], args[3],
                         *args[4:9], scores_fp32=True)
    assert rel_err(x, ref[1]) < TOL["bf16_rel_norm"]


@on_gpu
@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("n_blocks,with_prefix", [(8, True), (8, False), (3, True), (0, True)])
@pytest.mark.parametrize("pdl", [True, False])
def test_equals_the_two_launches(gen, monkeypatch, n, n_blocks, with_prefix, pdl):
    monkeypatch.setattr(kernel, "MAX_ROWS", 8)
    monkeypatch.setattr(settings.KERNELS, "pdl", pdl)
    monkeypatch.setattr(settings.KERNELS, "pdl_max_rows", 8)
    for _ in range(5):
        args = make_inputs(gen, n, n_blocks, with_prefix)
        with no_fallback():
            got = kernel.oproj_mix_cuda(*args)
        check(got, args)


@on_gpu
def test_close_to_the_op_reference(gen):
    args = make_inputs(gen, 2)
    with no_fallback():
        _, x = kernel.oproj_mix_cuda(*args)
    a = torch.nn.functional.linear(args[0], args[1])
    _, ref = attn_res_mix_norm_ref(args[2], a, args[3], *args[4:9])
    assert rel_err(x, ref) < TOL["vs_reference_rel_norm"]


@on_gpu
@pytest.mark.parametrize("n", [1, 2])
def test_back_to_back_and_graph_replay(gen, monkeypatch, n):
    """Consecutive launches on one stream, then a captured launch replayed with fresh inputs
    (twice and more): every launch has its last CTA (a counter left non-zero would mix nothing,
    or early)."""
    monkeypatch.setattr(kernel, "MAX_ROWS", 8)
    args = make_inputs(gen, n)
    for _ in range(4):
        with no_fallback():
            check(kernel.oproj_mix_cuda(*args), args)
    graph = torch.cuda.CUDAGraph()
    with no_fallback(), torch.cuda.graph(graph):
        captured = kernel.oproj_mix_cuda(*args)
    for _ in range(3):
        fresh = make_inputs(gen, n)
        for dst, src in zip([args[0], args[1], args[2], *args[3], *args[4:7]],
                            [fresh[0], fresh[1], fresh[2], *fresh[3], *fresh[4:7]]):
            dst.copy_(src)
        for c in captured:
            c.fill_(float("nan"))
        graph.replay()
        check(captured, args)
    from k3compile.kernels.common.last_cta import counter

    assert int(counter(args[0].device)) == 0


@on_gpu
def test_refused_calls_take_two_launches(gen, caplog):
    args = make_inputs(gen, kernel.MAX_ROWS + 1)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = kernel.oproj_mix_cuda(*args)
    want = two_launches(args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert "oproj_mix" in caplog.text


@on_gpu
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("with_prefix", [True, False])
def test_norm_weight_fp32_takes_the_two_launches(gen, caplog, n, with_prefix):
    """The mix's norm weight multiplied in fp32 (spell9's norm): the one launch refuses it (logged)
    and both CUDA implementations run o_proj, then the mix kernel's norm_weight_fp32 build: the
    same bits, within the kernel tolerances of the op's reference variant."""
    from k3compile.kernels.attn_res_mix_norm import attn_res_mix_norm_cuda
    from k3compile.kernels.common.router import linear

    args = make_inputs(gen, n, 8, with_prefix)
    with no_fallback():
        a = linear(args[0], args[1])  # o_proj as the two launches run it
        want = mix_norm_after(a, args[2], args[3], *args[4:9], True,
                              mix_norm=attn_res_mix_norm_cuda, norm_weight_fp32=True)
        two = kernel.oproj_attn_res_mix_norm_cuda(*args, True, True)
        via_op = torch.ops.k3.oproj_attn_res_mix_norm(*args, True, True)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        one = kernel.oproj_mix_cuda(*args, True, True)
    for got in (two, via_op, one):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if n <= kernel.MAX_ROWS:
        assert "norm_weight_fp32" in caplog.text
    ref = mix_norm_after(a, args[2], args[3], *args[4:9], True, norm_weight_fp32=True)
    assert torch.equal(want[0], ref[0]) and rel_err(want[1], ref[1]) < TOL["bf16_rel_norm"]
