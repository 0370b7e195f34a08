"""MLA decode kernel (`k3::mla_decode`) against `mla_decode_ref`.

GPU (marked `gpu`), each on both compute paths (tensor cores, the default, and CUDA cores):
one K3 TP16 rank (96 / 16 = 6 heads, latent 512, rope 64, a cache of 4160 rows) at every batch
bucket with T = 1 and T = 8, positions near 0, mid-cache and at the end of the cache; other head
counts (4, 1, 8), latent 256 / rope 32, other T (H·T not a multiple of 16: a partial query
group), several split counts, several consecutive steps on one cache. Slots are a permutation of a larger pool (the last request of a
batch is a padding row on the scratch slot, -1), k_pe is a column slice of the kv_a row (as the
model's split makes it), outputs are poisoned beforehand. The cache after the call must equal
the reference's bit for bit: the new rows written, every other row untouched.

CPU: the tensor-core path's fragment plumbing on emulated lanes (ldmatrix, mma.sync); a torch
model of the kernel's algorithm (context splits, 32-row tiles, online softmax with
p rounded to bf16 per tile, the fixed-order merge by split lanes, which CTA writes which new
row) against the reference, for several split counts (up to MAX_SPLITS); the query split of every
config; refusals; the fallback off the GPU.
"""

import logging

import pytest
import torch
from k3compile.kernels import mla_decode as kernel

from k3compile.ops.mla_decode import mla_decode_ref
from tests.kernel_checks import BUCKETS, assert_refused, assert_written, poisoned, rel_err, strided

H_TP16 = 96 // 16  # MLA heads per rank at TP16 (k3_arch.md §4.2; config num_attention_heads)
C, R = 512, 64
L_CACHE = 4096 + 64
SCALE = (128 + 64) ** -0.5  # (qk_nope + qk_rope)^-1/2
# The kernel rounds p to bf16 as e^(s - running max) before p·c_kv, the reference the normalised
# softmax: the same weights, each rounded once, differently. Measured on the CPU model at unit-
# scale inputs (H = 6, up to 600 rows): 2.6-2.7e-3 in norm, single elements up to 7.8e-3 (one
# bf16 ulp of outputs in [1, 2)), 1.6e-2 at |o| ~ 3.7. Indexing errors move outputs by O(0.1).
REF_TOL = {"rtol": 2e-2, "atol": 2e-2}
REF_REL_NORM = 6e-3


