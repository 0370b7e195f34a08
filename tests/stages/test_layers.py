"""K3 layers found by structure (`k3compile.layers`), not by module names, as the fusion contract
reads them.

Toy layers (each a few ops, compiled under backend="k3" with stage `fuse` off: seconds) show each
kind by what it computes, whatever its modules are called: a recurrent fp32 state [slots, H, K, V]
read and written (KDA), a softmax over a written cache's tokens (MLA), a top-k routing (MoE).
Look-alikes stay apart: a rank-4 fp32 weight that is only read, a softmax over the few sources of
a depth mix downstream of a cache, a bf16 rank-4 state, a top-k outside every layer. A graph
without a K3 layer says "no K3 layer found", never "met". Each compiled toy equals its eager run.

The tiny K3 (4 layers: dense, kda_moe, mla_moe, last) reads as before, also with its modules
renamed (`mlp` -> `block_sparse_moe`, `self_attn` -> `attention`, `layers` -> `h`, ...), and a
layer whose KDA step is left unfused (its patterns disabled) gets a near miss naming a node
(marked slow: tiny-model compiles, one with every other pattern).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import fx, nn

import k3compile.backend as k3be
from k3compile import layers
from k3compile.models import build_model, get_config
from k3compile.rewrite import module_path
from k3compile.rewrite.near_miss import stack_path
from k3compile.stages.contract import FINAL
from k3compile.tools import diff
from tests.conftest import TOL, rel_err

D, H, K, SLOTS, L, E = 16, 2, 4, 3, 8, 4
OURS = {0: "dense", 1: "kda_moe", 2: "mla_moe", 3: "last", FINAL: "final"}
CFG = dataclasses.replace(get_config("tiny"), num_hidden_layers=4, full_attn_layers=(2, 3))


# ---- toy layers ---------------------------------------------------------------------------------

class Recurrent(nn.Module):
    """A decayed outer-product recurrence on a [slots, H, K, K] state, read out with a bmm."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, H * K, bias=False)
        self.out = nn.Linear(H * K, D, bias=False)
        self.register_buffer("memory", torch.zeros(SLOTS, H, K, K))

    def forward(self, x, slots):
        k = self.proj(x).view(-1, H, K)
        s = self.memory[slots] * 0.9 + k.unsqueeze(-1) * k.unsqueeze(-2)
        self.memory[slots] = s
        return self.out(torch.einsum("bhkv,bhk->bhv", s, k).reshape(-1, H * K))


class CacheAttention(nn.Module):
    """One head attending over a written [slots, L, D] cache; `over_sources`: the look-alike, a
    softmax over [x, the cache's mean] (a depth mix's few sources) instead of the tokens."""

    def __init__(self, over_sources=False):
        super().__init__()
        self.q = nn.Linear(D, D, bias=False)
        self.over_sources = over_sources
        self.register_buffer("cache", torch.zeros(SLOTS, L, D))

    def forward(self, x, slots):
        self.cache[slots, 0] = x
        kv = self.cache[slots]  # [B, L, D]
        if self.over_sources:
            sources = torch.stack([x, kv.mean(1)])  # [2, B, D]
            alpha = torch.softmax(self.q(sources).sum(-1), dim=0)
            return (alpha.unsqueeze(-1) * sources).sum(0)
        p = torch.softmax(torch.einsum("bd,bld->bl", self.q(x), kv), dim=-1)
        return torch.einsum("bl,bld->bd", p, kv)


class BankRead(nn.Module):
    """A rank-4 fp32 weight gathered by slot: read, never written (no state)."""

    def __init__(self):
        super().__init__()
        self.bank = nn.Parameter(torch.randn(SLOTS, H, K, K))
        self.proj = nn.Linear(D, H * K, bias=False)
        self.out = nn.Linear(H * K, D, bias=False)

    def forward(self, x, slots):
        k = self.proj(x).view(-1, H, K)
        return self.out(torch.einsum("bhkv,bhk->bhv", self.bank[slots], k).reshape(-1, H * K))


