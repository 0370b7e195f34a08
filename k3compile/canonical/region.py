"""A graph region read as a function of a few input nodes, checked against a canonical torch
function on random values and replaced by that function's traced form (shared by the rules that
take an einsum's many lowerings: `conv_einsum`, `delta_einsum`).

Why: einsum, matmul and hand-written transposes lower to one of many equivalent chains of views
around a bmm or a broadcast mul. Instead of matching each chain, a rule names the region's inputs
and output (found structurally) and the canonical function it should compute; `replace` runs the
region and the function on the same random inputs, and only where they agree (within `rtol` of
the largest value: summation order) splices in the function as Inductor's joint passes trace it,
which is the form the patterns' searches have. Nothing is replaced where the region reads any
node other than its inputs (a constant table aside: nodes with no inputs), or already is the
canonical form.

`val`, `shape` and `static_shape` are the rules' shared readers of a node's fake value,
`cast_dtype`, `half_upcast` and `widens` (with `CAST`, `CASTS`, `LOW`) of a dtype conversion,
`arange_length` their one reading of an arange, `weight_rows` of F.linear's GEMM, `gemm_of` of
the GEMM a value is the output of, `POINTWISE` their elementwise ops; `splice` /
`splice_if_same` the one ending of the rules that copy a traced canonical form in whole.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_map

from k3compile.graph import call, fake_value, input_view
from k3compile.rewrite import inductor

aten, prims = torch.ops.aten, torch.ops.prims

CAST = prims.convert_element_type.default  # `.to(dtype)` / `.float()` as AOT writes it
# either spelling of a dtype conversion (a `_to_copy` where a graph keeps it whole)
CASTS = frozenset({CAST, aten._to_copy.default})
LOW = (torch.bfloat16, torch.float16)  # the activation dtypes an fp32 upcast is exact from

# ops that only re-read a tensor's elements (no arithmetic): what an einsum's lowering wraps
# around its bmm or mul
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
         aten.permute.default, aten.transpose.int, aten.t.default, aten.clone.default,
         aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims,
         aten.expand.default}
# elementwise ops (a GLU's product, a conv's or a head's pointwise tail)
POINTWISE = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.tanh.default,
             aten.sigmoid.default, aten.silu.default, aten.gelu.default, aten.exp.default,
             aten.neg.default, aten.relu.default, aten.reciprocal.default, aten.clamp.default,
             aten.pow.Tensor_Scalar, aten.erf.default, aten.rsqrt.default, aten.sqrt.default,
             CAST}


def val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def cast_dtype(node) -> torch.dtype | None:
    """The dtype node converts its input to: a `convert_element_type`'s, or a `_to_copy`'s that
    sets nothing but the dtype; None for any other node."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is CAST:
        return node.args[1]
    if node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}:
        return node.kwargs.get("dtype")
    return None


def half_upcast(node, to_copy: bool = False) -> bool:
    """node is an fp32 upcast (`convert_element_type`; with `to_copy` also a dtype-only
    `_to_copy`) of a bf16 / fp16 value: exact."""
    return (isinstance(node, fx.Node) and (node.target is CAST or to_copy and node.target in CASTS)
            and cast_dtype(node) == torch.float32 and val(node.args[0]) is not None
            and val(node.args[0]).dtype in LOW)


def widens(node, x) -> bool:
    """node is a `convert_element_type` of x to a wider float dtype (any: bf16 / fp16 -> fp32,
    fp32 -> fp64), so its values are x's exactly."""
    return (isinstance(node, fx.Node) and node.target is CAST and node.args[0] is x
            and val(node) is not None and val(x) is not None
            and val(x).dtype.is_floating_point and val(node).dtype.is_floating_point
            and val(node).dtype.itemsize > val(x).dtype.itemsize)


def shape(node) -> tuple[int, ...] | None:
    v = val(node)
    return tuple(v.shape) if v is not None else None


def static_shape(node) -> tuple[int, ...] | None:
    """`shape`, or None where a size is symbolic."""
    v = val(node)
    return tuple(v.shape) if v is not None and all(isinstance(d, int) for d in v.shape) else None


