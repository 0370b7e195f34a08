"""Stage `pack`: the weights a fused GEMM reads as one matrix are stored as one matrix.

`k3.linear_concat` (KDA q|k|v|g|f_a|b, MLA q_a|kv_a|g), `k3.moe_front` and `k3.moe_front_route`
(router | latent-down, one launch with gemv's or gemm_tc's split variant) and `k3.situ_gate_up`
(gate | up) read [W_0; W_1; ...] as one weight. Left alone, their CUDA kernels concatenate the weights at every call
(`k3compile.ops.linear_concat.concatenated`; no copy is cached, so none can go stale): ~46 MB
copied per KDA layer per step per GPU at TP16, 64 MB more per MoE layer with the split variant.
`k3.expert_stack` (the per-expert parameters of a ModuleList, stacked for `k3.moe_experts`)
reads [E_0, E_1, ...] as one [E, ...] tensor and, left alone, copies every expert on every
call. This stage moves each group's weights, once, into one buffer and makes
every weight a view of its rows (`param.data = rows`): the values, shapes, strides, the
parameters' identity and `state_dict` stay what they were, `load_state_dict` / `copy_` write
through to the buffer, and `concatenated` / `expert_stack` find the weights back to back and
return a view of them instead of a copy.

A weight may also be rows of a graph input (`select` / `slice` / `split` / `view` in the graph:
q|k|v of a stacked [3, W, D] parameter). Then the input is what moves (`input.data = rows`,
viewed in its own shape), and the graph's views of it land back to back where the group reads
each input whole, in its order; a `linear_concat`'s weights, which the matcher binds in no
particular order, are first put in storage order (the op's weight list and its split's readers
permuted together: the same GEMMs). Views already back to back (a gate|up parameter sliced in
two) are the packed buffer already: nothing moves.

The stage runs last, after every check, on the real tensors Dynamo handed the backend (the ATen
graph's placeholders in the same order). Only weights no earlier k3 compile in this process was
handed move (`remember`): a CUDA graph captured for another bucket or graph reads the addresses
it saw, so the first compile packs and later ones find the groups packed. A group is left as it
is, with the reason in the stage's report, where a weight is neither a graph input nor rows of
one, the group reads part of an input (a sharded front's row slice) or, for ops whose weights have
roles, an input's rows out of order, the weights differ in dtype, device or width, are not
contiguous or have rows of bytes not a multiple of 16 (every weight after the first would start
unaligned; for an expert stack: experts of bytes not a multiple of 16, the unit it steps by),
require grad in grad mode, are tensor subclasses, were seen by an earlier compile, one of them
already belongs to another group, two share one storage (tied), or one is a view into a larger
storage. Options.pack_weights / K3_PACK_WEIGHTS=0 turn the stage off.

Aliases taken before the compile. `param.data = rows` alone would leave every other tensor on a
weight's old storage behind: a `model.state_dict()` tensor or a `w = param.data` taken before the
first call would no longer alias the parameter, and writes through it would reach neither the
module nor the compiled step (issue 20, item 2). Counting the storage's other users
(`torch._C._storage_Use_Count`) could only refuse such groups, and the count includes whatever
Dynamo and AOTAutograd hold at that moment. Instead each old storage is re-pointed at the weight's
rows in the buffer (`UntypedStorage._swap_data_ptr_`, which torch's FSDP and CUDA-graph trees use;
the rows are handed over as a DLPack export, whose deleter keeps the buffer alive): every tensor
on it, whoever holds it, then reads and writes the packed rows. That needs the weight to own its
whole storage, hence the last refusal above.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from k3compile.graph import fake_value, input_view, replay
from k3compile.ops.expert_stack import back_to_back, expert_stack
from k3compile.ops.linear_concat import adjacent

log = logging.getLogger("k3compile")

_K3 = torch.ops.k3
_SEEN = WeakIdKeyDictionary()  # every tensor a k3 compile was handed, and its storage
# torch's private storage swap (FSDP and CUDA-graph trees use it); older torch lacks it (2.11)
CAN_REPOINT = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
_REPOINTED = WeakIdKeyDictionary()  # every old storage `_move` re-pointed at packed rows
# the `.t()` view of an [in, out] weight that stage kernel_layout hands the graph -> the weight
# (a Parameter): moving the view moves the weight, as its transpose (`weight.data = rows.t()`)
TRANSPOSE_OF = WeakIdKeyDictionary()


def remember(inputs) -> None:
    """Note the tensors a compile was handed, and their storages: later compiles never move
    them, nor re-point a storage an earlier compile reads through another tensor."""
    for x in inputs:
        if isinstance(x, torch.Tensor):
            _SEEN[x] = True
            if type(x) in (torch.Tensor, torch.nn.Parameter):
                _SEEN[x.untyped_storage()] = True


def _seen(w: torch.Tensor) -> bool:
    return w in _SEEN or w.untyped_storage() in _SEEN


@dataclasses.dataclass
class PackReport:
    packed: list[str] = dataclasses.field(default_factory=list)  # "node: n weights, MB"
    already: list[str] = dataclasses.field(default_factory=list)  # groups packed earlier
    skipped: list[str] = dataclasses.field(default_factory=list)  # "node: why"
    saved_bytes: int = 0  # the concatenated copies that no longer exist

    def __str__(self) -> str:
        return (f"{len(self.packed) + len(self.already)} fused groups stored as one buffer each "
                f"({len(self.packed)} moved by this compile, {self.saved_bytes / 1e6:.1f} MB of "
                f"copies saved; {len(self.already)} by an earlier one), {len(self.skipped)} left "
                "as they are")


def _groups(graph: fx.Graph):
    """(node, weight nodes) of every op that reads its weights as one concatenation."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _K3.linear_concat.default:
            yield node, list(node.args[1])
        elif node.target in (_K3.moe_front.default, _K3.moe_front_route.default,
                             _K3.situ_gate_up.default):
            yield node, [node.args[1], node.args[2]]
        elif node.target is _K3.expert_stack.default:
            yield node, list(node.args[0])


