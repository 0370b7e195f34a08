"""Stage `shard` over gloo at W = 2 and 4: the MoE's replicated router, latent down and latent up
projections run row-sharded (each rank reads 1/W of their weights, the ranks all-gather the small
results), and the compiled TP=W model still gives the unsharded model's logits.

A 2-layer tiny model (dense layer 0, one MoE layer) and only the MoE patterns: W processes share
the 2 cores of CI, and each compiles once."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests import gloo
from tests.conftest import TOL

MOE_ONLY = ["attn_res", "allreduce", "kda", "mla", "linear_concat", "rms_norm"]



def _gemm_weight_bytes(graph) -> dict[str, int]:
    """Bytes of graph-input weights read by the fused MoE projections, per weight input."""
    from k3compile.graph import weight_root

    out = {}
    for node in graph.nodes:
        if str(node.target) in ("k3.moe_front.default", "k3.norm_linear.default"):
            weights = node.args[1:3] if "front" in str(node.target) else node.args[2:3]
            for w in weights:
                root = weight_root(w)
                val = w.meta["val"]
                out[root.name] = out.get(root.name, 0) + val.numel() * val.element_size()
    return out


def _worker(rank: int, world: int, out_dir: str):
    import k3compile.backend as k3be
    from k3compile.models import build_model, get_config
    from k3compile.models.loader import shard_state_dict
    from tests.conftest import rel_err

    cfg = get_config("tiny").with_layers(2)
    kw = {"dtype": torch.float32, "max_batch": 4, "max_seq_len": 32}
    full = build_model(cfg, **kw)
    parts = [build_model(cfg.with_tp(world), group=dist.group.WORLD, **kw) for _ in range(2)]
    for p in parts:
        p.load_state_dict(shard_state_dict(full.state_dict(), p.config, rank))
    eager, model = parts
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "disabled_patterns": MOE_ONLY,
                                  "shard_moe": "on"})
    result = {"vs_full": [], "vs_tp_eager": []}
    pos, slots = torch.tensor([0, 5, 9]), torch.tensor([2, 0, 1])
    for i in range(3):
        ids = torch.randint(0, cfg.vocab_size, (3,), generator=torch.Generator().manual_seed(i))
        got = step(ids, pos + i, slots) * 1  # `* 1` waits on an async collective result
        result["vs_full"].append(rel_err(got, full(ids, pos + i, slots)))
        result["vs_tp_eager"].append(rel_err(got, eager(ids, pos + i, slots) * 1))
    compiled = k3be.last_compiled()
    graph = next(iter(compiled.observer.graphs.values()))
    result["bytes"] = _gemm_weight_bytes(graph)
    result["gathers"] = sum(n.meta.get("k3_shard") == "gather" for n in graph.nodes)
    result["sharded"] = sorted(n.meta["k3_shard"] for n in graph.nodes if "k3_shard" in n.meta
                               and str(n.target).startswith("k3."))
    moe = model.language_model.model.layers[1].mlp
    result["full_bytes"] = sum(t.numel() * t.element_size() for t in (
        moe.gate.weight, moe.routed_expert_down_proj.weight, moe.routed_expert_up_proj.weight))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 procs, 2 cores
def test_sharded_moe_projections_match_unsharded_model(tmp_path, world):
    gloo.spawn(_worker, world, str(tmp_path), world=world, timeout_s=300)  # ~20 s when well
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        # TP=W against TP=1 regroups the all-reduced sums: fp32 rounding through the layers
        assert max(r["vs_full"]) <= TOL["tp_fp32"], (rank, r["vs_full"])
        assert max(r["vs_tp_eager"]) <= TOL["aten_cpu"], (rank, r["vs_tp_eager"])
        # the router, latent down and latent up weights are read 1/W per rank
        assert len(r["bytes"]) == 3, r["bytes"]
        assert sum(r["bytes"].values()) * world == r["full_bytes"], (r["bytes"], r["full_bytes"])
        assert r["gathers"] == 2  # front (logits and z in one) + latent up
        assert r["sharded"] == [f"rows {rank}/{world}"] * 2, r["sharded"]


def _front_node(experts: int, latent: int, hidden: int = 7168):
    from torch import fx

    g = fx.Graph()
    args = []
    for shape in ((1, hidden), (experts, hidden), (latent, hidden)):
        p = g.placeholder(f"p{len(args)}")
        p.meta["val"] = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        args.append(p)
    return g.call_function(torch.ops.k3.moe_front.default, tuple(args))


def test_auto_keeps_projections_replicated_where_the_gather_costs_more():
    """K3's router + latent down (64 MB) at TP 2 save 32 MB of reads (~7.6 µs) per rank, less
    than the ~18 µs an all-gather cost on the H200: "auto" keeps them, saying why; "on" shards;
    a front 4x larger would pay at TP 16."""
    from k3compile.stages.shard import GATHER_US, worth_sharding

    front = _front_node(896, 3584)
    why = worth_sharding(front, 2, "auto")
    assert why is not None and "32.1 MB" in why and f"{GATHER_US:.0f} µs" in why, why
    assert worth_sharding(front, 2, "on") is None
    assert "off" in worth_sharding(front, 2, "off")
    assert worth_sharding(_front_node(4 * 896, 4 * 3584), 16, "auto") is None


def test_shard_moe_option_is_checked():
    from k3compile.settings import Options

    assert Options.make().shard_moe == "auto"
    with pytest.raises(ValueError, match="shard_moe"):
        Options.make({"shard_moe": "sometimes"})


@pytest.mark.parametrize("weight_fp32", [False, True])
def test_shard_up_keeps_the_norm_rounding_flag(weight_fp32):
    """The latent up-projection's rank part is rebuilt from the op's arguments: norm_linear's
    `weight_fp32` (a spelling's fp32-weight norm) stays on it, the plain call stays four
    arguments. One process: the graph is built by hand, nothing runs."""
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3compile.graph import call
    from k3compile.stages.shard import shard_replicated

    c10d, fake, g = torch.ops._c10d_functional, FakeTensorMode(), fx.Graph()

    def placeholder(name, shape, dtype):
        p = g.placeholder(name)
        with fake:
            p.meta["val"] = torch.empty(shape, dtype=dtype)
        return p

    u = placeholder("u", (2, 64), torch.float32 if weight_fp32 else torch.bfloat16)
    norm_w, w = placeholder("g", (64,), torch.bfloat16), placeholder("w", (128, 64), torch.bfloat16)
    u = call(g, c10d.wait_tensor.default, (call(g, c10d.all_reduce.default, (u, "sum", "0")),))
    flags = (None, True) if weight_fp32 else ()
    g.output(call(g, torch.ops.k3.norm_linear.default, (u, norm_w, w, 1e-5, *flags)))
    report = shard_replicated(g, group="0", rank=1, world=2, policy="on")
    assert report.sharded == ["norm_linear_default"]
    (part,) = [n for n in g.nodes if n.target is torch.ops.k3.norm_linear.default]
    assert part.args[4:] == flags and part.meta["val"].shape == (2, 64)
    assert part.args[2].meta["k3_rank_rows"] == (1, 2)
