"""Adapters: a foreign K3 implementation made into the built-in decode step
`step(input_ids, positions, slots) -> logits` (k3compile/models/k3.py), so that
`torch.compile(step, backend="k3")` sees one static graph per step.

`adapt(model, max_batch=..., max_seq_len=...)` takes Moonshot's released `KimiLinearForCausalLM`
or `KimiK3ForConditionalGeneration` (`kimi_linear.py`; their files are found through
K3_MOONSHOT_DIR, `moonshot.py`; fla's kernels are replaced by torch stand-ins, `fla.py`). The
release's routed experts, compressed-tensors MXFP4 loaded by `moonshot.from_pretrained`, are read
packed and fuse into `k3.moe_experts` (`compressed.py`); at TP > 1 each rank loads its slice of
the experts (`moonshot.from_pretrained(..., group=)`) and `adapt(..., group=)` sums them.
"""

from k3compile.adapt.kimi_linear import MoonshotStep, adapt

__all__ = ["MoonshotStep", "adapt"]
