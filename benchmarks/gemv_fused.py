"""gemv's one-launch variants against the two launches each replaces, at one K3 TP16 rank's shapes.

    python benchmarks/gemv_fused.py [--m 1,2] [--out DIR or r.json]

    norm_linear   rms_norm (3584) -> gemv [7168, 3584] + residual  vs  gemv with the norm prologue
    situ_gate_up  gemv [768, 7168] -> situ (384)                   vs  gemv with the SiTU epilogue
    moe_front     gemv [896, 7168] fp32, gemv [3584, 7168]         vs  one gemv over [W_r; W_d]

Timed as benchmarks/gemv.py times a GEMM (CUDA-graph replay, each call reading the next copy of
the weights so that the L2 does not serve them; median µs per call), with PDL off and on
(`common.settings.KERNELS.pdl`). The fused results must equal the two launches' (bitwise for SiTU and the
split; within the bf16 tolerance for the norm, whose sum of squares is added in another order).
"""


from k3compile import settings
import torch
from gemv import chain_main, graph_us, weight_copies
from k3compile.kernels import rms_norm, situ_gate_up
from k3compile.kernels.common import gemv

HIDDEN, LATENT, EXPERTS, SHARED, EPS, BETA, LINEAR_BETA = 7168, 3584, 896, 384, 1e-5, 4.0, 25.0


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


def norm_case(m):
    u, g, r = randn(m, LATENT, scale=3), 1 + randn(LATENT, scale=0.1), randn(m, HIDDEN)
    h, y = torch.empty_like(u), torch.empty(m, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def two(w):
        rms_norm.rms_norm_cuda(u, g, EPS, out=h)
        return gemv.gemv_cuda(h, w, r, out=y)

    return (HIDDEN, LATENT), two, lambda w: gemv.gemv_norm_cuda(u, g, w, EPS, r, out=y), False


def situ_case(m):
    x = randn(m, HIDDEN)
    gu, a = (torch.empty(m, width, device="cuda", dtype=torch.bfloat16)
             for width in (2 * SHARED, SHARED))

    def two(w):
        gemv.gemv_cuda(x, w, out=gu)
        return situ_gate_up.situ_cuda(gu, BETA, LINEAR_BETA, out=a)

    return (2 * SHARED, HIDDEN), two, \
        lambda w: gemv.gemv_situ_cuda(x, w, BETA, LINEAR_BETA, out=a), True


def front_case(m):
    x = randn(m, HIDDEN)
    logits = torch.empty(m, EXPERTS, device="cuda")
    z = torch.empty(m, LATENT, device="cuda", dtype=torch.bfloat16)

    def two(w):  # the same bytes as two weights
        return (gemv.gemv_cuda(x, w[:EXPERTS], out=logits),
                gemv.gemv_cuda(x, w[EXPERTS:], out=z))

    return (EXPERTS + LATENT, HIDDEN), two, \
        lambda w: gemv.gemv_split_cuda(x, w, EXPERTS, out=logits, out2=z), True


CASES = {"norm_linear": norm_case, "situ_gate_up": situ_case, "moe_front": front_case}


def outputs(call, w):
    out = call(w)
    return [t.clone() for t in (out if isinstance(out, tuple) else (out,))]


def run(ms):
    rows = []
    for name, case in CASES.items():
        for m in ms:
            (n, k), two, one, exact = case(m)
            weights = weight_copies(n, k)
            row = {"op": name, "M": m, "N": n, "K": k}
            for pdl in (False, True):
                settings.KERNELS.pdl = pdl
                want, got = outputs(two, weights[0]), outputs(one, weights[0])
                for g, w in zip(got, want, strict=True):
                    if exact:
                        assert torch.equal(g, w), f"{name}: the one launch differs from the two"
                    else:
                        torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)
                tag = "pdl" if pdl else "plain"
                row[f"two_{tag}_us"] = round(graph_us(two, weights), 2)
                row[f"one_{tag}_us"] = round(graph_us(one, weights), 2)
            settings.KERNELS.pdl = False
            rows.append(row)
            print(f"{name:13s} M={m:2d}  two launches {row['two_plain_us']:6.2f} us (PDL "
                  f"{row['two_pdl_us']:6.2f})  one {row['one_plain_us']:6.2f} us (PDL "
                  f"{row['one_pdl_us']:6.2f})", flush=True)
            del weights
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    chain_main(__doc__, "gemv_fused", run, "1")
