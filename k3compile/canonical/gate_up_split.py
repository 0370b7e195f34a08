"""Rule `gate_up_split`: a GLU's gate and up halves taken from one concatenated tensor -> the two
GEMMs that separate gate and up linears trace to, the form `patterns/situ_gate_up.py` matches.

Two spellings:
* one GEMM over the stacked weight [W_g; W_u], its output halved by `chunk(2, -1)`, `split(I, -1)`,
  `[..., :I]` / `[..., I:]` or `view(..., 2, I).unbind(-2)`: each half becomes the GEMM of x with the weight's rows of that half,
  `mm(x, permute(slice(W_gu, 0, 0, I)))`, as `F.linear(x, W_g)` traces (a column of a GEMM's
  output depends only on its weight row: the values are the same up to the GEMM's blocking).
  Only where the two halves meet in an elementwise product (SiTU, SwiGLU, GeGLU ...): a GEMM whose
  output is split for other uses keeps its one GEMM (MLA's kv_a [latent | rope] is one GEMM in
  the canonical form, fused with q_a by `linear_concat`).
* one GEMM over stacked projections whose output is cut into pieces along the last dim, where a
  piece other than the first is RMS-normalised as a whole (MLA's q_a | kv_a as one GEMM, vLLM's
  `fused_qkv_a_proj`, split [cq | c_kv | k_pe] with cq and c_kv normalised): the GEMM is cut
  before each such piece, so that each normalised latent begins a GEMM of its own and whatever
  trails it stays in that GEMM: [W_qa; W_kva] -> q_a and kv_a = [c_kv | k_pe], the form the
  separate linears trace to (`patterns/mla_lowrank_norm.py`; `linear_concat` fuses them into one
  GEMM again). Not one GEMM per piece: that would also cut kv_a's [c_kv | k_pe], which the
  pattern (and the canonical form) keeps as one GEMM. Same values as the GLU cut (a column of a
  GEMM's output depends only on its weight row), same dtypes and shapes. The norm is the
  canonical one (`rms_forms` runs before), over the piece or its fp32 upcast.
* separate gate and up GEMMs concatenated and then sliced again (Moonshot's `SituAndMul` on
  `cat([w1(x), w3(x)], -1)`): a slice that is exactly one of the cat's inputs is that input.
  The same values whatever the tensors are (elementwise CPU kernels may round an ulp apart on a
  contiguous tensor and a strided slice), and a copy less.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.norm_round import inv_rms
from k3compile.canonical.region import CAST, POINTWISE, gemm_of
from k3compile.canonical.region import shape as _shape
from k3compile.graph import call

aten = torch.ops.aten
_END = 2**63 - 1  # slice's "to the end"


# ---- the pieces a tensor is cut into along its last dim -----------------------------------------


def last_dim_pieces(node: fx.Node) -> list[tuple[fx.Node, int, int]] | None:
    """[(piece, start, end)] if every user of node cuts it along the last dim with step 1."""
    rank, width = len(_shape(node)), _shape(node)[-1]
    out = []
    for user in node.users:
        if user.target is aten.slice.Tensor:
            cut = slice_cut(user, rank, width)
            if cut is None:
                return None
            out.append((user, *cut))
        elif user.target in (aten.split.Tensor, aten.split_with_sizes.default):
            cuts = split_cuts(user, rank, width)
            if cuts is None:
                return None
            out += cuts
        elif user.target is aten.view.default:
            cuts = _unbind(user, rank, width)
            if cuts is None:
                return None
            out += cuts
        else:
            return None
    return out


def slice_cut(node: fx.Node, rank: int, width: int) -> tuple[int, int] | None:
    args = [*node.args[1:], *[None] * 4]
    dim, start, end, step = (args[0] or 0), (args[1] or 0), args[2], (args[3] or 1)
    end = width if end is None or end >= width else end
    start, end = (start + width if start < 0 else start), (end + width if end < 0 else end)
    if dim % rank != rank - 1 or step != 1 or not 0 <= start < end <= width:
        return None
    return start, end


def split_cuts(split: fx.Node, rank: int, width: int) -> list[tuple[fx.Node, int, int]] | None:
    sizes, dim = split.args[1], split.args[2] if len(split.args) > 2 else 0
    if dim % rank != rank - 1 or any(u.target is not operator.getitem for u in split.users):
        return None
    if isinstance(sizes, int):
        sizes = [min(sizes, width - s) for s in range(0, width, sizes)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(u, starts[u.args[1]], starts[u.args[1]] + sizes[u.args[1]]) for u in split.users]


def _unbind(view: fx.Node, rank: int, width: int) -> list[tuple[fx.Node, int, int]] | None:
    """`view(y, [..., k, width // k]).unbind(-2)`: the k pieces of y's last dim, in order."""
    shape, lead = _shape(view), _shape(view.args[0])[:-1]
    if (shape is None or len(shape) != rank + 1 or tuple(shape[:-2]) != tuple(lead)
            or shape[-2] * shape[-1] != width or len(view.users) != 1):
        return None
    (unbind,) = view.users
    dim = unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)
    if (unbind.target is not aten.unbind.int or dim % (rank + 1) != rank - 1
            or any(u.target is not operator.getitem for u in unbind.users)):
        return None
    k = shape[-1]
    return [(u, u.args[1] * k, (u.args[1] + 1) * k) for u in unbind.users]


