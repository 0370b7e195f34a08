"""Rule `depth_mix_scores`: an AttnRes depth mix over sources stacked on dim 0 (the canonical
`torch.stack([*blocks, prefix])`) whose graph is not a canonical mix's -> the whole canonical mix
(`k3compile.math.depth_mix_weights`, or `depth_mix_scores_fp32`), taken only where it evaluates
to the same values on random sources and weights (rule `depth_mix`'s check, RTOL 1e-5).

Rule `depth_mix` rebuilds whole mixes stacked on other dims, and on dim 0 rewrites the stack and
the weighted sum only: scores spelled otherwise stay, and `attn_res_mix_norm` misses. A paper's
reference code writes them so (tests/models/spell8_k3.py):

    v = torch.stack(bank + [prefix], dim=0).float()
    normed = v / torch.sqrt(torch.mean(v ** 2, -1, keepdim=True) + eps)
    scores = torch.einsum("s...d,d->s...", normed, w_norm * w_proj[0])   # folded weights
    h = torch.einsum("s...,s...d->...d", torch.softmax(scores, 0), v)

A mix whose graph already has a canonical form's ops (views aside) is left to `depth_mix`, so the
built-in model's graph does not change. The fold is the same math in fp32 (`depth_mix`'s
docstring: within 3e-7); in bf16 a mix rounding otherwise than a canonical form fails the check and
stays.
"""

from __future__ import annotations

import collections
import itertools
import logging

from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.depth_mix import (
    _VIEWS,
    FORMS,
    _canonical_trace,
    _rebuilt,
    _roles,
    _site,
    _softmax_dim,
)
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.region import val as _val

log = logging.getLogger("k3compile")


def _ops(nodes) -> collections.Counter:
    return collections.Counter(n.target for n in nodes
                               if n.op == "call_function" and n.target not in _VIEWS)


def _already_canonical(site, traced: dict) -> bool:
    """Whether the site's ops (views aside) are a canonical form's; `traced`: the forms' op
    counts by (form, eps, the inputs' shapes and dtypes), shared by one pass's sites (a model's
    mixes repeat a few shapes, and each trace costs ~10 ms)."""
    ops = _ops(site.nodes)
    for form, (wn, wp), eps in itertools.product(FORMS, _roles(site.weights),
                                                 dict.fromkeys(site.eps)):
        key = (form, eps, *((tuple(_shape(n)), _val(n).dtype) for n in (wn, wp, *site.tokens)))
        if key not in traced:
            try:
                traced[key] = _ops(_canonical_trace(site.tokens, wn, wp, eps, form).graph.nodes)
            except Exception as e:  # noqa: BLE001 (a weight the form cannot take: not this form)
                log.debug("k3 depth_mix_scores: %s: %s", type(e).__name__, e)
                traced[key] = None
        if traced[key] == ops:
            return True
    return False


def _match(node: fx.Node, traced: dict):
    if _softmax_dim(node) != 0:
        return None
    site = _site(node, 0)
    return None if site is None or _already_canonical(site, traced) else site


def _write(graph: fx.Graph, alpha: fx.Node, _) -> int:
    return _rebuilt(graph, alpha)


def apply(graph: fx.Graph) -> int:
    traced = {}
    return rewrite_sites(graph, lambda node: _match(node, traced), _write)


RULE = Rule("depth_mix_scores", apply, "AttnRes depth mix stacked on dim 0 with scores not in "
            "the canonical form (einsum against w_norm * w_proj, ...) -> math.depth_mix_weights")
