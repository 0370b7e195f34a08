"""Decoder layers 1-4 of Kimi K3 under tensor parallelism over W processes (one GPU each): per
layer time, kernels and bytes per rank for eager, `backend="k3"`, k3 without its `shard` stage
and Inductor, each compiled variant replayed as a CUDA graph. The per-layer yardstick of
benchmarks/decode_layer.py (whose classes and functions this reuses) at world size W.

    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/tp_decode.py --out $OUT
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_decode.py \\
        --smoke --device cpu --out out                       # CPU, gloo, tiny config: seconds

The model: `get_config(--config).with_tp(W)` (default "k3": the real K3 at one rank's TP=W
shapes), layers 1-4 (KDA, KDA, MLA, KDA, all MoE), all-reducing over the WORLD group. Every rank
holds its slice of one full model: replicated tensors come from build_model's seeded init (the
same on every rank) and each split tensor (heads, expert intermediates, row-parallel inputs) is
redrawn from a (seed, name, rank) stream (`shard_weights`), so the ranks' outputs must be equal.

Per batch bucket (default 1, 8, 64 single-token decode) and variant:

* correctness: the decode_layer check (outputs and written state against eager bf16 and an fp32
  twin, under `check_weights`) on every rank, and the outputs (prefix, delta, the MLA cache rows
  written; the other state is split by head) all-gathered: max |out_r - out_0| over ranks;
* time: median over CUDA-graph replays (eager: plain calls) of one step / 4, every call preceded
  by a device synchronize and a barrier so the ranks start it together; per rank, the max over
  ranks reported (a collective waits for the slowest rank);
* kernels per layer (rank 0's; each rank's is in the JSON);
* bytes per rank per layer: decode_layer's byte model at the rank's shapes; the router, latent
  down and latent up projections count whole (replicated, as in vLLM) for eager, Inductor and
  k3_noshard, and 1/W for k3 where its shard stage rewrote them (its report, per compiled graph);
  floor = bytes / the device-to-device copy bandwidth measured at the start (slowest rank).

Eager and the fp32 twin dequantise every routed expert slice of every token (K3 at TP=2, B=64:
~100 GB): on a GPU the check's reference calls run in row chunks that fit in free memory (rows
are independent requests), and eager is not timed where one whole call would not fit.

Rank 0 writes tp_decode.json and tp_decode.txt (the table) under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# run as a script from anywhere: this source tree's k3compile (no install needed), and
# decode_layer.py next to this file
for _path in (str(ROOT), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import decode_layer as dl
import torch
import torch.distributed as dist

from k3compile.models import get_config

VARIANTS = ("eager", "k3", "k3_noshard", "inductor")  # compile order: k3 first after eager
COLLECTIVE_ENV = {  # NVLink multicast off: it can put a shared host's GPUs out of service
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
}
# Bytes of device memory one token costs eager per element of one routed expert matrix it
# dequantises (k x I x L per matrix): the int64 nibble codes, the looked-up values, their stack
# and scaled copy, and the two matrices already dequantised (math.mxfp4_dequant, MXFP4Experts).
DEQUANT_BYTES = {torch.bfloat16: 20, torch.float32: 30}
MEMORY_SHARE = 0.6  # of the free device memory an eager or fp32 reference call may take


# ---- ranks -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ranks:
    """This process in the tensor-parallel world. `ctrl` is a gloo group for the benchmark's own
    bookkeeping (agreeing, gathering results), apart from the model's collectives."""

    rank: int
    world: int
    device: torch.device
    group: object
    ctrl: object

    def gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def max(self, x: float) -> float:
        return max(self.gather(x))

    def lockstep(self):
        """Every rank idle and released together: a timed call then measures the step, not one
        rank waiting in a collective for another still finishing its previous call."""
        dl.sync(self.device)
        dist.barrier(group=self.ctrl)

    def spread(self, tensors: dict[str, torch.Tensor]) -> float:
        """max |t_r - t_0| over ranks r, of tensors that must be equal on every rank."""
        flat = torch.cat([t.detach().float().flatten().cpu() for t in tensors.values()])
        parts = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(parts, flat, group=self.ctrl)
        return max(float((p - parts[0]).abs().max()) for p in parts)


