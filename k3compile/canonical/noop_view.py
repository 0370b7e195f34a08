"""Rule `noop_view`: a view that gives its input's own shape back -> the input.

K3 code reshapes defensively: `scores.view(-1, num_experts)` on scores that are already
[N, E] (DeepSeek-style gates), `scores.view(bsz * seq_len, -1)` after a router that already
flattened the tokens (Moonshot), `x.reshape(x.shape)`. Our model and the patterns do not write
these, so a no-op view between two ops of a fusion hides it (moe_route: sigmoid -> view -> add).

Taken: one `view` / `_unsafe_view` / `reshape` whose output has its input's shape. Exact: the
same tensor. A use by the graph's output stays (the output would alias its input). Left as they
are: chains of views that come back to their start (`x.view(B, 1, D)` ... `.view(B, D)`), which
our model writes around its projections (the KDA f_a -> f_b pair) and the patterns with it, and
expands to the own shape, which `matmul`'s lowering writes before its bmm (rule `gemm` reads it).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import RESHAPES

aten = torch.ops.aten


def _is_view(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in RESHAPES
            and isinstance(node.args[0], fx.Node))


def _same_tensor(node: fx.Node) -> fx.Node | None:
    """The input of `node` if node is a view that gives its input's own shape back."""
    if not _is_view(node):
        return None
    shape = _shape(node)
    return node.args[0] if shape is not None and _shape(node.args[0]) == shape else None


def bypass(graph: fx.Graph, node: fx.Node, source: fx.Node) -> bool:
    """node's readers read source instead (the graph's outputs keep node); False: none did."""
    users = [u for u in node.users if u.op != "output"]
    for user in users:
        user.replace_input_with(node, source)
    return bool(users)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _same_tensor, bypass, tidy=False)


RULE = Rule("noop_view", apply, "view / reshape to the input's own shape -> the input")
