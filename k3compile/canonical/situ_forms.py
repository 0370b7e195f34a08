"""Rule `situ_forms`: SiTU-GLU's product written in another order or with a reciprocal multiply,
e.g. `sigmoid(g) * tanh(g * (1 / b1)) * b1 * (tanh(u * (1 / b2)) * b2)` (spell6,
`tests/models/spell6_k3.py`), -> the canonical `b1 * tanh(g / b1) * sigmoid(g) * (b2 * tanh(u /
b2))` (`k3compile.math.situ`), the form `patterns/situ_gate_up.py` and the routed experts' SiTU
match.

A product of fp32 tensors traces to a tree of `aten.mul.Tensor`; the rule flattens the tree (the
muls read only inside it) and takes it when its leaves are exactly sigmoid(g), tanh(g / b1),
tanh(u / b2) (each divisor also as a multiply by the Python float 1 / b, round trip exact) and the
two Python floats b1, b2, g and u two different fp32 (or fp64) tensors. Pattern matching does not
try the orders of a commutative product, so every order needs this rule.

Values: equal in real arithmetic; in floating point the products round in another order and
`x * (1 / b)` rounds the reciprocal first (for b = 4 exact, for b = 25 within an ulp of x / b), a
few ulp apart (`tests/canonical/test_situ_forms.py` bounds it at 8 * 2^-23 relative). Left alone:
half-precision products (each op rounds to 8 / 11 bits: other values), a sigmoid of another
tensor than the gate's tanh, scalars that are not the divisors, a tree with another leaf, a factor
read outside the tree (it would still be computed; nothing gained).
"""

from __future__ import annotations

import collections

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.graph import call

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.float64)


def _float(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype in _FLOATS


def _scalar(a) -> bool:
    return isinstance(a, float)


def _leaves(node: fx.Node) -> list:
    out = []
    for a in node.args:
        inner = (isinstance(a, fx.Node) and a.target is aten.mul.Tensor and len(a.users) == 1
                 and _float(a))
        out += _leaves(a) if inner else [a]
    return out


def _one_use(node, target) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is target
            and len(node.users) == 1 and _float(node))


def _scaled(tanh: fx.Node):
    """(x, b) of tanh(x / b) or tanh(x * (1 / b)), b a Python float, or None."""
    y = tanh.args[0]
    if not (_one_use(y, aten.div.Tensor) or _one_use(y, aten.mul.Tensor)) or y.kwargs:
        return None
    x, c = y.args
    if not (isinstance(x, fx.Node) and _float(x) and _scalar(c) and c != 0.0):
        return None
    if y.target is aten.div.Tensor:
        return x, c
    b = 1.0 / c
    return (x, b) if 1.0 / b == c else None


def _site(node: fx.Node):
    """(g, b1, u, b2) of a SiTU product rooted at node, or None."""
    if not _float(node) or node.kwargs:
        return None
    leaves = _leaves(node)
    tensors = [a for a in leaves if isinstance(a, fx.Node)]
    scalars = [a for a in leaves if _scalar(a)]
    if len(leaves) != 5 or len(tensors) != 3 or len(scalars) != 2:
        return None
    sig = [t for t in tensors if _one_use(t, aten.sigmoid.default)]
    tanhs = [t for t in tensors if _one_use(t, aten.tanh.default)]
    if len(sig) != 1 or len(tanhs) != 2:
        return None
    scaled = [_scaled(t) for t in tanhs]
    if None in scaled:
        return None
    g = sig[0].args[0]
    gate = [s for s in scaled if s[0] is g]
    up = [s for s in scaled if s[0] is not g]
    if len(gate) != 1 or len(up) != 1:
        return None
    (g, b1), (u, b2) = gate[0], up[0]
    if collections.Counter(scalars) != collections.Counter([b1, b2]):
        return None
    dtype = node.meta["val"].dtype
    if g.meta["val"].dtype != dtype or u.meta["val"].dtype != dtype:
        return None
    return None if _canonical(node, g, b1, u, b2) else (g, b1, u, b2)


def _args(node, target):
    """node's arguments if it calls target, else None."""
    return node.args if isinstance(node, fx.Node) and node.target is target else None


def _canonical(node, g, b1, u, b2) -> bool:
    """node is already `(b1 * tanh(g / b1) * sigmoid(g)) * (b2 * tanh(u / b2))` as traced."""
    gate, lin = node.args
    scaled_sig = _args(gate, aten.mul.Tensor)
    return (scaled_sig is not None and _args(scaled_sig[1], aten.sigmoid.default) == (g,)
            and _scaled_form(scaled_sig[0], g, b1) and _scaled_form(lin, u, b2))


def _scaled_form(node, x, b) -> bool:
    """node is `b * tanh(x / b)` as traced: mul(tanh(div(x, b)), b)."""
    m = _args(node, aten.mul.Tensor)
    t = m is not None and not isinstance(m[1], fx.Node) and m[1] == b and _args(
        m[0], aten.tanh.default)
    d = t and _args(t[0], aten.div.Tensor)
    return bool(d) and d[0] is x and d[1] == b


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    g, b1, u, b2 = site
    mul = aten.mul.Tensor
    with graph.inserting_before(node):
        gate = call(graph, mul, (call(graph, aten.tanh.default,
                                      (call(graph, aten.div.Tensor, (g, b1), like=node),),
                                      like=node), b1), like=node)
        gate = call(graph, mul, (gate, call(graph, aten.sigmoid.default, (g,), like=node)),
                    like=node)
        lin = call(graph, mul, (call(graph, aten.tanh.default,
                                     (call(graph, aten.div.Tensor, (u, b2), like=node),),
                                     like=node), b2), like=node)
        act = call(graph, mul, (gate, lin), like=node)
    node.replace_all_uses_with(act)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.mul.Tensor})


RULE = Rule("situ_forms", apply, "SiTU's product in another order / x * (1 / b) (fp32) -> "
            "b1 * tanh(g / b1) * sigmoid(g) * (b2 * tanh(u / b2))")

__all__ = ["RULE", "apply"]