def init_ranks(args) -> Ranks:
    for key, value in COLLECTIVE_ENV.items():
        os.environ.setdefault(key, value)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout_s)  # a hung rank fails, never waits forever
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                            **({"device_id": device} if cuda else {}))
    # the bookkeeping outwaits the model's collectives: a rank that failed alone waits there
    # until the others' collective times out, and then they meet again
    ctrl = dist.new_group(backend="gloo", timeout=2 * timeout)
    return Ranks(dist.get_rank(), dist.get_world_size(), device, dist.group.WORLD, ctrl)


# ---- model -------------------------------------------------------------------------------------

@torch.no_grad()
def shard_weights(model, seed: int, rank: int, world: int):
    """Make the ranks' slices one full model. build_model draws each tensor from a (seed, name)
    stream at the rank's shape, so every rank would hold the same slice of a split tensor (a
    full model with each head repeated W times, its all-reduces W x one rank's part). Here each
    split tensor is redrawn from a (seed, name, rank) stream, row-parallel linears scaled by
    W^-1/2 (their full input width is W x the rank's). Replicated tensors are left as drawn."""
    from k3compile.models.k3 import _init_param, _name_seed
    from k3compile.models.loader import _split_dim

    if world == 1:
        return
    for name, p in model.named_parameters():
        dim = _split_dim(name, model.config)
        if dim is None:
            continue
        stream = _name_seed(seed, f"{name}@{rank}/{world}")
        gen = torch.Generator(device=p.device).manual_seed(stream)
        _init_param(name, p, gen, model.config)
        if dim == -1 and p.is_floating_point():
            p.mul_(world**-0.5)


def replicated_moe_bytes(stack) -> dict[str, float]:
    """Mean bytes per layer of the projections vLLM replicates and stage `shard` splits."""
    def nbytes(w):
        return w.numel() * w.element_size()

    front = up = 0
    for layer in stack.layers:
        moe = layer.mlp
        front += nbytes(moe.gate.weight) + nbytes(moe.routed_expert_down_proj.weight)
        up += nbytes(moe.routed_expert_up_proj.weight)
    n = len(stack.layers)
    return {"front": front / n, "up": up / n}


def dequant_elements(stack) -> int:
    """Elements of the routed expert matrices one token dequantises in eager, per matrix."""
    experts = stack.layers[0].mlp.experts
    _, inter, half_width = experts.w1_packed.shape
    return stack.layers[0].mlp.gate.top_k * inter * 2 * half_width


def row_caps(ranks: Ranks, stack, tokens: int) -> dict[str, int | None]:
    """Rows (requests) one eager bf16 / fp32 call may take without running out of memory; None:
    no limit (CPU). The smallest over ranks, so every rank chunks alike."""
    if ranks.device.type != "cuda":
        return {"bf16": None, "fp32": None}
    torch.cuda.empty_cache()
    free = min(ranks.gather(torch.cuda.mem_get_info(ranks.device)[0]))
    per_row = tokens * dequant_elements(stack)
    return {key: max(1, int(MEMORY_SHARE * free / (per_row * DEQUANT_BYTES[dtype])))
            for key, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}


def _smaller(a: int | None, b: int | None) -> int | None:
    """The tighter of two row limits (None: no limit)."""
    limits = [x for x in (a, b) if x]
    return min(limits) if limits else None


def in_rows(fn, inputs: list, rows: int | None):
    """fn(*inputs) over at most `rows` batch rows a call, outputs concatenated (every input and
    output is batch-first; rows are independent requests with their own state slots)."""
    batch = inputs[0].shape[0]
    if rows is None or batch <= rows:
        return fn(*inputs)
    parts = [fn(*[t[i:i + rows] for t in inputs]) for i in range(0, batch, rows)]
    return tuple(torch.cat(outs) for outs in zip(*parts))


def routing_by_layer(indices: list[torch.Tensor], layers: int) -> list[torch.Tensor]:
    """TopkRecorder's indices of chunked calls (layers 1-4 per chunk) regrouped per layer."""
    return [torch.cat(indices[i::layers]) for i in range(layers)]


def as_plain(tensors: list) -> list:
    """Inputs as plain tensors: layer 0's output may be a not-yet-waited collective result."""
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]


# ---- variants ----------------------------------------------------------------------------------