# ---- halves of one GEMM that meet in a GLU product ---------------------------------------------


def _meet(a: fx.Node, b: fx.Node, reach: int = 200) -> bool:
    """a and b flow only through elementwise ops until one product consumes both (a GLU)."""
    sides = {a: {0}, b: {1}}
    node = min(a, b, key=_position).next
    for _ in range(reach):
        if node.op == "output":
            return False
        ins = [sides[x] for x in node.all_input_nodes if x in sides]
        if ins:
            if node.target not in POINTWISE:
                return False
            sides[node] = set().union(*ins)
            if sides[node] == {0, 1}:
                # nothing on the way escapes around the product
                return node.target is aten.mul.Tensor and all(
                    n is node or all(u in sides for u in n.users) for n in sides)
        node = node.next
    return False


def _position(node: fx.Node) -> int:
    """node's place in its graph: the walk starts at the earlier half (graphs are topological)."""
    n, i = node, 0
    while n.op != "root":
        n, i = n.prev, i + 1
    return i


def _split_gemm(graph: fx.Graph, out: fx.Node) -> int:
    found = gemm_of(out)
    pieces = last_dim_pieces(out) if found else None
    if pieces and len(pieces) > 2 or pieces and len(pieces) == 2 and not _meet(*(
            p for p, *_ in pieces)):
        return _cut_before_norms(graph, out, found, pieces)
    if not pieces or len(pieces) != 2:
        return 0
    (g, g0, g1), (u, u0, u1) = sorted(pieces, key=lambda p: p[1])
    if (g0, g1 - g0, u0, u1) != (0, u1 - u0, g1, _shape(out)[-1]) or not _meet(g, u):
        return 0
    gemm, view = found
    for piece, start, end in ((g, g0, g1), (u, u0, u1)):
        with graph.inserting_before(piece):
            new = gemm_of_rows(graph, gemm, view, start, end, piece)
        piece.replace_all_uses_with(new)
    return 1


# ---- a GEMM cut before each piece that is RMS-normalised (MLA's q_a | kv_a) --------------------


def rms_normed(piece: fx.Node) -> bool:
    """piece (or its fp32 upcast) is RMS-normalised over its last dim as a whole."""
    for x in (piece, *(u for u in piece.users if u.target is CAST and u.args[1] is torch.float32)):
        for user in x.users:
            if user.target is aten.mul.Tensor and len(user.args) == 2 and any(
                    a is x and inv_rms(b, x) for a, b in (user.args, reversed(user.args))):
                return True
    return False