class Inputs:
    """One MLA decode call's operands: B requests of T query rows, H heads, a pool of S slots
    of L cache rows. `where`: positions near 0 ("start"), mid-cache ("mid"), at the end ("end")."""

    def __init__(self, gen, B, T, H=H_TP16, latent=C, rope=R, L=L_CACHE, where="mid",
                 device="cuda", extra_slots=3):
        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device)

        def randint(lo, hi, n):
            return torch.randint(lo, hi, (n,), generator=gen, device=device)

        self.B, self.T, self.H, self.C, self.R, self.L = B, T, H, latent, rope, L
        self.q_lat = randn(B, T, H, latent).bfloat16()
        self.q_pe = randn(B, T, H, rope).bfloat16()
        ckv = randn(B, T, latent + rope).bfloat16()  # kv_a's output row: [c_kv | k_pe]
        self.c_kv = ckv[..., :latent].contiguous()  # after kv_a_layernorm: rows of its own
        self.k_pe = ckv[..., latent:]  # a column slice (row stride C + R)
        S = B + extra_slots
        self.cache = randn(S, L, latent + rope).bfloat16()
        perm = torch.rand(S - 1, generator=gen, device=device).argsort()[:B]
        if B > 1:
            perm[-1] = -1  # a padding row on the scratch slot
        self.slots = perm
        if where == "start":
            pos = randint(0, 4, B)
            pos[0] = 0
        elif where == "mid":
            pos = randint(L // 3, 2 * L // 3, B)
        else:
            pos = L - T - randint(0, 4, B)
            pos[0] = L - T
        self.positions = pos.clamp(0, L - T)

    def args(self, cache):
        return (self.q_lat, self.q_pe, self.c_kv, self.k_pe, cache, self.slots, self.positions,
                SCALE)

    def new_rows(self):
        return torch.cat([self.c_kv, self.k_pe], dim=-1)


def check(inp, cache=None):
    """Kernel vs reference from the same cache; returns the kernel's cache (for the next step)."""
    cache = inp.cache if cache is None else cache
    got_cache, ref_cache = cache.clone(), cache.clone()
    out = poisoned(inp.B, inp.T, inp.H, inp.C)
    got = kernel.mla_decode_cuda(*inp.args(got_cache), out=out)
    assert got is out, "the kernel did not run (fallback)"
    ref = mla_decode_ref(*inp.args(ref_cache))
    assert_written(got)
    slot = inp.slots % cache.shape[0]
    rows = inp.positions.view(-1, 1) + torch.arange(inp.T, device=cache.device)
    assert torch.equal(got_cache[slot.view(-1, 1), rows], inp.new_rows()), "new rows"
    assert torch.equal(got_cache, ref_cache), "cache rows other than the new ones changed"
    torch.testing.assert_close(got.float(), ref.float(), **REF_TOL)
    assert rel_err(got, ref) < REF_REL_NORM
    return got_cache


@pytest.fixture(params=["mma", "fma"])
def path(request, monkeypatch):
    """Both compute paths of the kernel: tensor cores (`config`'s default) and CUDA cores."""
    monkeypatch.setattr(kernel, "MMA", request.param == "mma")
    return request.param


@pytest.mark.parametrize("where", ["start", "mid", "end"])
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("B", BUCKETS)
@pytest.mark.usefixtures("cuda_kernels", "path")
@pytest.mark.gpu
def test_tp16_rank(gen, B, T, where):
    check(Inputs(gen, B, T, where=where))


@pytest.mark.parametrize("B,T,H,latent,rope,L", [
    (3, 1, 4, 512, 64, 4160), (5, 8, 4, 512, 64, 1000), (2, 8, 1, 512, 64, 333),
    (3, 3, 6, 512, 64, 777), (6, 16, 6, 512, 64, 2048), (37, 1, 6, 512, 64, 512),
    (4, 5, 3, 256, 32, 130), (1, 2, 6, 512, 64, 17), (2, 3, 8, 512, 64, 700)])
@pytest.mark.usefixtures("cuda_kernels", "path")
@pytest.mark.gpu
def test_other_shapes(gen, B, T, H, latent, rope, L):
    for where in ("start", "mid", "end"):
        check(Inputs(gen, B, T, H, latent, rope, L, where))


@pytest.mark.parametrize("n", [1, 2, 5, 17, 64, kernel.MAX_SPLITS])
@pytest.mark.usefixtures("cuda_kernels", "path")
@pytest.mark.gpu
def test_split_counts(gen, n, monkeypatch):
    monkeypatch.setattr(kernel, "splits", lambda *_: n)
    for T in (1, 8):
        for where in ("start", "mid", "end"):
            check(Inputs(gen, 3, T, where=where))


@pytest.mark.parametrize("B,T", [(1, 1), (8, 8), (64, 1)])
@pytest.mark.usefixtures("cuda_kernels", "path")
@pytest.mark.gpu
def test_consecutive_steps(gen, B, T):
    """Four steps on one cache, each appending T rows after the last."""
    inp = Inputs(gen, B, T, where="start")
    cache = inp.cache
    for _ in range(4):
        cache = check(inp, cache)
        fresh = Inputs(gen, B, T, L=inp.L, where="start", extra_slots=inp.cache.shape[0] - B)
        inp.q_lat, inp.q_pe, inp.c_kv, inp.k_pe = fresh.q_lat, fresh.q_pe, fresh.c_kv, fresh.k_pe
        inp.positions = inp.positions + T


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_empty_batch(gen):
    inp = Inputs(gen, 0, 1, extra_slots=2)
    assert kernel.mla_decode_cuda(*inp.args(inp.cache)).shape == (0, 1, H_TP16, C)


@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.gpu
def test_refused_input_falls_back(gen, caplog):
    inp = Inputs(gen, 2, 1)
    inp.q_lat = strided(inp.q_lat)  # a strided last dim: the reference takes it, the kernel not
    assert not kernel.can_implement(*inp.args(inp.cache))
    got_cache, ref_cache = inp.cache.clone(), inp.cache.clone()
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = kernel.mla_decode_cuda(*inp.args(got_cache))
    assert "mla_decode" in caplog.text
    assert torch.equal(got, mla_decode_ref(*inp.args(ref_cache)))
    assert torch.equal(got_cache, ref_cache)


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's algorithm, modelled in torch


def split_model(q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions, scale, n_splits):
    """The kernel's split-KV decode in torch, CTA by CTA and tile by tile: updates kv_cache as the
    kernel does and returns o_lat. Asserts each new row is written by exactly one CTA."""
    B, T, H, Cl = q_lat.shape
    S, L = kv_cache.shape[:2]
    HT = H * T
    ws_o = torch.full((B, n_splits, HT, Cl), float("nan"))
    ws_ml = torch.full((B, n_splits, HT, 2), float("nan"))
    t_of = torch.arange(HT) // H  # query index t·H + h
    for b in range(B):
        slot, pos = int(slots[b]) % S, int(positions[b])
        n_vis = min(pos + T, L)
        per_split = -(-n_vis // n_splits)
        length = -(-per_split // kernel.TILE) * kernel.TILE  # whole tiles
        written = torch.zeros(L, dtype=torch.int)
        q = q_lat[b].reshape(HT, Cl).float()
        qp = q_pe[b].reshape(HT, -1).float()
        old = kv_cache[slot].clone()  # no CTA reads a row another CTA writes
        for s in range(n_splits):
            lo, hi = s * length, min(s * length + length, n_vis)
            m, lsum = torch.full((HT,), float("-inf")), torch.zeros(HT)
            acc = torch.zeros(HT, Cl)
            for base in range(lo, hi, kernel.TILE):
                tile = torch.zeros(kernel.TILE, kv_cache.shape[2], dtype=kv_cache.dtype)
                for r in range(kernel.TILE):
                    i = base + r
                    if i >= hi:
                        continue
                    if i >= pos:
                        tile[r] = torch.cat([c_kv[b, i - pos], k_pe[b, i - pos]])
                        kv_cache[slot, i] = tile[r]
                        written[i] += 1
                    else:
                        tile[r] = old[i]
                kv = tile.float()
                sn = (q @ kv[:, :Cl].T).bfloat16().float()
                sp = (qp @ kv[:, Cl:].T).bfloat16().float()
                score = (sn + sp).bfloat16().float() * scale
                i = base + torch.arange(kernel.TILE)
                visible = (i < hi) & (i.view(1, -1) <= pos + t_of.view(-1, 1))
                score = score.masked_fill(~visible, float("-inf"))
                m_new = torch.maximum(m, score.max(-1).values)
                m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
                p = torch.exp(score - m_use[:, None])
                corr = torch.exp(m - m_use)
                lsum = lsum * corr + p.sum(-1)
                m = m_new
                acc = acc * corr[:, None] + p.bfloat16().float() @ kv[:, :Cl]
            ws_o[b, s], ws_ml[b, s, :, 0], ws_ml[b, s, :, 1] = acc, m, lsum
        assert torch.equal(written[pos:n_vis], torch.ones(n_vis - pos, dtype=torch.int))
        assert written.sum() == n_vis - pos
    assert not ws_o.isnan().any() and not ws_ml.isnan().any(), "a partial not written"
    out = torch.empty(B, HT, Cl)
    lanes = kernel.COMBINE_LANES
    for b in range(B):  # the merge: lane k sums splits k, k + lanes, ..., then lanes in order
        m_all = ws_ml[b, :, :, 0].max(0).values
        w = torch.exp(ws_ml[b, :, :, 0] - m_all)  # (splits, HT)
        total = (ws_ml[b, :, :, 1] * w).sum(0)
        o = torch.zeros(HT, Cl)
        for k in range(lanes):
            part = torch.zeros(HT, Cl)
            for s in range(k, n_splits, lanes):
                part = part + ws_o[b, s] * w[s, :, None]
            o = o + part
        out[b] = o * (1.0 / total[:, None])
    return out.bfloat16().view(B, T, H, Cl)


def _cpu_gen():
    seed = int(torch.randint(1 << 30, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def check_split_model(inp, n_splits):
    """The split model's cache and output equal the reference's."""
    got_cache, ref_cache = inp.cache.clone(), inp.cache.clone()
    got = split_model(*inp.args(got_cache), n_splits)
    ref = mla_decode_ref(*inp.args(ref_cache))
    assert torch.equal(got_cache, ref_cache)
    torch.testing.assert_close(got.float(), ref.float(), **REF_TOL)
    assert rel_err(got, ref) < REF_REL_NORM


@pytest.mark.parametrize("n_splits", [1, 3, 7, 64, kernel.MAX_SPLITS])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_split_model_matches_reference(T, n_splits):
    gen = _cpu_gen()
    for where in ("start", "mid", "end"):
        check_split_model(Inputs(gen, 3, T, H=2, L=300, where=where, device="cpu"), n_splits)


def test_split_model_at_tp16_shape():
    """One request, 6 heads, 8 rows at the end of a 4160-row cache, the split count the kernel
    picks at B = 1."""
    inp = Inputs(_cpu_gen(), 1, 8, where="end", device="cpu", extra_slots=1)
    check_split_model(inp, kernel.splits(1, 8, H_TP16, L_CACHE))


def test_lane_scores():
    """The kernel's score step on 32 emulated lanes: per row group, `reduce_scatter` of each
    lane's partials, lane l keeping group l & 7's total; then lane_row / row_lane say where
    each tile row's score sits (the p·c_kv broadcast reads it there)."""
    lanes = torch.arange(32)
    part = torch.randn(kernel.TILE, 32, dtype=torch.float64, generator=_cpu_gen())
    kept = torch.full((32,), float("nan"), dtype=torch.float64)
    for g in range(kernel.TILE // kernel.GROUP):
        total = kernel.reduce_scatter(
            [part[kernel.GROUP * g + k] for k in range(kernel.GROUP)],
            lambda off: (lanes & off) != 0, lambda v, off: v[lanes ^ off], torch.where)
        kept = torch.where((lanes & 7) == g, total, kept)
    rows = torch.tensor([kernel.lane_row(lane) for lane in range(32)])
    assert sorted(rows.tolist()) == list(range(kernel.TILE))
    assert all(kernel.row_lane(kernel.lane_row(lane)) == lane for lane in range(32))
    torch.testing.assert_close(kept, part.sum(1)[rows])


def ldmatrix_emu(smem, addr, trans=False):
    """ldmatrix.x4 on 32 emulated lanes (PTX ISA): lanes 8i .. 8i + 7 address the rows of
    matrix i (`addr[lane]`: (row, column) of 8 values); lane (g, t) = (lane // 4, lane % 4)
    gets (row g, columns 2t, 2t + 1) of each matrix, or with `trans` (rows 2t, 2t + 1, column
    g). Returns regs[lane][i], a pair of values (low half first)."""
    mats = [torch.stack([smem[r, c:c + 8] for r, c in addr[8 * i:8 * i + 8]]) for i in range(4)]
    return [[m[2 * (lane % 4):2 * (lane % 4) + 2, lane // 4] if trans else
             m[lane // 4, 2 * (lane % 4):2 * (lane % 4) + 2] for m in mats] for lane in range(32)]


def mma_emu(a, b, c):
    """mma.sync m16n8k16 on 32 emulated lanes (PTX ISA fragments): a[lane] 4 pairs, b[lane] 2
    pairs, c[lane] 4 values; returns d[lane] as c."""
    A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, 2 * (lane % 4)
        A[g, t:t + 2], A[g + 8, t:t + 2] = a[lane][0], a[lane][1]
        A[g, t + 8:t + 10], A[g + 8, t + 8:t + 10] = a[lane][2], a[lane][3]
        B[t:t + 2, g], B[t + 8:t + 10, g] = b[lane][0], b[lane][1]
    D = A @ B
    return [[c[lane][e] + D[kernel.frag_c(lane, e)] for e in range(4)] for lane in range(32)]


@pytest.mark.parametrize("latent,rope", [(256, 32), (512, 64)])
def test_mma_fragments(latent, rope):
    """The tensor-core path's fragment plumbing on 4 x 32 emulated lanes, with the index
    functions the kernel uses (`ldsm_rows`, `ldsm_queries`, `ldsm_values`, `frag_c`,
    `p_rows`): each warp's scores of its 8 tile rows (nope and rope apart) and its columns of
    p · c_kv equal the matrix products."""
    gen = _cpu_gen()
    Q = torch.randn(kernel.MMA_QUERIES, latent + rope, generator=gen, dtype=torch.float64)
    K = torch.randn(kernel.TILE, latent + rope, generator=gen, dtype=torch.float64)
    P = torch.rand(kernel.MMA_QUERIES, kernel.TILE, generator=gen, dtype=torch.float64)
    warps, zero = 4, [[0.0] * 4 for _ in range(32)]
    cw = latent // warps
    S = torch.full((2, kernel.MMA_QUERIES, kernel.TILE), float("nan"), dtype=torch.float64)
    O = torch.full((kernel.MMA_QUERIES, latent), float("nan"), dtype=torch.float64)
    # lane (g, t)'s A fragments of p: a[ks][h + 2hi] = p[g + 8h, rows 4ks + 2hi of p_rows(t)]
    a = [[[P[lane // 4 + 8 * (k % 2), kernel.p_rows(lane % 4)[4 * ks + 2 * (k // 2)]:][:2]
           for k in range(4)] for lane in range(32)] for ks in range(2)]
    for w in range(warps):
        acc = [zero, zero]  # nope, rope
        for col in range(0, latent + rope, 32):
            kb = ldmatrix_emu(K, [kernel.ldsm_rows(lane, w, col) for lane in range(32)])
            for ks in range(2):
                qa = ldmatrix_emu(Q, [kernel.ldsm_queries(lane, col + 16 * ks)
                                      for lane in range(32)])
                part = int(col >= latent)
                acc[part] = mma_emu(qa, [r[2 * ks:2 * ks + 2] for r in kb], acc[part])
        for lane in range(32):
            for e in range(4):
                m, n = kernel.frag_c(lane, e)
                S[:, m, 8 * w + n] = torch.tensor([acc[0][lane][e], acc[1][lane][e]])
        for cb in range(0, cw, 16):
            for ks in range(2):
                vb = ldmatrix_emu(K, [kernel.ldsm_values(lane, 16 * ks, cw * w + cb)
                                      for lane in range(32)], trans=True)
                for n in range(2):
                    c0 = cw * w + cb + 8 * n
                    c = [[O[kernel.frag_c(lane, e)[0], c0 + kernel.frag_c(lane, e)[1]]
                          if ks else 0.0 for e in range(4)] for lane in range(32)]
                    d = mma_emu(a[ks], [r[2 * n:2 * n + 2] for r in vb], c)
                    for lane in range(32):
                        for e in range(4):
                            m, j = kernel.frag_c(lane, e)
                            O[m, c0 + j] = d[lane][e]
    torch.testing.assert_close(S[0], Q[:, :latent] @ K[:, :latent].T)
    torch.testing.assert_close(S[1], Q[:, latent:] @ K[:, latent:].T)
    torch.testing.assert_close(O, P @ K[:, :latent])
    assert sorted(r for t in range(4) for r in kernel.p_rows(t)) == list(range(kernel.TILE))


@pytest.mark.parametrize("T", range(1, kernel.MAX_TOKENS + 1))
@pytest.mark.parametrize("H", [1, 3, 4, 6, 8])
def test_configs_cover_every_query(T, H, monkeypatch):
    """CUDA cores: queries group·Q + warp·QW + j cover 0 .. H·T - 1 once; whole warps, <= 8
    per CTA. Tensor cores: 16 queries a group, the last group partial. Both: a split count
    in range at every bucket."""
    cfg = kernel.config(T, H, C, R, mma=False)
    q = cfg.queries_per_warp * cfg.warps
    assert 1 <= cfg.warps <= 8 and cfg.queries_per_warp in (1, 2, 4) and not cfg.mma
    assert cfg.groups(T, H) * q == H * T
    cfg = kernel.config(T, H, C, R, mma=True)
    assert cfg.mma and cfg.warps == 4
    assert 0 <= cfg.groups(T, H) * kernel.MMA_QUERIES - H * T < kernel.MMA_QUERIES
    for mma in (False, True):
        monkeypatch.setattr(kernel, "MMA", mma)
        for b in BUCKETS:
            n = kernel.splits(b, T, H, L_CACHE)
            assert 1 <= n <= kernel.MAX_SPLITS


def test_splits_at_tp16_rank(monkeypatch):
    """The split counts of docs/kernels.md (tensor cores, L 4096): at one row a tile per CTA
    (128 CTAs); at T = 1 every bucket in one round of two CTAs per SM; at T = 8 whole rounds."""
    monkeypatch.setattr(kernel, "MMA", True)
    got = {(b, t): kernel.splits(b, t, H_TP16, 4096) for t in (1, 8) for b in BUCKETS}
    assert [got[b, 1] for b in BUCKETS] == [128, 128, 64, 32, 16, 8, 4]
    assert [got[b, 8] for b in BUCKETS] == [43, 43, 22, 11, 11, 8, 4]
    slots = kernel.RESIDENT * kernel.SMS
    assert all(got[b, 1] * b <= slots for b in BUCKETS)
    assert -(-4096 // got[1, 1]) <= kernel.TILE


def test_refusals():
    inp = Inputs(_cpu_gen(), 2, 1, H=2, L=64, device="cpu")
    args = list(inp.args(inp.cache))
    assert kernel.refusal(*args) is None

    def refused(i, value, words):
        assert_refused(kernel.refusal, args, i, value, words)

    refused(0, inp.q_lat.float(), "q_lat:")
    refused(0, inp.q_lat[..., :384], "latent")
    refused(1, inp.q_pe[..., :48], "rope")
    B, T, H = inp.B, inp.T, inp.H
    refused(1, torch.zeros(B, T, H, R + 1, dtype=torch.bfloat16)[..., :R], "q_pe:")
    refused(2, torch.zeros(B, T, C + 4, dtype=torch.bfloat16)[..., :C], "c_kv:")
    refused(3, inp.k_pe.float(), "k_pe:")
    refused(4, inp.cache[..., :C + 32], "kv_cache:")
    refused(4, torch.zeros(*inp.cache.shape[:2], C + R + 4, dtype=torch.bfloat16)[..., :C + R],
            "kv_cache:")
    refused(5, inp.slots.int(), "slots:")
    refused(6, inp.positions.view(-1, 1), "positions:")
    long = Inputs(_cpu_gen(), 1, kernel.MAX_TOKENS + 1, H=1, L=64, device="cpu")
    why = kernel.refusal(*long.args(long.cache))
    assert why and "tokens" in why


def test_off_gpu_runs_the_reference(caplog):
    inp = Inputs(_cpu_gen(), 2, 2, H=2, L=64, device="cpu")
    got_cache, ref_cache = inp.cache.clone(), inp.cache.clone()
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = kernel.mla_decode_cuda(*inp.args(got_cache))
    assert "mla_decode" in caplog.text
    assert torch.equal(got, mla_decode_ref(*inp.args(ref_cache)))
    assert torch.equal(got_cache, ref_cache)