def compiled_variants(args, device) -> dict[str, dict]:
    """name -> how to build it, or a note why it is not run."""
    out: dict[str, dict] = {}
    backend, note = dl.resolve_k3()
    base = {"cuda_graphs": False}  # the benchmark captures every variant the same way
    if args.k3_executor:
        base["executor"] = args.k3_executor
    # the effect of router / latent sharding: forced on (k3) vs the stage off (k3_noshard); the
    # backend's default ("auto") picks by its cost model
    for name, options in (("k3", {**base, "shard_moe": "on"}),
                          ("k3_noshard", {**base, "disabled_stages": {"shard"}})):
        if name not in args.variants:
            out[name] = {"na": "n/a: not requested (--variants)"}
        elif backend is None:
            out[name] = {"na": note}
        else:
            out[name] = {"backend": backend, "options": options, "graphs": True, "label": name}
    if "inductor" in args.variants:
        backend = "inductor" if device.type == "cuda" else args.cpu_backend
        out["inductor"] = {"backend": backend, "options": None, "graphs": True, "label": backend}
    else:
        out["inductor"] = {"na": "n/a: not requested (--variants)"}
    return out


def shard_counts(compiled: list, world: int) -> dict:
    """What stage `shard` did in the k3 graphs compiled for one variant."""
    sharded, skipped = [], []
    for c in compiled:
        for notes in c.observer.notes.values():
            report = notes.get("shard")
            if report is not None and report.world == world:
                sharded += report.sharded
                skipped += report.skipped
    fronts = sum(name.startswith("moe_front") for name in sharded)
    return {"fronts": fronts, "ups": len(sharded) - fronts, "sharded": sharded,
            "skipped": skipped}


def variant_bytes(base: float, name: str, shard: dict | None, moe: dict, world: int,
                  layers: int) -> float:
    """Bytes per rank per layer: the replicated projections at 1/W where k3's shard stage
    split them (fronts: router + latent down; ups: latent up), whole elsewhere."""
    if name != "k3" or not shard:
        return base
    saved = (moe["front"] * min(shard["fronts"], layers) + moe["up"] * min(shard["ups"], layers))
    return base - (1 - 1 / world) * saved / layers


# ---- one bucket --------------------------------------------------------------------------------

@dataclass
class Step:
    """What every variant of a bucket shares: the static inputs a runner holds, the check's and
    the timing's values for them, the state snapshot, and the references."""

    inputs: list
    check_in: list
    time_in: list
    s0: dict
    eager: dict
    ref32: dict

    def load(self, stack, weights, values, bufs):
        dl.load_weights(stack, weights)
        for static, value in zip(self.inputs, values):
            static.copy_(value)
        dl.restore(bufs, self.s0)


def references(args, ranks, model, stack, twin, bucket, caps, res) -> tuple[Step, dict, dict]:
    gen = torch.Generator(device=ranks.device).manual_seed(args.seed + 1000 * bucket.batch
                                                            + bucket.tokens)
    bufs = dl.state_buffers(stack)
    n = len(stack.layers)
    tamed = dl.check_weights(stack, args.seed)
    natural = {k: p.clone() for k, p in stack.named_parameters() if k in tamed}
    dl.load_weights(stack, tamed)
    dl.load_weights(twin, tamed)
    inputs = as_plain(dl.make_inputs(model, bucket, args.context, gen))
    s0 = dl.snapshot(bufs)
    dl.restore(dl.state_buffers(twin), s0)
    floats = [t.float() if t.is_floating_point() else t for t in inputs]
    ref32 = dl.step_result(in_rows(twin, floats, caps["fp32"]), dl.state_buffers(twin), bucket,
                           args.context)
    with dl.TopkRecorder() as rec:
        eager = dl.step_result(in_rows(stack, inputs, caps["bf16"]), bufs, bucket, args.context)
    res["check_routing_distinct_experts"] = [
        int(i.unique().numel()) for i in routing_by_layer(rec.indices, n)]
    dl.restore(bufs, s0)
    # timing and bytes: the model's own weights, fresh inputs, routing counted from them
    dl.load_weights(stack, natural)
    time_in = as_plain(dl.make_inputs(model, bucket, args.context, gen))
    with dl.TopkRecorder() as rec:
        in_rows(stack, time_in, caps["bf16"])
    dl.restore(bufs, s0)
    res["bytes"] = dl.stack_bytes(stack, bucket, args.context, routing_by_layer(rec.indices, n))
    step = Step(inputs, [t.clone() for t in inputs], time_in, s0, eager, ref32)
    return step, tamed, natural


