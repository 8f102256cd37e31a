"""The fa3 forward's consumer main loop, one K/V block at a time.

`ForwardMainloop` is a base of the kernel class (`kernels.Fa3Forward`), which calls these
per-block steps from `consumer`: without intra-WG overlap `step` (QK, softmax, PV, each waited
for); with it `overlap_loop` (`first_half_block`, then `step_overlap` with QK(n) and PV(n+1) in
flight together, then `last_half_block`), and `pass_block` for a block none of a WG's rows can
see. `ctx` carries the tile's fragments, pipelines and problem (see `consumer`). P becomes
PV's A operand in `probs_to_operand`: a per-thread 16-bit convert, or for e4m3 inputs the
convert and register exchange of fp8_ops.py.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from flashsuite.fa3 import fp8_ops
from flashsuite.fa3.mask import apply_mask
from flashsuite.fa3.softmax import (
    needs_rescale,
    online_softmax,
    rescale_rows,
    speculative_softmax,
)
from flashsuite.fa3.utils import cvt_pack_16x2, gemm_pv, gemm_qk, nanosleep_zero


class ForwardMainloop:
    """Per-block steps of the consumer warpgroups (reads the kernel's static configuration)."""

    @cute.jit
    def _mask(self, ctx, n_block: Int32, scores: cute.Tensor):
        """mask.apply_mask on `scores` (ctx.acc_S, or the softmax_apart copy of it) with this
        kernel's tile and window edges."""
        apply_mask(
            scores,
            ctx.tScS,
            n_block,
            ctx.m_block,
            ctx.seqlen_k,
            ctx.shift,
            ctx.window_left,
            ctx.window_right,
            self.TILE_M,
            self.TILE_N,
            self.HAS_RIGHT,
            self.HAS_LEFT,
        )

    @cute.jit
    def scores_to_probs(
        self,
        ctx,
        n_block: Int32,
        mask: cutlass.Constexpr[bool],
        masked=None,
        probs=None,
        pv_wait_after_max: cutlass.Constexpr[bool] = False,
        exps_before_wait: cutlass.Constexpr[int] = 0,
    ):
        """Softcap, mask and online softmax of ctx.acc_S; returns the O rescale.

        `mask` (compile time) applies the mask; otherwise a runtime Boolean `masked` may. With
        `probs` (a fragment like acc_S; SOFTMAX_APART) the scores are taken out of acc_S first
        and all the rest happens there, P included, so acc_S is only read. Without it, all of
        it happens in acc_S. `pv_wait_after_max`, `exps_before_wait`: online_softmax's
        (Fa3Config.pv_wait_after_max, pv_wait_exps).
        """
        acc_S = ctx.acc_S
        scores = acc_S  # what the softmax reads: acc_S, or probs once written there
        if const_expr(probs is not None and (self.SOFTCAP or mask)):
            scores = probs
        blk = ctx.blk  # fp8 block scales (FP8_BLOCKS), else None
        row_scale = None
        if const_expr(blk is not None):
            # This block's descales of k and v (`block_descales`, loaded before S's wait): k's
            # joins each row's scale (tanh's argument with softcap, else the exp2 scale); v's
            # ratio to the previous block's joins O's rescale below.
            row_scale = (blk.row_pre[0] * blk.cur[0], blk.row_pre[1] * blk.cur[0])
        if const_expr(self.SOFTCAP and blk is not None):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                pre = row_scale[(i // 2) % 2]  # element i = 4j + 2r + c sits in row r
                scores[i] = cute.math.tanh(acc_S[i] * pre, fastmath=True)
            row_scale = None  # the exp2 scale stays the kernel's
        elif const_expr(self.SOFTCAP):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                scores[i] = cute.math.tanh(acc_S[i] * ctx.softcap_pre, fastmath=True)
        elif const_expr(probs is not None and mask):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                scores[i] = acc_S[i]
        if const_expr(masked is not None):  # noqa: SIM102 (a const_expr test stays its own `if`)
            if masked:
                self._mask(ctx, n_block, scores)
        if const_expr(mask):
            self._mask(ctx, n_block, scores)
        if const_expr(self.SPEC_EXPS and probs is not None and scores is acc_S and blk is None):
            return speculative_softmax(
                acc_S,
                ctx.row_max,
                ctx.row_sum,
                ctx.scale_log2,
                probs,
                self.EX2_EMU,
                self.RESCALE_THRESHOLD,
                self.ROW_CHAINS,
            )
        corr = online_softmax(
            scores,
            ctx.row_max,
            ctx.row_sum,
            ctx.scale_log2,
            probs,
            self.EX2_EMU,
            self.RESCALE_THRESHOLD,
            self.SKIP_UNIT_RESCALE,
            self.ROW_CHAINS,
            row_scale,
            pv_wait_after_max,
            exps_before_wait,
        )
        if const_expr(blk is not None):
            # O holds P·V in units of the previous block's descale of v (`dsv`): this block's
            # P·V comes in its own, so O's rescale gains their ratio (1 before the first
            # block, where O is 0). The row sum is of P alone and does not take it.
            ratio = blk.dsv[0] / blk.cur[1]
            blk.dsv[0] = blk.cur[1]
            corr[0], corr[1] = corr[0] * ratio, corr[1] * ratio
        return corr

    @cute.jit
    def block_descales(self, ctx, n_block: Int32):
        """FP8_BLOCKS: K/V block `n_block`'s descales of k and v into ctx.blk.cur, loaded at the
        top of the step so that their latency hides under the wait for S. One descale covers
        blk.kv_tiles consecutive K/V blocks (a block size of kv_tiles x TILE_N keys)."""
        blk = ctx.blk
        if const_expr(blk is not None):
            j = n_block // blk.kv_tiles
            blk.cur[0] = blk.mDK[blk.batch, blk.head_kv, j, 0]
            blk.cur[1] = blk.mDV[blk.batch, blk.head_kv, j, 0]

    @cute.jit
    def rescale_o(self, ctx, corr):
        """O times each row's rescale; with RESCALE_THRESHOLD or SKIP_UNIT_RESCALE only when
        some row of the warp has one other than 1.0."""
        if const_expr(self.RESCALE_THRESHOLD > 0 or self.SKIP_UNIT_RESCALE):
            if needs_rescale(corr):
                rescale_rows(ctx.acc_O, corr)
        else:
            rescale_rows(ctx.acc_O, corr)

    @cute.jit
    def probs_to_operand(self, ctx, probs=None):
        """P (fp32, in `probs` or else acc_S) -> A operand of PV (ctx.tOrP), in registers.

        16-bit: the C fragment of S and the A fragment of P have the same per-thread element
        order (m64nNk16), so this is a per-thread convert, no data moves between threads. e4m3:
        the A fragment (m64nNk32) gives a thread other keys (`fp8_ops.probs_to_operand`).
        """
        acc_S = ctx.acc_S if const_expr(probs is None) else probs
        if const_expr(self.FP8):
            fp8_ops.probs_to_operand(acc_S, ctx.tOrP, self.TILE_N, self.PERMUTE_V_KEYS)
        else:
            n = cute.size(acc_S)
            p32 = cute.make_tensor(
                cute.recast_ptr(ctx.tOrP.iterator, dtype=Int32), cute.make_layout(n // 2)
            )  # (n/2,) 32-bit view of the P fragment's registers
            bf16 = self.dtype is cutlass.BFloat16
            for j in cutlass.range_constexpr(n // 2):
                p32[j] = cvt_pack_16x2(acc_S[2 * j], acc_S[2 * j + 1], bf16)

    @cute.jit
    def step(self, ctx, kv_state, n_block: Int32, mask: cutlass.Constexpr[bool]):
        """One K/V block without intra-WG overlap: QK, softmax, PV, each waited for."""
        self.block_descales(ctx, n_block)
        ctx.pipe_k.consumer_wait(kv_state, ctx.pipe_k.consumer_try_wait(kv_state))
        gemm_qk(ctx.mma_qk, ctx.acc_S, ctx.tSrQ, ctx.tSrK, kv_state.index, self.STAGE_DESC)
        self.pingpong.arrive(ctx.cwg)  # the other WG may run its PV(n-1) and QK(n) meanwhile
        warpgroup.wait_group(0)
        ctx.pipe_k.consumer_release(kv_state)
        corr = self.scores_to_probs(ctx, n_block, mask)
        self.probs_to_operand(ctx)
        self.rescale_o(ctx, corr)
        ctx.pipe_v.consumer_wait(kv_state, ctx.pipe_v.consumer_try_wait(kv_state))
        self.pingpong.sync(ctx.cwg)  # our turn: PV(n) now, QK(n+1) right after
        gemm_pv(ctx.mma_pv, ctx.acc_O, ctx.tOrP, ctx.tOrVt, kv_state.index, None, self.STAGE_DESC)
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def overlap_loop(
        self, ctx, kv_state, n_block: Int32, i_first, n_blocks: Int32, n_masked_hi: Int32,
        n_unmasked: Int32, pipe_q: pipeline.PipelineTmaAsync, q_state: pipeline.PipelineState,
    ):  # fmt: skip
        """The intra-WG-overlap main loop over blocks n_block - i, i = i_first .. n_blocks - 1.

        One loop with a uniform runtime mask test rather than one loop per phase: S, P and O
        are carried from iteration to iteration, and with several loops ptxas gives them
        different registers in each (R227 instead of ~R180 at D=128) and then serialises the
        wgmmas for lack of registers (C7512). SPLIT_LOOPS (causal, no left window) runs the
        masked and the unmasked blocks as two loops all the same, the mask compiled into the
        first; the causal table entries at D = 64, 128 and 256 compile that way with 0 spills
        and no C75xx remark (Fa3Config.split_loops).
        """
        kv_state = self.first_half_block(ctx, kv_state, n_block - i_first)
        if const_expr(self.SPLIT_LOOPS and self.HAS_RIGHT and not self.HAS_LEFT):
            # The masked blocks, then the unmasked ones, each loop free of a mask test.
            i_mid = cutlass.max(cutlass.min(n_masked_hi, n_blocks - 1), i_first)
            for i in cutlass.range(i_first, i_mid, unroll=1):
                acc = self.o_accumulates(i, i_first)
                kv_state = self.step_overlap(ctx, kv_state, n_block - 1 - i, True, acc)
            for i in cutlass.range(i_mid, n_blocks - 1, unroll=1):
                acc = self.o_accumulates(i, i_first)
                kv_state = self.step_overlap(ctx, kv_state, n_block - 1 - i, None, acc)
            if const_expr(self.EARLY_Q_RELEASE):
                pipe_q.consumer_release(q_state)
            return self.last_half_block(ctx, kv_state, self.o_accumulates(n_blocks - 1, i_first))
        for i in cutlass.range(i_first, n_blocks - 1, unroll=1):
            masked = i < n_masked_hi
            if const_expr(
                not (self.HAS_RIGHT or self.HAS_LEFT)
                and (self.SOFTMAX_APART or not self.LOOP_MASK_TEST)
            ):
                # Only the newest block (first_half_block's) has masked keys, those past
                # seqlen_k (n_masked_hi is 0): no mask test in the loop, one softmax in it.
                masked = None
            if const_expr(self.HAS_LEFT):
                masked = masked | (i >= n_masked_hi + n_unmasked)
            acc = self.o_accumulates(i, i_first)
            kv_state = self.step_overlap(ctx, kv_state, n_block - 1 - i, masked, acc)
        if const_expr(self.EARLY_Q_RELEASE):
            # This WG's Q·Kᵀ wgmmas have all retired (wait_group(0) above): Q of the
            # next tile may land while the last P·V and the epilogue run.
            pipe_q.consumer_release(q_state)
        return self.last_half_block(ctx, kv_state, self.o_accumulates(n_blocks - 1, i_first))

    def o_accumulates(self, i, i_first):
        """Whether the P·V issued at loop position `i` adds to acc_O: None (always; acc_O was
        zeroed) without O_ZERO_INIT, else i > i_first, False for the tile's first P·V (that
        of block i_first, issued at `i_first`, or by last_half_block when the loop is empty)."""
        return (i > i_first) if const_expr(self.O_ZERO_INIT) else None

    @cute.jit
    def pass_block(self, ctx, kv_state, take_turn):
        """SKIP_MASKED_WG: the newest block, which none of this WG's rows can see.

        Its S would be all -inf and its P all 0, so the softmax state and O would not change:
        the WG only waits for and releases the K and V stages (the other WGs use them) and,
        if more blocks follow (`take_turn`), takes one empty ping-pong turn, since the
        step_overlap it replaces syncs and arrives once (the token keeps making whole rounds).
        The products stay out of the main loop (a predicated wgmma inside it makes ptxas
        serialise every wgmma: C7515).
        """
        ctx.pipe_k.consumer_wait(kv_state, ctx.pipe_k.consumer_try_wait(kv_state))
        ctx.pipe_k.consumer_release(kv_state)
        ctx.pipe_v.consumer_wait(kv_state, ctx.pipe_v.consumer_try_wait(kv_state))
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        if take_turn:
            self.pingpong.sync(ctx.cwg)
            self.pingpong.arrive(ctx.cwg)
        return kv_state

    @cute.jit
    def first_half_block(self, ctx, kv_state, n_block: Int32):
        """Intra-WG overlap prologue: S and P of the first (masked) block, no PV yet."""
        self.block_descales(ctx, n_block)
        ctx.pipe_k.consumer_wait(kv_state, ctx.pipe_k.consumer_try_wait(kv_state))
        gemm_qk(ctx.mma_qk, ctx.acc_S, ctx.tSrQ, ctx.tSrK, kv_state.index, self.STAGE_DESC)
        warpgroup.wait_group(0)
        ctx.pipe_k.consumer_release(kv_state)
        self.scores_to_probs(ctx, n_block, True)  # acc_O is still 0: nothing to rescale
        self.probs_to_operand(ctx)
        return kv_state

    @cute.jit
    def step_overlap(self, ctx, kv_state, n_block: Int32, masked, o_acc=None):
        """QK(n) and PV(previous block) in flight together; the softmax of n overlaps PV.

        `masked`: a runtime Boolean, None (no block of the loop is masked) or True (every
        block is: SPLIT_LOOPS' first loop). `o_acc`: `gemm_pv`'s accumulate (o_accumulates).
        SOFTMAX_APART: each side of its branch holds a whole `softmax_under_pv`, both waits
        included, since ptxas moves a wgmma wait that sits in another basic block than the
        wait_group(1) before it up to that block's first instructions: a softmax after the
        branch's join would run with P·V already retired (docs/design.md).
        """
        v_state = kv_state.clone()  # the previous block, whose P sits in tOrP
        kv_state.advance()
        self.block_descales(ctx, n_block)
        ctx.pipe_k.consumer_wait(kv_state, ctx.pipe_k.consumer_try_wait(kv_state))
        self.pingpong.sync(ctx.cwg)
        gemm_qk(ctx.mma_qk, ctx.acc_S, ctx.tSrQ, ctx.tSrK, kv_state.index, self.STAGE_DESC)
        if const_expr(self.RESCALE_BEFORE_PV):
            self.rescale_o(ctx, ctx.corr_prev)  # the previous block's, under Q·Kᵀ(n)
        ctx.pipe_v.consumer_wait(v_state, ctx.pipe_v.consumer_try_wait(v_state))
        gemm_pv(ctx.mma_pv, ctx.acc_O, ctx.tOrP, ctx.tOrVt, v_state.index, o_acc, self.STAGE_DESC)
        self.pingpong.arrive(ctx.cwg)
        if const_expr(self.SOFTMAX_APART):
            probs = cute.make_fragment_like(ctx.acc_S)  # P apart from S (Fa3Config says why)
            corr = cute.make_rmem_tensor((2,), Float32)
            if const_expr(masked is None or masked is True):
                self.softmax_under_pv(ctx, kv_state, n_block, masked is True, probs, corr)
            else:
                if masked:
                    self.softmax_under_pv(ctx, kv_state, n_block, True, probs, corr)
                else:
                    self.softmax_under_pv(ctx, kv_state, n_block, False, probs, corr)
        else:
            # SPEC_EXPS: P apart from S (speculative_softmax takes it again from S if need be)
            probs = cute.make_fragment_like(ctx.acc_S) if const_expr(self.SPEC_EXPS) else None
            warpgroup.wait_group(1)  # groups retire in order: S(n) is ready, PV may still run
            ctx.pipe_k.consumer_release(kv_state)
            always = masked is True  # SPLIT_LOOPS' masked loop: the mask at compile time
            corr = self.scores_to_probs(
                ctx,
                n_block,
                always,
                None if always else masked,
                probs,
                self.PV_WAIT_AFTER_MAX,
                self.PV_WAIT_EXPS,
            )  # acc_S, not tOrP / acc_O
            if const_expr(self.PIN_PV_WAIT):  # noqa: SIM102 (a const_expr test stays its own `if`)
                # A basic block ends here (Fa3Config.pin_pv_wait): the wait below cannot be
                # moved above the softmax. corr is never NaN, so the branch never runs.
                if corr[0] != corr[0]:
                    nanosleep_zero()
            if const_expr(not self.PV_WAIT_AFTER_MAX):  # else online_softmax waited
                warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(v_state)
        self.probs_to_operand(ctx, probs)  # tOrP and acc_O are free once PV has retired
        if const_expr(self.RESCALE_BEFORE_PV):
            ctx.corr_prev[0], ctx.corr_prev[1] = corr[0], corr[1]  # taken before the next P·V
        else:
            self.rescale_o(ctx, corr)
        return kv_state

    @cute.jit
    def softmax_under_pv(self, ctx, kv_state, n_block, mask: cutlass.Constexpr[bool], probs, corr):
        """step_overlap's middle: wait for S(n), release K, the softmax into `probs` (O's
        rescale into `corr`) while P·V runs, then wait for P·V."""
        warpgroup.wait_group(1)  # groups retire in order: S(n) is ready, PV may still run
        ctx.pipe_k.consumer_release(kv_state)
        c = self.scores_to_probs(ctx, n_block, mask, None, probs)  # neither tOrP nor acc_O
        corr[0], corr[1] = c[0], c[1]
        warpgroup.wait_group(0)

    @cute.jit
    def last_half_block(self, ctx, kv_state, o_acc=None):
        """Intra-WG overlap tail of the loop: PV of the last block."""
        if const_expr(self.RESCALE_BEFORE_PV):
            self.rescale_o(ctx, ctx.corr_prev)
        ctx.pipe_v.consumer_wait(kv_state, ctx.pipe_v.consumer_try_wait(kv_state))
        gemm_pv(ctx.mma_pv, ctx.acc_O, ctx.tOrP, ctx.tOrVt, kv_state.index, o_acc, self.STAGE_DESC)
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state