class Routed(nn.Module):
    """Top-2 of E experts, each a [D, D] matrix."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w = nn.Parameter(torch.randn(E, D, D) * D**-0.5)

    def forward(self, x):
        weights, ids = torch.sigmoid(self.router(x)).topk(2, dim=-1)
        return torch.einsum("bk,bkd->bd", weights, torch.einsum("bd,bkde->bke", x, self.w[ids]))


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, ffn: nn.Module | None = None):
        super().__init__()
        self.mixer = mixer
        self.ffn = ffn or nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, slots):
        x = x + self.mixer(x, slots)
        return x + self.ffn(x)


class Stack(nn.Module):
    """Blocks under `blocks`, an RMS norm after them (`final`), optionally a top-k in the head."""

    def __init__(self, blocks, final=True, head_topk=False, dtype=torch.float32):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.final, self.head_topk = final, head_topk
        self.to(dtype)

    def forward(self, x, slots):
        for block in self.blocks:
            x = block(x, slots)
        if self.final:
            x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        if self.head_topk:
            x = x + x.topk(2, dim=-1).values.sum(-1, keepdim=True)
        return x


def _compile(model, *args, fuse=False):
    """(compiled output, eager output, the graph the contract saw, K3Compiled) for one call."""
    torch._dynamo.reset()
    model.eval().requires_grad_(False)
    eager = {n: b.clone() for n, b in model.named_buffers()}
    want = model(*args)
    for n, b in model.named_buffers():
        b.copy_(eager[n])
    options = {"executor": "aten", "keep_graphs": False}
    if not fuse:
        options["disabled_stages"] = ["fuse"]
    got = torch.compile(model, backend="k3", fullgraph=True, options=options)(*args)
    compiled = k3be.last_compiled()
    (graph,) = compiled.observer.graphs.values()
    return got, want, graph, compiled


def _toy_args():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, D, generator=gen), torch.tensor([2, 0])


# ---- paths --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, index", [
    ("language_model.model.layers.3.mlp.experts", 3), ("transformer.h.3.attn", 3),
    ("blocks.3", 3), ("model.layers.12.block_sparse_moe.experts.5.w1", 12),
    ("model.layers[7].self_attn", 7), ("language_model.model.norm", None), ("lm_head", None),
    ("", None)])
def test_layer_index_is_the_first_container_index(path, index):
    assert layers.layer_index(path) == index


@pytest.mark.parametrize("path, want", [
    ("getattr(L['self'].net.layers, '2').attn", "net.layers.2.attn"),  # functional_call (spell12)
    ("getattr(getattr(L['self'].net.layers, '1').mlp.experts, '0').w1",
     "net.layers.1.mlp.experts.0.w1"),
    ("L['self'].model.layers[3].mlp", "model.layers[3].mlp"), ("L__self___lm_head", "lm_head")])
def test_a_stack_path_reads_dynamo_getattr_as_a_dotted_path(path, want):
    got = stack_path({"m": (path, None)})
    assert got == want and layers.layer_index(got) == layers.layer_index(want)


def test_below_layer():
    assert layers.below_layer("model.layers.3.mlp.experts.5") == "mlp.experts.5"
    assert layers.below_layer("transformer.h.3") == ""
    assert layers.below_layer("model.norm") is None


# ---- kinds by structure -------------------------------------------------------------------------

def test_toy_layers_read_by_what_they_compute():
    model = Stack([Block(Recurrent()), Block(Recurrent(), Routed()),
                   Block(CacheAttention(), Routed())])
    got, want, graph, compiled = _compile(model, *_toy_args())
    assert rel_err(got, want) <= TOL["aten_cpu"]
    found = layers.find_layers(graph)
    assert found.templates() == {0: "dense", 1: "kda_moe", 2: "last", FINAL: "final"}
    nodes = {n.name: n for n in graph.nodes}
    kda, mla, moe = (nodes[found.layers[i].evidence[k]] for i, k in
                     ((1, "kda"), (2, "mla"), (2, "moe")))
    assert str(kda.target) == "aten.index_put.default" and kda.args[0].op == "placeholder"
    assert str(mla.target) in ("aten.amax.default", "aten._softmax.default")
    assert str(moe.target) == "aten.topk.default"
    (report,) = compiled.contracts.values()
    assert [lr.template for lr in report.layers] == ["dense", "kda_moe", "last", "final"]


def test_without_a_final_norm_the_last_mla_layer_is_mla_moe():
    model = Stack([Block(Recurrent(), Routed()), Block(CacheAttention(), Routed())], final=False)
    got, want, graph, _ = _compile(model, *_toy_args())
    assert rel_err(got, want) <= TOL["aten_cpu"]
    assert layers.find_layers(graph).templates() == {0: "kda_moe", 1: "mla_moe"}


def test_look_alikes_are_no_k3_layers():
    model = Stack([Block(BankRead()), Block(CacheAttention(over_sources=True))], head_topk=True)
    got, want, graph, compiled = _compile(model, *_toy_args())
    assert rel_err(got, want) <= TOL["aten_cpu"]
    found = layers.find_layers(graph)
    assert {i: (lr.attention, lr.moe) for i, lr in found.layers.items()} == {
        0: (None, False), 1: (None, False)}
    assert not found.found and found.templates() == {0: "other", 1: "other"}
    (report,) = compiled.contracts.values()
    assert report.status == "no K3 layer found" and not report.met
    assert "no K3 layer found" in compiled.summary()


def test_a_bf16_rank4_state_is_no_recurrent_state():
    model = Stack([Block(Recurrent())], dtype=torch.bfloat16)
    x, slots = _toy_args()
    got, want, graph, _ = _compile(model, x.bfloat16(), slots)
    assert rel_err(got, want) <= TOL["aten_cpu"]
    assert layers.find_layers(graph).layers[0].attention is None
    fp32 = Stack([Block(Recurrent())])
    got, want, graph, _ = _compile(fp32, x, slots)
    assert rel_err(got, want) <= TOL["aten_cpu"]
    assert layers.find_layers(graph).layers[0].attention == "kda"


def _k3_node(graph: fx.Graph, op: str, path: str) -> fx.Node:
    node = graph.call_function(getattr(torch.ops.k3, op).default, ())
    node.meta["nn_module_stack"] = {path: (path, nn.Module)}
    return node


@pytest.mark.parametrize("ops, kind", [
    (("fb_kda_decode",), ("kda", False)), (("kda_decode", "moe_experts"), ("kda", True)),
    (("mla_decode", "moe_route"), ("mla", True)), (("mla_q_absorb",), ("mla", False)),
    (("rms_norm", "situ_gate_up"), (None, False))])
def test_fused_ops_show_the_kind(ops, kind):
    import k3compile.ops  # noqa: F401  (registers the k3 ops)

    graph = fx.Graph()
    nodes = [_k3_node(graph, op, "model.layers.5.x") for op in ops]
    lr = layers.classify(5, nodes, [])
    assert (lr.attention, lr.moe) == kind


def test_a_graph_without_layers_says_so():
    model = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))
    x = _toy_args()[0]
    got, want, _, compiled = _compile(model, x)
    assert rel_err(got, want) <= TOL["aten_cpu"]
    (report,) = compiled.contracts.values()
    assert report.status == "no K3 layer found" and not report.met and report.layers == []
    text = diff.format_text(diff.analyze(compiled), color=False)
    assert "fusion contract: no K3 layer found" in text and not re.search(r"\bmet\b", text)


# ---- the tiny K3 --------------------------------------------------------------------------------

def _rename(module: nn.Module, old: str, new: str) -> None:
    """Move submodule `old` to `new`; the module's code still says `self.<old>` (a property)."""
    module._modules[new] = module._modules.pop(old)
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), {old: property(lambda self: getattr(self, new))})


