"""Rule `table_lookup`: a lookup in a one-column table spelled as an embedding, read without its
column dim -> a gather from the flat table, the form `k3compile.math.mxfp4_dequant` reads its
E2M1 values with (`lut[codes]`), so rule `mxfp4_dequant` can evaluate the table:

    squeeze(embedding(table [V, 1], codes), -1)   ->   index(view(table, [V]), [codes])

spell12 (`tests/models/spell12_k3.py`) looks its E2M1 values up by
`F.embedding(nibbles, table[16, 1]).squeeze(-1)`. Faithful: `embedding(w, i)` is the rows
`w[i]` (an `index_select` along dim 0; padding_idx and scale_grad_by_freq only touch the
gradient, max_norm is a separate `embedding_renorm_` call), so with one column its element at
position p is `w[i[p], 0]`, the flat table's `i[p]`-th value: the same elements, equal bit for
bit. Taken only for a [V, 1] table, where every reader drops the column dim (`squeeze` of the
last dim, `select(-1, 0)`, a view to the codes' shape); a wider embedding (a token embedding,
read by the patterns and the input checks as such) or a one-column one also read whole is left
alone.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten
_SQUEEZES = {aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.select.int,
             *RESHAPES}


def _drops_column(user: fx.Node, codes: tuple[int, ...]) -> bool:
    """user is the embedding [..., 1] read as the codes' shape [...] (the column dim dropped)."""
    if user.op != "call_function" or user.target not in _SQUEEZES or _shape(user) != codes:
        return False
    if user.target is aten.select.int:
        return user.args[1] in (-1, len(codes)) and user.args[2] in (0, -1)
    return True  # a squeeze or view to the codes' shape drops only size-1 dims: the column


def _site(node: fx.Node):
    table, codes = node.args[:2]
    table_shape, code_shape = _shape(table), _shape(codes)
    if (table_shape is None or code_shape is None or len(table_shape) != 2
            or table_shape[1] != 1 or not node.users
            or not all(_drops_column(u, code_shape) for u in node.users)):
        return None
    return table, codes, table_shape[0]


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    table, codes, rows = site
    with graph.inserting_before(node):
        flat = call(graph, aten.view.default, (table, [rows]), like=node)
        gathered = call(graph, aten.index.Tensor, (flat, [codes]), like=node)
    for user in list(node.users):
        user.replace_all_uses_with(gathered)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.embedding.default})


RULE = Rule("table_lookup", apply,
            "embedding(table [V, 1], codes) read without the column -> view(table, [V])[codes]")

__all__ = ["RULE", "apply"]
