"""Compile time of Moonshot's adapted model against its routed-expert count (CPU, tiny widths).

    K3_MOONSHOT_DIR=/work/moonshot K3_CACHE_DIR=0 python benchmarks/moonshot_compile_time.py \\
        --experts 64,224,896 --layers 3 --format dense --out out

Per expert count E: Moonshot's tiny config (`moonshot.tiny_config`) with E routed experts and
`--layers` layers (3: dense KDA, KDA + MoE, MLA + MoE), experts dense (`nn.Linear`, 3 parameters
each) or compressed-tensors MXFP4 (`--format mxfp4`: a tiny checkpoint written by
tests/adapt/test_mxfp4_load.py's `write_checkpoint`, loaded with `moonshot.from_pretrained`;
6 tensors each), adapted (`k3compile.adapt`) and compiled under `backend="k3"` (aten executor,
fullgraph), timed up to the end of its first call at B2. Reported: wall and CPU seconds, the
graph's inputs, torch's own timers (`dynamo_timed`: Dynamo's trace, AOTAutograd, our backend
inside them; nested) and the seconds of each of our stages (Observer). Writes
moonshot_compile_time.json under --out. Set K3_CACHE_DIR=0: a stage cache hit is not a compile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_time import _delta, _stage_timer, torch_phases

import k3compile.backend as k3be
from k3compile.adapt import adapt, moonshot
from k3compile.observe import Observer

PHASES = ("_compile.compile_inner", "OutputGraph.call_user_compiler",
          "create_aot_dispatcher_function", "backend_compile")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", default="64,224,896", help="comma list of routed expert counts")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--format", default="dense", choices=("dense", "mxfp4"))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--out", default="out")
    return p.parse_args(argv)


def model_of(experts: int, layers: int, fmt: str):
    config = moonshot.tiny_config(num_hidden_layers=layers, mla_layers=(layers - 1,),
                                  num_experts=experts)
    if fmt == "dense":
        return moonshot.build(config)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.adapt.test_mxfp4_load import write_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        path = write_checkpoint(Path(folder), moonshot.build(config, dtype=torch.bfloat16))
        return moonshot.from_pretrained(path, dtype=torch.bfloat16)


def measure(experts: int, args) -> dict:
    model = model_of(experts, args.layers, args.format)
    t0 = time.perf_counter()
    step = adapt(model, max_batch=args.batch, max_seq_len=32)
    adapt_s = time.perf_counter() - t0
    k3be.ensure_registered()
    torch._dynamo.reset()
    ids = torch.arange(3, 3 + args.batch)
    pos, slots = torch.zeros_like(ids), torch.arange(args.batch)
    phases0, stages = torch_phases(), {}
    t0, cpu0 = time.perf_counter(), time.process_time()
    with Observer.subscribe(_stage_timer(stages)), torch.no_grad():
        compiled = torch.compile(step, backend="k3", fullgraph=True,
                                 options={"executor": "aten", "strict": False})
        compiled(ids, pos, slots)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    phases = _delta(torch_phases(), phases0)
    graph = k3be.last_compiled().observer.graphs
    inputs = sum(n.op == "placeholder" for n in next(iter(graph.values())).nodes)
    fused = [lr.actual.get("moe_experts", 0)
             for lr in next(iter(k3be.last_compiled().contracts.values())).layers]
    result = {"experts": experts, "layers": args.layers, "format": args.format,
              "adapt_s": round(adapt_s, 2), "compile_s": round(seconds, 2),
              "cpu_s": round(cpu, 2), "graph_inputs": inputs, "moe_experts_fused": fused,
              "torch_phases": {k: phases.get(k, 0.0) for k in PHASES},
              "stages_s": round(sum(stages.values()), 2),
              "stages": {k: round(v, 2) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])
                         if v >= 0.05}}
    print(json.dumps(result), flush=True)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    results = [measure(int(e), args) for e in args.experts.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moonshot_compile_time.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
