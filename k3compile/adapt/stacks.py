"""Moonshot's routed experts stored as rows of one [E, ...] buffer per MoE block and tensor, which
the adapted step reads (one graph input instead of E), and every rebind of an expert's parameter
made a write of its row, at the moment of the rebind, so the step never reads a stale expert.

`stack_experts` moves each block's `w1|w3|w2` expert tensors (dense `weight`; MXFP4
`weight_packed`, `weight_scale`) into one buffer (stage `pack`'s mover: aliases taken before follow)
and gives each expert parameter the class `ExpertRow`, whose `data` setter keeps it its row:

* `param.data = t` of the row's shape, dtype and device: t is copied into the row and t's storage
  re-pointed at it (pack's `write_through`: t and its aliases stay the parameter's, as torch's
  `param.data = t` promises);
* t of another dtype or device: the stack is converted (one buffer holds one dtype and device:
  every expert's tensor of that projection in that block follows; how `model.to()`, `.half()`,
  `step.to()` reach each expert in turn, the later ones finding theirs converted), then as above;
* t of another shape, or one whose aliases cannot follow (a view into a larger storage, tied,
  handed to an earlier compile): refused with a ValueError, the parameter unchanged.

`load_state_dict(..., assign=True)` puts new Parameter objects into the experts; a post-hook on the
adapted block and on the user's model's block puts the row parameters back with the assigned
values (`param.data = assigned`: the rules above; refused: the block's experts are left as they
were, the rest of the state dict loaded, and the error says so).

Constraints:
* `torch.utils.swap_tensors` on an expert (`set_swap_module_params_on_conversion(True)`: `.to()`,
  `load_state_dict`) is refused: the parameter unchanged, those swapped before it stay swapped;
* `_apply` under `set_overwrite_module_params_on_conversion(True)`, or to or from `meta`, gives
  the model new Parameter objects without any setter: the adapter keeps reading the ones it was
  made from (every weight, not only the experts; docs/decisions.md, session 13).
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
from torch import nn

from k3compile.stages.pack import stack_parts, unwritable, write_through

log = logging.getLogger("k3compile")

PROJECTIONS = ("w1", "w3", "w2")
_DATA = torch._C.TensorBase.data  # the setter ExpertRow wraps
_HOOKED = weakref.WeakKeyDictionary()  # the blocks carrying the assign post-hook


class Stack:
    """One [E, ...] buffer (`tensor`) whose row e is expert e's `params[e]`, and the adapted
    blocks that hold it as their buffer `key`."""

    def __init__(self, projection: str, tensor_name: str, name: str, tensor: torch.Tensor,
                 params: list[nn.Parameter]):
        self.projection, self.tensor_name, self.name = projection, tensor_name, name
        self.key = f"stacked_{projection}_{tensor_name}"
        self.tensor, self.params = tensor, params
        self.blocks = weakref.WeakSet()

    def convert(self, dtype: torch.dtype, device: torch.device) -> None:
        old = self.tensor
        if old.is_meta:  # no values to carry: each row is written as it is rebound
            new = torch.empty_like(old, dtype=dtype, device=device)
        else:
            new = old.to(dtype=dtype, device=device)
        for e, param in enumerate(self.params):
            _DATA.__set__(param, new[e])
        self.tensor = new
        for block in self.blocks:
            block._buffers[self.key] = new
        log.info("k3 adapt: %s converted to %s on %s (every expert of it)", self.name, dtype,
                 device)


class ExpertRow(nn.Parameter):
    """An expert's parameter that is row `row` of `stack` (see the module docstring)."""

    @property
    def data(self):
        return _DATA.__get__(self)

    @data.setter
    def data(self, t):
        stack = self.__dict__.get("stack")
        if stack is None:  # a copy (deepcopy): a row of nothing
            _DATA.__set__(self, t)
            return
        rebind(stack, self.__dict__["row"], t)

    def __setattr__(self, name, value):
        if name == "__class__" and value is not ExpertRow:  # torch.utils.swap_tensors
            raise ValueError(_swap_refusal(self))
        super().__setattr__(name, value)

    def module_load(self, other, assign=False):  # load_state_dict's, before it swaps
        raise ValueError(_swap_refusal(self))

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.detach().clone(), self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):  # saved as the Parameter it stands for
        return nn.Parameter(self.detach(), self.requires_grad).__reduce_ex__(protocol)


def _swap_refusal(param: ExpertRow) -> str:
    stack = param.__dict__["stack"]
    return (f"k3compile.adapt: {stack.name}, expert {param.__dict__['row']}: refused to swap "
            "this parameter for another tensor (torch.__future__."
            "set_swap_module_params_on_conversion(True)): the adapted step reads it as a row of "
            "one buffer per block. It is unchanged; tensors swapped before it in the same call "
            "stay swapped. Turn the option off for this model (conversions and "
            "load_state_dict then write the rows), or adapt again after the change")


