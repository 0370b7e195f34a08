"""Rule `nibble_unpack`: the MXFP4 nibble unpack written on a byte-duplicated tensor -> the two
nibble streams interleaved, the layout rule `mxfp4_dequant` takes.

Spell6 (`tests/models/spell6_k3.py`, `mxfp4_decode`) unpacks the low-first nibbles as

    (packed.repeat_interleave(2, -1) >> tensor([0, 4]).repeat(W)) & 15

each byte duplicated, then a shift pattern of period 2 along the last dim. `mxfp4_dequant`
models two nibble streams of one byte interleaved (`stack([p & 15, p >> 4], -1).flatten(-2)`),
not a duplicated byte with a position-periodic operand, so spell6's dequant was no site. This
rule writes the duplicated form as the interleaved one:

* layout, matched structurally: `repeat_interleave(2, -1)` of a uint8 tensor `packed` [..., W]
  (as traced: unsqueeze(-1), expand [..., W, 2], clone, view [..., 2W]; or the op itself),
  followed by a chain of single-use integer ops (shifts, `&`, integer casts) whose other operand
  is a Python int or a constant known at compile time (`mxfp4_dequant.known_value`) that is
  periodic with period 2 along the last dim and broadcasts to [..., 2W] without widening it;
* values, proved by evaluation: the chain is run on all 256 byte values, once with the
  constants' even-position values and once with their odd-position ones; the longest prefix of
  the chain whose two results equal `b & 15` and `b >> 4` (every byte, exactly; an integer dtype)
  is rewritten to `cat([(p & 15)[..., None], (p >> 4)[..., None]], -1).view(..., 2W)`, cast to the
  prefix's dtype where that is not uint8. Integer ops on the same bytes: bit for bit the same.

Left alone: another shift pattern (`[0, 3]`, `[4, 0]`: high nibble first), a mask that is not
15, a shift tensor that is not period 2, a float chain, a duplicated byte read elsewhere.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.mxfp4_dequant import known_value
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import call
from k3compile.rewrite import inductor

aten, prims = torch.ops.aten, torch.ops.prims

_OPS = {aten.__rshift__.Tensor, aten.__rshift__.Scalar, aten.bitwise_right_shift.Tensor,
        aten.bitwise_right_shift.Tensor_Scalar, aten.bitwise_and.Tensor, aten.bitwise_and.Scalar,
        prims.convert_element_type.default, aten._to_copy.default}
_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

with inductor.unset_fake_temporarily():  # real even when first imported inside a compile
    _BYTES = torch.arange(256, dtype=torch.uint8)
    _WANT = (_BYTES & 15, _BYTES >> 4)


def _dtype(node) -> torch.dtype | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


def _duplicated(node: fx.Node) -> fx.Node | None:
    """packed, where node = packed.repeat_interleave(2, -1) of a uint8 tensor, else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.repeat_interleave.self_int:
        packed, reps = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        shape = _shape(packed)
        if reps != 2 or shape is None or dim not in (-1, len(shape) - 1):
            return None
        return packed if _dtype(packed) == torch.uint8 else None
    if node.target not in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    src = node.args[0]
    if isinstance(src, fx.Node) and src.target is aten.clone.default and len(src.users) == 1:
        src = src.args[0]
    if not (isinstance(src, fx.Node) and src.target is aten.expand.default and len(src.users) == 1):
        return None
    unsq = src.args[0]
    if not (isinstance(unsq, fx.Node) and unsq.target is aten.unsqueeze.default
            and len(unsq.users) == 1):
        return None
    packed = unsq.args[0]
    shape, wide, out = _shape(packed), _shape(src), _shape(node)
    if shape is None or wide is None or out is None or _dtype(packed) != torch.uint8:
        return None
    if unsq.args[1] not in (-1, len(shape)) or wide != shape + (2,):
        return None
    return packed if out == shape[:-1] + (2 * shape[-1],) else None


