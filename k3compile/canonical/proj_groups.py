"""Rule `proj_groups`: one GEMM over stacked projections whose output is read only as pieces that
tile its columns -> one GEMM per projection on the weight's row slices, the form separate linears
trace to (`patterns/linear_concat.py` fuses them into one GEMM again, with the pieces the
downstream patterns read: `mla_lowrank_norm`, `fb_kda_decode`, `situ_gate_up`).

A blind spelling (tests/models/spell12_k3.py's `MergedLinear`) stores KDA's q|k|v|g|f_a|b, MLA's
q_a|kv_a|g and a MLP's gate|up each as one weight and cuts `F.linear`'s output with
`split(sizes, -1)`; others cut with `chunk`, `narrow`, `tensor_split` or `y[..., a:b]`.

Which cut is canonical: the user's cut names the projections (a `MergedLinear`'s sizes are its
projections' widths), so each piece is one projection, except where the canonical form keeps
two pieces as one GEMM. K3 has one such GEMM: MLA's kv_a = [latent | rope], whose latent is
RMS-normalised and whose rope is not (k3compile/models/k3.py splits kv_a's output). So:

    a piece starts a GEMM of its own, unless the piece before it is RMS-normalised as a whole
    and it is not RMS-normalised at all (neither as a whole nor a cut of it from column 0).

    [q_a | c_kv | k_pe] (vLLM's fused_qkv_a)  -> q_a, [c_kv | k_pe]     (c_kv normed, k_pe raw)
    [q_a | kv_a | g] (spell12, kv_a sliced later) -> q_a, kv_a, g         (kv_a's head is normed)
    [q | k | v | g | f_a | b], [gate | up]    -> one GEMM per piece     (no norm on a piece)

Pieces joined again by a `cat` are cut too: the canonical KDA itself concatenates three GEMMs,
`cat([q, k, v])`, into its short conv. The norms are read in their canonical form
(`gate_up_split.rms_normed`), so the rule runs after `rms_forms`; `proj_split` (a piece into a
depthwise conv, before `qkv_split`) takes vLLM's KDA in-projection earlier.

    y = mm(x, permute(W));  y[..., a_i:b_i] ...   ->   mm(x, permute(W[a_i:b_i])) ...

Exact up to the GEMM's blocking: a column of a GEMM depends only on its weight row
(`gate_up_split`'s argument). Measured on the CPU (torch 2.13): bit-equal at the tiny model's
shapes in fp32 and bf16; at K3's (x [64, 7168], pieces of 1024/128/96 rows) up to 1.5 ulps of the
piece's largest value in fp32, one bf16 ulp on a few elements (the backend blocks the narrower
GEMM otherwise). Left alone: a cut that does not tile the output, a GEMM also read whole, a
weight that is no parameter (or rows of one), and a cut with nothing to separate.
"""

from __future__ import annotations

import itertools

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.gate_up_split import cut_columns, rms_normed, slice_cut, split_cuts
from k3compile.canonical.proj_split import tiling
from k3compile.canonical.region import gemm_of, shape, weight_rows

aten = torch.ops.aten


def _head_normed(piece: fx.Node) -> bool:
    """piece, or a cut of it that starts at its column 0, is RMS-normalised as a whole (kv_a's
    latent sliced from a [latent | rope] piece)."""
    if rms_normed(piece):
        return True
    rank, width = len(shape(piece)), shape(piece)[-1]
    for user in piece.users:
        if user.target is aten.slice.Tensor:
            heads = [user] if (slice_cut(user, rank, width) or (None,))[0] == 0 else []
        elif user.target in (aten.split.Tensor, aten.split_with_sizes.default):
            heads = [p for p, start, _ in split_cuts(user, rank, width) or () if start == 0]
        else:
            heads = []
        if any(rms_normed(head) for head in heads):
            return True
    return False


def _site(node: fx.Node):
    found = gemm_of(node)
    if not found or len(shape(node) or ()) < 2 or not weight_rows(found[0]):
        return None
    pieces = tiling(node)
    if not pieces:
        return None
    cuts = [start for (prev, _, _), (piece, start, _) in itertools.pairwise(pieces)
            if not (rms_normed(prev) and not _head_normed(piece))]
    return (found, pieces, cuts) if cuts else None


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    found, pieces, cuts = site
    cut_columns(graph, node, found, pieces, cuts)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write,
                         targets={aten.mm.default, aten.addmm.default, aten.view.default})


RULE = Rule("proj_groups", apply,
            "one GEMM over stacked projections, read as pieces tiling it -> one GEMM per "
            "projection on the weight's row slices (MLA's [latent | rope] kept one)")

__all__ = ["RULE", "apply"]
