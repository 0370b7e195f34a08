"""The kernels issue 21 asks to profile, not guess at, for Nsight Compute: the routed MXFP4 experts
(FC1 and FC2, per-pair kernels) at 8 and 64 rows (`--rows`; `--variant` a kernel variant of
benchmarks/moe_experts.py, e.g. kernel+s1), and the weight-streaming GEMV at M = 1 on the
two shapes that fall short of copy bandwidth (2112x7168, 896x7168) beside one that does not
(3206x7168). Each case is compiled and warmed outside the profiled range, then called once inside a
profiler range (and an NVTX range named after the case), with weights that are not L2-resident.

    ncu --clock-control none --profile-from-start off --nvtx --set full \
        -o OUT/kernels python3 benchmarks/profile_kernels.py [all|gemv|moe|moe_by_expert|gemm_tc]
        [--rows 1,2,4] [--variant kernel]
    (benchmarks/profile_h200.sh runs it and writes the per-kernel tables)

`moe_by_expert` (issue 21, FC1 by expert): the expert step at 8 and 64 rows with FC1 per pair
(fp16 decode) and by expert with 1 and 8 experts per CTA
(benchmarks/moe_experts.py's variants), each in its own NVTX range.

`gemm_tc` (issue 21, the skinny tensor-core GEMM at 55-75% of copy speed): gemm_tc at 8 rows
on one KDA + MoE layer's shapes at `gemm_tc.config` (the tuned table's on the GPU it was tuned
on, the heuristic's on any other, e.g. an H100), the moe_front split and the shared experts'
SiTU as their one-launch variants, and the KDA in-projection at 2 and 16 rows.
"""

import argparse
import functools

import torch
import torch.nn.functional as F
from gemv import check as gemv_check
from gemv import weight_copies
from k3compile.kernels import moe_experts as kernel
from k3compile.kernels.common import gemm_tc, gemv
from moe_experts import BETA, LINEAR_BETA, kernel_variant, make_calls, make_experts

from k3compile.math import situ

GEMV_SHAPES = [(2112, 7168), (896, 7168), (3206, 7168)]
MOE_ROWS = [8, 64]
BY_EXPERT_VARIANTS = ["kernel_f16", "kernel_by_expert_x1", "kernel_by_expert_x8"]
# (variant, N, K, rows, split / I): one TP16 rank's KDA + MoE layer (benchmarks/gemm_tc.py)
GEMM_TC_CASES = [("plain", 3206, 7168, 8, 0), ("split", 4480, 7168, 8, 896),
                 ("situ", 768, 7168, 8, 384), ("plain", 7168, 384, 8, 0),
                 ("plain", 7168, 768, 8, 0), ("plain", 7168, 3584, 8, 0),
                 ("plain", 3206, 7168, 2, 0), ("plain", 3206, 7168, 16, 0)]


def profiled(name: str, fn) -> None:
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # ncu --profile-from-start off: only what runs in here
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()


def profile_moe(moe_rows, variants, name) -> None:
    """The expert step of each variant (benchmarks/moe_experts.py's) at each of moe_rows:
    compiled and warmed, then one profiled call on other experts (not L2-resident), in the NVTX
    range name(variant, rows)."""
    experts = make_experts()
    for rows in moe_rows:
        for variant in variants:
            with kernel_variant(variant):
                (z, ids, w), *_ = make_calls(rows)
                out = torch.empty_like(z)
                got = kernel.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA, out=out)
                assert got is out, "moe_experts refused the inputs (see the log)"
                (z, ids, w), *_ = make_calls(rows)
                profiled(name(variant, rows), functools.partial(
                    kernel.moe_experts_cuda, z, ids, w, *experts, BETA, LINEAR_BETA, out=out))
            print(f"moe_experts {rows} rows ({variant}): profiled", flush=True)


def gemm_tc_call(variant: str, x, w, part: int):
    if variant == "split":
        return functools.partial(gemm_tc.gemm_tc_split_cuda, x, w, part)
    if variant == "situ":
        return functools.partial(gemm_tc.gemm_tc_situ_cuda, x, w, BETA, LINEAR_BETA)
    return functools.partial(gemm_tc.gemm_tc_cuda, x, w)


def profile_gemm_tc() -> None:
    """Each of GEMM_TC_CASES at `gemm_tc.config` (shapes the table gives cuBLAS still run the
    kernel, at the heuristic config): compiled and checked against cuBLAS on one weight copy,
    then one profiled call on another (not L2-resident)."""
    for variant, n, k, rows, part in GEMM_TC_CASES:
        weights = weight_copies(n, k)
        x = torch.randn(rows, k, device="cuda").bfloat16()
        got = gemm_tc_call(variant, x, weights[0], part)()
        ref = F.linear(x, weights[0])
        if variant == "split":
            got, ref = torch.cat([got[0], got[1].float()], 1), ref.float()
        elif variant == "situ":
            ref = situ(*ref.split(part, dim=-1), BETA, LINEAR_BETA)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, f"gemm_tc {variant} {n}x{k}: relative error {err:.2e}"
        profiled(f"gemm_tc_{variant}_{n}x{k}_m{rows}", gemm_tc_call(variant, x, weights[-1], part))
        print(f"gemm_tc {variant} {n}x{k} {rows} rows: profiled", flush=True)
        del weights
        torch.cuda.empty_cache()


def main(which: str, moe_rows=MOE_ROWS, variant: str = "kernel") -> None:
    if which == "moe_by_expert":
        return profile_moe(moe_rows, BY_EXPERT_VARIANTS, lambda v, rows: f"{v}_{rows}")
    if which == "gemm_tc":
        return profile_gemm_tc()
    for n, k in GEMV_SHAPES if which in ("all", "gemv") else []:
        weights = weight_copies(n, k)
        x = torch.randn(1, k, device="cuda").bfloat16()
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        gemv_check(x, weights[0], out)  # compiles, and the kernel agrees with cuBLAS
        profiled(f"gemv_{n}x{k}", functools.partial(gemv.gemv_cuda, x, weights[-1], out=out))
        print(f"gemv {n}x{k}: profiled", flush=True)
    if which not in ("all", "moe"):
        return
    profile_moe(moe_rows, [variant], lambda _, rows: f"moe_experts_{rows}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("which", nargs="?", default="all",
                    choices=["all", "gemv", "moe", "moe_by_expert", "gemm_tc"])
    ap.add_argument("--rows", default=",".join(map(str, MOE_ROWS)), help="MoE rows, e.g. 1,2,4")
    ap.add_argument("--variant", default="kernel", help="a kernel variant of moe_experts.py")
    opts = ap.parse_args()
    main(opts.which, [int(r) for r in opts.rows.split(",")], opts.variant)
