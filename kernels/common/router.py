"""The GEMM router: y = x · Wᵀ [+ r] by the engine that is fastest at that shape.

    linear(x, w, residual=None, *, out_dtype=None)

gemv (CUDA cores, weight streaming) at M <= GEMV_MAX_M; gemm_tc (tensor cores) at
GEMV_MAX_M < M <= gemm_tc.MAX_M where its tuned table has it faster than cuBLAS
(`gemm_tc.prefers`) and K3_KERNELS_SKIP does not name it; cuBLAS (`gemm_ref`) otherwise, and
wherever an engine refuses the inputs. The choice is by shape only, fixed per bucket, and reads
only `settings.KERNELS` at each call (no state of its own). `tc_fused_takes`: the same rule for
the composites' one-launch gemm_tc variants (K3_GEMM_TC_FUSED).

Constraints:
    * x [M, K] rows on a CUDA device for the engines (anything else: `gemm_ref`).
"""

from k3compile.settings import KERNELS

from . import gemm_tc, gemv
from .dsl import have_dsl
from .gemm import GEMV_MAX_M, gemm_ref


def tensor_cores() -> bool:
    """Whether the router takes gemm_tc above GEMV_MAX_M rows now (K3_KERNELS_SKIP=gemm_tc:
    cuBLAS there)."""
    return gemm_tc.OP not in KERNELS.skip and have_dsl()


def tc_fused_takes(x, variant: str, n: int) -> bool:
    """Whether a composite with rows x over a weight of n rows takes gemm_tc's one-launch
    `variant`: settings.KERNELS.gemm_tc_fused names it, M is at most `gemm_tc.FUSED_MAX_M`
    and `linear` would run gemm_tc on that weight at this M (above GEMV_MAX_M, tensor cores on,
    `gemm_tc.prefers` the shape)."""
    return (variant in KERNELS.gemm_tc_fused and x.dim() == 2 and x.is_cuda
            and GEMV_MAX_M < x.shape[0] <= gemm_tc.FUSED_MAX_M and tensor_cores()
            and gemm_tc.prefers(n, x.shape[1], x.shape[0]))


def linear(x, w, residual=None, *, out_dtype=None):
    if x.dim() == 2 and x.is_cuda:
        m = x.shape[0]
        if m <= GEMV_MAX_M and gemv.can_implement(x, w, residual, out_dtype=out_dtype):
            return gemv.gemv_cuda(x, w, residual, out_dtype=out_dtype)
        if m <= gemm_tc.MAX_M and tensor_cores() and gemm_tc.prefers(w.shape[0], x.shape[1], m) \
                and gemm_tc.can_implement(x, w, residual, out_dtype=out_dtype):
            return gemm_tc.gemm_tc_cuda(x, w, residual, out_dtype=out_dtype)
    return gemm_ref(x, w, residual, out_dtype)