def _period2(value: torch.Tensor, shape: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(even, odd) [1]-element tensors of a constant with period 2 along the last dim that
    broadcasts to `shape` without widening it, else None."""
    if value.dim() == 0 or value.dim() > len(shape) or value.shape[-1] != shape[-1]:
        return None
    if any(d != 1 for d in value.shape[:-1]):
        return None
    row = value.reshape(-1)
    even, odd = row[0::2], row[1::2]
    if not (bool((even == even[0]).all()) and bool((odd == odd[0]).all())):
        return None
    return even[:1].clone(), odd[:1].clone()


def _constant_pair(node: fx.Node, shape: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`_period2` of a constant node; a `repeat` of a known [2] constant along the last dim is
    read from that constant (a full row of a wide layer is past `known_value`'s size bound)."""
    value = known_value(node)
    if value is not None:
        return _period2(value, shape)
    out = _shape(node)
    if node.target is not aten.repeat.default or out is None or len(out) > len(shape):
        return None
    src, reps = known_value(node.args[0]), node.args[1]
    if (src is None or src.dim() != 1 or src.shape[0] != 2 or any(r != 1 for r in reps[:-1])
            or out[-1] != shape[-1] or any(d != 1 for d in out[:-1])):
        return None
    return src[:1].clone(), src[1:].clone()


def _slot_args(node: fx.Node, prev: fx.Node, shape: tuple) -> tuple[list, list] | None:
    """node's args for the even and the odd slot (prev as a marker None), or None."""
    slots: tuple[list, list] = ([], [])
    for a in node.args:
        if a is prev:
            for s in slots:
                s.append(None)
        elif isinstance(a, fx.Node):
            pair = _constant_pair(a, shape)
            if pair is None:
                return None
            for s, v in zip(slots, pair):
                s.append(v)
        elif isinstance(a, (bool, int, torch.dtype)):
            for s in slots:
                s.append(a)
        else:
            return None
    return slots


def _site(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(packed, end): the longest chain from node = repeat_interleave(packed, 2, -1) whose
    results on every byte are its low nibble at even positions and its high one at odd ones."""
    packed = _duplicated(node)
    if packed is None:
        return None
    shape = _shape(node)
    with inductor.unset_fake_temporarily():
        probes, prev, best = [_BYTES, _BYTES], node, None
        while len(prev.users) == 1:
            user = next(iter(prev.users))
            if (user.op != "call_function" or user.target not in _OPS or _shape(user) != shape
                    or _dtype(user) not in _INTS or user.args.count(prev) != 1
                    or any(v is prev for v in user.kwargs.values())):
                break
            slots = _slot_args(user, prev, shape)
            if slots is None:
                break
            probes = [user.target(*(p if a is None else a for a in args), **user.kwargs)
                      for p, args in zip(probes, slots)]
            prev = user
            if all(torch.equal(got.long(), want.long()) for got, want in zip(probes, _WANT)):
                best = user
    return None if best is None else (packed, best)


def _write(graph: fx.Graph, node: fx.Node, site: tuple[fx.Node, fx.Node]) -> None:
    packed, end = site
    shape = _shape(end)
    with graph.inserting_before(end):
        lo = call(graph, aten.bitwise_and.Scalar, (packed, 15), like=end)
        hi = call(graph, aten.__rshift__.Scalar, (packed, 4), like=end)
        parts = [call(graph, aten.unsqueeze.default, (x, -1), like=end) for x in (lo, hi)]
        pair = call(graph, aten.cat.default, (parts, -1), like=end)
        out = call(graph, aten.view.default, (pair, list(shape)), like=end)
        if _dtype(end) != torch.uint8:
            out = call(graph, prims.convert_element_type.default, (out, _dtype(end)), like=end)
    end.replace_all_uses_with(out)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write)


RULE = Rule("nibble_unpack", apply,
            "(packed.repeat_interleave(2, -1) >> [0, 4]*) & 15 (period-2 constants, proved on all "
            "256 bytes) -> cat([p & 15, p >> 4] unsqueezed, -1).view")

__all__ = ["RULE", "apply"]