def renamed(model):
    """Our model with the module names of other K3 code (Moonshot's MoE is `block_sparse_moe`)."""
    inner = model.language_model.model
    for layer in inner.layers:
        _rename(layer, "mlp", "block_sparse_moe")
        _rename(layer, "self_attn", "attention")
    _rename(inner, "layers", "h")
    _rename(inner, "norm", "ln_f")
    _rename(inner, "output_attn_res_norm", "final_mix_norm")
    _rename(model.language_model, "model", "transformer")
    return model


def _tiny_args():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, CFG.vocab_size, (2,), generator=gen), torch.tensor([0, 3]), \
        torch.tensor([2, 0])


@pytest.mark.slow
@pytest.mark.parametrize("rename", [False, True])
def test_tiny_k3_reads_as_its_templates(rename):
    model = build_model(CFG, dtype=torch.float32, max_batch=4, max_seq_len=16)
    model = renamed(model) if rename else model
    got, want, graph, compiled = _compile(model, *_tiny_args())
    assert rel_err(got, want) <= TOL["aten_cpu"]
    paths = {module_path(n) for n in graph.nodes}
    names = ("block_sparse_moe", "transformer.h.") if rename else ("mlp", "model.layers.")
    assert all(any(name in p for p in paths) for name in names)
    if rename:
        assert not any(re.search(r"(^|\.)(mlp|self_attn|layers|model|norm)(\.|$)", p)
                       for p in paths)
    assert layers.find_layers(graph).templates() == OURS
    (report,) = compiled.contracts.values()
    assert {lr.layer: lr.template for lr in report.layers} == OURS


@pytest.mark.slow
def test_an_unfused_kda_step_is_a_near_miss_naming_a_node():
    torch._dynamo.reset()
    model = build_model(CFG, dtype=torch.float32, max_batch=4, max_seq_len=16)
    eager = build_model(CFG, dtype=torch.float32, max_batch=4, max_seq_len=16)
    step = torch.compile(model, backend="k3", fullgraph=True, options={
        "executor": "aten", "disabled_patterns": ["kda_decode", "fb_kda_decode"]})
    assert rel_err(step(*_tiny_args()), eager(*_tiny_args())) <= TOL["aten_cpu"]
    compiled = k3be.last_compiled()
    (bucket,) = compiled.observer.graphs
    final = compiled.observer.graphs[bucket]
    # the fused graph (MLA and MoE fused, KDA not) reads as the graph before fusion did
    assert layers.find_layers(final).templates() == OURS
    assert compiled.observer.notes[bucket]["layers"].templates() == OURS
    (report,) = compiled.contracts.values()
    short = {lr.layer: lr.shortfall for lr in report.layers if lr.shortfall}
    assert short == {0: {"fb_kda_decode": 1}, 1: {"fb_kda_decode": 1}}
    alive = {n.name for n in final.nodes}
    for layer in (0, 1):
        misses = [m for m in compiled.observer.reports[bucket].near_misses
                  if layers.layer_index(m.module) == layer and m.pattern.startswith("kda_decode")]
        assert misses, layer
        assert all(m.node in alive and f"{m.node} (index_put float32[" in m.reason
                   and "disabled" in m.reason for m in misses), misses
    text = diff.format_text(diff.analyze(compiled), color=False)
    assert "near misses: none recorded" not in text
    assert "near misses: {'kda_decode': 1}" in text
