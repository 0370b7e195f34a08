"""`SiTU`, the CuTe DSL kernel of kernels/situ_gate_up.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

from cutlass import BFloat16, Float32, cute

from ..common.copy import load_vectors, make_frag, row_vectors, store_vectors
from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..situ_gate_up import Config


class SiTU:
    def __init__(self, width: int, cfg: Config, pdl: bool = False):
        self.width, self.n_vec, self.pdl = width, width // 8, pdl
        self.threads, self.v = cfg.threads, cfg.vec_per_thread

    @cute.jit
    def __call__(self, mGU: cute.Tensor, mY: cute.Tensor, beta: Float32, linear_beta: Float32,
                 stream):
        # mGU: (N, 2I) = [g | u]; mY: (N, I)
        self.kernel(mGU, mY, beta, linear_beta).launch(
            grid=[mY.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mGU: cute.Tensor, mY: cute.Tensor, beta: Float32, linear_beta: Float32):
        pdl_launch_dependents(self.pdl)
        pdl_wait(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        T, nv = self.threads, self.n_vec
        gRow = row_vectors(mGU, row)  # (8, 2 * n_vec): g's vectors, then u's
        rG, rU = make_frag(BFloat16, self.v), make_frag(BFloat16, self.v)  # (8, V)
        load_vectors(gRow, rG, tidx, T, nv)
        load_vectors(gRow, rU, tidx, T, nv, first=nv)
        g = rG.load().to(Float32)
        u = rU.load().to(Float32)
        sig = 1.0 / (1.0 + cute.math.exp(-g, fastmath=True))
        act = beta * cute.math.tanh(g / beta, fastmath=False) * sig
        lin = linear_beta * cute.math.tanh(u / linear_beta, fastmath=False)
        rG.store((act * lin).to(BFloat16))
        store_vectors(rG, row_vectors(mY, row), tidx, T, nv)
