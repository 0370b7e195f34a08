"""Routed MXFP4 experts: the kernels (kernels/moe_experts.py) against the op's torch reference
(eager) and Inductor's code for the model's math (torch.compile of `mxfp4_experts`), at one K3
TP16 rank (896 experts, top-16, L 3584, I 192).

    python benchmarks/moe_experts.py [--batches 1,8,64]
                                     [--variants kernel,kernel_f16,kernel_by_expert,grouped,
                                                 eager,inductor]
                                     [--out DIR or r.json]
    python benchmarks/moe_experts.py --sweep [--f16] [--batches 1,8,64] [--out DIR]   # configs

A variant `kernel_by_expert_xX` is `kernel_by_expert` with X experts per CTA
(kernels/moe_experts.py BY_EXPERT_EXPERTS; e.g. --variants kernel_f16,kernel_by_expert_x1,
kernel_by_expert_x8). A kernel variant may end in config modifiers, forced at every bucket:
`+cp4` / `+cp8` (FC1 with 4 / 8 warps x 1 row and cp.async), `+rR` (FC2 with R output rows per
CTA), `+sS` (FC2 with S threads per W2 row, `FC2Config.split`), e.g.
`--variants kernel+s1,kernel,kernel_f16+cp8+r8+s2`. The grouped kernels take `+g1F<n>` (fc1g) and
`+g2F<n>` (fc2g), F one of w (warps), b (row blocks), p (steps loaded ahead), e (experts per
CTA), c (1: the weight loads' ring across token tiles, `GroupedConfig.carry`), e.g.
`grouped+g1p4+g2e1+g2c1`.

`kernel` is the per-pair kernels, `kernel_f16` the same with FC1's packed fp16 decode
(K3_MOE_F16), `kernel_by_expert` that with FC1 by expert (K3_MOE_BY_EXPERT: each weight word
decoded once per chunk of the expert's tokens, the same bits as `kernel_f16`; 2-64 rows, at one
row the same as `kernel_f16`), `grouped` the kernels by expert (K3_MOE_GROUPED; at 8-64 rows,
below it the same as `kernel`), each forced for its rows whatever the environment says (the default variants time
`kernel` and `kernel_f16` at one batch before the next: an A/B in one process).
Each variant is captured into a CUDA graph of CALLS calls (benchmarks/graph_timing.py); time per
call = median over replays of graph time / calls. Every call has its own rows and routing: at
one row the calls take disjoint experts (a shuffled cycle over all 896), above it each row draws
top-16 uniformly, so ~1 GB of experts rotate and the L2 (60 MB) does not serve a call from an
earlier one. Bytes = packed weights + scales of the distinct experts a call touches (mean over
the calls); "% copy" compares bytes / time with a 4 GiB device-to-device copy (read + write)
measured in the same run. Kernel and eager rows come first, Inductor's (a compile per batch)
last; the JSON is rewritten after every row, so a timeout keeps what was measured.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import re
import time
from pathlib import Path

import torch
from gemv import copy_gbps
from graph_timing import graph_us
from k3compile.kernels import moe_experts as kernel

from k3compile import settings
from k3compile.math import mxfp4_experts
from k3compile.models import mxfp4
from k3compile.ops.moe_experts import e2m1_table, moe_experts_ref

EXPERTS, TOP_K, LATENT, INTER = 896, 16, 3584, 192
BETA, LINEAR_BETA = 4.0, 25.0
EXPERT_BYTES = 3 * INTER * LATENT // 2 * 17 // 16  # W1, W3, W2: nibbles + one scale per 32
CALLS, REPLAYS = 16, 20


def make_experts():
    w1 = mxfp4.random_mxfp4((EXPERTS, INTER, LATENT), LATENT ** -0.5, device="cuda")
    w3 = mxfp4.random_mxfp4((EXPERTS, INTER, LATENT), LATENT ** -0.5, device="cuda")
    w2 = mxfp4.random_mxfp4((EXPERTS, LATENT, INTER), INTER ** -0.5, device="cuda")
    return (*w1, *w3, *w2)


def make_calls(n: int, top_k: int = TOP_K):
    """CALLS inputs (z, ids, weights) of n rows; see the module docstring for the routing."""
    cycle = torch.randperm(EXPERTS, device="cuda")
    calls = []
    for c in range(CALLS):
        z = torch.randn(n, LATENT, device="cuda").bfloat16()
        if n == 1:
            ids = cycle[(c * top_k + torch.arange(top_k, device="cuda")) % EXPERTS][None]
        else:
            ids = torch.rand(n, EXPERTS, device="cuda").argsort(-1)[:, :top_k]
        w = torch.rand(n, top_k, device="cuda") + 0.1
        calls.append((z, ids, w / w.sum(-1, keepdim=True)))
    return calls


# the kernel variants: settings.KERNELS fields forced while they run
KERNEL_VARIANTS = {"kernel": {"moe_grouped": False, "moe_f16": False, "moe_by_expert": False},
                   "kernel_f16": {"moe_grouped": False, "moe_f16": True, "moe_by_expert": False},
                   "kernel_by_expert": {"moe_grouped": False, "moe_f16": True,
                                        "moe_by_expert": True},
                   "grouped": {"moe_grouped": True, "moe_f16": False, "moe_by_expert": False}}


def experts_per_cta(name: str) -> int | None:
    """X of a variant `kernel_by_expert_xX` (modifiers aside), else None."""
    m = re.fullmatch(r"kernel_by_expert_x(\d+)", name.split("+")[0])
    return int(m.group(1)) if m else None


# FC1 config modifiers after a kernel variant's name ("kernel_f16+cp8"; FC2's: "+r8", "+s2")
FC1_MODS = {"cp4": {"warps": 4, "rows_per_warp": 1, "cp_async": True},
            "cp8": {"warps": 8, "rows_per_warp": 1, "cp_async": True}}


# grouped-kernel config modifiers ("grouped+g1p4+g2e1"): stage g1 (fc1g) or g2 (fc2g), then a
# GroupedConfig field (w warps, b row blocks, p prefetch, e experts per CTA, c carry) and its
# value
GROUPED_MOD = re.compile(r"g([12])([wbpec])(\d+)")
GROUPED_FIELDS = {"w": "warps", "b": "row_blocks", "p": "prefetch", "e": "experts_per_cta",
                  "c": "carry"}


def grouped_mods(mods) -> dict:
    """{"fc1g" / "fc2g": {GroupedConfig field: value}} of a variant's grouped modifiers."""
    out = {}
    for m in mods:
        if match := GROUPED_MOD.fullmatch(m):
            stage, field, value = match.groups()
            value = bool(int(value)) if field == "c" else int(value)
            out.setdefault(f"fc{stage}g", {})[GROUPED_FIELDS[field]] = value
    return out