def arange_length(node) -> int | None:
    """n where node is arange(n), 0 to n - 1 by 1: `prims.iota` as AOT decomposes it, or an
    `aten.arange` left whole (any dtype: a rule that needs integers checks the dtype itself)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is prims.iota.default:
        kw = node.kwargs
        return node.args[0] if kw.get("start", 0) == 0 and kw.get("step", 1) == 1 else None
    if node.target is aten.arange.default:
        return node.args[0]
    if node.target in (aten.arange.start, aten.arange.start_step) and node.args[0] == 0 \
            and tuple(node.args[2:]) in ((), (1,)):
        return node.args[1]
    return None


def weight_rows(gemm: fx.Node) -> bool:
    """The GEMM (`mm` / `addmm`) is F.linear's: x times the transpose of a parameter or of rows
    of one."""
    w = gemm.args[2] if gemm.target is aten.addmm.default else gemm.args[1]
    if w.target is not aten.permute.default or list(w.args[1]) != [1, 0]:
        return False
    found = input_view(w.args[0])
    return found is not None and not found[0].meta.get("k3_user_input")


def gemm_of(node: fx.Node):
    """(mm or addmm, the view from [M, N] to [..., N] or None) that node is the output of."""
    view = None
    if node.target is aten.view.default and len(node.users) and shape(node.args[0]):
        src = node.args[0]
        if len(src.users) == 1 and shape(src)[-1] == shape(node)[-1]:
            view, node = node, src
    return (node, view) if node.target in (aten.mm.default, aten.addmm.default) else None


def root(node: fx.Node, through=VIEWS) -> fx.Node:
    """The first node up node's chain of `through` ops."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in through:
        node = node.args[0]
    return node


def below(node: fx.Node, want: tuple[int, ...], through=VIEWS) -> fx.Node | None:
    """The first node of shape `want` down node's chain of single-user `through` ops."""
    while shape(node) != want:
        if len(node.users) != 1:
            return None
        (node,) = node.users
        if node.target not in through:
            return None
    return node


def state_read(bmm: fx.Node, layout: str) -> tuple[list[fx.Node], fx.Node] | None:
    """([S, x], out) where bmm's operands are view chains of a 4-D fp32 state S and a 3-D fp32
    vector x [B, H, K], read back through views as out [B, H, V]: the delta rule's state read
    Σ_k S x over K, S laid out "bhkv" ([B, H, K, V], `delta_einsum`) or "bhvk" ([B, H, V, K],
    `state_matvec`). The product the region computes is not checked here (`replace` does)."""
    roots = [root(a) for a in bmm.args]
    by_rank = {len(shape(r) or ()): r for r in roots}
    S, x = by_rank.get(4), by_rank.get(3)
    if S is None or x is None or len(set(roots)) != 2:
        return None
    sizes = dict(zip(layout, shape(S)))
    B, H, K, V = (sizes[d] for d in "bhkv")
    if val(S).dtype != torch.float32 or shape(x) != (B, H, K) or val(x).dtype != torch.float32:
        return None
    out = below(bmm, (B, H, V))
    return None if out is None else ([S, x], out)


def pointwise_tail(node: fx.Node, ops, dtype: torch.dtype | None = None
                   ) -> tuple[list[fx.Node], fx.Node] | None:
    """The region of `ops` of node's shape (and `dtype`, where given) fed by node alone, in graph
    order, and the one node of it read from outside: (region, end); ([], node) where no such op
    follows node; None where the region does not take every use of node, reads another tensor
    (scalars aside) or is read from outside at more than one node."""
    def inside(n):
        return n.target in ops and shape(n) == shape(node) and (dtype is None
                                                                 or val(n).dtype == dtype)

    region, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n not in region and inside(n):
            region.add(n)
            todo += n.users
    if not region:
        return [], node
    ends = [n for n in region if any(u not in region for u in n.users)]
    if (len(ends) != 1 or any(u not in region for u in node.users)
            or any(a is not node and a not in region for n in region for a in n.all_input_nodes)):
        return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(region, key=order.__getitem__), ends[0]


