"""Cold and warm compile time of the yardstick's buckets under `backend="k3"` (issue 22 item 2).

    python benchmarks/compile_time.py --out out            # GPU: B1..B64 and B1xT8, fresh caches
    python benchmarks/compile_time.py --config tiny --device cpu --batches 2 --verify 0 \\
        --executor aten --context 64 --out out             # CPU: the same code paths

Two processes, one after the other, share one fresh cache folder (--cache-dir, default a new
temporary folder): K3_CACHE_DIR (compiled CuTe DSL kernels, traced patterns, each bucket's stage
output: k3compile/stage_cache.py) and TORCHINDUCTOR_CACHE_DIR
(Inductor's FX graph and Triton caches) under it. Each builds the yardstick's 4 layers
(benchmarks/decode_layer.py), then compiles every bucket in turn as the yardstick does
(`torch.compile(stack, backend=k3, dynamic=False, options={"cuda_graphs": False})`, timed up to
the end of its first call) from one state snapshot. `--dynamic`: as a server does, one
`torch.compile` for B1..B64 with the batch marked (`mark_batch`), so Dynamo traces the step once
and the backend compiles each bucket from that one graph (B1xT8 stays a graph of its own);
`--against REPORT` then also requires each bucket's outputs to equal that (per-bucket) report's. Pass 1 (cold) fills the caches, pass 2
(warm) is what a restarted server pays. Per bucket: seconds (and CPU seconds), the pipeline's stage seconds
("torch": the rest, Dynamo, AOT and Inductor, and the first call), kernels built / loaded from
the cache and the seconds that took, pattern traces made / loaded from the cache
(k3compile/rewrite/trace_cache.py), stage-cache lookups, torch's own compile timers
(`dynamo_timed`: Dynamo's trace, AOTAutograd, our stages inside it; nested), Inductor FX-graph
cache hits, and a digest of the outputs; the warm pass must build no kernel, trace no pattern,
load every bucket's stages the cold pass stored and give bitwise the outputs of the cold one
(exit status 1 otherwise).
Writes compile_time.json under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import hashlib
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_layer as yardstick

PASSES = ("cold", "warm")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="k3_tp16")
    p.add_argument("--model", choices=yardstick.MODELS, default="k3",
                   help="the spelling of the layers (decode_layer.py's --model): hf, the second "
                        "spelling with per-expert parameters; moonshot, Moonshot's code, adapted")
    p.add_argument("--narrow", type=int, default=0,
                   help="F > 0: --config with its expert count, heads and ranks, but the widths "
                        "narrowed (hidden 512F, experts' latent 256F and intermediate 32F per "
                        "rank, ...): the per-input compile cost on a small CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, default=4096, help="MLA context")
    p.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma list of batch buckets")
    p.add_argument("--verify", type=int, default=8, help="T of the B=1 verify bucket (0: none)")
    p.add_argument("--executor", default="inductor", choices=("inductor", "aten"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dynamic", action="store_true",
                   help="one Dynamo graph for B1..B64 (mark_batch), not one per bucket")
    p.add_argument("--precompile", action="store_true",
                   help="with --dynamic: torch's caching precompile (TORCH_CACHING_PRECOMPILE=1; "
                        "k3compile/precompile.py) in both passes, B1xT8 through the same "
                        "torch.compile; the cold pass saves Dynamo's packages, the warm one loads "
                        "them instead of tracing (the load is timed into its first bucket)")
    p.add_argument("--against", help="a compile_time.json whose outputs each bucket must equal")
    p.add_argument("--cache-dir", help="a fresh folder for both passes' caches (default: a new "
                                       "temporary folder)")
    p.add_argument("--out", default="out")
    p.add_argument("--profile", nargs="?", const="first", metavar="BUCKET",
                   help="cProfile one bucket of each pass, the first one or the named one (B8, "
                        "B1xT8, ...): profile_<pass>.txt (a named bucket: profile_<pass>_<name>"
                        ".txt) under --out, the functions by cumulative and by own time, and "
                        "the .prof beside it")
    p.add_argument("--fx-keys", action="store_true",
                   help="write every Inductor FX graph cache key each pass computes, with the "
                        "details it hashed, to fx_keys_<pass>.txt under --out (a warm miss: "
                        "diff the two files)")
    p.add_argument("--pass", dest="which", choices=PASSES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",") if b.strip()]
    if a.precompile and not a.dynamic:
        p.error("--precompile needs --dynamic (one torch.compile, one saved package)")
    return a


def config(args):
    """--config, narrowed by --narrow: the same number of experts (each a graph input in the
    second spelling), of narrower widths."""
    from k3compile.models import get_config

    cfg = get_config(args.config)
    if not args.narrow:
        return cfg
    f, tp = args.narrow, cfg.tp_size
    return dataclasses.replace(cfg, hidden_size=512 * f, routed_expert_hidden_size=256 * f,
                               moe_intermediate_size=32 * f * tp, intermediate_size=64 * f * tp,
                               vocab_size=512 * f * tp, name=f"{cfg.name}_narrow{f}")


def buckets(args) -> list[yardstick.Bucket]:
    out = [yardstick.Bucket(b) for b in args.batches]
    return out + ([yardstick.Bucket(1, args.verify)] if args.verify else [])


# ---- one pass (a child process) ----------------------------------------------------------------

def run_pass(args) -> dict:
    from k3compile.kernels.common import disk_cache

    from k3compile import stage_cache
    from k3compile.backend import mark_batch
    from k3compile.observe import Observer
    from k3compile.rewrite import trace_cache

    t_start = time.perf_counter()
    if args.fx_keys:
        _log_fx_keys(Path(args.out) / f"fx_keys_{args.which}.txt")
    yardstick.configure_dynamo(argparse.Namespace(compile_only=False))
    backend, note = yardstick.resolve_k3()
    if backend is None:
        raise SystemExit(note)
    device = torch.device(args.device)
    max_batch = max(b.batch for b in buckets(args))
    with torch.no_grad():
        _, model, stack = yardstick.build(config(args), device, max_batch, args.context, args.seed,
                                          spelling=args.model)
    bufs = yardstick.state_buffers(stack)
    start = yardstick.snapshot(bufs)
    result = {"pass": args.which, "build_s": time.perf_counter() - t_start, "buckets": []}
    options = {"cuda_graphs": False, "executor": args.executor}
    batched = None  # --dynamic: the one compiled step of every [B] bucket
    load_s = 0.0  # --precompile: torch.compile installs a saved package here (warm pass)
    if args.dynamic:
        options["buckets"] = tuple(args.batches)
        t0 = time.perf_counter()
        batched = torch.compile(stack, backend=backend, options=options)
        load_s = time.perf_counter() - t0
        result["dynamo_cache"] = dict(torch._dynamo.utils.counters["dynamo_cache"])
    for bucket in buckets(args):
        gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * bucket.batch
                                                         + bucket.tokens)
        with torch.no_grad():
            inputs = yardstick.make_inputs(model, bucket, args.context, gen)
            yardstick.restore(bufs, start)
            kernels0, graphs0 = disk_cache.stats(), yardstick._cache_counters()
            kernel_s0, traces0 = disk_cache.seconds(), trace_cache.stats()
            stages0, phases0 = stage_cache.stats(), torch_phases()
            stages: dict[str, float] = {}
            dynamo0 = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            t0, cpu0 = time.perf_counter(), time.process_time()
            profile = None
            if args.profile == "first" and not result["buckets"]:
                profile = f"profile_{args.which}.txt"
            elif args.profile == bucket.name:
                profile = f"profile_{args.which}_{bucket.name}.txt"
            with Observer.subscribe(_stage_timer(stages)), _profiled(
                    Path(args.out) / profile if profile else None):
                if batched is not None and bucket.tokens == 1:
                    mark_batch(*inputs)
                    outputs = batched(*inputs)
                elif batched is not None and args.precompile:  # one package for every graph
                    outputs = batched(*inputs)
                else:
                    outputs = torch.compile(stack, backend=backend, dynamic=False,
                                            options=options)(*inputs)
                yardstick.sync(device)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if not result["buckets"]:  # the package's load belongs to the first bucket
            seconds, stages["precompile load"] = seconds + load_s, load_s
        stages["torch"] = seconds - sum(stages.values())
        result["buckets"].append({
            "name": bucket.name, "compile_s": round(seconds, 2), "cpu_s": round(cpu, 2),
            "stages": {k: round(v, 2) for k, v in stages.items()},
            "torch_phases": _delta(torch_phases(), phases0),
            "stage_cache": _delta(stage_cache.stats(), stages0),
            "patterns": _delta(trace_cache.stats(), traces0),
            "kernels": _delta(disk_cache.stats(), kernels0),
            "kernel_s": _delta(disk_cache.seconds(), kernel_s0),
            "fx_graph_cache": yardstick._cache_counters(graphs0),
            "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - dynamo0,
            "outputs_sha256": digest(outputs)})
        print(f"{args.which} {bucket.name}: {seconds:.1f} s, kernels "
              f"{result['buckets'][-1]['kernels']}", flush=True)
    if args.precompile:
        from k3compile import precompile

        t0 = time.perf_counter()
        result["precompile_saved"] = precompile.save()
        result["precompile_save_s"] = round(time.perf_counter() - t0, 2)
    result["compile_s"] = round(sum(b["compile_s"] for b in result["buckets"]), 2)
    result["cpu_s"] = round(sum(b["cpu_s"] for b in result["buckets"]), 2)
    result["process_s"] = round(time.perf_counter() - t_start, 2)
    return result


def torch_phases() -> dict[str, float]:
    """Seconds torch's own timers (`dynamo_timed`: Dynamo's trace, AOTAutograd, Inductor's
    compile, our backend's call inside them) have summed so far in this process, by name."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: sum(times) for name, times in compilation_time_metrics.items()}


