"""k3::moe_experts in one launch (K3_KERNELS_EXTRA=moe_one_launch): FC1 + SiTU and FC2 +
finalize in one grid of ticketed CTAs, FC2 items waiting on their token's count of FC1 items.
CPU (needs the DSL): it builds for sm_90a as one kernel without spills, with the ticket, the
release/acquire counts and the last CTA's reset in its PTX and no non-coherent load of act; its
configs keep the two launches' values; it refuses what it cannot take; the extra replaces the
two launches. GPU (marked `gpu`): one TP16 rank (896 experts, L 3584, I 192) at 1, 2, 8 rows,
top-8 and top-16, int64 and int32 ids, with and without PDL: y equals the two launches' bit for
bit and is close to the op's reference; back-to-back launches, CUDA-graph replays (the counters
reset) and two streams at once; rows above MAX_ROWS take the two launches (no fallback)."""

import dataclasses
import logging
import re
import tempfile

import pytest
import torch
from k3compile.kernels import moe_experts, moe_one_launch

from k3compile import settings
from k3compile.ops.moe_experts import moe_experts_ref
from tests.fusions.test_moe_experts_kernel import (
    BETA,
    EXPERTS,
    INTER,
    LATENT,
    LINEAR_BETA,
    make_tokens,
    rank_experts_of,
)
from tests.kernel_checks import (
    TOL,
    assert_written,
    check_extra_replaces,
    no_fallback,
    on_gpu,
    poisoned,
    rel_err,
)

# ---- CPU: the build, the configs, the refusals, the switch --------------------------------------


@pytest.mark.dsl
@pytest.mark.parametrize("latent,inter,top_k,rows,ids64,pdl,block", [
    (LATENT, INTER, 8, 1, True, True, "fc1"), (LATENT, INTER, 16, 1, True, False, "fc1"),
    (LATENT, INTER, 8, 2, False, False, "fc1"), (LATENT, INTER, 16, 8, True, True, "fc1"),
    (1056, 64, 3, 1, False, False, "fc1"), (LATENT, INTER, 16, 1, True, False, "fc2"),
    (LATENT, INTER, 16, 8, True, False, "fc2")])
def test_builds_for_sm90a_as_one_kernel(latent, inter, top_k, rows, ids64, pdl, block):
    """One entry; the relaxed ticket, the FC1 items' release add, the FC2 items' acquire loads,
    the last CTA's acq_rel arrival and reset; the PDL wait only with PDL; act never read by
    ld.global.nc (the non-coherent path could serve lines from before the count); no local
    memory. Registers (sm_90a, 2026-12-04): 72 at one row (FC1 by cp.async), 130 at 2-8 rows
    (the two-launch FC1 alone: 128), for either block size."""
    pytest.importorskip("cutlass")
    from k3compile.kernels.common.dsl import cubin_of, cubin_resources, ptx_of

    cfgs = moe_one_launch.configs(latent, inter, top_k, rows, block)
    with tempfile.TemporaryDirectory() as d:
        built = moe_one_launch.build(latent, inter, top_k, ids64, *cfgs, arch="sm_90a",
                                     dump_dir=d, pdl=pdl)
        ptx, res = ptx_of(built), cubin_resources(cubin_of(built))
    assert len(re.findall(r"\.entry ", ptx)) == 1
    assert ("griddepcontrol.wait;" in ptx) == pdl
    for op in ("atom.global.add.u32", "atom.global.release.add", "ld.acquire.gpu",
               "atom.global.acq_rel.add", "atom.global.exch"):
        assert op in ptx, op
    assert "ld.global.nc" not in ptx
    assert res["frame"] == 0 and 0 < res["regs"] <= 255, res
    print(f"{latent} {inter} top-{top_k} rows {rows} block {block}: {res}")