def _cut_before_norms(graph: fx.Graph, out: fx.Node, found, pieces) -> int:
    width = _shape(out)[-1]
    pieces = sorted(pieces, key=lambda p: p[1])
    if [p[1] for p in pieces] != [0, *(p[2] for p in pieces[:-1])] or pieces[-1][2] != width:
        return 0  # not a partition of the columns (overlapping, missing or repeated pieces)
    cuts = [start for piece, start, _ in pieces if start and rms_normed(piece)]
    if not cuts:
        return 0
    cut_columns(graph, out, found, pieces, cuts)
    return 1


def cut_columns(graph: fx.Graph, out: fx.Node, found, pieces, cuts: list[int]) -> None:
    """The GEMM `found` (whose output `out` is read as `pieces`, sorted, tiling its columns)
    -> one GEMM per column range between `cuts`, on the weight's row slices; a range of several
    pieces is cut from its GEMM by one `split_with_sizes`."""
    width = _shape(out)[-1]
    gemm, view = found
    bounds = list(zip([0, *cuts], [*cuts, width]))
    for lo, hi in bounds:
        group = [p for p in pieces if lo <= p[1] < hi]
        first = group[0][0]
        with graph.inserting_before(min((p[0] for p in group), key=_position)):
            y = gemm_of_rows(graph, gemm, view, lo, hi, first,
                             shape=[*_shape(out)[:-1], hi - lo])
            if len(group) == 1:
                outs = [y]
            else:
                split = call(graph, aten.split_with_sizes.default,
                             (y, [e - b for _, b, e in group], -1), like=first)
                outs = [call(graph, operator.getitem, (split, i), like=first)
                        for i in range(len(group))]
        for (piece, _, _), new in zip(group, outs, strict=True):
            piece.replace_all_uses_with(new)


def gemm_of_rows(graph, gemm, view, start, end, like, shape=None):
    """The GEMM of the weight's output rows [start, end) (and the bias's), viewed as `like` (or
    to `shape`)."""
    if gemm.target is aten.addmm.default:
        bias, x, w = gemm.args[:3]
        bias = call(graph, aten.slice.Tensor, (bias, -1, start, end), like=like)
    else:
        bias, (x, w) = None, gemm.args[:2]
    if w.target is aten.permute.default and list(w.args[1]) == [1, 0]:  # F.linear's W.t()
        rows = call(graph, aten.slice.Tensor, (w.args[0], 0, start, end), like=like)
        w = call(graph, aten.permute.default, (rows, [1, 0]), like=like)
    else:
        w = call(graph, aten.slice.Tensor, (w, 1, start, end), like=like)
    if view is not None and x.target is aten.view.default:  # F.linear flattens x per GEMM
        x = call(graph, aten.view.default, tuple(x.args), like=like)
    y = (call(graph, aten.addmm.default, (bias, x, w, *gemm.args[3:]), gemm.kwargs, like=like)
         if bias is not None else call(graph, aten.mm.default, (x, w), like=like))
    if view is not None:
        y = call(graph, aten.view.default, (y, list(shape or _shape(like))), like=like)
    return y


# ---- slices of a cat that are one of its inputs --------------------------------------------------


def _uncat_slices(cat: fx.Node) -> int:
    inputs, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    rank = len(_shape(cat))
    if dim % rank != rank - 1:
        return 0
    bounds, start = {}, 0
    for x in inputs:
        width = _shape(x)[-1]
        bounds[(start, start + width)] = x
        start += width
    rewritten = 0
    for piece, lo, hi in last_dim_pieces(cat) or ():
        x = bounds.get((lo, hi))
        if x is not None and _shape(x) == _shape(piece) and x.meta["val"].dtype == piece.meta[
                "val"].dtype:
            piece.replace_all_uses_with(x)
            rewritten += 1
    return rewritten


def _write(graph: fx.Graph, node: fx.Node, _) -> int:
    return _uncat_slices(node) if node.target is aten.cat.default else _split_gemm(graph, node)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, lambda n: n.op == "call_function" and bool(_shape(n)), _write,
                         tidy=False)


RULE = Rule("gate_up_split", apply, "GLU halves of one gate|up GEMM -> two GEMMs on weight row "
            "slices; one GEMM cut before each RMS-normed piece (q_a | kv_a); a slice of a cat "
            "that is one of its inputs -> that input")