@contextlib.contextmanager
def _profiled(path: Path | None):
    """cProfile of the block into `path` (the 60 functions with the most cumulative and the 40
    with the most own time), or nothing where `path` is None."""
    if path is None:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.getvalue())
        profile.dump_stats(path.with_suffix(".prof"))  # for pstats' callers / callees


def _log_fx_keys(path: Path) -> None:
    """Inductor's debug line of each FX graph cache key it computes (the key and every detail
    hashed into it), appended to `path`."""
    import logging

    class Keys(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if text.startswith("FX graph cache hash details"):
                with path.open("a") as f:
                    f.write(text + "\n\n")

    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("torch._inductor.codecache")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Keys(logging.DEBUG))


def _stage_timer(stages: dict[str, float]):
    """An Observer listener summing each stage's seconds into `stages`."""
    def on(event):
        if event.record is not None:
            stages[event.stage] = stages.get(event.stage, 0.0) + event.record.seconds
    return on


def _delta(now: dict, before: dict) -> dict:
    return {k: round(v - before.get(k, 0), 2) for k, v in now.items() if v - before.get(k, 0)}


def digest(outputs) -> str:
    h = hashlib.sha256()
    for t in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ---- the parent ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.which:
        Path(args.result).write_text(json.dumps(run_pass(args)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="k3-compile-time-"))
    if cache.exists() and any(cache.iterdir()):
        raise SystemExit(f"--cache-dir {cache} is not empty: the cold pass needs fresh caches")
    env = {**os.environ, "K3_CACHE_DIR": str(cache / "k3"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           **({"TORCH_CACHING_PRECOMPILE": "1"} if args.precompile else {})}
    forwarded = list(argv if argv is not None else sys.argv[1:])
    passes = {}
    for which in PASSES:
        result = out / f"compile_time_{which}.json"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, *forwarded, "--pass", which, "--result",
                        str(result)], env=env, check=True)
        passes[which] = json.loads(result.read_text())
        passes[which]["wall_s"] = round(time.perf_counter() - t0, 2)
    against = json.loads(Path(args.against).read_text()) if args.against else None
    report = {"meta": meta(args, cache), **passes, "problems": problems(passes, against)}
    if args.fx_keys:
        report["fx_key_misses"] = fx_key_misses(out)
        for line in report["fx_key_misses"]:
            print("FX cache miss:", line)
    (out / "compile_time.json").write_text(json.dumps(report, indent=1))
    print(table(passes))
    for line in report["problems"]:
        print("PROBLEM:", line)
    print(f"json: {out / 'compile_time.json'}")
    return 1 if report["problems"] else 0


