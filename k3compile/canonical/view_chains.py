"""Rule `view_chains`: a chain of views that forks into further views -> one chain per read.

A view chain (select, unsqueeze, view, permute, ...) re-indexes one value; whether two reads of
the same re-indexing share the chain's first links is an accident of the code, not of the math:
    k_t = k[:, t]; ... k_t.unsqueeze(3) ... k_t.unsqueeze(-1)     (one select, two unsqueezes)
    ... k[:, t].unsqueeze(3) ... k[:, t].unsqueeze(-1)            (a select per read)
The patterns (`patterns/kda_decode.py`'s delta rule, `k3compile/math.py` `delta_rule_step`) are
traced from the second, and the matcher refuses a pattern whose intermediate node is also used
outside it. The canonical form is the second: a view node read by a further whole view and by
anything else gives each such reader its own copy of it (recursively up the chain), so no chain
shares a prefix with another. Only readers that re-index the whole view count: selects or slices of a
view take parts of it (`v[:, t]` per token of one `v.view(B, T, H, K)`, as the patterns' own
loops do), and reading different parts of one value shares its chain in every spelling.

A chain's last view, the value ops compute on, stays shared by its non-view users (x in
`x * rsqrt(x.pow(2).sum(-1))` is one value read twice in every spelling, and patterns bind it as
one argument). Copies are views: nothing is computed twice.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites

aten = torch.ops.aten

VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
         aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.default,
         aten.squeeze.dim, aten.squeeze.dims, aten.select.int, aten.slice.Tensor,
         aten.expand.default, aten.alias.default}


# views that re-index all of their input's elements (a select or slice takes a part)
WHOLE = VIEWS - {aten.select.int, aten.slice.Tensor}


def is_view(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEWS


def is_whole_view(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in WHOLE


def _split(graph: fx.Graph, view: fx.Node, _) -> int:
    """Give each whole-view reader of `view` (beyond the first, where all readers are such) its
    own copy; returns the copies."""
    users = list(view.users)
    view_users = [u for u in users if is_whole_view(u)]
    if len(users) < 2 or not view_users:
        return 0
    keep_first = len(view_users) == len(users)  # all readers are views: the first keeps it
    copies = 0
    for user in view_users[1:] if keep_first else view_users:
        with graph.inserting_after(view):
            copy = graph.node_copy(view)
        copy.meta = dict(view.meta)
        user.replace_input_with(view, copy)
        copies += 1
    return copies


def apply(graph: fx.Graph) -> int:
    """Split every forking view chain, last links first (a copy adds a reader to its input, which
    is then split in turn). Returns the number of copies made."""
    return rewrite_sites(graph, is_view, _split, reverse=True, tidy=False)


RULE = Rule("view_chains", apply,
            "a view read whole by two re-indexings (k_t = k[:, t] used twice) -> a chain per read")
