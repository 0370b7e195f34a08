"""Rule `mxfp4_dequant`: every faithful spelling of the MXFP4 (E2M1 x E8M0) dequantisation -> the
canonical one, `k3compile.math.mxfp4_dequant` (a gather from one 16-entry E2M1 table in the output
dtype by `packed & 15` and `packed >> 4`, stack + flatten, `exp2(scale - 127)` per group of 32),
which `patterns/moe_experts.py` matches.

K3 code dequantises in many ways: bit arithmetic on the nibble (sign, exponent, mantissa), LUT
gathers of other layouts (`(packed >> 4)` / `packed & 15`, nibble codes interleaved first by slice
assignment, a 256-entry table by byte), interleave by `stack(-1).reshape`, `view(..., 2)` or
strided writes, scales as `2.0 ** (s - 127)`, `torch.ldexp`, `exp2` of an int16, a 256-entry E8M0
table, repeated per element or broadcast per group, math in fp32 and a cast at the end. Rather
than a pattern per spelling, the rule separates what moves data from what computes values:

* layout, matched structurally: the interleave of a low-nibble and a high-nibble stream of one
  uint8 tensor `packed` [..., O, W] into [..., O, 2W] (cat of unsqueezes + view, or two strided
  `slice_scatter`s / `select_scatter`s), the grouping of that into [..., O, G, 32], and the
  broadcast of a stream of one uint8 tensor `scale` [..., O, G] over each group (unsqueeze,
  expand, the clone + view of `repeat_interleave`);
* values, proved by evaluation: every op between the two uint8 tensors and the result is
  pointwise (or a gather from a table whose values are known at compile time: a constant, a
  graph input's real value, or a table the graph computes from constants), so the result at a
  position is a function of one byte of `packed` and one byte of `scale` only. The rule evaluates
  that function on all 256 x 256 (byte, scale) pairs, for the low and the high nibble, and
  rewrites only where it equals the canonical dequant bit for bit in the result's dtype (NaN
  where it is NaN), for every scale but 255: that is E8M0's NaN encoding, a block no quantiser
  writes, on which spellings disagree (exp2 gives inf, `ldexp` a finite 2^128 multiple). A
  table that is not E2M1, a scale that is not `2^(s - 127)`, or fp16 math whose roundings
  differ from the canonical form's are left alone; so is a table held by a graph input whose
  real value stage `canonicalize` did not hand over (`gm.meta["real_inputs"]`).

The canonical form reads one E2M1 table the rule computes in the graph (from an iota by the
E2M1 bit rule, fp32, converted once per dtype; on the packed weights' device), so every site of a
graph shares one table node, as the pattern needs.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import RESHAPES
from k3compile.math import E2M1_VALUES, GROUP, e2m1_table, mxfp4_dequant
from k3compile.rewrite import inductor

aten, prims = torch.ops.aten, torch.ops.prims

MAX_TABLE = 4096  # a constant larger than this is no lookup table
_CASTS = {prims.convert_element_type.default, aten._to_copy.default, aten.clone.default,
          aten.alias.default, aten.lift_fresh_copy.default}
_FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
              aten.scalar_tensor.default, aten.zeros.default, aten.ones.default,
              prims.iota.default}  # deterministic: never `empty` or a random op
# views that pick elements of a known constant by static ints (a table cut out of a larger
# buffer, `byte_pairs[:16, 0]`): their value is the constant's, read exactly
_PICKS = {aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.default}

with inductor.unset_fake_temporarily():  # real even when first imported inside a compile
    _BYTES = torch.arange(256, dtype=torch.uint8)
    _PAIR_B = _BYTES.repeat_interleave(256)  # (byte, scale) pairs: every byte with every scale
    _PAIR_S = _BYTES.repeat(256)


@dataclasses.dataclass
class Stream:
    """What the analysis knows of a node: how its values sit relative to the uint8 roots, and
    their probes (a 256-entry table per root byte, or per (byte, scale) pair once combined).

    kind: "byte" (pointwise in one uint8 root, its shape; `trail` = an unsqueezed last dim),
    "half" (one nibble stream written into a strided buffer), "pair" ([..., W, 2]), "values"
    ([..., O, 2W] "flat" or [..., O, G, 32] "grouped"; from `packed` only, or combined with a
    scale: `scale` set), "scale" (a scale stream broadcast over the groups: "flat", "grouped",
    or "grouped1" = [..., O, G, 1])."""

    kind: str
    root: fx.Node
    probes: tuple  # byte: (t,); half: (t,) ; pair/values: (lo, hi); scale: (t,)
    layout: str = ""
    trail: bool = False
    scale: fx.Node | None = None
    slot: int = 0  # half: which of the two nibble positions it filled


def _dtype(node) -> torch.dtype | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


class Constants:
    """Real values of small tensors known at compile time: graph-module attributes, graph inputs
    whose real value the stage handed over (`real_inputs`), and what the graph computes from
    them with factory, pointwise, reshape and static slice / select ops."""

    def __init__(self, graph: fx.Graph):
        self.module = graph.owning_module
        meta = getattr(self.module, "meta", {}) or {}
        inputs = meta.get("real_inputs") or []
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.inputs = dict(zip(placeholders, inputs)) if len(inputs) == len(placeholders) else {}
        self.index = {n: i for i, n in enumerate(placeholders)}
        # the inputs whose values a rewrite depended on (k3compile/stage_cache.py keys by them)
        self.read = meta.setdefault("inputs_read", set()) if isinstance(meta, dict) else set()
        self.memo: dict[fx.Node, torch.Tensor | None] = {}

    def __call__(self, node) -> torch.Tensor | None:
        if not isinstance(node, fx.Node):
            return None
        if node not in self.memo:
            self.memo[node] = self._value(node)
        return self.memo[node]

    def source(self, node: fx.Node) -> torch.Tensor | None:
        """The real tensor of a module attribute or of a graph input handed over (any size; the
        input recorded as read), else None."""
        if node.op == "get_attr":
            value = getattr(self.module, node.target, None)
            return value if isinstance(value, torch.Tensor) else None
        value = self.inputs.get(node) if node.op == "placeholder" else None
        if value is not None:
            self.read.add(self.index[node])
        return value

    def _value(self, node: fx.Node) -> torch.Tensor | None:
        shape = _shape(node)
        if shape is None or torch.Size(shape).numel() > MAX_TABLE:
            return None
        if node.op in ("get_attr", "placeholder"):
            value = self.source(node)
        elif node.op == "call_function" and (node.target in _FACTORIES or _pointwise(node)
                                             or node.target in RESHAPES
                                             or node.target in _PICKS):
            if any(self(a) is None for a in node.all_input_nodes):
                return None
            args, kwargs = fx.map_arg((node.args, node.kwargs), self)
            value = _run(node.target, args, kwargs)
        else:
            return None
        if not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor,
                                                                     torch.nn.Parameter):
            return None
        with inductor.unset_fake_temporarily():
            return value.detach().cpu().clone()


def known_value(node) -> torch.Tensor | None:
    """The real value of a small tensor the graph knows at compile time (a constant, a graph
    input stage `canonicalize` handed over, or computed from those), else None."""
    if not isinstance(node, fx.Node) or node.graph.owning_module is None:
        return None
    return Constants(node.graph)(node)


def _pointwise(node: fx.Node) -> bool:
    t = node.target
    return (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags) or t in _CASTS


def _run(target, args, kwargs) -> torch.Tensor:
    with inductor.unset_fake_temporarily():
        return target(*args, **kwargs)


class _Analysis:
    """Forward over the graph: a `Stream` for every node the MXFP4 structure explains."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.constants = Constants(graph)
        self.streams: dict[fx.Node, Stream] = {}

    def run(self) -> dict[fx.Node, Stream]:
        for node in self.graph.nodes:
            if node.op != "call_function" and node.op != "placeholder" and node.op != "get_attr":
                continue
            stream = None
            if node.op == "call_function":
                try:
                    stream = self._transfer(node)
                except (RuntimeError, IndexError, TypeError, ValueError):
                    stream = None  # a probe the op cannot evaluate: not this structure
            if stream is None and _dtype(node) == torch.uint8 and _shape(node):
                stream = Stream("byte", node, (_BYTES,))
            if stream is not None:
                self.streams[node] = stream
        return self.streams

    def _transfer(self, node: fx.Node) -> Stream | None:
        t = node.target
        if t is aten.index.Tensor:
            return self._gather(node)
        if t is aten.unsqueeze.default:
            return self._unsqueeze(node)
        if t is aten.cat.default:
            return self._interleave(node)
        if t in RESHAPES:
            return self._view(node)
        if t is aten.expand.default:
            return self._expand(node)
        if t is aten.slice_scatter.default:
            return self._strided_write(node)
        if t is aten.select_scatter.default:
            return self._pair_write(node)
        if t is aten.copy.default:
            return self._copy(node)
        if _pointwise(node):
            return self._pointwise(node)
        return None

    # --- values ------------------------------------------------------------------------------

    def _pointwise(self, node: fx.Node) -> Stream | None:
        tensor_args = list(node.all_input_nodes)
        ins = [self.streams.get(a) for a in tensor_args]
        if not ins or any(s is None and (_shape(a) != () or self.constants(a) is None)
                          for s, a in zip(ins, tensor_args)):
            return None  # only streams and 0-d constants
        streams = [s for s in ins if s is not None]
        first = streams[0]
        if first.kind == "byte":
            if any(s.kind != "byte" or s.root is not first.root or s.trail != first.trail
                   for s in streams):
                return None
            (t,) = self._eval(node, {a: s.probes[0] for a, s in zip(tensor_args, ins) if s})
            return dataclasses.replace(first, probes=(t,))
        if all(s.kind == "scale" and s.layout == first.layout and s.root is first.root
               for s in streams):
            (t,) = self._eval(node, {a: s.probes[0] for a, s in zip(tensor_args, ins) if s})
            return dataclasses.replace(first, probes=(t,))
        return self._combine(node, tensor_args, ins)

    def _combine(self, node, tensor_args, ins) -> Stream | None:
        values = [s for s in ins if s is not None and s.kind == "values"]
        scales = [s for s in ins if s is not None and s.kind in ("scale", "byte")]
        if not values or any(s.kind not in ("values", "scale", "byte") for s in ins if s):
            return None
        layout, roots = values[0].layout, {s.root for s in values}
        scale_roots = {s.scale for s in values if s.scale is not None}
        for s in scales:
            if s.kind == "byte":  # a scale stream [..., O, G, 1] next to grouped values
                if not (s.trail and layout == "grouped"):
                    return None
            elif s.layout != layout:
                return None
            scale_roots.add(s.root)
        if any(s.layout != layout for s in values) or len(roots) != 1 or len(scale_roots) > 1:
            return None
        if _shape(node) != _shape(next(a for a, s in zip(tensor_args, ins) if s in values)):
            return None
        scale = next(iter(scale_roots), None)
        if scale is not None and not _pairs_with(values[0].root, scale):
            return None
        wide = scale is not None and any(len(p) > 256 for s in values for p in s.probes) or scales
        probes = []
        for slot in (0, 1):
            env = {}
            for a, s in zip(tensor_args, ins):
                if s is None:
                    continue
                p = s.probes[slot] if s.kind == "values" else s.probes[0]
                if wide and len(p) == 256:
                    p = p[_PAIR_S.long()] if s.kind != "values" else p[_PAIR_B.long()]
                env[a] = p
            probes.append(self._eval(node, env)[0])
        return Stream("values", values[0].root, tuple(probes), layout, scale=scale)

    def _copy(self, node: fx.Node) -> Stream | None:
        """copy(dst, src), the functional `dst.copy_(src)`: src's values in dst's dtype."""
        dst, src = node.args[:2]
        s = self.streams.get(src)
        if s is None or s.kind != "byte" or _shape(dst) != _shape(src):
            return None
        dtype = _dtype(dst)
        return dataclasses.replace(s, probes=tuple(_run(prims.convert_element_type.default,
                                                        (p, dtype), {}) for p in s.probes))

    def _gather(self, node: fx.Node) -> Stream | None:
        table, indices = node.args[0], node.args[1]
        if len(indices) != 1 or not isinstance(indices[0], fx.Node):
            return None
        values, stream = self.constants(table), self.streams.get(indices[0])
        if values is None or values.dim() != 1 or stream is None:
            return None
        if _dtype(indices[0]) not in (torch.int64, torch.int32):
            return None  # a uint8 / bool index is a mask, not a gather
        gathered = tuple(_run(aten.index.Tensor, (values, [p.long()]), {}) for p in stream.probes)
        return dataclasses.replace(stream, probes=gathered)

    def _eval(self, node: fx.Node, env: dict) -> tuple:
        args, kwargs = fx.map_arg((node.args, node.kwargs),
                                  lambda a: env[a] if a in env else self.constants(a))
        return (_run(node.target, args, kwargs),)

    # --- layout ------------------------------------------------------------------------------

    def _unsqueeze(self, node: fx.Node) -> Stream | None:
        s, dim = self.streams.get(node.args[0]), node.args[1]
        shape = _shape(node.args[0])
        if s is None or s.kind != "byte" or s.trail or shape is None:
            return None
        if dim not in (-1, len(shape)):
            return None
        return dataclasses.replace(s, trail=True)

    def _interleave(self, node: fx.Node) -> Stream | None:
        parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        ins = [self.streams.get(p) for p in parts]
        shape = _shape(node)
        if (len(parts) != 2 or shape is None or dim not in (-1, len(shape) - 1)
                or any(s is None or s.kind != "byte" or not s.trail for s in ins)
                or ins[0].root is not ins[1].root or shape[-1] != 2):
            return None
        return Stream("pair", ins[0].root, (ins[0].probes[0], ins[1].probes[0]), "pair")

    def _view(self, node: fx.Node) -> Stream | None:
        s, src, dst = self.streams.get(node.args[0]), _shape(node.args[0]), _shape(node)
        if s is None or src is None or dst is None:
            return None
        lead = src[:-2] if s.layout in ("pair", "grouped") else src[:-1]
        flat = lead + (src[-1] * src[-2],) if s.layout in ("pair", "grouped") else src
        if s.kind == "pair" or s.kind == "values":
            if dst == flat:
                return dataclasses.replace(s, kind="values", layout="flat")
            if len(dst) == len(flat) + 1 and dst[:-2] == flat[:-1] and dst[-1] == GROUP \
                    and dst[-2] * GROUP == flat[-1]:
                return dataclasses.replace(s, kind="values", layout="grouped")
            return None
        if s.kind == "scale" and s.layout == "grouped" and dst == flat:
            return dataclasses.replace(s, layout="flat")
        return None

    def _expand(self, node: fx.Node) -> Stream | None:
        s, src, dst = self.streams.get(node.args[0]), _shape(node.args[0]), _shape(node)
        if s is None or src is None or dst is None or src[-1] != 1:
            return None
        if s.kind == "byte" and s.trail and dst == src[:-1] + (GROUP,):
            return Stream("scale", s.root, s.probes, "grouped")
        return None

    def _strided_write(self, node: fx.Node) -> Stream | None:
        """slice_scatter(base, src, dim=-1, start, end, step=2): one nibble stream into every
        other element of [..., 2W]; the second write of the other parity completes it."""
        base, src, dim, start, end, step = (list(node.args) + [0, None, None, 1])[:6]
        shape, src_shape = _shape(node), _shape(src)
        s, b = self.streams.get(src), self.streams.get(base)
        if (shape is None or src_shape is None or s is None or s.kind != "byte" or s.trail
                or dim not in (-1, len(shape) - 1) or step != 2 or start not in (0, 1)
                or (end is not None and end < shape[-1]) or shape != src_shape[:-1]
                + (2 * src_shape[-1],)):
            return None
        if b is not None and b.kind == "half" and b.root is s.root and b.slot != start:
            lo, hi = (s.probes[0], b.probes[0]) if start == 0 else (b.probes[0], s.probes[0])
            return Stream("values", s.root, (lo, hi), "flat")
        if b is not None:
            return None
        return Stream("half", s.root, s.probes, slot=start)

    def _pair_write(self, node: fx.Node) -> Stream | None:
        """select_scatter(base [..., W, 2], src [..., W], -1, index): `out[..., i] = src`."""
        base, src, dim, index = node.args[:4]
        shape, s, b = _shape(node), self.streams.get(src), self.streams.get(base)
        if (shape is None or s is None or s.kind != "byte" or s.trail or shape[-1] != 2
                or dim not in (-1, len(shape) - 1) or index not in (0, 1)
                or _shape(src) != shape[:-1]):
            return None
        if b is not None and b.kind == "half" and b.layout == "pair" and b.root is s.root \
                and b.slot != index:
            lo, hi = (s.probes[0], b.probes[0]) if index == 0 else (b.probes[0], s.probes[0])
            return Stream("pair", s.root, (lo, hi), "pair")
        if b is not None:
            return None
        return Stream("half", s.root, s.probes, "pair", slot=index)