def closed_region(graph: fx.Graph, seed, kind, is_exit) -> tuple[dict, dict, list[fx.Node]]:
    """The nodes computed from seeds by the ops `kind` admits, less those whose value leaves the
    region: (keys, seeds, region). Shared by the rules that rewrite a region of batch-merged
    [B*H, ...] rows per head (`head_rows`, `delta_einsum`).

    `seed(node)`: a tuple whose first item is node's key (e.g. its (B, H)), or None;
    `kind(node, keys)`: node's key where it computes from keyed nodes as the region may, else
    None; `is_exit(user, node, key)`: user reads node's value back out (a view to its per-head
    shape). A node read by anything other than the region or an exit leaves the region, and so
    does what reads it (a fixpoint: the largest region closed under that rule, whatever the
    order). `keys`: node -> key for every seed and admitted node; `seeds`: seed -> seed(node);
    `region`: the admitted nodes that stay, in graph order."""
    keys, seeds, computed = {}, {}, []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if (m := seed(n)) is not None:
            keys[n], seeds[n] = m[0], m
        elif (key := kind(n, keys)) is not None:
            keys[n] = key
            computed.append(n)
    live = set(computed)
    changed = True
    while changed:
        changed = False
        for n in list(live):
            ins = [a for a in n.args if isinstance(a, fx.Node) and a in keys]
            if any(u not in live and not is_exit(u, n, keys[n]) for u in n.users) or any(
                    a not in live and a not in seeds for a in ins):
                live.discard(n)
                changed = True
    return keys, seeds, [n for n in computed if n in live]


def nodes_between(inputs: list[fx.Node], output: fx.Node, limit: int = 64) -> list[fx.Node] | None:
    """The call_function nodes output is computed from, stopping at inputs, in graph order; None
    where it reads a placeholder or other outside node, or is larger than `limit`."""
    seen, todo = set(inputs), [output]
    region: list[fx.Node] = []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function" or len(region) >= limit:
            return None
        region.append(n)
        todo += n.all_input_nodes
    order = {n: i for i, n in enumerate(output.graph.nodes)}
    return sorted(region, key=order.__getitem__)


def _signature(nodes) -> list[str]:
    return sorted(f"{n.target}{fx.map_arg(n.args, lambda _: '%')}" for n in nodes)


def _random(node: fx.Node, gen: torch.Generator) -> torch.Tensor:
    v = val(node)
    return torch.randn(tuple(v.shape), generator=gen).to(v.dtype)


_CPU = torch.device("cpu")


def on_cpu(a):
    if isinstance(a, torch.device):
        return _CPU
    return a.cpu() if isinstance(a, torch.Tensor) and a.device.type != "cpu" else a


def call_on_cpu(target, args, kwargs):
    """target(*args, **kwargs) with every device argument the CPU and every tensor moved there.
    The rules prove a region on small values on the CPU, and a GPU graph's factory ops (arange,
    zeros, full, `_to_copy`) name its device and its lifted constants live there: run as
    written, they mix devices, the proof raises, and the site is silently left unfused on GPU
    graphs only (session 26: expert_rows on spell6)."""
    args, kwargs = tree_map(on_cpu, (args, kwargs))
    return target(*args, **kwargs)


def agrees(inputs: list[fx.Node], output: fx.Node, region: list[fx.Node], fn, rtol: float) -> bool:
    """region(random inputs) == fn(the same inputs) within rtol of the largest value, in dtype and
    shape too."""
    gen = torch.Generator().manual_seed(0)
    with unset_fake_temporarily():
        env = {x: _random(x, gen) for x in inputs}
        want = fn(*env.values())
        for n in region:
            args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = call_on_cpu(n.target, args, kwargs)
        got = env[output]
        if got.shape != want.shape or got.dtype != want.dtype:
            return False
        scale = float(want.abs().max().clamp_min(1e-30))
        return float((got.float() - want.float()).abs().max()) <= rtol * scale


def trace_canonical(fn, fakes: list[torch.Tensor]) -> fx.GraphModule:
    """fn traced on contiguous inputs, as the patterns' example inputs are (the lowering, which
    permutes need a clone, then is the one their searches have); on inputs of the real strides
    where that lowering cannot view them (a token's row `q[:, t]` of a [B, T, H, K] q, t > 0:
    there the patterns, traced over all T tokens, have the clone too)."""
    with torch._guards.detect_fake_mode(fakes):
        dense = [torch.empty(f.shape, dtype=f.dtype, device=f.device) for f in fakes]
        gm = inductor.fwd_only_joint(fn, dense)
        if all(f.is_contiguous() for f in fakes):
            return gm
        strided = [torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=f.device)
                   for f in fakes]
        return gm if _runs(gm, strided) else inductor.fwd_only_joint(fn, strided)