@pytest.mark.parametrize("top_k", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("block", ["fc1", "fc2"])
def test_configs_keep_the_two_launches_values(top_k, rows, block):
    """Each config differs from the two launches' at most in what no value depends on: FC1's
    warps, FC2's R (output rows per CTA), threads (>= R·k) and split (one thread a W2 row
    here; the two launches split it at one row); one block size."""
    fc1, fc2 = moe_one_launch.configs(LATENT, INTER, top_k, rows, block)
    one = moe_experts.config("fc1", LATENT, INTER, top_k, rows)
    two = moe_experts.config("fc2", LATENT, INTER, top_k, rows)
    assert two.split == (2 if rows == 1 else 1) and fc2.split == 1
    two_threads = -(-two.rows_per_cta * top_k // 32) * 32  # one thread a row
    assert dataclasses.replace(fc1, warps=one.warps) == one
    assert fc2.threads == fc1.threads >= fc2.rows_per_cta * top_k and fc2.f16 == two.f16
    assert fc2.rows_per_cta <= two.rows_per_cta
    assert (fc1 == one) == (block == "fc1" or two_threads <= one.threads)
    assert moe_one_launch.refusal(rows, LATENT, INTER, top_k, block) is None


def test_refusals(monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", False)
    monkeypatch.setattr(settings.KERNELS, "moe_f16", False)
    ok = (LATENT, INTER, 16)
    assert moe_one_launch.refusal(moe_one_launch.MAX_ROWS, *ok) is None
    assert moe_one_launch.refusal(0, *ok).startswith("0 rows")
    assert moe_one_launch.refusal(moe_one_launch.MAX_ROWS + 1, *ok).startswith(
        f"{moe_one_launch.MAX_ROWS + 1} rows")
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", True)
    assert "GROUPED" in moe_one_launch.refusal(8, *ok)
    assert moe_one_launch.refusal(4, *ok) is None  # grouped starts at 8 rows
    monkeypatch.setattr(settings.KERNELS, "moe_grouped", False)
    monkeypatch.setattr(settings.KERNELS, "moe_f16", True)
    assert "F16" in moe_one_launch.refusal(1, *ok)
    monkeypatch.setattr(settings.KERNELS, "moe_f16", False)
    assert "shared memory" in moe_one_launch.refusal(1, 8192, 3072, 16)


def test_the_extra_replaces_the_two_launches(monkeypatch):
    """K3_KERNELS_EXTRA=moe_one_launch names a module; its register() makes the one launch the
    op's CUDA implementation (the two-launch one restored afterwards)."""
    from k3compile.ops.moe_experts import moe_experts as op

    check_extra_replaces(monkeypatch, "moe_one_launch", op, moe_one_launch.moe_one_launch_cuda,
                         moe_experts.moe_experts_cuda, moe_experts.register)


# ---- GPU ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def experts():
    """One TP16 rank's 896 experts (~1 GB of packed weights), made once per module."""
    return rank_experts_of(INTER)


def two_launches(z, ids, w, experts):
    with no_fallback():
        return moe_experts.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA)


def one_launch(z, ids, w, experts, out=None):
    out = poisoned(*z.shape) if out is None else out
    with no_fallback():
        got = moe_one_launch.moe_one_launch_cuda(z, ids, w, *experts, BETA, LINEAR_BETA, out=out)
    assert got is out
    return out


def check(got, z, ids, w, experts, vs_reference=False):
    assert_written(got)
    assert torch.equal(got, two_launches(z, ids, w, experts)), "y differs from the two launches"
    if vs_reference:
        ref = moe_experts_ref(z, ids, w, *experts, BETA, LINEAR_BETA)
        assert rel_err(got, ref) < TOL["vs_reference_rel_norm"]


def counts_are_zero():
    """Every stream's counter words (the graph's capture stream has a slot of its own) are 0."""
    from k3compile.kernels.common import last_cta

    torch.cuda.synchronize()
    words = last_cta._counters[torch.cuda.current_device()]
    assert not words.any(), f"counter words left at {words.nonzero().flatten().tolist()}"


@pytest.fixture
def all_rows(monkeypatch):
    """The one launch at every row it builds for (TAKEN_ROWS keeps calls at 1 row)."""
    monkeypatch.setattr(moe_one_launch, "TAKEN_ROWS", moe_one_launch.MAX_ROWS)


@on_gpu
@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("top_k", [8, 16])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_equals_the_two_launches(gen, experts, monkeypatch, all_rows, n, top_k, ids_dtype, pdl):
    monkeypatch.setattr(settings.KERNELS, "pdl", pdl)
    monkeypatch.setattr(settings.KERNELS, "pdl_max_rows", 8)
    for i in range(3):
        z, ids, w = make_tokens(gen, n, LATENT, EXPERTS, top_k, "cuda")
        ids = ids.to(ids_dtype)
        check(one_launch(z, ids, w, experts), z, ids, w, experts, vs_reference=i == 0)
    counts_are_zero()


@on_gpu
def test_rows_that_share_experts(gen, experts, all_rows):
    """8 rows over 12 experts: FC2 items of every token read act rows of shared experts."""
    z, ids, w = make_tokens(gen, 8, LATENT, EXPERTS, 8, "cuda", pool=12)
    check(one_launch(z, ids, w, experts), z, ids, w, experts, vs_reference=True)


@on_gpu
@pytest.mark.parametrize("n", [1, 8])
def test_back_to_back_and_graph_replay(gen, experts, all_rows, n):
    """Consecutive launches on one stream, then a captured launch replayed with fresh inputs:
    every launch finds its counters at 0 (a count left over would let FC2 read act early, a
    ticket left over would skip FC1 items)."""
    z, ids, w = make_tokens(gen, n, LATENT, EXPERTS, 16, "cuda")
    for _ in range(4):
        check(one_launch(z, ids, w, experts), z, ids, w, experts)
    out = poisoned(*z.shape)
    graph = torch.cuda.CUDAGraph()
    with no_fallback(), torch.cuda.graph(graph):
        one_launch(z, ids, w, experts, out)
        one_launch(z, ids, w, experts, out)  # two launches of it in one graph
    for _ in range(3):
        for static, fresh in zip((z, ids, w), make_tokens(gen, n, LATENT, EXPERTS, 16, "cuda")):
            static.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, z, ids, w, experts)
    counts_are_zero()


@on_gpu
def test_two_streams_at_once(gen, experts):
    """Launches on two streams overlap: each stream has its own counter slot."""
    calls = [make_tokens(gen, 1, LATENT, EXPERTS, 16, "cuda") for _ in range(2)]
    for z, ids, w in calls:  # compile, and the counter buffer, before the streams
        one_launch(z, ids, w, experts)
    outs = [poisoned(*calls[0][0].shape) for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(5):
        with torch.cuda.stream(side):
            one_launch(*calls[1], experts, outs[1])
        one_launch(*calls[0], experts, outs[0])
        torch.cuda.current_stream().wait_stream(side)
    for out, (z, ids, w) in zip(outs, calls):
        check(out, z, ids, w, experts)
    counts_are_zero()


@on_gpu
@pytest.mark.parametrize("n", [moe_one_launch.TAKEN_ROWS + 1, moe_one_launch.MAX_ROWS + 1])
def test_rows_above_max_take_two_launches(gen, experts, caplog, n):
    """Rows one launch does not take go to the two launches, logged at debug level and not
    counted as a fallback (the kernels ran)."""
    z, ids, w = make_tokens(gen, n, LATENT, EXPERTS, 16, "cuda")
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"), no_fallback():
        got = moe_one_launch.moe_one_launch_cuda(z, ids, w, *experts, BETA, LINEAR_BETA)
    assert torch.equal(got, two_launches(z, ids, w, experts))
    assert f"moe_one_launch: {n} rows" in caplog.text