def outputs_to_match(result: dict) -> dict:
    """The parts of a step's result that every rank must hold equal (the KDA states are split)."""
    return {k: v for k, v in result.items() if not k.startswith("state:") or k.endswith("kv_cache")}


def run_variant(args, ranks, stack, bucket, step, weights, name, spec, caps) -> dict:
    """This rank's entry for one variant; the collectives inside run on every rank alike."""
    import k3compile.backend as k3be

    tamed, natural = weights
    bufs = dl.state_buffers(stack)
    entry: dict = {"backend": spec.get("label", "eager")}
    runner = None
    try:
        step.load(stack, tamed, step.check_in, bufs)
        if name == "eager":
            entry["check"] = dl.check(step.eager, step.eager, step.ref32)
            entry["rank_max_abs_diff"] = ranks.spread(outputs_to_match(step.eager))
            if caps["bf16"] is not None and bucket.batch > caps["bf16"]:
                entry.update(status="ok", timing="n/a: one eager call would not fit in memory "
                             f"(at most {caps['bf16']} rows)")
                return entry
            runner = dl.Runner(name, stack, step.inputs, ranks.device)
        else:
            before = len(k3be._compiled)
            runner = dl.Runner(name, stack, step.inputs, ranks.device, spec["backend"],
                               spec["options"], spec["graphs"])
            entry["compile_s"] = runner.compile_s
            entry["cuda_graph"] = runner.graph is not None
            if name.startswith("k3"):
                entry["shard"] = shard_counts(k3be._compiled[before:], ranks.world)
            dl.restore(bufs, step.s0)
            got = dl.step_result(runner.run(), bufs, bucket, args.context)
            entry["check"] = dl.check(got, step.eager, step.ref32)
            entry["rank_max_abs_diff"] = ranks.spread(outputs_to_match(got))
        entry["status"] = "ok" if entry["check"]["passed"] else "check failed"
        step.load(stack, natural, step.time_in, bufs)
        times = time_lockstep(args, ranks, runner.run)
        entry["us_per_step"] = statistics.median(times)
        entry["us_per_layer"] = entry["us_per_step"] / len(dl.STACK_LAYERS)
        entry["us_spread"] = [min(times), max(times), len(times)]  # per step, as decode_layer
        dl.restore(bufs, step.s0)
        k = runner.kernels()
        entry["kernels_per_layer"] = k["kernels"] / len(dl.STACK_LAYERS)
        entry["kernel_count"] = k
    except Exception as e:  # noqa: BLE001 - one variant failing must not end the run
        entry.update(status="error", reason=f"{type(e).__name__}: {e}"[:2000])
    finally:
        dl.load_weights(stack, natural)
        dl.restore(bufs, step.s0)
        del runner  # its CUDA graph's memory pool: one variant's at a time
        if ranks.device.type == "cuda":
            torch.cuda.empty_cache()
    return entry


def time_lockstep(args, ranks: Ranks, run) -> list[float]:
    """decode_layer's timer with every call started together on all ranks; the number of calls
    agreed from a probe (a rank stopping early would leave the others in a collective)."""
    probe = dl.time_calls(run, ranks.device, args.warmup, 1, math.inf, before=ranks.lockstep)
    per_call_s = ranks.max(probe[0]) * 1e-6
    iters = max(3, min(args.iters, int(args.max_time_s / max(per_call_s, 1e-9))))
    return dl.time_calls(run, ranks.device, 0, iters, math.inf, before=ranks.lockstep)


