"""`MoEOneLaunch`, the CuTe DSL kernel of kernels/moe_one_launch.py: moe_experts' FC1 + SiTU and
FC2 + finalize (`FC1`, `FC2` of kernels/device/moe_experts.py, their code unchanged) in one grid.

Every CTA takes a ticket (`last_cta.ticket`): tickets below N·k·B1 are FC1 work items (pair,
row block), pair-major, the rest FC2 work items (token, row block). An FC1 item writes its act
rows and `signal`s its token's count; an FC2 item loads its first W2 chunk, waits for its token's
count to reach k·B1 (`wait_count`), then runs as in the two launches. No deadlock: a CTA only
holds an FC2 ticket once every FC1 ticket is held by a CTA that runs, and FC1 items wait for
nothing. The last FC2 item to finish (`arrive` on a word of its own, not the ticket word: tickets
are still being taken when the first FC2 items finish) resets the tickets, the tokens' counts
and the arrivals for the next launch.

Imports `cutlass` at the top: the host module imports this one only in `build`."""

import cutlass
from cutlass import Float32, Int32, const_expr, cute

from ..common.dsl import pdl_wait
from ..moe_one_launch import TICKET_BYTES, TICKET_WORD, arrival_word, arrivals, shared_bytes
from .last_cta import arrive, signal, ticket
from .moe_experts import FC1, FC2


class MoEOneLaunch:
    def __init__(self, latent, inter, top_k, fc1_cfg, fc2_cfg, pdl: bool = False,
                 expert_rows: int = 0):
        if fc1_cfg.threads != fc2_cfg.threads:
            raise ValueError(f"{fc1_cfg} and {fc2_cfg}: one block size for both")
        self.fc1 = FC1(latent, inter, top_k, fc1_cfg, expert_rows=expert_rows)
        self.fc2 = FC2(latent, inter, top_k, fc2_cfg)
        self.top_k, self.threads, self.pdl = top_k, fc1_cfg.threads, pdl
        self.blocks1 = -(-inter // self.fc1.rows)  # B1: FC1 row blocks per pair
        self.blocks2 = -(-latent // self.fc2.rows)  # B2: FC2 row blocks per token
        self.cp_async = fc1_cfg.cp_async
        self.smem = shared_bytes(latent, inter, top_k, fc1_cfg, fc2_cfg)

    @cute.jit
    def __call__(self, mZ: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor, mW1: cute.Tensor,
                 mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mW2: cute.Tensor,
                 mS2: cute.Tensor, mAct: cute.Tensor, mActRows: cute.Tensor, mY: cute.Tensor,
                 mCount: cute.Tensor, beta: Float32, linear_beta: Float32, stream):
        # mZ, mY: (N, L) bf16; mIds, mWt: (N, k); mW1, mW3: (E·I, L/8) int32 words, mS1, mS3:
        # (E·I, L/32) uint8; mW2: (E·L, I/8), mS2: (E·L, I/32); mAct: (N·k, I) bf16 and
        # mActRows its (N, k·I) view; mCount: (2 + N,) int32 (`slot_words`), 0 between launches
        n = mZ.shape[0]
        self.kernel(mZ, mIds, mWt, mW1, mS1, mW3, mS3, mW2, mS2, mAct, mActRows, mY, mCount,
                    beta, linear_beta).launch(
            grid=[n * (self.top_k * self.blocks1 + self.blocks2), 1, 1],
            block=[self.threads, 1, 1], smem=self.smem, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mZ: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor, mW1: cute.Tensor,
               mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mW2: cute.Tensor,
               mS2: cute.Tensor, mAct: cute.Tensor, mActRows: cute.Tensor, mY: cute.Tensor,
               mCount: cute.Tensor, beta: Float32, linear_beta: Float32):
        # with PDL the ticket waits too: the previous kernel in the stream may use this counter
        pdl_wait(self.pdl)
        K, B1, B2 = self.top_k, self.blocks1, self.blocks2
        n_rows = mZ.shape[0]
        fc1_items = n_rows * K * B1
        sTicket = cutlass.memory.SmemAllocator().allocate_tensor(
            Int32, cute.make_layout((TICKET_BYTES // 4,)), 16)
        t = ticket(mCount, sTicket)
        if t < fc1_items:
            pair, blk = t // B1, t % B1
            body = self.fc1.body_async if const_expr(self.cp_async) else self.fc1.body
            body(pair, blk, mZ, mIds, mW1, mS1, mW3, mS3, mAct, beta, linear_beta)
            signal(cute.make_tensor(mCount.iterator + 1 + pair // K, cute.make_layout((1,))))
        else:
            u = t - fc1_items
            n = u // B2
            done = cute.make_tensor(mCount.iterator + 1 + n, cute.make_layout((1,)))
            self.fc2.body(n, u % B2, mActRows, mIds, mWt, mW2, mS2, mY, done, K * B1)
            # the last arrival: every FC2 item has read its count
            last = arrive(cute.make_tensor(mCount.iterator + arrival_word(n_rows),
                                           cute.make_layout((1,))), arrivals(n_rows, K * B1, B2),
                          sTicket)
            if last:  # every ticket taken, every count read
                tidx = cute.arch.thread_idx()[0]
                if tidx < n_rows:
                    mCount[1 + tidx] = Int32(0)
                if tidx == 0:
                    mCount[TICKET_WORD] = Int32(0)
