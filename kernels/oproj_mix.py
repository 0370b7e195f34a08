"""K3_KERNELS_EXTRA=oproj_mix: `k3::oproj_attn_res_mix_norm` in one launch at up to MAX_ROWS
rows (kernels/oproj_attn_res_mix_norm.py, `oproj_mix_cuda`: the o_proj gemv whose last CTA runs
the mix + RMSNorm), its two launches elsewhere. Opt-in until its GPU tests pass on the H200
(tests/fusions/test_oproj_attn_res_mix_norm_kernel.py); registered after KERNELS, so it replaces
the two-launch CUDA implementation."""

from . import oproj_attn_res_mix_norm


def register() -> None:
    oproj_attn_res_mix_norm.register(one_launch=True)