def _pairs_with(packed: fx.Node, scale: fx.Node) -> bool:
    p, s = _shape(packed), _shape(scale)
    return (p is not None and s is not None and len(p) == len(s) and p[:-1] == s[:-1]
            and 2 * p[-1] == GROUP * s[-1])


@functools.cache
def canonical_probes(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical dequant of every (byte, scale) pair, low and high nibble, in dtype. Computed
    once per dtype (~1M values; every candidate site of every bucket compares against it), so
    callers only read the tensors."""
    packed = _PAIR_B.unsqueeze(-1).expand(-1, GROUP // 2).contiguous()
    out = mxfp4_dequant(packed, _PAIR_S.unsqueeze(-1), e2m1_table(dtype=dtype))
    return out[:, 0], out[:, 1]


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    return torch.equal(got[~nan].view(ints), want[~nan].view(ints))


def is_exact(stream: Stream, dtype: torch.dtype) -> bool:
    """Whether the stream's probes are the canonical dequant, bit for bit, in dtype."""
    if stream.kind != "values" or stream.scale is None or not dtype.is_floating_point:
        return False
    if any(p.shape != _PAIR_S.shape for p in stream.probes):
        return False
    with inductor.unset_fake_temporarily():
        lo, hi = canonical_probes(dtype)
        spec = _PAIR_S != 255  # E8M0's NaN encoding, which no quantiser emits (see above)
        return (_same_bits(stream.probes[0][spec], lo[spec])
                and _same_bits(stream.probes[1][spec], hi[spec]))


def _table(graph: fx.Graph, dtype: torch.dtype, device, cache: dict) -> fx.Node:
    """The graph's one E2M1 table node per dtype and device: computed in the graph from an
    iota by the E2M1 bit rule (fp32, converted once per dtype), not a tensor attribute: a real
    constant breaks Inductor's fake-tensor propagation and sits on one device. The table reads
    nothing, so it folds away where `k3.moe_experts` (which builds its own) takes the site."""
    if (dtype, device) in cache:
        return cache[dtype, device]
    if (torch.float32, device) not in cache:
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            cache[torch.float32, device] = _e2m1_nodes(graph, device)
    node = cache[torch.float32, device]
    if dtype != torch.float32:
        with graph.inserting_after(node):
            node = _insert(graph, prims.convert_element_type.default, (node, dtype))
        cache[dtype, device] = node
    return node


def _insert(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A call with meta["val"] computed under the graph's fake mode (no input may carry it)."""
    node = graph.call_function(target, args, kwargs or {})
    vals, kw = fx.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    with _fake_mode(graph):
        node.meta["val"] = target(*vals, **kw)
    return node


def _e2m1_nodes(graph: fx.Graph, device) -> fx.Node:
    """E2M1 of codes 0..15: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    def op(target, *args):
        return _insert(graph, target, args)

    codes = _insert(graph, prims.iota.default, (16,), {"start": 0, "step": 1, "dtype": torch.int64,
                    "device": device, "requires_grad": False})  # arange, as decomposed

    def bits(shift, mask):  # (codes >> shift) & mask, as fp32
        shifted = op(aten.__rshift__.Scalar, codes, shift) if shift else codes
        return op(prims.convert_element_type.default, op(aten.bitwise_and.Scalar, shifted, mask),
                  torch.float32)

    mant, exp, sign = bits(0, 1), bits(1, 3), bits(3, 1)
    # (1 + m/2) * 2^(e-1) for e >= 1, m/2 for e = 0: (min(e, 1) + m/2) * 2^(max(e, 1) - 1)
    lead = op(aten.add.Tensor, op(aten.clamp_max.default, exp, 1.0), op(aten.mul.Tensor, mant, 0.5))
    power = op(aten.exp2.default, op(aten.sub.Tensor, op(aten.clamp_min.default, exp, 1.0), 1.0))
    signed = op(aten.add.Tensor, op(aten.mul.Tensor, sign, -2.0), 1.0)  # 1 - 2 s
    return op(aten.mul.Tensor, op(aten.mul.Tensor, lead, power), signed)  # code 8: -0.0


def _fake_mode(graph: fx.Graph):
    vals = [n.meta.get("val") for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    mode = torch._guards.detect_fake_mode(vals)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def _canonical_graph(packed: fx.Node, scale: fx.Node, dtype: torch.dtype,
                     traced: dict) -> fx.GraphModule:
    """math.mxfp4_dequant traced as the model's graph is (one trace per shapes and dtype)."""
    device = packed.meta["val"].device
    key = (_shape(packed), _shape(scale), dtype, device)
    if key not in traced:
        with _fake_mode(packed.graph):
            # a fake table on the weights' device: its values do not enter the trace
            table = torch.empty(len(E2M1_VALUES), dtype=dtype, device=device)
            traced[key] = inductor.fwd_only_joint(
                mxfp4_dequant, [packed.meta["val"], scale.meta["val"], table])
    return traced[key]


def _cone_targets(node: fx.Node, roots: set, streams: dict) -> list[str]:
    """The ops between the roots and node that carry their values (not a table's conversion)."""
    seen, stack, out = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen or n in roots or n.op != "call_function" or n not in streams:
            continue
        seen.add(n)
        out.append(str(n.target))
        stack.extend(n.all_input_nodes)
    return sorted(out)


def _splice(graph: fx.Graph, site: fx.Node, found: tuple[Stream, dict], shared: dict) -> bool:
    stream, streams = found
    tables, traced = shared.setdefault("tables", {}), shared.setdefault("traced", {})
    dtype = _dtype(site)
    gm = _canonical_graph(stream.root, stream.scale, dtype, traced)
    canonical = sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    if _cone_targets(site, {stream.root, stream.scale}, streams) == canonical:
        return False  # already the canonical form
    # not `region.splice_if_same`: the table's nodes, added here at the first site, take that
    # site's module as the copy's do (splice labels only the copy; measured plans are per layer)
    before = set(graph.nodes)
    table = _table(graph, dtype, stream.root.meta["val"].device, tables)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(site):
        out = graph.graph_copy(gm.graph, dict(zip(placeholders, [stream.root, stream.scale,
                                                                  table])))
    new = out[0] if isinstance(out, (list, tuple)) else out
    if _shape(new) != _shape(site) or _dtype(new) != dtype:
        return False
    stack = site.meta.get("nn_module_stack")
    for n in graph.nodes:  # the nodes just copied in (not the model's own without a module)
        if (n not in before and n.meta.get("val") is not None and "nn_module_stack" not in n.meta
                and stack):
            n.meta["nn_module_stack"] = stack
    site.replace_all_uses_with(new)
    return True


def sites(graph: fx.Graph) -> tuple[list[tuple[fx.Node, Stream]], dict]:
    """(node, stream) of every MXFP4 dequant the analysis proves exact: a flat [..., O, 2W]
    value stream of one packed and one scale tensor, none of whose users continues it."""
    streams = _Analysis(graph).run()
    found = []
    for node, s in streams.items():
        if s.kind != "values" or s.layout != "flat" or s.scale is None:
            continue
        if any(streams.get(u, Stream("", node, ())).kind == "values" and
               streams[u].scale is not None for u in node.users):
            continue
        if is_exact(s, _dtype(node)):
            found.append((node, s))
    return found, streams


def apply(graph: fx.Graph) -> int:
    if graph.owning_module is None:
        return 0
    with inductor.unset_fake_temporarily():  # the probes are real tensors, whatever mode is on
        found, streams = sites(graph)
    at = {site: (stream, streams) for site, stream in found}
    return rewrite_sites(graph, at.get, _splice, traced=True, sort=True)


RULE = Rule("mxfp4_dequant", apply,
            "E2M1 x E8M0 dequant by bit ops / LUT gathers / ldexp / E8M0 tables, any interleave "
            "-> math.mxfp4_dequant's gather + stack + exp2(scale - 127) per 32")

__all__ = ["RULE", "apply", "canonical_probes", "is_exact", "known_value", "sites"]