def is_kernel(name: str) -> bool:
    return name.split("+")[0] in KERNEL_VARIANTS or experts_per_cta(name) is not None


@contextlib.contextmanager
def kernel_variant(name: str):
    """`KERNEL_VARIANTS[base]` set on settings.KERNELS while open (read at each call); a
    `kernel_by_expert_xX` variant also sets the by-expert FC1's experts per CTA, and with
    modifiers (`FC1_MODS`, `+rR`, `+sS`) FC1's or FC2's config is replaced at every bucket."""
    base, *mods = name.split("+")
    x = experts_per_cta(base)
    values = KERNEL_VARIANTS["kernel_by_expert" if x else base]
    before = {k: getattr(settings.KERNELS, k) for k in values}
    x_before = kernel.BY_EXPERT_EXPERTS
    default = kernel.config
    fc1 = {k: v for m in mods if m in FC1_MODS for k, v in FC1_MODS[m].items()}
    grp = grouped_mods(mods)
    # FC2's "r" rows, "s" split
    fc2 = {m[0]: int(m[1:]) for m in mods if m not in FC1_MODS and not GROUPED_MOD.fullmatch(m)}
    for k, v in values.items():
        setattr(settings.KERNELS, k, v)
    if x:
        kernel.BY_EXPERT_EXPERTS = x

    def config(stage, latent, inter, top_k, b):
        cfg = default(stage, latent, inter, top_k, b)
        if stage == "fc1" and fc1:
            return dataclasses.replace(cfg, **fc1)
        if stage == "fc2" and fc2:
            rows, split = fc2.get("r", cfg.rows_per_cta), fc2.get("s", cfg.split)
            return dataclasses.replace(cfg, rows_per_cta=rows, split=split,
                                       threads=kernel.fc2_threads(rows, top_k, split))
        if stage in grp:
            return dataclasses.replace(cfg, **grp[stage])
        return cfg

    if fc1 or fc2 or grp:
        kernel.config = config
    try:
        yield
    finally:
        kernel.config = default
        for k, v in before.items():
            setattr(settings.KERNELS, k, v)
        kernel.BY_EXPERT_EXPERTS = x_before