def _refusal_of_inputs(roots: list[torch.Tensor]) -> str | None:
    """Why the graph inputs the weights are (or are views of) cannot move."""
    if any(type(r) not in (torch.Tensor, torch.nn.Parameter) for r in roots):
        return "a weight is a tensor subclass (its storage is not ours to move)"
    if torch.is_grad_enabled() and any(r.requires_grad for r in roots):
        return "a weight requires grad in grad mode"
    return None


def _refusal(weights: list[torch.Tensor], experts: bool = False) -> str | None:
    first = weights[0]
    if any(w.dim() != 2 for w in weights):
        return "a weight is not 2-D"
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) > 1:
        return ("weights differ in dtype, device or width: "
                + ", ".join(f"{w.dtype} {tuple(w.shape)} {w.device}" for w in weights))
    if any(not w.is_contiguous() for w in weights):
        return "a weight is not contiguous"
    if experts and len({w.shape for w in weights}) > 1:
        return "experts differ in shape"
    if experts and first.nbytes % 16:  # an expert stack steps by whole experts
        return f"experts of {first.nbytes} bytes (not a multiple of 16)"
    if not experts and first.shape[1] * first.element_size() % 16:
        # the weights after the first would start off 16-byte alignment, which Inductor's and
        # our kernels assume of their inputs (Inductor would copy them back on every call)
        return f"rows of {first.shape[1] * first.element_size()} bytes (not a multiple of 16)"
    if first.is_meta:
        return "meta weights hold no data"
    return None


def _owns_its_storage(w: torch.Tensor) -> bool:
    return w.storage_offset() == 0 and w.untyped_storage().nbytes() == w.nbytes


