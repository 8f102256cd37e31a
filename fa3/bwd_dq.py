"""How the fa3 backward's dQ reaches the float32 accumulator in global memory (the
`BwdConfig.dq_mode`, `dq_handoff` and `deterministic` mechanisms of `bwd_kernel.Fa3Backward`,
which mixes `BwdDq` in), how `dq_convert` turns the accumulator into dQ inside the kernel, and
the named barriers of the backward's warps."""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import enum

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from flashsuite.fa3.bwd_configs import dq_tile_modes
from flashsuite.fa3.utils import (
    atom_add_acq_rel_gpu_s32,
    bulk_reduce_add_f32,
    ld_acquire_cta_shared_s32,
    ld_acquire_gpu_s32,
    ld_cg_v4_f32_at,
    nanosleep,
    opaque_tid_x,
    red_release_gpu_add_s32,
    st_global_16_at,
    st_release_cta_shared_s32,
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
    # dq_convert: the writer has reported the last row block (MMA threads wait, writer arrives).
    DQ_REPORTED = 13
    DQ_CONVERTERS = 14  # dq_convert: producer warps 2 and 3 are done with a queued row block


# dq_convert: the row blocks the writer queues for the converter warps (shared-memory ring).
DQ_RING = 4
# The queue's words after the ring: how many row blocks were queued, how many converted, and
# whether the writer is done queueing.
QUEUED, CONVERTED, DONE = 0, 1, 2


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
        dq_conv: tuple | None = None,  # dq_convert: cta's dq_conv_s (bwd_kernel)
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
        blocks = (m_block_min, n_m, n_iter)
        counts = None  # dq_convert: what `report_dq` needs to count a row block's adds
        if const_expr(self.DQ_CONVERT):
            counts = (dq_conv, (seqlen_k + self.TILE_N - 1) // self.TILE_N, seqlen_k - seqlen_q)
        if const_expr(self.DQ_HANDOFF_WG):
            self.write_dq_chunks(sdQ, mdQacc, blocks, head_kv, rows, group, counts)
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
                if const_expr(counts is not None):  # noqa: SIM102 (trace time, then runtime)
                    if i > 0:  # row block i - 1's group: all but this row block's one
                        self.report_dq(counts, i - 1, 1, blocks, head_kv, rows, group)
            if lane == 0:  # the last adds complete before the CTA exits
                cute.arch.cp_async_bulk_wait_group(0, read=False)
            if const_expr(counts is not None):
                self.finish_reports(counts, blocks, head_kv, rows, group)

    @cute.jit
    def write_dq_chunks(
        self, sdQ: cute.Tensor, mdQacc: cute.Tensor, blocks: tuple, head_kv: Int32, rows,
        group: Int32, counts: tuple | None = None,
    ):  # fmt: skip
        """`write_dq` with dq_handoff "wg": per row block, for each MMA warpgroup g in turn,
        wait for its chunk (DQ_FULL_WG + g) and add it (TILE_M x D / G floats, contiguous in
        sdQ and in the accumulator's block: bwd_configs.dq_tile_modes) with its own bulk
        reduce; chunk g's DQ_EMPTY_WG + g comes once that reduce has read sdQ (bulk groups
        complete in order: wait_group G - 1 - g), given at the top of the next row block. The
        first arrivals come before the loop and none after the last row block, so every
        arrive meets one wait of its warpgroup. `blocks`: `row_blocks`' (m_block_min, n_m,
        n_iter); `rows`: the column block's sequence (bwd_varlen.DenseRowsBwd / SeqRowsBwd).

        dq_convert (`counts` = (dq_conv, n_blocks, shift)): once row block i's
        chunks are issued, row block i - 1's adds are waited for and counted (`report_dq`);
        after the loop the last one's, then DQ_REPORTED."""
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
                if const_expr(counts is not None):  # noqa: SIM102 (trace time, then runtime)
                    if i > 0:  # row block i - 1's groups: all but this row block's num_wgs
                        self.report_dq(counts, i - 1, num_wgs, blocks, head_kv, rows, group)
            if lane == 0:  # the last adds complete before the CTA exits
                cute.arch.cp_async_bulk_wait_group(0, read=False)
            if const_expr(counts is not None):
                self.finish_reports(counts, blocks, head_kv, rows, group)

    @cute.jit
    def finish_reports(self, counts: tuple, blocks: tuple, head_kv: Int32, rows, group: Int32):
        """dq_convert, writer warp after its loop (every add complete): report the last row
        block, tell the converter warps that nothing more comes (DONE) and the MMA threads
        that both slots are written (DQ_REPORTED)."""
        _, n_m, _ = blocks
        # n_m * group - 1 (= n_iter - 1) from values the loop keeps: in the writer's 24
        # registers n_iter itself would be spilled across the loop.
        self.report_dq(counts, n_m * group - 1, -1, blocks, head_kv, rows, group)
        if cute.arch.lane_idx() == 0:
            st_release_cta_shared_s32(counts[0][5].iterator + DONE, Int32(1))
        cute.arch.barrier_arrive(
            barrier_id=int(Barrier.DQ_REPORTED), number_of_threads=self.MMA_THREADS + 32
        )

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
    def report_dq(
        self, counts: tuple, j: Int32, pending: cutlass.Constexpr[int], blocks: tuple,
        head_kv: Int32, rows, group: Int32,
    ):  # fmt: skip
        """dq_convert, writer warp: once row block j's bulk adds are complete (wait_group
        `pending`, not only read; -1: already waited for), count them into the (batch, head,
        row block) counter (atom.acq_rel.gpu, after a proxy fence for the async-proxy writes).
        If that made every column block that visits the row block (`dq_adds`) done, this CTA
        converts it: all but the last two row blocks go into the converter warps' ring (head
        and row block packed in one word; the writer waits while the ring is full) and are
        published by a release of the queued count; the last two go to slot j % 2 (j, or -1
        when another CTA converts), which the MMA threads read after DQ_REPORTED."""
        (_, mCount, slots, _, ring, queue), n_blocks, shift = counts
        m_block_min, n_m, _ = blocks
        if cute.arch.lane_idx() == 0:
            if const_expr(pending >= 0):
                cute.arch.cp_async_bulk_wait_group(pending, read=False)
            cute.arch.fence_proxy("async.global")
            head, m_block = self.row_block(j, m_block_min, n_m, head_kv, group)
            ptr = mCount.iterator + cute.crd2idx((rows.batch, head, m_block), mCount.layout)
            old = atom_add_acq_rel_gpu_s32(ptr, Int32(1))
            last = old == self.dq_adds(m_block, n_blocks, shift) - 1
            if j < n_m * group - 2:  # to the converter warps, through the ring
                if last:
                    queued = ld_acquire_cta_shared_s32(queue.iterator + QUEUED)
                    while queued - ld_acquire_cta_shared_s32(queue.iterator + CONVERTED) >= DQ_RING:
                        nanosleep(128)  # the ring is full: its oldest row block is not done
                    # head < 2^15 and m_block < 2^16: the host's limits for dq_convert
                    ring[queued % DQ_RING] = head * 65536 + m_block
                    st_release_cta_shared_s32(queue.iterator + QUEUED, queued + 1)
            else:  # the last two: to the MMA threads after their loop
                slots[j % 2] = j if last else Int32(-1)
        cute.arch.sync_warp()

    @cute.jit
    def dq_adds(self, m_block: Int32, n_blocks: Int32, shift: Int32) -> Int32:
        """How many column blocks add into row block m_block of a head: all of them, or
        (causal, shift = Nk - Nq >= 0) those n with n TILE_N - shift < (m_block + 1) TILE_M,
        the blocks whose first visible row (`row_blocks`) is in or before it."""
        adds = n_blocks
        if const_expr(self.CAUSAL):
            reach = (m_block + 1) * self.TILE_M + shift
            adds = cutlass.min(n_blocks, (reach + self.TILE_N - 1) // self.TILE_N)
        return adds

    @cute.jit
    def dq_addresses(self, dq_conv: tuple, mdQacc: cute.Tensor, rows):
        """dq_convert, one MMA thread before the row-block loop: what `convert_dq` addresses
        by, as 64-bit byte values in shared memory (the dq_addr words): dQ[batch, 0, 0, 0], its
        row and head strides, the accumulator's [batch, 0, 0, 0] and its head stride. Read
        back where a conversion runs, so the loop keeps none of them in registers."""
        mdQ, addr = dq_conv[0], dq_conv[3]
        b = rows.batch
        esize = self.dtype.width // 8
        q0 = cute.crd2idx((0, 0, 0, b), mdQ.layout)  # mdQ is (Nq, D, Hq, B)
        addr[0] = (mdQ.iterator + q0).toint()
        addr[1] = Int64(cute.crd2idx((1, 0, 0, b), mdQ.layout) - q0) * esize
        addr[2] = Int64(cute.crd2idx((0, 0, 1, b), mdQ.layout) - q0) * esize
        a0 = cute.crd2idx((b, 0, 0, 0), mdQacc.layout)  # (B, Hq, Nq_pad, D)
        addr[3] = (mdQacc.iterator + a0).toint()
        addr[4] = Int64(cute.crd2idx((b, 1, 0, 0), mdQacc.layout) - a0) * 4

    @cute.jit
    def convert_queue(
        self, dq_conv: tuple, n_block: Int32, head_kv: Int32, rows, group: Int32,
        seqlen_q: Int32, seqlen_k: Int32, win: tuple | None, scale: Float32,
    ):  # fmt: skip
        """dq_convert, producer warps 2 and 3 (otherwise idle): convert the row blocks the
        writer queues (`report_dq`: every row block but the last two, whose count this CTA
        completed), in queue order, while the MMA warpgroups run on. Poll the queue (acquire
        at CTA scope, nanosleep between polls), convert the next row block with the 64 threads
        (`convert_rows`), meet at DQ_CONVERTERS, count it converted (release); stop once the
        writer is done and nothing is left."""
        _, _, n_iter = self.row_blocks(n_block, seqlen_q, seqlen_k, group, win)
        _, _, _, addr, ring, queue = dq_conv
        tid = cute.arch.thread_idx()[0] - 64  # 0 .. 63
        if n_iter > 2:  # the last two row blocks never go through the queue
            k = Int32(0)
            go = cutlass.Boolean(True)
            while go:
                done = ld_acquire_cta_shared_s32(queue.iterator + DONE)  # before QUEUED: then
                queued = ld_acquire_cta_shared_s32(queue.iterator + QUEUED)  # QUEUED is final
                if queued > k:
                    entry = ring[k % DQ_RING]  # head * 2^16 + m_block
                    self.convert_rows(addr, entry >> 16, entry & 0xFFFF, seqlen_q, scale, tid, 64)
                    cute.arch.barrier(barrier_id=int(Barrier.DQ_CONVERTERS), number_of_threads=64)
                    k = k + 1
                    if tid == 0:
                        st_release_cta_shared_s32(queue.iterator + CONVERTED, k)
                elif done == 1:
                    go = cutlass.Boolean(False)
                else:
                    nanosleep(256)

    @cute.jit
    def conversion_bases(self, addr: cute.Tensor, head: Int32, m_block: Int32) -> tuple:
        """(row0, dQ's byte address of (row0, column 0), dQ's row stride in bytes, the
        accumulator tile's byte address) of row block m_block of `head`, from `dq_addresses`'
        words; row0 = m_block * TILE_M."""
        dq_row = addr[1]
        row0 = m_block * self.TILE_M
        dq_base = addr[0] + Int64(head) * addr[2] + Int64(row0) * dq_row
        tile_base = addr[3] + Int64(head) * addr[4] + Int64(row0) * (self.HEAD_DIM * 4)
        return row0, dq_base, dq_row, tile_base

    @cute.jit
    def store_dq(
        self, v: Float32, row: Int32, col: Int32, base: tuple, seqlen_q: Int32, scale: Float32
    ):
        """One dQ value of a converted row block to dQ[row0 + row, col] in the input dtype
        (times the softmax scale with SCALE_OUT), unless that row is past seqlen_q; `base`:
        `conversion_bases`' (row0, dQ address, row stride)."""
        row0, dq_base, dq_row = base
        if const_expr(self.SCALE_OUT):
            v = v * scale
        if row0 + row < seqlen_q:
            addr = dq_base + Int64(row) * dq_row + col * (self.dtype.width // 8)
            st_global_16_at(addr, v, self.dtype is cutlass.BFloat16)

    @cute.jit
    def convert_rows(
        self, addr: cute.Tensor, head: Int32, m_block: Int32, seqlen_q: Int32, scale: Float32,
        tid: Int32, threads: cutlass.Constexpr[int],
    ):  # fmt: skip
        """`convert_dq` for threads that hold no dQ fragment: the row block's TILE_M * D floats
        in 16-byte chunks, chunk c to thread c % threads (a warp reads 512 contiguous bytes), each
        float's (row, column) from the tile layout's inverse (row + TILE_M * column),
        CONVERT_INFLIGHT chunks in flight at a time (what the producer warpgroup's 24 registers
        hold without spilling: two at 64 and 80 rows, where four spill 92-188 bytes; one at
        128 rows)."""
        tile = dq_tile_layout(self.TILE_M, self.HEAD_DIM, self.NUM_MMA_WGS, self.DQ_SPLIT)
        inv = cute.right_inverse(tile)  # tile offset -> row + TILE_M * column
        row0, dq_base, dq_row, tile_base = self.conversion_bases(addr, head, m_block)
        inflight = self.CONVERT_INFLIGHT  # chunks loaded before the first of their stores
        for i in cutlass.range(self.TILE_M * self.HEAD_DIM // 4 // threads // inflight, unroll=1):
            xs = [
                ld_cg_v4_f32_at(tile_base + Int64(tid + (inflight * i + u) * threads) * 16)
                for u in range(inflight)
            ]
            for u in cutlass.range_constexpr(inflight):
                c = tid + (inflight * i + u) * threads
                for e in cutlass.range_constexpr(4):
                    idx = cute.crd2idx(4 * c + e, inv)
                    row, col = idx % self.TILE_M, idx // self.TILE_M
                    self.store_dq(xs[u][e], row, col, (row0, dq_base, dq_row), seqlen_q, scale)

    @cute.jit
    def convert_reported(
        self, mma_dq: cute.TiledMma, dq_conv: tuple, j: Int32, blocks: tuple, head_kv: Int32,
        group: Int32, seqlen_q: Int32, scale: Float32,
    ):  # fmt: skip
        """dq_convert, MMA threads: if the writer reported row block j as this CTA's to convert
        (slot j % 2 holds j), convert it (`convert_dq`)."""
        slots = dq_conv[2]
        if slots[j % 2] == j:
            m_block_min, n_m, _ = blocks
            head, m_block = self.row_block(j, m_block_min, n_m, head_kv, group)
            self.convert_dq(mma_dq, dq_conv[3], head, m_block, seqlen_q, scale)

    @cute.jit
    def convert_dq(
        self, mma_dq: cute.TiledMma, addr: cute.Tensor, head: Int32, m_block: Int32,
        seqlen_q: Int32, scale: Float32,
    ):  # fmt: skip
        """One row block of the float32 accumulator, every column block's adds complete, to dQ
        (B, Nq, Hq, D) in the input dtype (times the softmax scale with SCALE_OUT): each MMA
        thread reads back the places its own dQ fragment was added to (dq_tile_layout: 16
        contiguous bytes per 4 registers, through L2, since other SMs added them), CONVERT_TRIPS
        batches of loads each issued before its first store, and stores each value to its
        (row, column) with one 16-bit store, rows past seqlen_q skipped. Addresses come from
        `dq_addresses`' words and the thread index is read afresh (`opaque_tid_x`), so the
        row-block loop around this rarely taken branch keeps none of it in registers."""
        thr_dq = mma_dq.get_slice(opaque_tid_x() - 128)  # the MMA threads are 128 and up
        tile = dq_tile_layout(self.TILE_M, self.HEAD_DIM, self.NUM_MMA_WGS, self.DQ_SPLIT)
        if const_expr(self.DQ_SPLIT == "dt"):  # the fragment holds dQ^T: (column, row) pairs
            crd = thr_dq.partition_C(cute.make_identity_tensor((self.HEAD_DIM, self.TILE_M)))
        else:
            crd = thr_dq.partition_C(cute.make_identity_tensor((self.TILE_M, self.HEAD_DIM)))
        row0, dq_base, dq_row, tile_base = self.conversion_bases(addr, head, m_block)
        per_trip = cute.size(crd) // 4 // self.CONVERT_TRIPS
        for t in cutlass.range_constexpr(self.CONVERT_TRIPS):
            coords = []  # per 16-byte group, the (row, column) of its four values
            loaded = []
            for q in cutlass.range_constexpr(t * per_trip, (t + 1) * per_trip):
                quad = []
                for k in cutlass.range_constexpr(4):
                    a, b = crd[4 * q + k]
                    quad.append((b, a) if const_expr(self.DQ_SPLIT == "dt") else (a, b))
                coords.append(quad)
                offset = cute.crd2idx(quad[0], tile) * 4
                loaded.append(ld_cg_v4_f32_at(tile_base + offset))
            for q in cutlass.range_constexpr(per_trip):
                for k in cutlass.range_constexpr(4):
                    row, col = coords[q][k]
                    self.store_dq(loaded[q][k], row, col, (row0, dq_base, dq_row), seqlen_q, scale)

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
