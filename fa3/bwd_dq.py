"""How the fa3 backward's dQ reaches the float32 accumulator in global memory (the
`BwdConfig.dq_mode` and `deterministic` mechanisms of `bwd_kernel.Fa3Backward`, which mixes
`BwdDq` in), and the named barriers of the backward's MMA warpgroups."""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import enum

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flashsuite.fa3.utils import bulk_reduce_add_f32, turn_pass, turn_wait


class Barrier(enum.IntEnum):
    """Named barrier ids over the MMA threads; 0 is __syncthreads."""

    DS_FREE = 1  # every WG's dQ wgmma of the previous row block has retired: sdS may be written
    DS_READY = 2  # sdS holds this row block's dS (written and fenced by every WG)
    DQ_FREE = 3  # "bulk" dq_mode: the previous row block's bulk reduce has read sdQ
    DQ_READY = 4  # "bulk" dq_mode: sdQ holds this row block's dQ (written and fenced)
    DQ_TURN = 5  # deterministic: the column blocks before this one have added their dQ
    DQ_ADDED = 6  # deterministic: every MMA thread has issued its dQ adds of this row block


class BwdDq:
    """dQ of one row block into the accumulator. Uses the kernel's TILE_M, HEAD_DIM and
    MMA_THREADS."""

    @cute.jit
    def add_dq(
        self,
        thr_dq,
        acc_dQ: cute.Tensor,
        mdQacc: cute.Tensor,
        head: Int32,
        batch: Int32,
        m_block: Int32,
        seqlen_q: Int32,
    ):
        """dQ of this row block added into the fp32 accumulator, one red.global.add per value;
        rows past seqlen_q are skipped."""
        gdQ = cute.local_tile(
            mdQacc[None, None, head, batch], (self.TILE_M, self.HEAD_DIM), (m_block, 0)
        )  # (TILE_M, D)
        tdQcdQ = thr_dq.partition_C(cute.make_identity_tensor((self.TILE_M, self.HEAD_DIM)))
        for i in cutlass.range_constexpr(cute.size(acc_dQ)):
            if m_block * self.TILE_M + tdQcdQ[i][0] < seqlen_q:
                ptr = gdQ.iterator + cute.crd2idx(tdQcdQ[i], gdQ.layout)
                cute.arch.atomic_add(ptr.llvm_ptr, acc_dQ[i])

    @cute.jit
    def reduce_dq(
        self,
        thr_dq,
        acc_dQ: cute.Tensor,
        sdQ: cute.Tensor,
        mdQacc: cute.Tensor,
        mtid: Int32,
        head: Int32,
        batch: Int32,
        m_block: Int32,
        seqlen_q: Int32,
    ):
        """dQ of this row block added into the fp32 accumulator through shared memory: every
        MMA thread stores its fragment to sdQ, then the 32 lanes of MMA warp 0 each issue
        cp.reduce.async.bulk add.f32 for rows lane, lane + 32, ... (D x 4 bytes each, rows past
        seqlen_q skipped) in their own bulk group.

        Handover (every MMA thread passes both named barriers once per row block): a lane of
        warp 0 waits until its previous row block's reduces have read sdQ, then DQ_FREE; the
        stores; the generic -> async proxy fence; DQ_READY; the bulk reduces. They then run
        while the next row block computes."""
        if mtid < 32:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=int(Barrier.DQ_FREE), number_of_threads=self.MMA_THREADS)
        cute.autovec_copy(acc_dQ, thr_dq.partition_C(sdQ))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(Barrier.DQ_READY), number_of_threads=self.MMA_THREADS)
        if mtid < 32:
            gdQ = cute.local_tile(
                mdQacc[None, None, head, batch], (self.TILE_M, self.HEAD_DIM), (m_block, 0)
            )  # (TILE_M, D)
            for r in cutlass.range_constexpr(self.TILE_M // 32):
                row = mtid + 32 * r
                if m_block * self.TILE_M + row < seqlen_q:
                    bulk_reduce_add_f32(
                        gdQ.iterator + cute.crd2idx((row, 0), gdQ.layout),
                        sdQ.iterator + cute.crd2idx((row, 0), sdQ.layout),
                        self.HEAD_DIM * 4,
                    )
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def add_dq_in_order(
        self,
        thr_dq,
        acc_dQ: cute.Tensor,
        mdQacc: cute.Tensor,
        mSem: cute.Tensor,
        mtid: Int32,
        n_block: Int32,
        head: Int32,
        batch: Int32,
        m_block: Int32,
        seqlen_q: Int32,
    ):
        """`add_dq` in n_block order (docs/design.md, "Deterministic dQ"): wait until the
        (batch, head, m_block) counter reads n_block, add, then increment it. The column blocks
        that see a row block are a prefix of the n_blocks, and a CTA only waits on lower
        n_blocks of its own (kv head, batch), which the grid launches before it."""
        sem = mSem.iterator + cute.crd2idx((batch, head, m_block), mSem.layout)
        turn_wait(sem, n_block, mtid, int(Barrier.DQ_TURN), self.MMA_THREADS)
        self.add_dq(thr_dq, acc_dQ, mdQacc, head, batch, m_block, seqlen_q)
        turn_pass(sem, mtid, int(Barrier.DQ_ADDED), self.MMA_THREADS)
