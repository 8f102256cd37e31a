"""The producer side of the fa3 backward (`bwd_kernel.Fa3Backward` mixes `BwdLoad` in): the
TMA pipelines and warp 0's loads of K and V (once) and of Q, dO, LSE and D per row block, on
one ring ("sdp_t") or on a Q / LSE ring and a dO / D ring ("dkv_t", `bwd_dkvt`)."""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync


class BwdLoad:
    """Pipelines and the producer warp's loads. Uses the kernel's TILE_M, TILE_N, HEAD_DIM,
    STAGES, DO_STAGES, DKV_T, MMA_THREADS, dtype and `row_blocks` / `row_block`."""

    def _make_pipelines(self, st, sQ_l, sK_l):
        """pipe_kv (K and V, one stage) and pipe_qdo (Q, dO, LSE, D per stage), init included;
        "dkv_t": pipe_qdo carries Q and LSE, pipe_do (DO_STAGES) dO and D (else None)."""
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # consumer_release arrives from one lane per warp: the count is MMA *warps*.
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.MMA_THREADS // 32)
        kv_bytes = 2 * cute.size_in_bytes(self.dtype, sK_l)
        q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_l, mode=[0, 1]))
        qdo_bytes = 2 * q_bytes + 2 * self.TILE_M * 4  # Q, dO, LSE and D of one row block
        if const_expr(self.DKV_T):
            qdo_bytes = q_bytes + self.TILE_M * 4  # Q and LSE
        pipe_kv = pipeline.PipelineTmaAsync.create(
            num_stages=1,
            producer_group=producer,
            consumer_group=consumers,
            tx_count=kv_bytes,
            barrier_storage=st.mbar_kv.data_ptr(),
            defer_sync=True,
        )
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            num_stages=self.STAGES,
            producer_group=producer,
            consumer_group=consumers,
            tx_count=qdo_bytes,
            barrier_storage=st.mbar_qdo.data_ptr(),
            defer_sync=True,
        )
        pipe_do = None
        if const_expr(self.DKV_T):
            pipe_do = pipeline.PipelineTmaAsync.create(
                num_stages=self.DO_STAGES,
                producer_group=producer,
                consumer_group=consumers,
                tx_count=q_bytes + self.TILE_M * 4,  # dO and D
                barrier_storage=st.mbar_do.data_ptr(),
                defer_sync=True,
            )
        pipeline.pipeline_init_arrive()
        return pipe_kv, pipe_qdo, pipe_do

    @cute.jit
    def load(
        self,
        tmas: tuple,
        smem: tuple,
        pipes: tuple,  # pipe_kv, pipe_qdo, pipe_do ("dkv_t"; else None)
        n_block: Int32,
        head_kv: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd: the column block's sequence
        group: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        win: tuple | None,  # (window_left, window_right): local builds
    ):
        """Producer warp: K and V once, then Q, dO, LSE, D of row block i = 0 .. n_iter - 1
        (query head head_kv * group + i // n_m, row block m_block_min + i % n_m); "dkv_t": Q
        and LSE into pipe_qdo, dO and D into pipe_do."""
        tma_q, tQ, tma_do, tdO, tma_k, tK, tma_v, tV, tma_lse, tLSE, tma_dsum, tDsum = tmas
        sQ, sdO, sK, sV, sLSE, sD = smem
        pipe_kv, pipe_qdo, pipe_do = pipes
        one = cute.make_layout(1)
        m_block_min, n_m, n_iter = self.row_blocks(n_block, seqlen_q, seqlen_k, group, win)
        if n_iter > 0:  # a CTA without row blocks loads nothing (no TMA in flight at exit)
            gK = cute.local_tile(
                rows.k_rows(tK, head_kv), (self.TILE_N, self.HEAD_DIM), (n_block, 0)
            )  # (TILE_N, D)
            gV = cute.local_tile(
                rows.k_rows(tV, head_kv), (self.TILE_N, self.HEAD_DIM), (n_block, 0)
            )  # (TILE_N, D)
            tKs, tKg = cpasync.tma_partition(
                tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
            )
            tVs, tVg = cpasync.tma_partition(
                tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
            )
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.producer_acquire(kv_state)
            bar = pipe_kv.producer_get_barrier(kv_state)
            cute.copy(tma_k, tKg, tKs, tma_bar_ptr=bar)
            cute.copy(tma_v, tVg, tVs, tma_bar_ptr=bar)
            if const_expr(self.PDL):  # K and V are in flight; LSE and D come from the preprocess
                cute.arch.griddepcontrol_wait()

            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.STAGES)
            do_state = state
            if const_expr(self.DKV_T):
                do_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.DO_STAGES
                )
            for i in cutlass.range(n_iter, unroll=1):
                head, m_block = self.row_block(i, m_block_min, n_m, head_kv, group)
                gQ = cute.local_tile(
                    rows.q_rows(tQ, head), (self.TILE_M, self.HEAD_DIM), (m_block, 0)
                )  # (TILE_M, D)
                gdO = cute.local_tile(
                    rows.q_rows(tdO, head), (self.TILE_M, self.HEAD_DIM), (m_block, 0)
                )  # (TILE_M, D)
                gLSE = cute.local_tile(
                    rows.stat_rows(tLSE, head), (self.TILE_M,), (m_block,)
                )  # (TILE_M,)
                gD = cute.local_tile(rows.stat_rows(tDsum, head), (self.TILE_M,), (m_block,))
                tQs, tQg = cpasync.tma_partition(
                    tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
                )  # (TMA, STAGES), (TMA,)
                tdOs, tdOg = cpasync.tma_partition(
                    tma_do, 0, one, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2)
                )
                tLs, tLg = cpasync.tma_partition(
                    tma_lse, 0, one, cute.group_modes(sLSE, 0, 1), cute.group_modes(gLSE, 0, 1)
                )
                tDs, tDg = cpasync.tma_partition(
                    tma_dsum, 0, one, cute.group_modes(sD, 0, 1), cute.group_modes(gD, 0, 1)
                )
                pipe_qdo.producer_acquire(state)
                bar = pipe_qdo.producer_get_barrier(state)
                s = state.index
                cute.copy(tma_q, tQg, tQs[None, s], tma_bar_ptr=bar)
                if const_expr(self.DKV_T):  # dO and D on their own ring
                    cute.copy(tma_lse, tLg, tLs[None, s], tma_bar_ptr=bar)
                    pipe_do.producer_acquire(do_state)
                    bar = pipe_do.producer_get_barrier(do_state)
                    s = do_state.index
                    cute.copy(tma_do, tdOg, tdOs[None, s], tma_bar_ptr=bar)
                    cute.copy(tma_dsum, tDg, tDs[None, s], tma_bar_ptr=bar)
                    do_state.advance()
                else:
                    cute.copy(tma_do, tdOg, tdOs[None, s], tma_bar_ptr=bar)
                    cute.copy(tma_lse, tLg, tLs[None, s], tma_bar_ptr=bar)
                    cute.copy(tma_dsum, tDg, tDs[None, s], tma_bar_ptr=bar)
                state.advance()
