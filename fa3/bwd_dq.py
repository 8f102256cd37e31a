"""How the fa3 backward's dQ reaches the float32 accumulator in global memory (the
`BwdConfig.dq_mode`, `dq_handoff` and `deterministic` mechanisms of `bwd_kernel.Fa3Backward`,
which mixes `BwdDq` in), and the named barriers of the backward's warps."""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import enum

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from flashsuite.fa3.bwd_configs import dq_tile_modes
from flashsuite.fa3.utils import (
    bulk_reduce_add_f32,
    ld_acquire_gpu_s32,
    red_release_gpu_add_s32,
    turn_pass,
    turn_wait,
)


class Barrier(enum.IntEnum):
    """Named barrier ids over the MMA threads; 0 is __syncthreads."""

    DS_FREE = 1  # every WG's dQ wgmma of the previous row block has retired: sdS may be written
    DS_READY = 2  # sdS holds this row block's dS (written and fenced by every WG)
    DQ_TURN = 5  # deterministic: the column blocks before this one have added their dQ
    DQ_ADDED = 6  # deterministic: every MMA thread has issued its dQ adds of this row block
    DQ_FULL = 7  # "warp" dq_mode: sdQ holds this row block's dQ (MMA threads arrive, writer waits)
    DQ_EMPTY = 8  # "warp" dq_mode: the writer's bulk reduce has read sdQ (writer arrives)
    # dq_handoff "wg": DQ_FULL and DQ_EMPTY per MMA warpgroup g (ids + g), 128 + 32 threads.
    DQ_FULL_WG = 9
    DQ_EMPTY_WG = 11


def dq_tile_layout(
    tile_m: int, head_dim: int, num_wgs: int, split: str = "d", one_chunk: bool = False
) -> cute.Layout:
    """(TILE_M, D) -> offset of the tiled dq_modes' fp32 tile, in smem and in each TILE_M x D
    block of the global accumulator: bwd_configs.dq_tile_modes, the dQ wgmma's fragment order.
    `one_chunk` (the sdQ of dq_handoff "turn"): every warpgroup's chunk at offset 0."""
    shape, stride = dq_tile_modes(tile_m, head_dim, num_wgs, split, one_chunk)
    return cute.make_layout(shape, stride=stride)