def _runs(gm: fx.GraphModule, args: list[torch.Tensor]) -> bool:
    """gm's views can read args (as laid out)."""
    try:
        gm(*args)
    except (RuntimeError, ValueError):  # "Cannot view a tensor ..." (ValueError under fake)
        return False
    return True


def replace(inputs: list[fx.Node], output: fx.Node, fn, rtol: float, cache: dict,
            key=None) -> fx.Node | None:
    """Splice fn's traced form in place of output where the region between inputs and output
    computes fn (checked on random values); the new output node, or None (nothing changed)."""
    region = nodes_between(inputs, output)
    if region is None:
        return None
    key = (key, *((shape(x), val(x).dtype, val(x).stride()) for x in inputs))
    if key not in cache:
        cache[key] = trace_canonical(fn, [val(x) for x in inputs])
    gm = cache[key]
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    if _signature(region) == _signature(body) or not agrees(inputs, output, region, fn, rtol):
        return None
    graph = output.graph
    env = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs))
    # node by node with `call`, not `splice`: each value (its strides) is recomputed from the
    # graph's own inputs, where the trace ran on contiguous stand-ins (`trace_canonical`)
    with graph.inserting_before(output):
        for n in body:
            args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = call(graph, n.target, args, kwargs, like=output)
    new = env[output_of(gm)]
    if shape(new) != shape(output) or val(new).dtype != val(output).dtype:
        return None
    output.replace_all_uses_with(new)
    refresh([new])
    return new


def output_of(gm: fx.GraphModule) -> fx.Node:
    """The node a traced function's one output is."""
    out = gm.graph.output_node().args[0]
    return out[0] if isinstance(out, (list, tuple)) else out


def splice(graph: fx.Graph, gm: fx.GraphModule, inputs: list[fx.Node], site: fx.Node,
           rule: str | None = None) -> fx.Node:
    """gm's graph copied in before site, reading inputs; its nodes take site's module stack
    (and `meta["k3_rule"] = rule`, where given)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    before = set(graph.nodes)
    with graph.inserting_before(site):
        out = graph.graph_copy(gm.graph, dict(zip(placeholders, inputs)))
    stack = site.meta.get("nn_module_stack")
    for n in graph.nodes:
        if n not in before:
            if stack:
                n.meta["nn_module_stack"] = stack
            if rule:
                n.meta["k3_rule"] = rule
    return out[0] if isinstance(out, (list, tuple)) else out


def splice_if_same(graph: fx.Graph, gm: fx.GraphModule, inputs: list[fx.Node],
                   site: fx.Node) -> bool:
    """`splice`, and site's uses moved to the copy where its output has site's shape and dtype
    (True); else the copy is left unread, for dead-code elimination (False). The ending of the
    rules that splice a traced canonical form (expert_combine, expert_dense, expert_gather,
    expert_gemm, expert_pick, expert_slots, expert_split)."""
    new = splice(graph, gm, inputs, site)
    if shape(new) != shape(site) or val(new).dtype != val(site).dtype:
        return False
    site.replace_all_uses_with(new)
    return True

def refresh(changed: list[fx.Node]) -> None:
    """Recompute meta["val"] downstream of nodes a rewrite put in place of others: their users'
    recorded strides were derived from the old ones (a view chain that was valid on them may
    not be on the new layout)."""
    if not changed:
        return
    graph, changed = changed[0].graph, set(changed)
    for node in graph.nodes:
        if node.op != "call_function" or not any(a in changed for a in node.all_input_nodes):
            continue
        old = node.meta.get("val")
        new = fake_value(node.target, node.args, node.kwargs)
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and (
                old.shape != new.shape or old.dtype != new.dtype):
            raise ValueError(f"{node.name}: {old.dtype}{list(old.shape)} became "
                             f"{new.dtype}{list(new.shape)}")
        node.meta["val"] = new
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
                and old.stride() == new.stride()):
            changed.add(node)


__all__ = ["VIEWS", "agrees", "below", "closed_region", "nodes_between", "pointwise_tail",
           "refresh", "replace", "root", "shape", "state_read", "val"]
