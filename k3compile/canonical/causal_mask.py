"""Rule `causal_mask`: a causal mask gathered from a lower-triangular buffer at the positions ->
the mask computed from the positions, `arange(C) <= positions[..., None]`.

gpt-fast and the code written in its style (spell14) keep a bool `causal_mask` [L, L] buffer,
`torch.tril(torch.ones(L, L))`, and read each query's row of it by position:

    mask = causal_mask[input_pos]                          (index(buffer, [positions]))
    mask = arange(C) <= input_pos.unsqueeze(-1)            (canonical: iota, unsqueeze, le)

`k3compile/math.py` writes the second, which the mla_decode pattern absorbs; a gather from a
buffer is an input the pattern cannot own (its values are data), so spell14's MLA layers lost
mla_decode to it.

Taken: `aten.index.Tensor(buffer, [positions])` with one integer index tensor, where the buffer is
a bool [R, C] graph input or module attribute whose real value (`gm.meta["real_inputs"]`, handed
over by stage `canonicalize`) is exactly `buffer[i, j] = j <= i` (torch.tril of ones, also for
R != C). The input is recorded in `gm.meta["inputs_read"]`, so the stage cache keys by its value.
Left alone: any other buffer (a band or sliding-window mask, a float mask of 0 / -inf, a padded
one), a buffer whose value was not handed over, an index by two tensors or with a None.

Values: equal for positions in [0, R). Outside it eager's gather raises; the compiled step's
input check (k3compile/validate.py: positions index the buffer's rows and the caches) raises
first, before the step runs. A buffer changed in place after compiling is not seen (as for any
constant table the rules read, e.g. `mxfp4_dequant`'s E2M1 table).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.mxfp4_dequant import Constants
from k3compile.graph import call
from k3compile.rewrite import inductor

aten, prims = torch.ops.aten, torch.ops.prims


def is_causal(value: torch.Tensor) -> bool:
    """value is a bool [R, C] with value[i, j] = j <= i."""
    if value.dtype != torch.bool or value.dim() != 2 or value.is_meta:
        return False
    rows, cols = value.shape
    with inductor.unset_fake_temporarily():  # the stage may run under the compile's fake mode
        want = torch.ones(rows, cols, dtype=torch.bool, device=value.device).tril()
        return bool(torch.equal(value, want))


def _site(node: fx.Node, constants: Constants) -> fx.Node | None:
    """The positions, where node = buffer[positions] of a causal buffer."""
    buffer, indices = node.args[:2]
    if not (isinstance(buffer, fx.Node) and isinstance(indices, (list, tuple))
            and len(indices) == 1 and isinstance(indices[0], fx.Node)):
        return None
    positions = indices[0]
    pos_val, buf_val = positions.meta.get("val"), buffer.meta.get("val")
    if not (isinstance(pos_val, torch.Tensor) and isinstance(buf_val, torch.Tensor)):
        return None
    if pos_val.dtype not in (torch.int64, torch.int32) or buf_val.dtype != torch.bool:
        return None
    if buf_val.dim() != 2 or not isinstance(buf_val.shape[1], int):
        return None
    value = constants.source(buffer)
    return positions if value is not None and is_causal(value) else None


def write(graph: fx.Graph, node: fx.Node, positions: fx.Node) -> None:
    cols = node.args[0].meta["val"].shape[1]
    device = node.meta["val"].device
    kwargs = {"start": 0, "step": 1, "dtype": torch.int64, "device": device,
              "requires_grad": False}
    with graph.inserting_before(node):
        steps = call(graph, prims.iota.default, (cols,), kwargs, like=node)
        column = call(graph, aten.unsqueeze.default, (positions, -1), like=node)
        mask = call(graph, aten.le.Tensor, (steps, column), like=node)
    node.replace_all_uses_with(mask)


def apply(graph: fx.Graph) -> int:
    constants = Constants(graph)  # the inputs' real values (stage canonicalize hands them over)
    return rewrite_sites(graph, lambda node: _site(node, constants), write,
                         targets={aten.index.Tensor})


RULE = Rule("causal_mask", apply,
            "causal_buffer[positions] (a tril-of-ones bool buffer) -> arange(C) <= positions[..., None]")

__all__ = ["RULE", "apply", "is_causal"]