def merge(entries: list[dict]) -> dict:
    """One variant's entries of all ranks as one: rank 0's, with the slowest rank's time, the
    worst status and every rank's own numbers alongside."""
    out = dict(entries[0])
    statuses = [e.get("status") for e in entries]
    for worst in ("error", "check failed"):
        if worst in statuses:
            out["status"] = worst
            break
    reasons = {r: e["reason"] for r, e in enumerate(entries) if "reason" in e}
    if reasons:
        out["reason"] = "; ".join(f"rank {r}: {why}" for r, why in reasons.items())
    if all("check" in e for e in entries):
        out["check_passed_ranks"] = [e["check"]["passed"] for e in entries]
    for key in ("us_per_layer", "kernels_per_layer", "compile_s"):
        if all(key in e for e in entries):
            out[f"{key}_ranks"] = [e[key] for e in entries]
    if "us_per_layer_ranks" in out:
        out["us_per_layer"] = max(out["us_per_layer_ranks"])
    if "compile_s_ranks" in out:
        out["compile_s"] = max(out["compile_s_ranks"])
    if all("rank_max_abs_diff" in e for e in entries):
        out["rank_max_abs_diff"] = max(e["rank_max_abs_diff"] for e in entries)
        out["ranks_equal"] = out["rank_max_abs_diff"] == 0.0
    return out


def run_bucket(args, ranks, model, stack, twin, bucket, variants, t_start) -> dict:
    res = {"name": bucket.name, "batch": bucket.batch, "tokens": bucket.tokens, "variants": {}}
    caps = res["memory_rows"] = row_caps(ranks, stack, bucket.tokens)
    ref_caps = res["reference_rows"] = {k: _smaller(v, args.reference_rows)
                                        for k, v in caps.items()}
    try:
        step, *weights = references(args, ranks, model, stack, twin, bucket, ref_caps, res)
    except Exception as e:  # noqa: BLE001 - the next bucket may still fit
        if ranks.device.type == "cuda":
            torch.cuda.empty_cache()
        reasons = ranks.gather(f"{type(e).__name__}: {e}"[:2000])
        res["error"] = "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons))
        log(ranks, f"  {bucket.name}: references failed ({res['error'][:300]})")
        return res
    for name in VARIANTS:
        spec = variants.get(name, {})
        elapsed = ranks.max(time.perf_counter() - t_start)
        if "na" in spec:
            res["variants"][name] = {"status": "n/a", "reason": spec["na"]}
            continue
        if name != "eager" and args.time_budget and elapsed > args.time_budget:
            res["variants"][name] = {"status": "n/a", "reason": f"n/a: time budget ({elapsed:.0f} "
                                     f"s used of {args.time_budget:.0f} s)"}
            continue
        entry = run_variant(args, ranks, stack, bucket, step, weights, name, spec, caps)
        res["variants"][name] = merge(ranks.gather(entry))
        log(ranks, variant_line(bucket, name, res["variants"][name]))
    return res


def variant_line(bucket, name: str, e: dict) -> str:
    c = e.get("check", {})
    return (f"  {bucket.name} {name}: {e['status']}"
            + (f", compile {e['compile_s']:.1f} s" if "compile_s" in e else "")
            + (f", {e['us_per_layer']:.1f} us/layer" if "us_per_layer" in e else "")
            + (f", rank diff {e['rank_max_abs_diff']:.1e}" if "rank_max_abs_diff" in e else "")
            + (f", vs eager {c['max_err_vs_eager']:.1e}; worst vs fp32 {c['worst']} "
               f"{c['max_err']:.1e} (bound {c['tol_max_err']:.1e})" if c else "")
            + (f", shard {e['shard']['fronts']} fronts {e['shard']['ups']} ups"
               if "shard" in e else "")
            + (f" ({e['reason'][:300]})" if "reason" in e else ""))


def derive(res: dict, copy_gbps: float, moe: dict, world: int):
    """Bytes per rank, floor and ratios of one bucket, per variant."""
    if "bytes" not in res:
        return
    base, layers = res["bytes"]["per_layer_mean"], len(dl.STACK_LAYERS)
    for name, e in res["variants"].items():
        if e["status"] == "n/a":
            continue
        e["bytes_per_layer"] = variant_bytes(base, name, e.get("shard"), moe, world, layers)
        e["floor_us_per_layer"] = e["bytes_per_layer"] / (copy_gbps * 1e3)
        if "us_per_layer" in e:
            e["gbps"] = e["bytes_per_layer"] / (e["us_per_layer"] * 1e3)
            e["over_floor"] = e["us_per_layer"] / e["floor_us_per_layer"]
    t = {n: e.get("us_per_layer") for n, e in res["variants"].items()}
    res["ratios"] = {
        "k3_over_inductor": dl._ratio(t.get("k3"), t.get("inductor")),
        "k3_over_k3_noshard": dl._ratio(t.get("k3"), t.get("k3_noshard")),
        "k3_noshard_over_inductor": dl._ratio(t.get("k3_noshard"), t.get("inductor")),
    }


