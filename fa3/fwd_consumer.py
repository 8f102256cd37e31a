"""The consumer warpgroups' per-tile work in the fa3 forward (`kernels.Fa3Forward` mixes
`ForwardConsumer` in): the main loop over the tile's K/V blocks with the masked-unmasked split
(`consumer`), the fp8 tile's scales (`tile_scales`) and the epilogue (O /= l, LSE, O to smem
and the TMA store). Uses the kernel's static configuration and the per-block steps of
fwd_mainloop.py.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import math
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, const_expr

from flashsuite.fa3 import trace
from flashsuite.fa3.epilogue import store_o, store_o_direct, store_o_wg
from flashsuite.fa3.mask import mask_phases
from flashsuite.fa3.softmax import finalize_row, rescale_rows
from flashsuite.fa3.utils import q_to_regs


class ForwardConsumer:
    """A consumer warpgroup's tile: main loop, fp8 scales, epilogue."""

    # ----------------------------------------------------------------------------------------
    # consumer: main loop
    # ----------------------------------------------------------------------------------------
    @cute.jit
    def consumer(
        self,
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,
        mLSE,  # (Nq, Hq, B) fp32; LSE_TMA: (TMA atom, coordinates, sLSE)
        descales,  # fp8: (mDescaleQ, mDescaleK, mDescaleV, group); None for 16-bit inputs
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sVt: cute.Tensor,
        sO: cute.Tensor,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_k: pipeline.PipelineTmaAsync,
        pipe_v: pipeline.PipelineTmaAsync,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
        ctid: Int32,  # 0..CONSUMER_THREADS-1 over the consumer warpgroups
        warp: Int32,
        cwg: Int32,  # consumer warpgroup 0..NUM_CONSUMER_WGS-1
        m_block: Int32,
        head: Int32,
        rows,  # varlen.DenseRows / SeqRows: the tile's sequence
        seqlen_q: Int32,
        seqlen_k: Int32,
        scale_log2: Float32,
        softcap_pre: Float32,
        window_left: Int32,
        window_right: Int32,
        n_block_min: Int32,
        n_block_max: Int32,
        trace_at=None,  # TRACE: (trace tensor, CTA start, CTA start ns, row), fa3/trace.py
    ):
        t_tile = trace.now() if const_expr(self.TRACE) else None
        t_q = Int64(0) if const_expr(self.TRACE) else None
        scale_log2, softcap_pre, descale_v = self.tile_scales(
            descales, head, rows.batch, scale_log2, softcap_pre
        )
        thr_qk = mma_qk.get_slice(ctid)
        thr_pv = mma_pv.get_slice(ctid)
        # WG_SLICE: the shared-memory operands' descriptors from the warpgroup's slice (cwg is
        # warp-uniform), so they stay in uniform registers.
        wg_qk, wg_pv = thr_qk, thr_pv
        if const_expr(self.WG_SLICE):
            wg_qk = mma_qk.get_slice(cwg * 128)
            wg_pv = mma_pv.get_slice(cwg * 128)
        if const_expr(self.Q_STAGES > 1):
            sQ = sQ[None, None, q_state.index]  # this tile's Q buffer
        tSrQ = None  # Q_IN_REGS: loaded from sQ once Q has arrived (q_to_regs)
        if const_expr(not self.Q_IN_REGS):
            tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))  # (MMA, MMA_M, MMA_K) descriptors
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))  # (MMA, MMA_N, MMA_K, STAGES)
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))  # (MMA, MMA_N, MMA_K, STAGES)
        acc_S = thr_qk.make_fragment_C(
            thr_qk.partition_shape_C((self.TILE_M, self.TILE_N))
        )  # ((2, 2, TILE_N/8), 1, 1) fp32: 2 rows per thread
        acc_O = thr_pv.make_fragment_C(
            thr_pv.partition_shape_C((self.TILE_M, self.HEAD_DIM))
        )  # ((2, 2, D/8), 1, 1) fp32
        tOrP = thr_pv.make_fragment_A(
            thr_pv.partition_shape_A((self.TILE_M, self.TILE_N))
        )  # ((2, 2, 2), 1, TILE_N/16) 16-bit
        # The softmax, mask and P conversion index fragments as i = c + 2r + 4j (m64nNk16 C
        # layout, one MMA tile per warpgroup): check the shapes that assumption rests on.
        assert cute.size(acc_S, mode=[1]) == 1 and cute.size(acc_S, mode=[2]) == 1
        assert cute.size(acc_O, mode=[1]) == 1 and cute.size(acc_O, mode=[2]) == 1
        assert cute.size(acc_S) == self.TILE_N // 2 and cute.size(acc_O) == self.HEAD_DIM // 2
        cS = cute.make_identity_tensor((self.TILE_M, self.TILE_N))
        tScS = thr_qk.partition_C(cS)  # (row, col) of each acc_S element within the tile
        row_max = cute.make_rmem_tensor((2,), Float32)  # raw-score max of this thread's 2 rows
        row_sum = cute.make_rmem_tensor((2,), Float32)  # thread-partial sum of P
        row_max.fill(Float32(-math.inf))
        row_sum.fill(0.0)
        if const_expr(not self.O_ZERO_INIT):
            acc_O.fill(0.0)  # else the tile's first P·V overwrites it (or the branches below)
        blk = None  # fp8 block scales (FP8_BLOCKS): the tile's descales, `block_scales`
        if const_expr(self.FP8_BLOCKS):
            blk = self.block_scales(
                descales, head, rows.batch, m_block, seqlen_q, tScS, scale_log2, softcap_pre
            )
        corr_prev = None  # rescale_before_pv: the correction O has yet to take
        if const_expr(self.RESCALE_BEFORE_PV):
            corr_prev = cute.make_rmem_tensor((2,), Float32)
            corr_prev.fill(1.0)

        n_blocks = n_block_max - n_block_min
        if const_expr(self.PERSISTENT):
            pipe_q.consumer_wait(q_state)  # every tile loads Q (see load)
            if const_expr(self.TRACE):
                t_q = trace.now()
        if n_blocks > 0:
            if const_expr(not self.PERSISTENT):
                pipe_q.consumer_wait(q_state)
                if const_expr(self.TRACE):
                    t_q = trace.now()
            tSrQ_tile = tSrQ
            if const_expr(self.Q_IN_REGS):
                tSrQ_tile = q_to_regs(mma_qk, sQ, ctid, self.dtype)
                if const_expr(self.Q_RELEASE_AT_LOAD):
                    pipe_q.consumer_release(q_state)  # this warp's Q is in its registers
            # Loop phases, newest block first: [n_block_max-1] masked, then n_masked_hi masked
            # blocks, n_unmasked unmasked ones, n_masked_lo masked ones to the end.
            shift, first_row, n_masked_hi, n_unmasked, n_masked_lo = mask_phases(
                m_block, n_block_min, n_block_max, n_blocks, seqlen_q, seqlen_k, window_left,
                window_right, self.TILE_M, self.TILE_N, self.HAS_RIGHT, self.HAS_LEFT,
            )  # fmt: skip

            ctx = SimpleNamespace(
                mma_qk=mma_qk,
                mma_pv=mma_pv,
                tSrQ=tSrQ_tile,
                tSrK=tSrK,
                tOrVt=tOrVt,
                acc_S=acc_S,
                acc_O=acc_O,
                corr_prev=corr_prev,
                blk=blk,
                tOrP=tOrP,
                tScS=tScS,
                row_max=row_max,
                row_sum=row_sum,
                pipe_k=pipe_k,
                pipe_v=pipe_v,
                cwg=cwg,
                m_block=m_block,
                seqlen_k=seqlen_k,
                shift=shift,
                scale_log2=scale_log2,
                softcap_pre=softcap_pre,
                window_left=window_left,
                window_right=window_right,
            )
            n_block = n_block_max - 1
            if const_expr(self.INTRA_WG_OVERLAP):
                if const_expr(self.SKIP_MASKED_WG):
                    # The WG's rows end at first_row + 64 (cwg + 1) - 1 (padding rows past
                    # seqlen_q included, so all 64 are masked); they see keys below key_end.
                    key_end = first_row + 64 * (cwg + 1) + shift + window_right
                    i_first = Int32(0)
                    if key_end <= n_block * self.TILE_N:
                        kv_state = self.pass_block(ctx, kv_state, n_blocks > 1)
                        i_first = Int32(1)
                    if i_first < n_blocks:
                        kv_state = self.overlap_loop(
                            ctx, kv_state, n_block, i_first, n_blocks, n_masked_hi, n_unmasked,
                            pipe_q, q_state,
                        )  # fmt: skip
                    else:
                        if const_expr(self.O_ZERO_INIT):
                            acc_O.fill(0.0)  # the passed block alone: no P·V wrote O
                        if const_expr(self.EARLY_Q_RELEASE):
                            pipe_q.consumer_release(q_state)
                else:
                    kv_state = self.overlap_loop(
                        ctx, kv_state, n_block, 0, n_blocks, n_masked_hi, n_unmasked,
                        pipe_q, q_state,
                    )  # fmt: skip
            else:
                self.pingpong.sync(cwg)
                kv_state = self.step(ctx, kv_state, n_block, True)
                for i in cutlass.range(n_masked_hi, unroll=1):
                    kv_state = self.step(ctx, kv_state, n_block - 1 - i, True)
                n_block -= n_masked_hi
                for i in cutlass.range(n_unmasked, unroll=1):
                    kv_state = self.step(ctx, kv_state, n_block - 1 - i, False)
                n_block -= n_unmasked
                if const_expr(self.HAS_LEFT):
                    for i in cutlass.range(n_masked_lo, unroll=1):
                        kv_state = self.step(ctx, kv_state, n_block - 1 - i, True)
                # Hand the tensor cores to the other WG for its last PV.
                self.pingpong.arrive(cwg)
        if const_expr(self.O_ZERO_INIT):  # noqa: SIM102 (a const_expr test stays its own `if`)
            if n_blocks <= 0:
                acc_O.fill(0.0)  # no key: no P·V wrote O
        t_loop = trace.now() if const_expr(self.TRACE) else None

        if const_expr(self.PERSISTENT and not self.O_ALIAS_Q):
            if const_expr(self.EARLY_Q_RELEASE or self.Q_RELEASE_AT_LOAD):
                if n_blocks <= 0:  # no main loop ran: release this tile's Q here
                    pipe_q.consumer_release(q_state)
            else:
                # Every wgmma reading sQ has retired: the producer may load the next tile's Q.
                pipe_q.consumer_release(q_state)
        if const_expr(self.FP8_BLOCKS):
            # O is in units of the last block's descale of v; row_max in log2 units, except
            # with softcap (the kernel's constant exp2 scale, `scores_to_probs`).
            descale_v = blk.dsv[0]
            if const_expr(not self.SOFTCAP):
                scale_log2 = Float32(1.0)
        self.epilogue(
            tma_o,
            tO,
            mLSE,
            mma_pv,
            sO,
            acc_O,
            tScS,
            row_max,
            row_sum,
            ctid,
            warp,
            cwg,
            m_block,
            head,
            rows,
            seqlen_q,
            scale_log2,
            descale_v,
        )
        if const_expr(self.PERSISTENT):
            if const_expr(self.O_ALIAS_Q):
                # sO sits on sQ: free it once the TMA store has read it (warp 4 waited for that
                # before its release; the Q barrier completes only with every consumer warp).
                pipe_q.consumer_release(q_state)
            q_state.advance()
        if const_expr(self.TRACE):  # noqa: SIM102 (a const_expr test stays its own `if`)
            if ctid % 128 == 0:
                t_end = (trace.now(), trace.now_ns())
                stamps = (cute.arch.smid(), trace_at[1], t_tile, t_q, t_loop, t_end[0], trace_at[2])
                trace.write(trace_at[0], trace_at[3], trace.CONSUMER_FIELDS, (*stamps, t_end[1]))
        return q_state, kv_state

    def tile_scales(
        self, descales, head: Int32, batch: Int32, scale_log2: Float32, softcap_pre: Float32
    ):
        """(scale_log2, softcap_pre, descale_v) of the tile of (`head`, `batch`), at the top of
        `consumer` (one tile per CTA, or each tile of a persistent CTA): the kernel's own
        scales and no descale_v for 16-bit inputs.

        fp8: the descales of the tile's (batch, kv head). Scores are (q·descale_q)·
        (k·descale_k) = descale_q·descale_k·(q·k): the product scales what multiplies the raw
        fp32 score (the exp2 scale, or tanh's argument). descale_v goes to the same tile's
        epilogue: O = descale_v · P·V / l.
        """
        if const_expr(not self.FP8 or self.FP8_BLOCKS):
            return scale_log2, softcap_pre, None  # FP8_BLOCKS: `block_scales`
        m_dq, m_dk, m_dv, group = descales
        head_kv = head // group
        qk_descale = m_dq[batch, head_kv] * m_dk[batch, head_kv]
        descale_v = m_dv[batch, head_kv]
        if const_expr(self.SOFTCAP):
            return scale_log2, softcap_pre * qk_descale, descale_v
        return scale_log2 * qk_descale, softcap_pre, descale_v

    @cute.jit
    def block_scales(
        self,
        descales,
        head: Int32,
        batch: Int32,
        m_block: Int32,
        seqlen_q: Int32,
        tScS: cute.Tensor,
        scale_log2: Float32,
        softcap_pre: Float32,
    ):
        """FP8_BLOCKS: the tile's per-block descales (`consumer` builds it once per tile).

        The descales are (B, H, nblocks, block) fp32 views whose last mode has stride 0: the
        block size travels as its extent (interface.forward makes the views, no copy). q's H
        is Hq or Hkv (the group's query heads share it); k's and v's block is kv_tiles x TILE_N
        keys, so each K/V block of the loop meets one descale of each (`block_descales`).

        row_pre: each of the thread's two rows' scale before k's descale: the exp2 scale (or
        tanh's argument with softcap) times the row's descale of q (the row's query position
        clamped to seqlen_q - 1: padding rows of the last tile read the last block, and are
        not stored). dsv: the descale of v that O's P·V sum is in (1 before any block).
        """
        m_dq, m_dk, m_dv, group = descales
        head_kv = head // group
        head_q = head if m_dq.shape[1] != m_dk.shape[1] else head_kv
        pre = softcap_pre if const_expr(self.SOFTCAP) else scale_log2
        row_pre = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            row = cutlass.min(m_block * self.TILE_M + tScS[2 * r][0], seqlen_q - 1)
            row_pre[r] = pre * m_dq[batch, head_q, row // m_dq.shape[3], 0]
        dsv = cute.make_rmem_tensor((1,), Float32)
        dsv[0] = Float32(1.0)
        return SimpleNamespace(
            mDK=m_dk,
            mDV=m_dv,
            batch=batch,
            head_kv=head_kv,
            kv_tiles=m_dk.shape[3] // self.TILE_N,
            row_pre=row_pre,
            dsv=dsv,
            cur=cute.make_rmem_tensor((2,), Float32),  # this block's (descale_k, descale_v)
        )

    # ----------------------------------------------------------------------------------------
    # consumer: epilogue
    # ----------------------------------------------------------------------------------------
    def _o_scale(self, descale_v: Float32 | None):
        """What multiplies a row of O with softmax sum l (> 0), as a function of 1/l: 1/l, or
        descale_v / l for fp8 (O = descale_v · P·V / l)."""
        if descale_v is None:
            return lambda rcp_l: rcp_l
        return lambda rcp_l: rcp_l * descale_v

    @cute.jit
    def epilogue(
        self,
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,
        mLSE,  # (Nq, Hq, B) fp32; LSE_TMA: (TMA atom, coordinates, sLSE)
        mma_pv: cute.TiledMma,
        sO: cute.Tensor,
        acc_O: cute.Tensor,
        tScS: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        ctid: Int32,
        warp: Int32,
        cwg: Int32,
        m_block: Int32,
        head: Int32,
        rows,  # varlen.DenseRows / SeqRows: the tile's sequence
        seqlen_q: Int32,
        scale_log2: Float32,
        descale_v: Float32 | None,  # fp8: this tile's descale of V (`tile_scales`)
    ):
        """O /= l (0 for empty rows), LSE to gmem, O -> sO (stmatrix) -> TMA store."""
        inv = cute.make_rmem_tensor((2,), Float32)
        batch = rows.batch
        lse_rows = rows.lse_rows(mLSE, head) if const_expr(self.VARLEN) else None
        lse_out = None  # LSE_TMA: (TMA atom, coordinates, sLSE, this thread's two rows' LSE)
        if const_expr(self.LSE_TMA):
            lse_out = (*mLSE, cute.make_rmem_tensor((2,), Float32))
        for r in cutlass.range_constexpr(2):
            inv[r], lse = finalize_row(row_max[r], row_sum[r], scale_log2, self._o_scale(descale_v))
            row = m_block * self.TILE_M + tScS[2 * r][0]
            if const_expr(self.LSE_TMA):
                lse_out[3][r] = lse  # to sLSE in store_o_wg, then out by TMA (rows < seqlen_q)
            # One lane of each quad owns the row's statistics; tail rows are not stored.
            elif (tScS[0][1] == 0) & (row < seqlen_q):
                if const_expr(self.VARLEN):
                    lse_rows[row] = lse  # (seqlen_q,) of this sequence and head
                else:
                    mLSE[row, head, batch] = lse
        rescale_rows(acc_O, inv)
        if const_expr(self.PER_WG_EPILOGUE):
            store_o_wg(
                tma_o, tO, sO, acc_O, ctid, warp, cwg, m_block, head, rows, self.HEAD_DIM,
                self.dtype, self.o_dtype, self._pv_b_major(), self.NUM_CONSUMER_WGS,
                lse_out, tScS,
            )  # fmt: skip
        elif const_expr(self.O_DIRECT_STORE):
            store_o_direct(
                tO, mma_pv, sO, acc_O, ctid, m_block, head, rows, seqlen_q, self.TILE_M,
                self.HEAD_DIM, self.o_dtype, self.CONSUMER_THREADS, self.O_ALIAS_Q,
            )  # fmt: skip
        else:
            # sO on sQ: every WG's Q·Kᵀ must have retired; persistent: the previous store
            # must have read sO.
            store_o(
                tma_o, tO, mma_pv, sO, acc_O, ctid, warp, m_block, head, rows, self.TILE_M,
                self.HEAD_DIM, self.o_dtype, self.CONSUMER_THREADS,
                self.O_ALIAS_Q or self.PERSISTENT,
            )  # fmt: skip