def variant_fn(name: str, experts, compiled=None):
    if is_kernel(name):
        def call(z, ids, w, out):
            with kernel_variant(name):
                return kernel.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA, out=out)
        return call
    if name == "eager":
        return lambda z, ids, w, out: moe_experts_ref(z, ids, w, *experts, BETA, LINEAR_BETA)
    lut = e2m1_table(torch.device("cuda"), torch.bfloat16)
    return lambda z, ids, w, out: compiled(z, ids, w, lut, *experts, BETA, LINEAR_BETA)


def time_variant(fn, calls) -> float:
    outs = [torch.empty_like(z) for z, _, _ in calls]
    steps = [functools.partial(fn, *call, out) for call, out in zip(calls, outs)]
    return graph_us(steps, steps[:2], REPLAYS)


def check(experts, calls, variant="kernel"):
    """The kernels ran and agree with the reference (a benchmark of wrong results is worthless)."""
    z, ids, w = calls[0]
    out = torch.empty_like(z)
    with kernel_variant(variant):
        got = kernel.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA, out=out)
    assert got is out, "moe_experts refused the inputs (see the log)"
    ref = moe_experts_ref(z, ids, w, *experts, BETA, LINEAR_BETA).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"moe_experts disagrees with the reference: relative error {err:.2e}"


def run(batches, variants, gbps, experts, save):
    rows = {}
    inputs = {n: make_calls(n) for n in batches}
    order = [v for v in variants if is_kernel(v) or v == "eager"]
    plan = [(n, v) for n in batches for v in order if v.startswith("kernel")]
    plan += [(n, v) for v in order for n in batches if not v.startswith("kernel")]
    plan += [(n, "inductor") for n in batches if "inductor" in variants]
    compiled = torch.compile(mxfp4_experts, dynamic=False) if "inductor" in variants else None
    for n, name in plan:
        calls = inputs[n]
        if is_kernel(name) and name != "kernel":
            check(experts, calls, name)
        if n not in rows:
            check(experts, calls)
            distinct = sum(len(torch.unique(ids)) for _, ids, _ in calls) / len(calls)
            moved = distinct * EXPERT_BYTES
            rows[n] = {"batch": n, "distinct_experts": round(distinct, 1),
                       "MB": round(moved / 1e6, 2), "floor_us": round(moved / gbps / 1e3, 2)}
        t0 = time.time()
        us = time_variant(variant_fn(name, experts, compiled), calls)
        row = rows[n]
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_pct_copy"] = round(100 * row["MB"] * 1e6 / us / 1e3 / gbps, 1)
        for other in ("eager", "inductor"):
            if f"{other}_us" in row and "kernel_us" in row:
                row[f"kernel_speedup_vs_{other}"] = round(row[f"{other}_us"] / row["kernel_us"], 2)
        for other in [v for v in variants if is_kernel(v) and v != "kernel"]:
            if f"{other}_us" in row and "kernel_us" in row:
                row[f"{other}_speedup_vs_kernel"] = round(row["kernel_us"] / row[f"{other}_us"], 2)
        for other in [v for v in variants if v.startswith("kernel_by_expert")]:
            if f"{other}_us" in row and "kernel_f16_us" in row:
                row[f"{other}_speedup_vs_kernel_f16"] = round(
                    row["kernel_f16_us"] / row[f"{other}_us"], 3)
        print(f"B{n:<3} {name:16s} {us:9.2f} us  {row[f'{name}_pct_copy']:5.1f}% of copy  "
              f"({row['distinct_experts']} experts, {row['MB']} MB, floor {row['floor_us']} us; "
              f"{time.time() - t0:.0f} s)", flush=True)
        save(list(rows.values()))
    return list(rows.values())