# ---- output ------------------------------------------------------------------------------------

def table(results: dict) -> str:
    f = dl._fmt
    head = (f"{'bucket':<8}{'variant':<12}{'status':<14}{'us/layer':>10}{'kern':>7}"
            f"{'MB/rank':>9}{'floor us':>10}{'x floor':>8}{'vs fp32':>9}{'bound':>9}"
            f"{'rank diff':>10}")
    lines = [head, "-" * len(head)]
    for b in sorted(results["buckets"], key=lambda b: (b["tokens"], b["batch"])):
        if "error" in b:
            lines.append(f"{b['name']:<8}error: {b['error'][:200]}")
            continue
        for name in VARIANTS:
            e = b["variants"].get(name, {})
            c = e.get("check", {})
            mb = e["bytes_per_layer"] / 1e6 if "bytes_per_layer" in e else None
            lines.append(
                f"{b['name']:<8}{name:<12}{e.get('status', 'n/a'):<14}"
                f"{f(e.get('us_per_layer'), '10.1f'):>10}{f(e.get('kernels_per_layer'), '7.1f'):>7}"
                f"{f(mb, '9.2f'):>9}{f(e.get('floor_us_per_layer'), '10.1f'):>10}"
                f"{f(e.get('over_floor'), '8.2f'):>8}{f(c.get('max_err'), '9.1e'):>9}"
                f"{f(c.get('tol_max_err'), '9.1e'):>9}{f(e.get('rank_max_abs_diff'), '10.1e'):>10}")
        r = b["ratios"]
        lines.append(f"{'':<8}k3/inductor {f(r['k3_over_inductor'], '.2f')}, k3/k3_noshard "
                     f"{f(r['k3_over_k3_noshard'], '.2f')}, k3_noshard/inductor "
                     f"{f(r['k3_noshard_over_inductor'], '.2f')}")
    return "\n".join(lines)


def write(results: dict, out: Path):
    (out / "tp_decode.json").write_text(json.dumps(results, indent=1, default=str))


def log(ranks: Ranks, msg: str):
    if ranks.rank == 0:
        print(msg, flush=True)