def meta(args, cache: Path) -> dict:
    device = torch.device(args.device)
    return {"date": time.strftime("%Y-%m-%d"), "config": args.config, "narrow": args.narrow,
            "model": args.model,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "executor": args.executor, "context": args.context,
            "dynamic": args.dynamic, "precompile": args.precompile,
            "buckets": [b.name for b in buckets(args)], "cache_dir": str(cache)}


def problems(passes: dict, against: dict | None = None) -> list[str]:
    """What the warm pass must satisfy: no kernel built, bitwise the cold pass's outputs (and,
    with `against`, bitwise that report's)."""
    found = []
    if against is not None:
        theirs = {b["name"]: b["outputs_sha256"] for b in against["cold"]["buckets"]}
        found += [f"{b['name']}: outputs differ from the --against report's"
                  for b in passes["cold"]["buckets"]
                  if theirs.get(b["name"], b["outputs_sha256"]) != b["outputs_sha256"]]
    if "precompile_saved" in passes["cold"]:  # --precompile: the warm pass traces nothing
        if not passes["warm"].get("dynamo_cache", {}).get("dynamo_cache_hit"):
            found.append("the warm pass loaded no Dynamo package")
        if traced := sum(b["dynamo_graphs"] for b in passes["warm"]["buckets"]):
            found.append(f"the warm pass traced {traced} Dynamo graphs")
    for cold, warm in zip(passes["cold"]["buckets"], passes["warm"]["buckets"], strict=True):
        if warm["kernels"].get("built"):
            found.append(f"{warm['name']}: the warm pass built {warm['kernels']['built']} kernels")
        if warm["patterns"].get("traced"):
            found.append(f"{warm['name']}: the warm pass traced {warm['patterns']['traced']} "
                         "patterns")
        if cold.get("stage_cache", {}).get("stored") and not warm["stage_cache"].get("loaded"):
            found.append(f"{warm['name']}: the warm pass ran the stages the cold one stored")
        if warm["outputs_sha256"] != cold["outputs_sha256"]:
            found.append(f"{warm['name']}: warm outputs differ from cold")
    return found