def _unmovable(weights: list[torch.Tensor]) -> str | None:
    """Why the group's weights cannot move with every alias following them, or None."""
    if len({w.untyped_storage().data_ptr() for w in weights}) < len(weights):
        return "two weights share one storage (tied)"
    if any(w.untyped_storage() in _REPOINTED for w in weights):
        return "a weight shares its storage with a weight packed before (tied)"
    if not all(_owns_its_storage(w) for w in weights):
        return ("a weight is a view into a larger storage (what else lives there would not "
                "follow it)")
    return None


def _move(roots: list[torch.Tensor], width: int) -> torch.Tensor:
    """Copy the weight inputs into one buffer of rows `width` wide and make each a view of its
    rows, then re-point each input's old storage at the same rows: a `state_dict()` tensor or a
    `.data` taken before the compile (any tensor on the old storage) reads and writes what the
    compiled step reads. The old storage's new pointer holds the buffer alive (a DLPack export of
    the rows)."""
    # the stage runs inside Inductor's compile, under its fake-tensor mode: real work here
    with unset_fake_temporarily(), torch.no_grad():
        buffer = torch.cat([r.detach().reshape(-1, width) for r in roots])
        parts = [rows.view(r.shape) for r, rows in
                 zip(roots, buffer.split([r.numel() // width for r in roots]), strict=True)]
        exports = [torch.from_dlpack(p).untyped_storage() for p in parts]  # before anything moves
        for r, part, export in zip(roots, parts, exports, strict=True):
            old = r.untyped_storage()
            r.data = part
            if (owner := TRANSPOSE_OF.get(r)) is not None:  # r is an [in, out] weight's `.t()`
                owner.data = part.t()
            _repoint(old, export)
    return buffer


def _repoint(old: torch.UntypedStorage, export: torch.UntypedStorage) -> None:
    if not CAN_REPOINT:
        _warn_no_repoint()
        return
    old._swap_data_ptr_(export)  # `export` now holds the old memory, freed with it
    _REPOINTED[old] = True


def unwritable(t: torch.Tensor) -> str | None:
    """Why `write_through(t, rows)` could not take every alias of t along, or None."""
    if _seen(t):
        return "an earlier compile was handed it"
    return _unmovable([t])


@torch.no_grad()
def write_through(t: torch.Tensor, rows: torch.Tensor) -> None:
    """Copy t into `rows` (of a packed buffer) and re-point t's storage at them, as a weight's old
    storage is when it moves: every tensor on it then reads and writes the rows."""
    export = torch.from_dlpack(rows.detach()).untyped_storage()
    rows.copy_(t)
    _repoint(t.untyped_storage(), export)


@functools.cache
def _warn_no_repoint() -> None:
    log.warning("k3 pack: this torch (%s) has no UntypedStorage._swap_data_ptr_: a state_dict() "
                "tensor or a .data taken before the first compile no longer aliases a packed "
                "weight (writes through it are not seen; K3_PACK_WEIGHTS=0 keeps them)",
                torch.__version__)


@dataclasses.dataclass
class _Weight:
    arg: fx.Node  # the op's weight argument
    root: torch.Tensor  # the real graph input it is (or is rows of)
    value: torch.Tensor  # its real value: the root, or the view the graph takes of it


def _weights(args: list, real: dict) -> list[_Weight] | str:
    """The group's weights on the real inputs, or why they are not inputs or views of them."""
    weights = []
    for arg in args:
        found = input_view(arg) if isinstance(arg, fx.Node) else None
        if found is None or found[0] not in real:
            return "a weight is computed in the graph (not an input or a view of one)"
        root = real[found[0]]
        if not isinstance(root, torch.Tensor):
            return "a weight input is no tensor"
        with unset_fake_temporarily():
            weights.append(_Weight(arg, root, replay(found[1], root)))
    return weights


def _in_storage_order(node: fx.Node, weights: list[_Weight]) -> list[_Weight]:
    """A linear_concat's weights that share a storage (views of one input; inputs packed by an
    earlier compile) in the order it holds them, at the place of the first of them: the matcher
    binds same-shaped weights in no particular order, and the op's output order is ours to
    choose (`_reorder`). A storage whose rows make output columns of bytes not a multiple of 16
    goes last: each output piece after it would start off 16-byte alignment, which the kernels
    reading a piece as a column slice refuse (Moonshot's KDA b_proj, 6 rows at TP16, bound
    before f_a: the f_b gemv ran as its torch reference on the H200, session 15). Other ops'
    weights have roles: as they are."""
    if node.target is not _K3.linear_concat.default:
        return weights
    runs: dict[int, list[_Weight]] = {}  # storage -> its weights, in the order first bound
    for w in weights:
        runs.setdefault(_storage(w.value), []).append(w)
    ordered = [sorted(run, key=lambda w: w.value.data_ptr()) for run in runs.values()]
    ordered.sort(key=lambda run: sum(w.value.shape[0] for w in run)
                 * run[0].value.element_size() % 16 != 0)  # stable: aligned runs first
    return [w for run in ordered for w in run]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _untiled(weights: list[_Weight]) -> str | None:
    """Why the inputs cannot be packed whole with the weights laid out in their order: each input's
    weights must follow one another and cover it exactly, in its storage order (a row slice of a
    shard's front reads part of a parameter)."""
    runs: list[list[_Weight]] = []
    began: set[int] = set()  # the roots a run began with (an expert stack: E of them)
    for w in weights:
        if runs and runs[-1][0].root is w.root:
            runs[-1].append(w)
        elif id(w.root) in began:
            return "views of one input are split by other weights"
        else:
            runs.append([w])
            began.add(id(w.root))
    for run in runs:
        root = run[0].root
        if not root.is_contiguous():
            return "a weight input is not contiguous"
        if (run[0].value.data_ptr() != root.data_ptr() or not adjacent([w.value for w in run])
                or sum(w.value.nbytes for w in run) != root.nbytes):
            return (f"the group does not read an input {tuple(root.shape)} whole in its order "
                    "(as " + ", ".join(str(tuple(w.value.shape)) for w in run) + ")")
    return None


def _reorder(node: fx.Node, order: list[fx.Node]) -> str | None:
    """Make linear_concat `node` take its weights in `order`, its output's split consumers reading
    the same pieces; why not where they are not one split of it into the weights' rows."""
    old = list(node.args[1])
    rows = [w.meta["val"].shape[0] for w in old]
    split = next(iter(node.users)) if len(node.users) == 1 else None
    if (split is None or split.target is not torch.ops.aten.split_with_sizes.default
            or list(split.args[1]) != rows
            or (split.args[2] if len(split.args) > 2 else 0) not in (-1, node.meta["val"].dim() - 1)
            or any(u.target is not operator.getitem for u in split.users)):
        return "its output is read otherwise than as one split into the weights' outputs"
    moved = [old.index(w) for w in order]  # new position -> old position
    node.args = (node.args[0], order, *node.args[2:])
    split.args = (node, [rows[i] for i in moved], *split.args[2:])
    split.meta["val"] = fake_value(split.target, split.args, split.kwargs)
    for piece in list(split.users):
        piece.args = (split, moved.index(piece.args[1]))
    return None


def _pack_group(node: fx.Node, args: list, real: dict, taken: dict, report: PackReport) -> None:
    weights = _weights(args, real)
    if isinstance(weights, str):
        report.skipped.append(f"{node.name}: {weights}")
        return
    values = [w.value for w in weights]
    roots = list({id(w.root): w.root for w in weights}.values())
    if (why := _refusal_of_inputs(roots)
            or _refusal(values, node.target is _K3.expert_stack.default)) is not None:
        report.skipped.append(f"{node.name}: {why}")
        return
    if len({(v.data_ptr(), v.shape) for v in values}) < len(values):
        report.skipped.append(f"{node.name}: one weight appears twice")
        return
    weights = _in_storage_order(node, weights)
    values = [w.value for w in weights]
    order = [w.arg for w in weights]
    # in the op's new order: `_move` lays the roots out in this order, so the views the op reads
    # lie back to back (with the roots in their first-bound order, a reordered group was packed
    # but read through a fresh concatenation per call on the GPU: Moonshot's and the hf
    # spelling's KDA in-projections, ~18 µs per layer at B1 on the H200, session 17)
    roots = list({id(w.root): w.root for w in weights}.values())
    why = _untiled(weights)
    if why is None and order != args:
        why = _reorder(node, order)
    if why is not None:
        report.skipped.append(f"{node.name}: {why}")
        return
    if adjacent(values):
        report.already.append(node.name)
        taken.update({id(r): node.name for r in roots})
        return
    if any(_seen(r) for r in roots):
        report.skipped.append(f"{node.name}: an earlier compile was handed these weights")
        return
    if other := next((taken[id(r)] for r in roots if id(r) in taken), None):
        report.skipped.append(f"{node.name}: a weight is packed with {other}")
        return
    if (why := _unmovable(roots)) is not None:
        report.skipped.append(f"{node.name}: {why}")
        return
    buffer = _move(roots, values[0].shape[1])
    taken.update({id(r): node.name for r in roots})
    if not _read_back_to_back(node, order, real):  # a bug of this stage, never the user's
        log.warning("k3 pack: %s: packed, but the op reads its weights out of the buffer's "
                    "order: its CUDA path copies them on every call", node.name)
    report.packed.append(f"{node.name}: {len(values)} weights, {buffer.nbytes / 1e6:.1f} MB")
    # the fronts' weights would be copied per step only by the split variants (gemv's,
    # gemm_tc's), which take packed weights only
    if node.target not in (_K3.moe_front.default, _K3.moe_front_route.default):
        report.saved_bytes += buffer.nbytes


def _read_back_to_back(node: fx.Node, args: list, real: dict) -> bool:
    """After the move: the op's weight arguments, evaluated on the moved inputs, lie back to back
    in its order (what its CUDA path needs to read one buffer and copy nothing)."""
    weights = _weights(args, real)
    if isinstance(weights, str):
        return False
    values = [w.value for w in weights]
    return (back_to_back(values) if node.target is _K3.expert_stack.default
            else adjacent(values))


def stack_parts(parts: list[torch.Tensor]) -> torch.Tensor | str:
    """Per-expert tensors [O, W] as one [E, O, W] tensor that the parts are views of, or why
    not: moved once into one buffer as this stage moves an expert stack's group (every old
    storage re-pointed at its rows), under the same refusals; parts back to back already (an
    earlier stacking) are a view of themselves. For a model's code that reads its experts
    stacked (`k3compile.adapt`), so the graph reads one input instead of E."""
    if back_to_back(parts):
        return expert_stack(parts)
    if (why := _refusal_of_inputs(parts) or _refusal(parts, experts=True)) is not None:
        return why
    if any(_seen(p) for p in parts):
        return "an earlier compile was handed these weights"
    if (why := _unmovable(parts)) is not None:
        return why
    return _move(parts, parts[0].shape[1]).view(len(parts), *parts[0].shape)


def pack_concatenated(graph: fx.Graph, inputs: list) -> PackReport:
    """Pack every group's weights into one buffer (see the module docstring); `inputs` are the
    real tensors of the graph's placeholders, in order."""
    report = PackReport()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        report.skipped.append(f"graph: {len(placeholders)} placeholders for {len(inputs)} inputs")
        return report
    real = dict(zip(placeholders, inputs, strict=True))
    taken: dict[int, str] = {}  # id of a weight input -> the group that packed it
    for node, args in list(_groups(graph)):
        _pack_group(node, args, real, taken, report)
    log.info("k3 pack: %s", report)
    return report


def pack(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage (on with `Options.pack_weights`), last: it moves real weights."""
    ctx.notes["pack"] = pack_concatenated(gm.graph, ctx.inputs)
    return gm