def refusal(stack: Stack, row: int, t: torch.Tensor) -> str | None:
    """Why expert `row` of `stack` cannot take tensor t as its data, or None."""
    current = stack.tensor[row]
    if t.shape != current.shape:
        return f"its stack holds {tuple(current.shape)}, not {tuple(t.shape)}"
    if t.is_meta or _is_row(t, current):
        return None
    if (why := unwritable(t)) is not None:
        return f"the new tensor cannot become its row: {why}; param.copy_(t) writes the values"
    return None


def _is_row(t: torch.Tensor, row: torch.Tensor) -> bool:
    return (t.data_ptr(), t.dtype, t.device) == (row.data_ptr(), row.dtype, row.device)


def rebind(stack: Stack, row: int, t: torch.Tensor) -> None:
    """`stack.params[row].data = t`, seen by the step reading the stack, or a ValueError and
    nothing changed."""
    if (why := refusal(stack, row, t)) is not None:
        raise ValueError(f"k3compile.adapt: {stack.name}, expert {row}: {why}. The adapted "
                         "step reads the experts as rows of one buffer per block "
                         "(k3compile.adapt.stacks)")
    if (t.dtype, t.device) != (stack.tensor.dtype, stack.tensor.device):
        stack.convert(t.dtype, t.device)
    current = stack.tensor[row]
    if not (t.is_meta or _is_row(t, current)):
        write_through(t.detach(), current)


def tensor_names(block: nn.Module) -> tuple[str, ...]:
    return ("weight_packed", "weight_scale") if block.mxfp4_experts else ("weight",)


def stack_experts(name: str, block: nn.Module, users_block: nn.Module) -> str | None:
    """Store each projection's expert tensors in one [E, ...] buffer per block (the block's
    `stacked_<projection>_<tensor>`, not in its state_dict) and make every expert's parameter an
    `ExpertRow` of it, as stage `pack` stores an expert stack (`stack_parts`: the same refusals,
    aliases taken before re-pointed); `users_block` is the block of the user's model the adapted
    `block` was cloned from (`watch_assign`). Where a tensor cannot move, the block reads its
    experts one by one (why: returned, and logged)."""
    stacks = []
    for projection in PROJECTIONS:
        for tensor in tensor_names(block):
            params = [getattr(e, projection)._parameters[tensor] for e in block.experts]
            where = f"{name}.experts.*.{projection}.{tensor}"
            moved = stack_parts(params)  # a view of them where an earlier adapt stacked them
            if isinstance(moved, str):
                log.info("k3 adapt: experts read one by one, %s: %s", where, moved)
                block.expert_stacks = None
                return f"{where}: {moved}"
            stacks.append(_stack_of(params) or Stack(projection, tensor, where, moved, params))
    for stack in stacks:
        for e, param in enumerate(stack.params):
            param.__class__ = ExpertRow
            param.__dict__.update(stack=stack, row=e)
        block.register_buffer(stack.key, stack.tensor, persistent=False)
        stack.blocks.add(block)
    block.expert_stacks = sorted(s.key for s in stacks)
    watch_assign([block, users_block], stacks)
    return None


def _stack_of(params: list[nn.Parameter]) -> Stack | None:
    """The stack these parameters are the rows of in order (an earlier adapt's), or None."""
    stack = params[0].__dict__.get("stack")
    if stack is None or stack.params != params:
        return None
    return stack


def watch_assign(blocks: list[nn.Module], stacks: list[Stack]) -> None:
    """After `load_state_dict(..., assign=True)` on any module holding one of `blocks` (the
    adapted block, the user's): the assigned expert tensors written into their rows and the row
    parameters put back, or a ValueError and the block's experts as they were before."""
    for block in blocks:
        if block not in _HOOKED:
            _HOOKED[block] = block.register_load_state_dict_post_hook(
                functools.partial(_reattach_assigned, stacks))


def _reattach_assigned(stacks: list[Stack], block: nn.Module, incompatible_keys) -> None:
    assigned = []  # (where the parameter is held, its name, row, the assigned parameter)
    for stack in stacks:
        for e, (expert, row) in enumerate(zip(block.experts, stack.params, strict=True)):
            linear = getattr(expert, stack.projection)
            now = linear._parameters[stack.tensor_name]
            if now is not row:
                assigned.append((linear, stack, e, now))
    for linear, stack, e, _ in assigned:  # every row parameter back: nothing lost if refused
        linear._parameters[stack.tensor_name] = stack.params[e]
    whys = [f"expert {e}: {why}" for _, stack, e, now in assigned
            if (why := refusal(stack, e, now)) is not None]
    if whys:
        raise ValueError(f"k3compile.adapt: load_state_dict(assign=True) into {stack.name}: "
                         + "; ".join(whys) + ". The block's experts were left as they were "
                         "(the rest of the state dict is loaded); load without assign=True "
                         "(copies the values) or adapt the model again")
    for _, stack, e, now in assigned:
        rebind(stack, e, now.detach())
