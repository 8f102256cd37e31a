"""The "sdp_t" layout of the fa3 backward (`BwdConfig.layout`), for D = 64, 96 and 128: the MMA
warpgroups' loop over the row blocks of their column block (`bwd_kernel.Fa3Backward` mixes
`BwdSdpT` in; its module docstring walks through the five GEMMs, the barriers and the masking).
S^T and dP^T put the key rows on wgmma's M axis, so P^T and dS^T stay in registers as the A
operands of dV and dK; dS^T also goes to sdS for dQ, which leaves through `bwd_dq.BwdDq`.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from flashsuite.fa3.bwd_dq import Barrier


class BwdSdpT:
    """The "sdp_t" MMA loop of one CTA's MMA warpgroups."""

    @cute.jit
    def mma(
        self,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        smem: tuple,
        pipes: tuple,  # pipe_kv, pipe_qdo (and pipe_do, None here)
        mdQacc: cute.Tensor,
        dkv_out: tuple,  # mdK, mdV (Nk, D, Hkv, B); DKV_TMA: the dK / dV TMA stores
        mtid: Int32,  # 0 .. MMA_THREADS - 1
        n_block: Int32,
        head_kv: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd: the column block's sequence
        group: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        scale_log2: Float32,
        scale: Float32,
        mSem: cute.Tensor | None,
        softcap_pre: Float32 | None,
        win: tuple | None,
    ):
        """MMA warpgroups: the five GEMMs of every row block, dQ added to gmem, then dK, dV."""
        sQ, sdO, sK, sV, _, sdS, sLSE, sD, sdQ = smem  # no sP in "sdp_t"
        pipe_kv, pipe_qdo, _ = pipes
        m_block_min, n_m, n_iter = self.row_blocks(n_block, seqlen_q, seqlen_k, group, win)
        D, TM, TN, ST = self.HEAD_DIM, self.TILE_M, self.TILE_N, self.STAGES
        thr_sdp = mma_sdp.get_slice(mtid)
        thr_dkv = mma_dkv.get_slice(mtid)
        thr_dq = mma_dq.get_slice(mtid)
        # The shared-memory operands' descriptors depend on the thread only through its
        # warpgroup. WG_SLICE: partition them with the slice of the warpgroup's first thread,
        # its index made warp-uniform, so the descriptors are uniform-register values;
        # otherwise with the thread's own slice (mtid lives in a vector register), and ptxas
        # rebuilds every descriptor per wgmma in vector registers and moves it across (R2UR).
        wg_sdp, wg_dkv, wg_dq = thr_sdp, thr_dkv, thr_dq
        if const_expr(self.WG_SLICE):
            wg_first = cute.arch.make_warp_uniform(mtid // 128) * 128
            wg_sdp = mma_sdp.get_slice(wg_first)
            wg_dkv = mma_dkv.get_slice(wg_first)
            wg_dq = mma_dq.get_slice(wg_first)
        # S^T = K Q^T and dP^T = V dO^T.
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))  # (MMA, 1, D/16)
        tSrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))  # (MMA, 1, D/16)
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))  # (MMA, 1, D/16, STAGES)
        tSrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))  # (MMA, 1, D/16, STAGES)
        acc_S = thr_sdp.make_fragment_C(
            thr_sdp.partition_shape_C((TN, TM))
        )  # ((2, 2, TILE_M/8), 1, 1) fp32: 2 key rows per thread
        acc_dP = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((TN, TM)))
        # dV += P^T dO and dK += dS^T Q: B is dO / Q as a (D, TILE_M) MN-major view.
        sdOt = self._transposed(sdO, TM, D, ST)  # (D, TILE_M, STAGES)
        sQt = self._transposed(sQ, TM, D, ST)  # (D, TILE_M, STAGES)
        tdVrdO = wg_dkv.make_fragment_B(wg_dkv.partition_B(sdOt))  # (MMA, 1, TILE_M/16, ST)
        tdKrQ = wg_dkv.make_fragment_B(wg_dkv.partition_B(sQt))  # (MMA, 1, TILE_M/16, ST)
        tdVrP = thr_dkv.make_fragment_A(thr_dkv.partition_shape_A((TN, TM)))  # 16-bit P^T
        tdKrdS = thr_dkv.make_fragment_A(thr_dkv.partition_shape_A((TN, TM)))  # 16-bit dS^T
        acc_dV = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((TN, D)))  # ((2,2,D/8),1,1)
        acc_dK = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((TN, D)))
        # dQ = dS K: A = sdS (TILE_M, TILE_N), B = K as a (D, TILE_N) MN-major view; dq_split
        # "dt": dQ^T = K^T dS^T, the same two operands in the other places.
        sKt = self._transposed(sK, TN, D)  # (D, TILE_N)
        if const_expr(self.DQ_SPLIT == "dt"):
            tdQrK = wg_dq.make_fragment_A(wg_dq.partition_A(sKt))  # (MMA, 1, TILE_N/16)
            tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))  # (.., TILE_N/16, DS_ST)
            acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((D, TM)))  # dQ^T
        else:
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))  # (.., TILE_N/16, DS_ST)
            tdQrK = wg_dq.make_fragment_B(wg_dq.partition_B(sKt))  # (MMA, 1, TILE_N/16)
            acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((TM, D)))
        # The elementwise code indexes acc_S as i = c + 2r + 4j (m64nNk16 C layout, one MMA
        # tile per warpgroup) and relies on the C fragment of S^T having the element order of
        # the A fragment of dV/dK: check the shapes those rest on.
        assert cute.size(acc_S, mode=[1]) == 1 and cute.size(acc_S, mode=[2]) == 1
        assert cute.size(acc_S) == TM // 2 and cute.size(acc_dV) == D // 2
        assert cute.size(tdVrP) == cute.size(acc_S)
        tScS = thr_sdp.partition_C(cute.make_identity_tensor((TN, TM)))  # (key, row) coords
        sdSt = self._transposed(sdS, TM, TN, self.DS_STAGES)  # (TILE_N, TILE_M, DS_ST): dS^T
        rdS = cute.make_tensor(tdKrdS.iterator, acc_S.layout)  # tdKrdS in acc_S's shape
        if const_expr(self.DS_STMATRIX):
            # stmatrix.trans: the fragment's register pairs run along query rows, sdS rows
            # along keys; each 8x8 matrix row is 16 contiguous bytes of sdS (swizzle-safe).
            ds_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
            )
            ds_copy = cute.make_tiled_copy_C(ds_atom, mma_sdp)
            thr_ds = ds_copy.get_slice(mtid)
            tSsdS = thr_ds.partition_D(sdSt)  # where this thread's stmatrix rows go
            tSrdS = thr_ds.retile(rdS)
        else:
            ds_copy = None
            tSsdS = thr_sdp.partition_C(sdSt)  # where this thread's dS^T elements go
            tSrdS = rdS
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)

        if n_iter > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_kv.consumer_wait(kv_state)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ST)
            shift = seqlen_k - seqlen_q
            # Which row blocks need the per-element mask (key tail, causal / window edges).
            edges = self.key_edges(n_block, seqlen_k, shift, win)
            for i in cutlass.range(n_iter, unroll=1):
                head, m_block = self.row_block(i, m_block_min, n_m, head_kv, group)
                masked = self.block_masked(m_block, n_block, shift, edges, win)
                s = state.index
                ds_i = 0  # the sdS buffer of this row block
                if const_expr(self.DS_STAGES > 1):
                    ds_i = i % self.DS_STAGES
                pipe_qdo.consumer_wait(state, pipe_qdo.consumer_try_wait(state))
                lse_i, d_i = sLSE, sD  # STATS_REGS: this thread's rows, loaded under the GEMMs
                if const_expr(self.LSE_REGS and not self.STATS_REGS):
                    lse_i = self.load_rows(sLSE, tScS, s, True)
                self.gemm_ss(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, s], False)
                if const_expr(self.STATS_REGS):
                    lse_i = self.load_rows(sLSE, tScS, s, True)
                if const_expr(self.STATS_SHFL):
                    lse_i = self.load_shfl(sLSE, s, True)
                self.gemm_ss(mma_sdp, acc_dP, tSrV, tSrdO[None, None, None, s], False)
                if const_expr(self.STATS_REGS):
                    d_i = self.load_rows(sD, tScS, s, False)
                probs_args = (tScS, lse_i, s, masked, n_block, m_block, seqlen_k, shift,
                              scale_log2, win)  # fmt: skip
                if const_expr(self.DV_EARLY):
                    # S^T retired: P^T, then dV on it while dP^T's wgmma still runs; dS^T
                    # once dP^T retires, under dV's wgmma (tdVrP is its register operand
                    # until the wait_group after dK: not touched before).
                    warpgroup.wait_group(1)
                    self.probs(acc_S, *probs_args, None, softcap_pre)
                    self.pack(acc_S, tdVrP)
                    self.gemm_rs(mma_dkv, acc_dV, tdVrP, tdVrdO[None, None, None, s])
                    warpgroup.wait_group(1)
                    self.dscores(acc_S, acc_dP, tScS, d_i, s, scale)
                    self.pack(acc_dP, tdKrdS)
                else:
                    self.probs_and_dscores(acc_S, acc_dP, probs_args, d_i, scale, softcap_pre,
                                           tdVrP, tdKrdS)  # fmt: skip
                # dS^T -> sdS once every WG's dQ wgmma that read this buffer has retired, and
                # before the dK wgmma takes tdKrdS: a wgmma's register operands may not be
                # touched (read included) until a wait_group has retired it. With two sdS
                # buffers the DS_READY barrier of the previous row block already ordered it (every
                # WG had retired the dQ wgmma of the block before that).
                if const_expr(self.DS_STAGES == 1):
                    cute.arch.barrier(
                        barrier_id=int(Barrier.DS_FREE), number_of_threads=self.MMA_THREADS
                    )
                if const_expr(self.DS_STMATRIX):
                    cute.copy(ds_copy, tSrdS, tSsdS[None, None, None, ds_i])
                else:
                    cute.autovec_copy(tSrdS, tSsdS[None, None, None, ds_i])
                if const_expr(self.DV_BEFORE_FENCE):  # dV reads no sdS: issued first
                    self.gemm_rs(mma_dkv, acc_dV, tdVrP, tdVrdO[None, None, None, s])
                # Generic-proxy smem writes must be visible to the wgmma (async proxy) reads.
                cute.arch.fence_proxy("async.shared", space="cta")
                if const_expr(self.OVERLAP):
                    if const_expr(not (self.DV_EARLY or self.DV_BEFORE_FENCE)):
                        self.gemm_rs(mma_dkv, acc_dV, tdVrP, tdVrdO[None, None, None, s])
                    cute.arch.barrier(
                        barrier_id=int(Barrier.DS_READY), number_of_threads=self.MMA_THREADS
                    )
                    self.gemm_dq(mma_dq, acc_dQ, tdQrdS[None, None, None, ds_i], tdQrK)
                    self.gemm_rs(mma_dkv, acc_dK, tdKrdS, tdKrQ[None, None, None, s])
                    warpgroup.wait_group(1)  # dV and dQ retired; dK runs on
                    self.dq_out(thr_dq, acc_dQ, sdQ, mdQacc, mSem, mtid, n_block, head, rows,
                                m_block, seqlen_q)  # fmt: skip
                    warpgroup.wait_group(0)  # dK retired: the sQ / sdO stage is read
                    pipe_qdo.consumer_release(state)
                else:
                    self.gemm_rs(mma_dkv, acc_dV, tdVrP, tdVrdO[None, None, None, s])
                    self.gemm_rs(mma_dkv, acc_dK, tdKrdS, tdKrQ[None, None, None, s])
                    cute.arch.barrier(
                        barrier_id=int(Barrier.DS_READY), number_of_threads=self.MMA_THREADS
                    )
                    self.gemm_dq(mma_dq, acc_dQ, tdQrdS[None, None, None, ds_i], tdQrK)
                    # dV, dK and dQ retired: the sQ / sdO stage and sdS are read.
                    warpgroup.wait_group(0)
                    pipe_qdo.consumer_release(state)
                    self.dq_out(thr_dq, acc_dQ, sdQ, mdQacc, mSem, mtid, n_block, head, rows,
                                m_block, seqlen_q)  # fmt: skip
                state.advance()
        if const_expr(self.DKV_TMA):  # dkv_out: the dK and dV TMA stores
            self.store_dkv_tma(thr_dkv, acc_dK, acc_dV, sK, sV, dkv_out, mtid, n_block, head_kv,
                               rows, False, scale)  # fmt: skip
        else:
            mdK, mdV = dkv_out
            self.store_dkv(
                thr_dkv, acc_dK, acc_dV, mdK, mdV, n_block, head_kv, rows, seqlen_k, scale
            )
