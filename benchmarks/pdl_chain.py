"""A chain of our decode kernels with programmatic dependent launch off and on (`common.settings.KERNELS.pdl`).

    python benchmarks/pdl_chain.py [--m 1,8] [--out DIR or r.json]

The shared expert into the next mix at one K3 TP16 rank (tests/kernels/test_pdl.py checks it):
rms_norm -> GEMM gate|up (768 x 7168) -> situ -> GEMM down (7168 x 384, + residual) ->
attn_res_mix_norm (9 sources); the GEMMs are gemv at one row, gemm_tc above. Timed as
benchmarks/gemv.py times a GEMM: CUDA-graph replay of >= CALLS chains, each reading the next copy
of both GEMM weights (enough copies that the L2 does not serve them); median µs per chain. Both
settings must give bitwise the same outputs.
"""


from k3compile import settings
import torch
from gemv import chain_main, graph_us, weight_copies
from k3compile.kernels import attn_res_mix_norm, rms_norm, situ_gate_up
from k3compile.kernels.common import gemm_tc, gemv

HIDDEN, SHARED, BLOCKS, EPS, BETA, LINEAR_BETA = 7168, 384, 8, 1e-5, 4.0, 25.0
KERNELS = 5  # launches per chain


def buffers(m):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).bfloat16()

    b = {"x": randn(m, HIDDEN, scale=4), "prefix": randn(m, HIDDEN, scale=2),
         "bank": randn(m, BLOCKS, HIDDEN), "mix_proj_w": randn(1, HIDDEN, scale=3 / HIDDEN ** 0.5)}
    for name in ("norm_w", "mix_norm_w", "out_norm_w"):
        b[name] = 1 + randn(HIDDEN, scale=0.2)
    for name, width in (("h", HIDDEN), ("gu", 2 * SHARED), ("a", SHARED), ("d", HIDDEN),
                        ("p", HIDDEN), ("y", HIDDEN)):
        b[name] = torch.empty(m, width, device="cuda", dtype=torch.bfloat16)
    return b


def chain(b, weights):
    w_gu, w_down = weights
    gemm = gemv.gemv_cuda if b["x"].shape[0] == 1 else gemm_tc.gemm_tc_cuda
    ran = [rms_norm.rms_norm_cuda(b["x"], b["norm_w"], EPS, out=b["h"]) is b["h"],
           gemm(b["h"], w_gu, out=b["gu"]) is b["gu"],
           situ_gate_up.situ_cuda(b["gu"], BETA, LINEAR_BETA, out=b["a"]) is b["a"],
           gemm(b["a"], w_down, b["x"], out=b["d"]) is b["d"],
           attn_res_mix_norm.attn_res_mix_norm_cuda(
               b["prefix"], b["d"], [b["bank"][:, j] for j in range(BLOCKS)], b["mix_norm_w"],
               b["mix_proj_w"], b["out_norm_w"], EPS, EPS, out=(b["p"], b["y"]))[1] is b["y"]]
    assert all(ran), f"a kernel fell back to torch (see the log): {ran}"


def run(ms):
    rows = []
    weights = list(zip(weight_copies(2 * SHARED, HIDDEN), weight_copies(HIDDEN, SHARED)))
    for m in ms:
        b = buffers(m)
        us, outs = {}, {}
        for pdl in (False, True):
            settings.KERNELS.pdl = pdl
            chain(b, weights[0])
            outs[pdl] = [b[k].clone() for k in ("h", "gu", "a", "d", "p", "y")]
            us[pdl] = graph_us(lambda w, b=b: chain(b, w), weights)
        assert all(torch.equal(*pair) for pair in zip(outs[False], outs[True])), \
            "PDL changed a result"
        row = {"M": m, "kernels": KERNELS, "off_us": round(us[False], 2),
               "on_us": round(us[True], 2), "saved_us": round(us[False] - us[True], 2),
               "saved_per_launch_us": round((us[False] - us[True]) / KERNELS, 2)}
        rows.append(row)
        print(f"M={m:2d}  PDL off {row['off_us']:6.2f} us  on {row['on_us']:6.2f} us  "
              f"saved {row['saved_us']:5.2f} us ({row['saved_per_launch_us']:.2f} per launch)",
              flush=True)
    return rows


if __name__ == "__main__":
    chain_main(__doc__, "pdl_chain", run, "1,8")
