"""The step's call checked before Dynamo traces it (issue 20 item 8).

A call whose index arguments have a float dtype or disagree on the batch size fails inside
Dynamo's fake-tensor run of the step, the first call or the recompile a later call triggers, and
under `fullgraph=True` the caller gets Dynamo's `TorchRuntimeError` ("RuntimeError when making
fake tensor call"), an `AssertionError` from a guard (a batch marked unbacked), or an
`Unsupported` "Observed exception", with eager's message buried inside. `check_calls(module)`
registers a forward pre-hook that raises a `ValueError` naming the argument first, both for the
compiled step and for the module called eagerly, so the two raise the same error.

The hook runs outside Dynamo where the module is the compiled one: `torch.compile(module)` calls a
user module's hooks outside its trace, and the hook's code is marked for Dynamo's frame
evaluation to run, not compile (`skip_code`), so no guard on it recompiles. Inside a larger
compiled module Dynamo inlines it with the rest (its checks read only dtypes and shapes).
The checks are structural only; values (ranges, duplicate slots) are checked by the compiled step
itself (k3compile/validate.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn


def integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def structure_error(named: Sequence[tuple[str, torch.Tensor, str]]) -> str | None:
    """Why (name, tensor, where its bound comes from) inputs cannot be one step's index
    arguments, or None: a non-integer dtype, or leading sizes (the batch) that differ."""
    for name, t, why in named:  # loops, not comprehensions: those are frames Dynamo would compile
        if not integer_dtype(t.dtype):
            return (f"k3: {name} has dtype {t.dtype}; it must be an integer tensor"
                    + (f" ({why})" if why else ""))
    return batch_error(named)


def batch_error(named: Sequence[tuple[str, torch.Tensor, str]]) -> str | None:
    """Why the inputs are not one batch (their dim 0 differs), or None."""
    leads, sizes = [], set()
    for name, t, _ in named:
        if t.dim() > 0:
            leads.append(f"{name} {list(t.shape)}")
            sizes.add(t.shape[0])
    if len(sizes) > 1:
        return "k3: the inputs disagree on the batch size (dim 0): " + ", ".join(leads)
    return None


class CallCheck:
    """The pre-hook: `names` are the forward's index arguments (None: every tensor argument)."""

    def __init__(self, module: nn.Module, names: Sequence[str] | None):
        self.names = None if names is None else frozenset(names)
        params = inspect.signature(module.forward).parameters.values()
        self.positional = [p.name for p in params
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        named = []
        for name, value in [*zip(self.positional, args), *kwargs.items()]:
            if isinstance(value, torch.Tensor) and (self.names is None or name in self.names):
                named.append((name, value, ""))
        if (error := structure_error(named)) is not None:
            raise ValueError(error)


_skip = getattr(torch._dynamo.eval_frame, "skip_code", None)  # absent: the hook is traced
for _code in (CallCheck.__call__.__code__, structure_error.__code__, batch_error.__code__,
              integer_dtype.__code__):
    if _skip is not None:
        _skip(_code)


def check_calls(module: nn.Module, names: Sequence[str] | None = None) -> CallCheck:
    """Check every call of `module` (a decode step) before it runs or Dynamo traces it; once per
    module (a later call returns the hook already there)."""
    hook = getattr(module, "_k3_call_check", None)
    if hook is None:
        hook = module._k3_call_check = CallCheck(module, names)
        module.register_forward_pre_hook(hook, with_kwargs=True)
    return hook


def has_call_check(module: nn.Module) -> bool:
    return getattr(module, "_k3_call_check", None) is not None


__all__ = ["CallCheck", "batch_error", "check_calls", "has_call_check", "integer_dtype", "structure_error"]