@dsl_user_op
def red_add_v4_f32(
    ptr: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None
) -> None:
    """gmem[ptr .. ptr + 3] += (a, b, c, d), one vectorised fp32 reduction (sm_90:
    red.global.add.v4.f32, relaxed, GPU scope); ptr 16-byte aligned."""
    llvm.inline_asm(
        None,
        [ptr.llvm_ptr, *(Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d))],
        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class BwdDq:
    """dQ of one row block into the accumulator. Uses the kernel's TILE_M, HEAD_DIM,
    MMA_THREADS and DQ_SPLIT."""

    @cute.jit
    def add_dq(
        self,
        thr_dq,
        acc_dQ: cute.Tensor,
        mdQacc: cute.Tensor,
        head: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd
        m_block: Int32,
        seqlen_q: Int32,
    ):
        """dQ of this row block added into the fp32 accumulator, one red.global.add per value;
        rows past seqlen_q are skipped."""
        gdQ = cute.local_tile(
            rows.q_out(mdQacc, head), (self.TILE_M, self.HEAD_DIM), (m_block, 0)
        )  # (TILE_M, D)
        tdQcdQ = thr_dq.partition_C(cute.make_identity_tensor((self.TILE_M, self.HEAD_DIM)))
        for i in cutlass.range_constexpr(cute.size(acc_dQ)):
            if m_block * self.TILE_M + tdQcdQ[i][0] < seqlen_q:
                ptr = gdQ.iterator + cute.crd2idx(tdQcdQ[i], gdQ.layout)
                cute.arch.atomic_add(ptr.llvm_ptr, acc_dQ[i])

    @cute.jit
    def dq_out(
        self,
        thr_dq,
        acc_dQ: cute.Tensor,
        sdQ: cute.Tensor,
        mdQacc: cute.Tensor,
        mSem: cute.Tensor | None,
        mtid: Int32,
        n_block: Int32,
        head: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd
        m_block: Int32,
        seqlen_q: Int32,
    ):
        """This row block's dQ fragment on its way to the accumulator, by the config's route."""
        if const_expr(self.DQ_WARP):
            self.stage_dq(thr_dq, acc_dQ, sdQ, mtid)
        elif const_expr(self.DQ_RED):
            self.red_dq(thr_dq, acc_dQ, mdQacc, head, rows, m_block)
        elif const_expr(self.DETERMINISTIC):  # "atomic": the MMA threads order their adds
            self.add_dq_in_order(
                thr_dq, acc_dQ, mdQacc, mSem, mtid, n_block, head, rows, m_block, seqlen_q
            )
        else:
            self.add_dq(thr_dq, acc_dQ, mdQacc, head, rows, m_block, seqlen_q)

    @cute.jit
    def red_dq(
        self,
        thr_dq,
        acc_dQ: cute.Tensor,
        mdQacc: cute.Tensor,
        head: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd
        m_block: Int32,
        col0: cutlass.Constexpr[int] = 0,
    ):
        """dq_mode "red": this thread's dQ fragment added to its row block of the tile-ordered
        accumulator, one red.global.add.v4.f32 per 4 registers. In dq_tile_modes order the
        fragment's registers 4 j .. 4 j + 3 are 16 contiguous bytes and a warp's lanes 512
        (whole 32-byte sectors); the padded rows past Nq are the accumulator's own. With
        DQ_SLICES the fragment is the slice of dQ columns [col0, col0 + D / DQ_SLICES)."""
        tile = dq_tile_layout(self.TILE_M, self.HEAD_DIM, self.NUM_MMA_WGS, self.DQ_SPLIT)
        gdq = rows.dq_tile(mdQacc, head, m_block * self.TILE_M)
        width = self.HEAD_DIM // self.DQ_SLICES
        crd = thr_dq.partition_C(cute.make_identity_tensor((self.TILE_M, width)))
        for j in cutlass.range_constexpr(cute.size(acc_dQ) // 4):
            v = [acc_dQ[4 * j + i] for i in range(4)]
            row, col = crd[4 * j]
            red_add_v4_f32(gdq + cute.crd2idx((row, col + col0), tile), *v)

    @cute.jit
    def stage_dq(self, thr_dq, acc_dQ: cute.Tensor, sdQ: cute.Tensor, mtid: Int32):
        """MMA threads, "warp" dq_mode: once the writer has read the previous tile
        (DQ_EMPTY), store this row block's dQ fragment to sdQ, fence it for the async proxy
        and hand it over (DQ_FULL); the bulk reduce then runs while the MMAs go on. With
        dq_handoff "wg" each warpgroup waits for and hands over only its own chunk; "turn"
        the same, through one chunk-sized sdQ (`write_dq_turns` orders the warpgroups)."""
        n = self.MMA_THREADS + 32
        empty, full = int(Barrier.DQ_EMPTY), int(Barrier.DQ_FULL)
        if const_expr(self.DQ_HANDOFF_WG or self.DQ_HANDOFF_TURN):
            n = 128 + 32
            wg = cute.arch.make_warp_uniform(mtid // 128)
            empty, full = int(Barrier.DQ_EMPTY_WG) + wg, int(Barrier.DQ_FULL_WG) + wg
        cute.arch.barrier(barrier_id=empty, number_of_threads=n)
        if const_expr(self.DQ_SPLIT == "dt"):  # the fragment holds dQ^T: a (D, TILE_M) view
            sdQ = cute.make_tensor(sdQ.iterator, cute.select(sdQ.layout, mode=[1, 0]))
        cute.autovec_copy(acc_dQ, thr_dq.partition_C(sdQ))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=full, number_of_threads=n)

    @cute.jit
    def write_dq(
        self,
        sdQ: cute.Tensor,
        mdQacc: cute.Tensor,
        mSem: cute.Tensor | None,
        n_block: Int32,
        head_kv: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd
        group: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        win: tuple | None,
    ):
        """Warp 1 of the producer warpgroup, "warp" dq_mode: per row block, wait for the MMA
        threads' tile (DQ_FULL), add it to its TILE_M x D block of the (B, Hq, Nq_pad, D)
        accumulator with one cp.reduce.async.bulk add.f32 (lane 0), wait until the copy has read
        sdQ and release it (DQ_EMPTY). The row blocks come in the MMA warpgroups' order
        (`row_blocks`); the first DQ_EMPTY is given before the loop, and none after the last
        tile, so every arrive meets one wait of the MMA threads.

        Deterministic builds order the adds here, off the MMA threads: lane 0 spins on the
        (batch, head, row block) turn counter until it reads n_block (ld.acquire.gpu), adds,
        waits until the add has completed (not only read sdQ), and passes the turn
        (red.release.gpu); proxy fences order the counter's generic accesses against the bulk
        copy's async-proxy writes on both sides."""
        n = self.MMA_THREADS + 32
        lane = cute.arch.lane_idx()
        m_block_min, n_m, n_iter = self.row_blocks(n_block, seqlen_q, seqlen_k, group, win)
        if const_expr(self.DQ_HANDOFF_WG):
            self.write_dq_chunks(sdQ, mdQacc, (m_block_min, n_m, n_iter), head_kv, rows, group)
        elif const_expr(self.DQ_HANDOFF_TURN):
            self.write_dq_turns(sdQ, mdQacc, (m_block_min, n_m, n_iter), head_kv, rows, group)
        elif n_iter > 0:
            cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_EMPTY), number_of_threads=n)
            for i in cutlass.range(n_iter, unroll=1):
                head, m_block = self.row_block(i, m_block_min, n_m, head_kv, group)
                cute.arch.barrier(barrier_id=int(Barrier.DQ_FULL), number_of_threads=n)
                if lane == 0:
                    if const_expr(self.DETERMINISTIC):
                        crd = (rows.batch, head, m_block)  # dense builds only
                        sem = mSem.iterator + cute.crd2idx(crd, mSem.layout)
                        seen = ld_acquire_gpu_s32(sem)
                        while seen != n_block:
                            seen = ld_acquire_gpu_s32(sem)
                        cute.arch.fence_proxy("async.global")
                    bulk_reduce_add_f32(
                        rows.dq_tile(mdQacc, head, m_block * self.TILE_M),
                        sdQ.iterator,
                        self.TILE_M * self.HEAD_DIM * 4,
                    )
                    cute.arch.cp_async_bulk_commit_group()
                    if const_expr(self.DETERMINISTIC):
                        cute.arch.cp_async_bulk_wait_group(0, read=False)
                        cute.arch.fence_proxy("async.global")
                        red_release_gpu_add_s32(sem, Int32(1))
                    else:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()
                if i < n_iter - 1:
                    cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_EMPTY), number_of_threads=n)
            if lane == 0:  # the last adds complete before the CTA exits
                cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def write_dq_chunks(
        self, sdQ: cute.Tensor, mdQacc: cute.Tensor, blocks: tuple, head_kv: Int32, rows,
        group: Int32,
    ):  # fmt: skip
        """`write_dq` with dq_handoff "wg": per row block, for each MMA warpgroup g in turn,
        wait for its chunk (DQ_FULL_WG + g) and add it (TILE_M x D / G floats, contiguous in
        sdQ and in the accumulator's block: bwd_configs.dq_tile_modes) with its own bulk
        reduce; chunk g's DQ_EMPTY_WG + g comes once that reduce has read sdQ (bulk groups
        complete in order: wait_group G - 1 - g), given at the top of the next row block. The
        first arrivals come before the loop and none after the last row block, so every
        arrive meets one wait of its warpgroup. `blocks`: `row_blocks`' (m_block_min, n_m,
        n_iter); `rows`: the column block's sequence (bwd_varlen.DenseRowsBwd / SeqRowsBwd)."""
        n, num_wgs = 128 + 32, self.NUM_MMA_WGS
        chunk = self.TILE_M * self.HEAD_DIM // num_wgs
        lane = cute.arch.lane_idx()
        m_block_min, n_m, n_iter = blocks
        if n_iter > 0:
            for g in cutlass.range_constexpr(num_wgs):
                cute.arch.barrier_arrive(
                    barrier_id=int(Barrier.DQ_EMPTY_WG) + g, number_of_threads=n
                )
            for i in cutlass.range(n_iter, unroll=1):
                head, m_block = self.row_block(i, m_block_min, n_m, head_kv, group)
                if i > 0:
                    for g in cutlass.range_constexpr(num_wgs):
                        if lane == 0:
                            cute.arch.cp_async_bulk_wait_group(num_wgs - 1 - g, read=True)
                        cute.arch.sync_warp()
                        cute.arch.barrier_arrive(
                            barrier_id=int(Barrier.DQ_EMPTY_WG) + g, number_of_threads=n
                        )
                gdq = rows.dq_tile(mdQacc, head, m_block * self.TILE_M)
                for g in cutlass.range_constexpr(num_wgs):
                    cute.arch.barrier(barrier_id=int(Barrier.DQ_FULL_WG) + g, number_of_threads=n)
                    if lane == 0:
                        bulk_reduce_add_f32(gdq + g * chunk, sdQ.iterator + g * chunk, chunk * 4)
                        cute.arch.cp_async_bulk_commit_group()
                    cute.arch.sync_warp()
            if lane == 0:  # the last adds complete before the CTA exits
                cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def write_dq_turns(
        self, sdQ: cute.Tensor, mdQacc: cute.Tensor, blocks: tuple, head_kv: Int32, rows,
        group: Int32,
    ):  # fmt: skip
        """`write_dq` with dq_handoff "turn": sdQ holds one warpgroup's chunk (TILE_M x D / G
        floats). Per row block, for each MMA warpgroup g in turn: once the previous bulk reduce
        has read sdQ, give it to g (DQ_EMPTY_WG + g), wait for g's chunk (DQ_FULL_WG + g) and
        add it to chunk g of the accumulator's block with one bulk reduce. Each arrive meets
        one wait of its warpgroup in the same row block, so none is left over at the end.
        `blocks`: `row_blocks`' (m_block_min, n_m, n_iter); `rows`: the column block's
        sequence (bwd_varlen.DenseRowsBwd / SeqRowsBwd)."""
        n, num_wgs = 128 + 32, self.NUM_MMA_WGS
        chunk = self.TILE_M * self.HEAD_DIM // num_wgs
        lane = cute.arch.lane_idx()
        m_block_min, n_m, n_iter = blocks
        for i in cutlass.range(n_iter, unroll=1):
            head, m_block = self.row_block(i, m_block_min, n_m, head_kv, group)
            gdq = rows.dq_tile(mdQacc, head, m_block * self.TILE_M)
            for g in cutlass.range_constexpr(num_wgs):
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()
                cute.arch.barrier_arrive(
                    barrier_id=int(Barrier.DQ_EMPTY_WG) + g, number_of_threads=n
                )
                cute.arch.barrier(barrier_id=int(Barrier.DQ_FULL_WG) + g, number_of_threads=n)
                if lane == 0:
                    bulk_reduce_add_f32(gdq + g * chunk, sdQ.iterator, chunk * 4)
                    cute.arch.cp_async_bulk_commit_group()
                cute.arch.sync_warp()
        if lane == 0:  # the last adds complete before the CTA exits
            cute.arch.cp_async_bulk_wait_group(0, read=False)

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
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd
        m_block: Int32,
        seqlen_q: Int32,
    ):
        """`add_dq` in n_block order (docs/design.md, "Deterministic dQ"): wait until the
        (batch, head, m_block) counter reads n_block, add, then increment it. The column blocks
        that see a row block are consecutive n_blocks from the one the host starts its counter
        at (`bwd_host.turn_counters`), and a CTA only waits on lower n_blocks of its own (kv
        head, batch), which the grid launches before it."""
        sem = rows.turn_counter(mSem, head, m_block, self.TILE_M)
        turn_wait(sem, n_block, mtid, int(Barrier.DQ_TURN), self.MMA_THREADS)
        self.add_dq(thr_dq, acc_dQ, mdQacc, head, rows, m_block, seqlen_q)
        turn_pass(sem, mtid, int(Barrier.DQ_ADDED), self.MMA_THREADS)