def candidates(n: int, f16: bool = False):
    """(stage, config) timed at batch n: FC1 warps x rows per warp, weights to registers (the
    default) or by cp.async per lane step; then every FC2 config (`f16`: all with the packed
    fp16 decode)."""
    fc1 = kernel.FC1Config
    cands = [fc1(w, r, a, f16) for a in (False, True) for w in (2, 4, 8) for r in (1, 2, 4)]
    out = [("fc1", c) for c in cands if kernel.fc1_fits(LATENT, c)]
    return out + [("fc2", kernel.FC2Config(r, r * TOP_K, f16)) for r in (8, 16, 32, 64)]


def sweep(batches, experts, save, f16=False):
    """Time the kernels with every FC1 config of `candidates` (FC2 at its default), then every
    FC2 config (FC1 at its default)."""
    default = kernel.config
    rows = []
    try:
        for n in batches:
            calls = make_calls(n)
            for stage, cfg in candidates(n, f16):
                kernel.config = lambda s, *a, stage=stage, cfg=cfg: cfg if s == stage \
                    else default(s, *a)
                check(experts, calls)
                us = time_variant(variant_fn("kernel", experts), calls)
                rows.append({"batch": n, "stage": stage, "config": str(cfg), "us": round(us, 2)})
                print(f"B{n:<3} {stage} {cfg}: {us:.2f} us", flush=True)
                save(rows)
    finally:
        kernel.config = default
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--variants", default="kernel,kernel_f16,grouped,eager,inductor")
    ap.add_argument("--sweep", action="store_true", help="time the kernels' configs instead")
    ap.add_argument("--f16", action="store_true", help="--sweep: FC1 configs with K3_MOE_F16")
    ap.add_argument("--out")
    opts = ap.parse_args()
    from k3compile.kernels.common.dsl import runtime_refusal

    assert torch.cuda.is_available() and not runtime_refusal(), runtime_refusal() or "no GPU"
    torch.manual_seed(0)
    batches = [int(b) for b in opts.batches.split(",")]
    gbps = copy_gbps()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"4 GiB device copy: {gbps:.0f} GB/s (read + write)", flush=True)
    path = Path(opts.out) if opts.out else None
    if path is not None and path.suffix != ".json":
        path.mkdir(parents=True, exist_ok=True)
        path = path / ("moe_experts_sweep.json" if opts.sweep else "moe_experts.json")

    def save(rows):
        if path is not None:
            path.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "copy_GBps": round(gbps), "sweep": opts.sweep,
                                        "expert_bytes": EXPERT_BYTES, "rows": rows}, indent=1))

    experts = make_experts()
    if opts.sweep:
        sweep(batches, experts, save, opts.f16)
        return
    rows = run(batches, opts.variants.split(","), gbps, experts, save)
    print("\n| batch | experts | MB | floor µs | kernel µs | % copy | kernel_f16 µs | % copy | "
          "kernel_by_expert µs | % copy | grouped µs | % copy | eager µs | inductor µs | vs eager | vs inductor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['distinct_experts']} | {r['MB']} | {r['floor_us']} | "
              f"{r.get('kernel_us', '-')} | {r.get('kernel_pct_copy', '-')} | "
              f"{r.get('kernel_f16_us', '-')} | {r.get('kernel_f16_pct_copy', '-')} | "
              f"{r.get('kernel_by_expert_us', '-')} | {r.get('kernel_by_expert_pct_copy', '-')} | "
              f"{r.get('grouped_us', '-')} | {r.get('grouped_pct_copy', '-')} | "
              f"{r.get('eager_us', '-')} | {r.get('inductor_us', '-')} | "
              f"x{r.get('kernel_speedup_vs_eager', '-')} | "
              f"x{r.get('kernel_speedup_vs_inductor', '-')} |")


if __name__ == "__main__":
    main()