def _fx_keys(path: Path) -> dict[str, list[str]]:
    """key -> the detail lines Inductor hashed into it, from an fx_keys_<pass>.txt."""
    entries = {}
    for block in path.read_text().split("FX graph cache hash details for key ")[1:]:
        key, _, body = block.partition(":\n")
        entries[key] = body.strip().splitlines()
    return entries


def fx_key_misses(out: Path) -> list[str]:
    """For each key the warm pass computed and the cold one did not: the detail lines whose
    hashes differ from the cold key closest to it (the most hashes in common). A line is
    "[hash] name: value"; the value's text may differ where the hash does not (an address)."""
    cold, warm = (_fx_keys(out / f"fx_keys_{which}.txt") for which in PASSES)

    def hashed(lines):
        return {line.partition(": ")[0]: line for line in lines}

    found = []
    for key, lines in warm.items():
        if key in cold or not cold:
            continue
        mine = hashed(lines)
        near = max((hashed(theirs) for theirs in cold.values()),
                   key=lambda theirs: len(mine.keys() & theirs.keys()))
        diff = ([f"warm: {line[:200]}" for h, line in mine.items() if h not in near]
                + [f"cold: {line[:200]}" for h, line in near.items() if h not in mine])
        found.append(f"{key}: {len(diff)} lines differ: " + " | ".join(diff[:6]))
    return found


def table(passes: dict) -> str:
    head = f"{'bucket':<10}{'cold s':>9}{'warm s':>9}{'cold cpu':>9}{'warm cpu':>9}{'graphs':>7}"
    rows = [head + "  warm stages; kernels cold -> warm"]
    for cold, warm in zip(passes["cold"]["buckets"], passes["warm"]["buckets"], strict=True):
        shown = ", ".join(f"{k} {v:.1f}" for k, v in warm["stages"].items() if v >= 0.05)
        rows.append(f"{cold['name']:<10}{cold['compile_s']:>9.1f}{warm['compile_s']:>9.1f}"
                    f"{cold['cpu_s']:>9.1f}{warm['cpu_s']:>9.1f}"
                    f"{warm.get('dynamo_graphs', 0):>7}  {shown}; "
                    f"{cold['kernels']} -> {warm['kernels']}")
    rows.append(f"{'compile':<10}{passes['cold']['compile_s']:>9.1f}"
                f"{passes['warm']['compile_s']:>9.1f}")
    rows.append(f"{'cpu':<10}{passes['cold']['cpu_s']:>9.1f}{passes['warm']['cpu_s']:>9.1f}"
                "  (this process's CPU seconds in the compiles: less noisy on a shared machine)")
    rows.append(f"{'process':<10}{passes['cold']['wall_s']:>9.1f}{passes['warm']['wall_s']:>9.1f}"
                "  (imports, model build and every bucket)")
    rows.append("seconds by stage, all buckets (cold -> warm): " + ", ".join(
        f"{name} {cold:.1f} -> {warm:.1f}" for name, (cold, warm) in totals(passes).items()))
    rows.append("torch's timers, all buckets (cold -> warm): " + ", ".join(
        f"{name} {cold:.1f} -> {warm:.1f}" for name, (cold, warm) in
        list(totals(passes, "torch_phases").items())[:8]) + " (nested: they overlap)")
    rows.append("stage cache (cold -> warm): " + " -> ".join(
        str(dict(sum((Counter(b["stage_cache"]) for b in passes[p]["buckets"]), Counter())))
        for p in PASSES))
    rows.append("pattern traces (cold -> warm): " + " -> ".join(
        str(dict(sum((Counter(b["patterns"]) for b in passes[p]["buckets"]), Counter())))
        for p in PASSES))
    return "\n".join(rows)


def totals(passes: dict, field: str = "stages") -> dict[str, tuple[float, float]]:
    """Each stage's (or torch timer's) seconds summed over the buckets, per pass, the largest
    first."""
    sums = {p: Counter() for p in PASSES}
    for p in PASSES:
        for b in passes[p]["buckets"]:
            sums[p].update(b.get(field, {}))
    names = sorted(set(sums["cold"]) | set(sums["warm"]), key=lambda n: -sums["cold"][n])
    return {n: (sums["cold"][n], sums["warm"][n]) for n in names
            if max(sums["cold"][n], sums["warm"][n]) >= 0.05}


if __name__ == "__main__":
    sys.exit(main())