# ---- main --------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="model config, sliced for TP=W (default k3; smoke tiny)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    p.add_argument("--context", type=int, help="MLA context (default 4096; smoke 64)")
    p.add_argument("--batches", help="comma list (default 1,8,64; smoke 1)")
    p.add_argument("--verify", type=int, default=0, help="T of a B=1 verify bucket (0: none)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--k3-executor", choices=("inductor", "aten"),
                   help="the k3 variants' executor (default: the backend's, Inductor; CPU smoke: "
                        "aten, as Inductor's C++ build takes about 30 s a graph on 2 cores)")
    p.add_argument("--cpu-backend", default="aot_eager",
                   help="the 'inductor' variant's backend on CPU")
    p.add_argument("--reference-rows", type=int,
                   help="rows a call of the check's eager and fp32 references takes at most "
                        "(default: what fits in free device memory; CPU: all)")
    p.add_argument("--iters", type=int, help="timed calls at most (default 50; smoke 3)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-time-s", type=float, default=2.0, help="timing per variant, about")
    p.add_argument("--time-budget", type=float, default=270.0,
                   help="seconds; start no new compiled variant or bucket after (0: none)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="process-group timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny config, B=1, small context, 3 iters")
    p.add_argument("--out", default="out")
    a = p.parse_args(argv)
    a.config = a.config or ("tiny" if a.smoke else "k3")
    a.context = a.context or (64 if a.smoke else 4096)
    a.batches = [int(b) for b in (a.batches or ("1" if a.smoke else "1,8,64")).split(",") if b]
    a.iters = a.iters or (3 if a.smoke else 50)
    if a.smoke:
        a.warmup, a.max_time_s = 1, 1.0
        if a.device == "cpu":
            a.k3_executor = a.k3_executor or "aten"
    a.variants = [v for v in a.variants.split(",") if v]
    a.compile_only = False  # decode_layer.configure_dynamo reads it
    return a


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    ranks = init_ranks(args)
    try:
        return run(args, ranks, argv)
    finally:
        dist.destroy_process_group()


def run(args, ranks: Ranks, argv) -> dict | None:
    device, out = ranks.device, Path(args.out)
    if ranks.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dl.configure_dynamo(args)
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    buckets = dl.buckets_in_order(args)
    if not buckets:
        raise SystemExit("no buckets: give --batches or --verify")
    max_batch = max(b.batch for b in buckets)
    cfg = get_config(args.config).with_tp(ranks.world)

    meta = {
        "date": time.strftime("%Y-%m-%d"), "config": cfg.name, "world": ranks.world,
        "context": args.context, "layers": list(dl.STACK_LAYERS), "dtype": "bfloat16",
        "device": device.type, "backend": dist.get_backend(),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "max_batch": max_batch, "smoke": args.smoke, "tol": dl.TOL,
        "argv": sys.argv if argv is None else ["benchmarks/tp_decode.py", *argv],
        "env": {k: os.environ.get(k) for k in COLLECTIVE_ENV},
        "time_budget": args.time_budget,
    }
    copy_bytes = (4 << 30) if device.type == "cuda" else (256 << 20)
    meta["copy_gbps_ranks"] = ranks.gather(dl.copy_bandwidth(device, copy_bytes))
    meta["copy_gbps"] = min(meta["copy_gbps_ranks"])  # the floor of the slowest rank
    meta["copy_bytes"] = copy_bytes
    log(ranks, f"world {ranks.world} ({meta['backend']}), copy bandwidth "
               f"{meta['copy_gbps']:.0f} GB/s (slowest rank; read + write)")

    t0 = time.perf_counter()
    with torch.no_grad():
        cfg, model, stack = dl.build(cfg, device, max_batch, args.context, args.seed, ranks.group)
        shard_weights(model, args.seed, ranks.rank, ranks.world)
        dl.sync(device)
    meta["build_s"] = ranks.max(time.perf_counter() - t0)
    meta["stack_weight_bytes_per_rank"] = sum(p.numel() * p.element_size()
                                              for p in stack.parameters())
    moe = meta["replicated_moe_bytes_per_layer"] = replicated_moe_bytes(stack)
    # the cross-rank comparison on weights: a split one must differ, a replicated one must not
    layer = stack.layers[0]
    meta["rank_max_abs_diff_weights"] = {
        "o_proj (split)": ranks.spread({"w": layer.self_attn.o_proj.weight}),
        "router (replicated)": ranks.spread({"w": layer.mlp.gate.weight}),
    }
    twin = dl.fp32_twin(stack)
    log(ranks, f"built {cfg.name} layers {dl.STACK_LAYERS} on {ranks.world} x {device.type} in "
               f"{meta['build_s']:.1f} s: {meta['stack_weight_bytes_per_rank'] / 1e9:.2f} GB "
               "a rank")
    variants = compiled_variants(args, device)
    meta["variants"] = {n: v.get("na", v.get("label")) for n, v in variants.items()}
    results = {"meta": meta, "buckets": [], "skipped": []}

    for bucket in buckets:
        elapsed = ranks.max(time.perf_counter() - t_start)
        if args.time_budget and elapsed > args.time_budget:
            results["skipped"].append(bucket.name)
            log(ranks, f"{bucket.name}: skipped, {elapsed:.0f} s used of a "
                       f"{args.time_budget:.0f} s budget")
            continue
        t0 = time.perf_counter()
        with torch.no_grad():
            res = run_bucket(args, ranks, model, stack, twin, bucket, variants, t_start)
        derive(res, meta["copy_gbps"], moe, ranks.world)
        res["wall_s"] = ranks.max(time.perf_counter() - t0)
        results["buckets"].append(res)
        if ranks.rank == 0:
            write(results, out)
        log(ranks, f"{bucket.name}: done in {res['wall_s']:.1f} s")

    meta["total_s"] = ranks.max(time.perf_counter() - t_start)
    if ranks.rank != 0:
        return None
    write(results, out)
    text = table(results)
    (out / "tp_decode.txt").write_text(text + "\n")
    log(ranks, "\n" + text)
    log(ranks, f"json: {out / 'tp_decode.json'}")
    return results


if __name__ == "__main__":
    main()
