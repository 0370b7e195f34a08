"""The fused-op layer: every fused op is a `torch.library` custom op in the `k3` namespace.

Each op has a fake (shape) implementation and a CPU implementation that is its torch reference
(written to round exactly like the unfused model code, so a rewritten graph equals eager on CPU).
The reference is registered for every device; a CuTe DSL kernel in `k3compile.kernels` replaces
it on CUDA when its module is imported and the DSL is present (`k3compile.kernels.register_all`).
"""

from k3compile.ops import attn_res, gemm, kda, linear, mla, moe, norms, sched

__all__ = ["attn_res", "gemm", "kda", "linear", "mla", "moe", "norms", "sched"]
