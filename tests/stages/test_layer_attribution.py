"""A functional model's K3 layers read off the weights it reads (`k3compile.layers.attribute`).

The rule on hand-written graphs: a node belongs to the earliest layer whose inputs it, or any node
computed from it, reads; what feeds no layer stays outside; module paths win wherever any node has
a layer; a graph whose inputs name no layer is left as it was.

Two functional spellings of test_layers' toy stack (a KDA-like recurrent layer + top-k MoE, then
an MLA-like cache attention + MoE, a final norm), compiled with stage `fuse` off (seconds): the
weights in a tree of plain containers read back as a flat dict (Flax's `unflatten_dict`, as
tests/models/spell9_k3.py), and JAX's `apply(params, ...)` with the dict passed as an argument.
Both equal the module-based stack (same weights) and read as its templates, with the state write,
the cache softmax and the top-k in the layer they belong to. Look-alikes: the module-based stack
gets no attributed node; weights stacked over the layers ([L, ...], no layer in any name) give
"no K3 layer found", as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import k3compile.backend as k3be
from k3compile import layers
from k3compile.rewrite import module_path
from k3compile.stages.contract import FINAL, NO_LAYER
from tests.conftest import TOL, rel_err
from tests.stages.test_layers import (
    Block,
    CacheAttention,
    H,
    K,
    Recurrent,
    Routed,
    Stack,
    _toy_args,
)

KINDS = ("kda", "mla")  # the toy stack's mixers, layer by layer (each with a top-2 MoE)
TEMPLATES = {0: "kda_moe", 1: "last", FINAL: "final"}


# ---- the rule on hand-written graphs ------------------------------------------------------------

@pytest.mark.parametrize("name, source, path", [
    ("l_self_modules_params_modules_layers_modules_3_modules_attn_norm_parameters_scale_", None,
     "params.layers.3.attn_norm.scale"),
    ("x", "L['self']._modules['params']._modules['layers']._modules['3']._parameters['kernel']",
     "params.layers.3.kernel"),
    ("x", "L['params']['layers.3.attn.wq.kernel']", "layers.3.attn.wq.kernel"),
    ("l_input_ids_", None, "input_ids"), ("x", "L['input_ids']", ""), ("x", "L['args'][0]", "0"),
    ("x", "L['fn']._modules['0']._parameters['weight']", "0.weight")])
def test_input_path(name, source, path):
    assert layers.input_path(name, source) == path


def two_layers(x, pos, w0a, w0b, w1, wf):
    shared = pos * 3  # read by both layers: the first one's
    h = x + shared  # prepares layer 0's input: layer 0
    a = torch.relu(h @ w0a)  # between two reads of layer 0: layer 0
    b = a @ torch.t(w0b)  # reads layer 0's weight through a view: layer 0
    c = b + h  # computed from layer 0, feeds only layer 1: layer 1
    d = (c * shared) @ w1
    e = d * 2  # feeds no layer: outside
    return e @ wf, torch.sum(b)  # the final weight, outside; b's sum feeds no layer: outside


PATHS = ["input_ids", "positions", "params.layers.0.mixer.wa", "params.layers.0.mixer.wb",
         "params.layers.1.mixer.w", "params.head.w"]


def _placed(graph: fx.Graph) -> dict[str, str]:
    return {n.name: module_path(n) for n in graph.nodes if n.op == "call_function"}


def test_a_node_belongs_to_the_earliest_layer_it_feeds():
    graph = fx.symbolic_trace(two_layers).graph
    assert layers.attribute(graph, PATHS) == 9
    assert _placed(graph) == {
        "mul": "params.layers.0", "add": "params.layers.0", "matmul": "params.layers.0.mixer",
        "relu": "params.layers.0", "t": "params.layers.0.mixer",
        "matmul_1": "params.layers.0.mixer",
        "add_1": "params.layers.1", "mul_1": "params.layers.1",
        "matmul_2": "params.layers.1.mixer", "mul_2": "", "matmul_3": "", "sum_1": ""}
    by_layer = layers.nodes_by_layer(graph)
    assert {i: len(nodes) for i, nodes in by_layer.items()} == {0: 6, 1: 3, None: 3}
    # every placed node's stack holds the one entry, in the form the stage cache keeps
    assert all(list(n.meta["nn_module_stack"]) == [layers.ATTRIBUTED]
               for n in by_layer[0] + by_layer[1])


def test_an_existing_module_stack_keeps_its_entries():
    graph = fx.symbolic_trace(two_layers).graph
    relu = next(n for n in graph.nodes if n.name == "relu")
    relu.meta["nn_module_stack"] = {"L__self__": ("", nn.Module)}
    layers.attribute(graph, PATHS)
    assert list(relu.meta["nn_module_stack"]) == ["L__self__", layers.ATTRIBUTED]
    assert module_path(relu) == "params.layers.0"


@pytest.mark.parametrize("case", ["module_paths", "no_layer_names", "paths_mismatch"])
def test_graphs_it_leaves_alone(case):
    graph = fx.symbolic_trace(two_layers).graph
    paths = PATHS
    if case == "module_paths":  # one node in a layer by its module: module paths win everywhere
        mul = next(n for n in graph.nodes if n.name == "mul")
        mul.meta["nn_module_stack"] = {"k": ("model.layers.0.rope", nn.Module)}
    elif case == "no_layer_names":
        paths = ["input_ids", "positions", "params.w0a", "params.w0b", "params.w1", "params.wf"]
    else:
        paths = PATHS[:-1]
    before = _placed(graph)
    assert layers.attribute(graph, paths) == 0
    assert _placed(graph) == before


# ---- two functional spellings of the toy stack --------------------------------------------------

def _sub(p: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}


def recurrent(p, x, slots):
    k = F.linear(x, p["proj.weight"]).view(-1, H, K)
    s = p["memory"][slots] * 0.9 + k.unsqueeze(-1) * k.unsqueeze(-2)
    p["memory"].index_put_((slots,), s)
    return F.linear(torch.einsum("bhkv,bhk->bhv", s, k).reshape(-1, H * K), p["out.weight"])


def cache_attention(p, x, slots):
    p["cache"].index_put_((slots, torch.zeros_like(slots)), x)
    kv = p["cache"][slots]
    scores = torch.softmax(torch.einsum("bd,bld->bl", F.linear(x, p["q.weight"]), kv), dim=-1)
    return torch.einsum("bl,bld->bd", scores, kv)


def routed(p, x):
    weights, ids = torch.sigmoid(F.linear(x, p["router.weight"])).topk(2, dim=-1)
    return torch.einsum("bk,bkd->bd", weights, torch.einsum("bd,bkde->bke", x, p["w"][ids]))


def apply(params: dict, x, slots, stacked=False):
    """The toy stack as pure functions over a flat dict (`stacked`: the look-alike, no layer in
    any name: the mixers under their kind, `mixers.kda.proj.weight`, the MoE weights stacked
    over the layers, `ffn.w[i]`)."""
    for i, kind in enumerate(KINDS):
        if stacked:
            mixer = _sub(params, f"mixers.{kind}.")
            ffn = {k: v[i] for k, v in _sub(params, "ffn.").items()}
        else:
            mixer, ffn = _sub(params, f"blocks.{i}.mixer."), _sub(params, f"blocks.{i}.ffn.")
        x = x + (recurrent if kind == "kda" else cache_attention)(mixer, x, slots)
        x = x + routed(ffn, x)
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class Tree(nn.Module):
    """Nested plain containers made from dotted paths (Flax's unflatten_dict)."""

    def __init__(self, flat: dict):
        super().__init__()
        for path, t in flat.items():
            node = self
            *parents, leaf = path.split(".")
            for name in parents:
                if not hasattr(node, name):
                    node.add_module(name, nn.Module())
                node = getattr(node, name)
            node.register_buffer(leaf, t.clone())


class FunctionalStack(nn.Module):
    def __init__(self, flat: dict, stacked=False):
        super().__init__()
        self.params, self.stacked = Tree(flat), stacked

    def forward(self, x, slots):
        return apply(dict(self.params.named_buffers()), x, slots, self.stacked)


def _module_stack():
    torch.manual_seed(0)
    return Stack([Block(Recurrent(), Routed()), Block(CacheAttention(), Routed())]).eval()


def _flat(model: nn.Module, stacked=False) -> dict:
    flat = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not stacked:
        return flat
    out = {}
    for i, kind in enumerate(KINDS):
        out.update({f"mixers.{kind}.{k}": v for k, v in _sub(flat, f"blocks.{i}.mixer.").items()})
    out.update({f"ffn.{k}": torch.stack([flat[f"blocks.{i}.ffn.{k}"] for i in range(len(KINDS))])
                for k in _sub(flat, "blocks.0.ffn.")})
    return out


def _compiled(fn, *args):
    """(output, the graph the contract saw, K3Compiled) of fn compiled with stage fuse off."""
    torch._dynamo.reset()
    out = torch.compile(fn, backend="k3", fullgraph=True, options={
        "executor": "aten", "keep_graphs": False, "disabled_stages": ["fuse"]})(*args)
    compiled = k3be.last_compiled()
    (graph,) = compiled.observer.graphs.values()
    return out, graph, compiled


def _kinds(found: layers.Layers) -> dict[int, tuple]:
    return {i: (lr.attention, lr.moe) for i, lr in found.layers.items()}


@pytest.fixture(scope="module")
def module_based():
    """The module-based stack's output on one step, its layers, and its graph."""
    with torch.no_grad():
        want = _module_stack()(*_toy_args())
        got, graph, _ = _compiled(_module_stack(), *_toy_args())
    assert rel_err(got, want) <= TOL["aten_cpu"]
    return want, layers.find_layers(graph), graph


@pytest.mark.parametrize("spelling", ["tree", "apply"])
def test_functional_spellings_read_as_the_module_stack(spelling, module_based):
    want, found_modules, _ = module_based
    x, slots = _toy_args()
    with torch.no_grad():
        if spelling == "tree":
            model = FunctionalStack(_flat(_module_stack()))
            assert rel_err(model(x, slots), want) <= TOL["aten_cpu"]
            got, graph, compiled = _compiled(FunctionalStack(_flat(_module_stack())), x, slots)
        else:
            assert rel_err(apply(_flat(_module_stack()), x, slots), want) <= TOL["aten_cpu"]
            got, graph, compiled = _compiled(apply, _flat(_module_stack()), x, slots)
    assert rel_err(got, want) <= TOL["aten_cpu"]
    found = layers.find_layers(graph)
    assert found.templates() == found_modules.templates() == TEMPLATES
    assert _kinds(found) == _kinds(found_modules)
    nodes = {n.name: n for n in graph.nodes}
    for i, lr in found.layers.items():
        for name in lr.evidence.values():  # the state write, the cache softmax, the top-k
            assert layers.layer_index(module_path(nodes[name])) == i
    assert {layers.layer_index(module_path(n)) for n in graph.nodes if module_path(n)} == {0, 1}
    norm = [n for n in graph.nodes if str(n.target) == "aten.rsqrt.default"]
    assert len(norm) == 1 and module_path(norm[0]) == ""  # the final norm: outside
    (report,) = compiled.contracts.values()
    assert [lr.template for lr in report.layers] == list(TEMPLATES.values())


def test_module_paths_win(module_based):
    _, _, graph = module_based
    assert not any(layers.ATTRIBUTED in (n.meta.get("nn_module_stack") or {})
                   for n in graph.nodes)


def test_weights_stacked_over_the_layers_name_no_layer(module_based):
    want = module_based[0]
    x, slots = _toy_args()
    model = FunctionalStack(_flat(_module_stack(), stacked=True), stacked=True)
    with torch.no_grad():
        got, graph, compiled = _compiled(model, x, slots)
    assert rel_err(got, want) <= TOL["aten_cpu"]
    assert not any(layers.ATTRIBUTED in (n.meta.get("nn_module_stack") or {})
                   for n in graph.nodes)
    (report,) = compiled.contracts.values()
    assert report.status == NO_LAYER


def test_a_rewrite_goes_to_the_earliest_layer_of_its_matched_nodes():
    """A residual fusion anchored at `routed + shared`, which the weights place in the layer it
    feeds: the fused op goes where the GEMMs it takes lie (functional models only)."""
    from k3compile.rewrite.engine import _site_module

    graph = fx.symbolic_trace(two_layers).graph
    layers.attribute(graph, PATHS)
    nodes = {n.name: n for n in graph.nodes}
    matched = [nodes["matmul_1"], nodes["add_1"]]  # layer 0's GEMM, the add placed in layer 1
    assert _site_module(nodes["add_1"], matched)[0] == "params.layers.0.mixer"
    assert _site_module(nodes["add_1"], [nodes["add_1"]])[0] == "params.layers.1"
    # the last layer's `routed + shared` feeds no layer: outside; its fusion still goes to the layer
    assert _site_module(nodes["mul_2"], [nodes["matmul_2"], nodes["mul_2"]])[0] == \
        "params.layers.1.mixer"
    assert _site_module(nodes["mul_2"], [nodes["mul_2"], nodes["matmul_3"]])[0] == ""
    # module-based: the anchor's module, as before
    stack = {"m": ("model.layers.1.mlp", nn.Module)}
    for n in matched:
        n.meta["nn_module_stack"] = stack
    nodes["matmul_1"].meta["nn_module_stack"] = {"m": ("model.layers.0.mlp", nn.Module)}
    assert _site_module(nodes["add_1"], matched)[0] == "model.layers.1.mlp"
