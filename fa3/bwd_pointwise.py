"""The per-row-block steps of the fa3 backward's MMA warpgroups that are not the loop itself:
issuing the wgmmas, the elementwise P^T and dS^T, packing fp32 fragments to 16-bit operands and
the dK / dV epilogues (`bwd_kernel.Fa3Backward` mixes `BwdSteps` in). Uses the kernel's TILE_M,
TILE_N, HEAD_DIM, MMA_THREADS, dtype, CAUSAL, LOCAL, SOFTCAP, OVERLAP, SCALE_OUT, STATS_REGS,
LSE_REGS, STATS_SHFL and DQ_SPLIT."""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from flashsuite.fa3.bwd_dq import Barrier
from flashsuite.fa3.epilogue import tma_store
from flashsuite.fa3.utils import cvt_pack_16x2


class BwdSteps:
    """GEMM issue, elementwise and epilogue steps of one MMA warpgroup."""

    @cute.jit
    def gemm_ss(self, tiled: cute.TiledMma, acc, tA, tB, accumulate: cutlass.Constexpr[bool]):
        """Issue acc (+)= A·B (both operands from smem descriptors) and commit."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled.op)
        atom.set(warpgroup.Field.ACCUMULATE, accumulate)
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def gemm_dq(self, tiled: cute.TiledMma, acc, tdS, tK):
        """Issue dQ = dS K, or dQ^T = K^T dS^T (DQ_SPLIT "dt"): `tdS` and `tK` are sdS's and
        sK's fragments in whichever operand places the dQ MMA gave them."""
        if const_expr(self.DQ_SPLIT == "dt"):
            self.gemm_ss(tiled, acc, tK, tdS, False)
        else:
            self.gemm_ss(tiled, acc, tdS, tK, False)

    @cute.jit
    def gemm_rs(self, tiled: cute.TiledMma, acc, tA, tB):
        """Issue acc += A·B (A from registers) and commit."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        warpgroup.commit_group()

    @cute.jit
    def probs(
        self,
        acc_S: cute.Tensor,
        tScS: cute.Tensor,
        sLSE: cute.Tensor,
        stage: Int32,
        masked,
        n_block: Int32,
        m_block: Int32,
        seqlen_k: Int32,
        shift: Int32,
        scale_log2: Float32,
        win: tuple | None,
        ds: tuple | None = None,
        softcap_pre: Float32 | None = None,
    ):
        """P^T = exp2(S^T * scale_log2 - LSE_log2) into acc_S, in place, masked keys 0. With
        ds = (acc_dP, sD, scale) also dS^T into acc_dP in the same loop (`dscores`' formula).
        With STATS_REGS, sLSE and sD are `load_rows`' register views (indexed like acc_S; the
        LSE already read as +inf where it was -inf) and `stage` is unused; with LSE_REGS sLSE
        alone is; with STATS_SHFL sLSE is `load_shfl`'s (LSE already fixed likewise).

        Softcap builds first replace S^T by t = tanh(S^T * softcap_pre) (the forward's order:
        tanh, then the mask; scale_log2 is softcap * log2 e) and multiply dS^T by the
        derivative of the cap, 1 - t^2 (times softmax_scale, already in dS^T's formula); a
        masked entry has t = -inf and P = 0, and the factor is clamped at 0 so that 0 * inf
        never makes a NaN."""
        if const_expr(self.SOFTCAP):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * softcap_pre, fastmath=True)
        if masked:
            # In tile coordinates: key k of row r is hidden iff k >= key_end (past seqlen_k) or
            # (causal) k > r + diag, i.e. k >= min(r + diag + 1, key_end); with a window
            # (win = (left, right)) iff k > r + diag + right or k < r + diag - left.
            key_end = seqlen_k - n_block * self.TILE_N
            diag = m_block * self.TILE_M + shift - n_block * self.TILE_N
            if const_expr(self.LOCAL):
                hi, lo = diag + win[1] + 1, diag - win[0]
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                limit = key_end
                if const_expr(self.LOCAL):
                    limit = cutlass.min(tScS[i][1] + hi, key_end)
                    hidden = (tScS[i][0] >= limit) | (tScS[i][0] < tScS[i][1] + lo)
                    acc_S[i] = -Float32.inf if hidden else acc_S[i]
                else:
                    if const_expr(self.CAUSAL):
                        limit = cutlass.min(tScS[i][1] + diag + 1, key_end)
                    acc_S[i] = -Float32.inf if tScS[i][0] >= limit else acc_S[i]
        lses, ds_rows = {}, {}  # STATS_SHFL: one shuffle per row (the fragment's two key rows)
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            if const_expr(self.STATS_SHFL):
                lse = self._shfl_row(sLSE, i, lses)
            elif const_expr(self.STATS_REGS or self.LSE_REGS):
                lse = sLSE[i]
            else:
                lse = self._no_neg_inf(sLSE[tScS[i][1], stage])
            if const_expr(self.SOFTCAP):
                t = acc_S[i]
            acc_S[i] = cute.math.exp2(acc_S[i] * scale_log2 - lse, fastmath=True)
            if const_expr(ds is not None):
                acc_dP, sD, scale = ds
                d = self._row(sD, tScS, i, stage, ds_rows)
                acc_dP[i] = self._ds(acc_S[i], acc_dP[i], d, scale)
                if const_expr(self.SOFTCAP):
                    acc_dP[i] = acc_dP[i] * cutlass.max(Float32(1.0) - t * t, Float32(0.0))

    @cute.jit
    def _no_neg_inf(self, lse: Float32) -> Float32:
        """A row that sees no key (or a padding row) must give P = 0, never NaN: the shared
        preprocess hands +inf there (exp2(s - inf) = 0, exp2(-inf - inf) = 0 for masked
        entries), and with LSE_GUARD a natural-log -inf is read as +inf too."""
        if const_expr(self.LSE_GUARD):
            lse = Float32.inf if lse == -Float32.inf else lse
        return lse

    @cute.jit
    def _row(
        self, sX: cute.Tensor, tScS: cute.Tensor, i: cutlass.Constexpr[int], stage: Int32,
        rows: dict | None = None,
    ):  # fmt: skip
        """The LSE / D value of element i's query row: from smem, from the `load_rows`
        register view (STATS_REGS) or by shuffle from `load_shfl`'s (STATS_SHFL; `rows` keeps
        the values already shuffled in this loop)."""
        if const_expr(self.STATS_SHFL):
            v = self._shfl_row(sX, i, rows)
        elif const_expr(self.STATS_REGS):
            v = sX[i]
        else:
            v = sX[tScS[i][1], stage]
        return v

    def _shfl_row(self, held: tuple, i: int, rows: dict):
        """STATS_SHFL: element i's query row value from the lane that `load_shfl` gave it. In
        the S^T fragment element c + 2 r + 4 j is row 8 j + 2 q + c (q = lane % 4, the same for
        every warp of the warpgroup), which lane 4 (j % 8) + q holds as its value
        2 (j // 8) + c. One shuffle per (j, c), kept in `rows` for the other key row r."""
        vals, q = held
        j, c = i // 4, i % 2
        if (j, c) not in rows:
            rows[(j, c)] = cute.arch.shuffle_sync(vals[2 * (j // 8) + c], 4 * (j % 8) + q)
        return rows[(j, c)]

    @cute.jit
    def load_shfl(self, sX: cute.Tensor, stage: Int32, lse: cutlass.Constexpr[bool]) -> tuple:
        """STATS_SHFL: the TILE_M / 32 rows of sX (stage `stage`) that this lane serves to the
        others, (values, lane % 4): lane 4 a + b holds rows 64 h + 8 a + 2 b + c as value
        2 h + c (h < TILE_M / 64, c < 2; two adjacent rows, one LDS.64). `lse`: -inf read as
        +inf (`_no_neg_inf`) here, once per row."""
        lane = cute.arch.lane_idx()
        a, b = lane // 4, lane % 4
        n = self.TILE_M // 32
        vals = cute.make_rmem_tensor((n,), Float32)
        for k in cutlass.range_constexpr(n):
            v = sX[64 * (k // 2) + 8 * a + 2 * b + k % 2, stage]
            if const_expr(lse):
                v = self._no_neg_inf(v)
            vals[k] = v
        return vals, b

    @cute.jit
    def _ds(self, p: Float32, dp: Float32, d: Float32, scale: Float32) -> Float32:
        """One element of dS^T = P^T (dP^T - D), times softmax_scale unless SCALE_OUT (then
        dK's epilogue and the host's dQ conversion take the scale)."""
        ds = p * (dp - d)
        if const_expr(not self.SCALE_OUT):
            ds = ds * scale
        return ds

    @cute.jit
    def load_rows(
        self, sX: cute.Tensor, tScS: cute.Tensor, stage: Int32, lse: cutlass.Constexpr[bool]
    ) -> cute.Tensor:
        """STATS_REGS: this thread's query rows of sLSE / sD (stage `stage`) in registers, as a
        view indexed like the S^T fragment. In its m64nNk16 C layout element c + 2 r + 4 j
        (acc_S's ((2, 2, TILE_M/8), 1, 1)) is query row 8 j + 2 (lane % 4) + c for both key
        rows r, so TILE_M / 4 values serve the TILE_M / 2 elements: the view's r mode has
        stride 0. `lse`: read -inf as +inf (`_no_neg_inf`) once per row here."""
        n = cute.size(tScS) // 2  # TILE_M / 4 rows: (c, j) -> c + 2 j
        vals = cute.make_rmem_tensor((n,), Float32)
        for k in cutlass.range_constexpr(n):
            v = sX[tScS[k % 2 + 4 * (k // 2)][1], stage]
            if const_expr(lse):
                v = self._no_neg_inf(v)
            vals[k] = v
        view = cute.make_layout(((2, 2, n // 2), 1, 1), stride=((1, 0, 2), 0, 0))
        return cute.make_tensor(vals.iterator, view)

    @cute.jit
    def dscores(
        self, acc_P: cute.Tensor, acc_dP: cute.Tensor, tScS: cute.Tensor, sD: cute.Tensor,
        stage: Int32, scale: Float32,
    ):  # fmt: skip
        """dS^T = P^T * (dP^T - D) * softmax_scale into acc_dP, in place (acc_P holds P^T;
        SCALE_OUT: without the scale; STATS_REGS: sD is `load_rows`' view; STATS_SHFL:
        `load_shfl`'s)."""
        rows = {}  # STATS_SHFL: one shuffle per row
        for i in cutlass.range_constexpr(cute.size(acc_P)):
            d = self._row(sD, tScS, i, stage, rows)
            acc_dP[i] = self._ds(acc_P[i], acc_dP[i], d, scale)

    @cute.jit
    def probs_and_dscores(
        self, acc_S: cute.Tensor, acc_dP: cute.Tensor, probs_args: tuple, sD, scale: Float32,
        softcap_pre, rP: cute.Tensor, rdS: cute.Tensor,
    ):  # fmt: skip
        """P into acc_S and its 16-bit operand rP, dS into acc_dP and rdS, once the S and dP
        wgmmas issued last (in that order) retire. OVERLAP: P while dP's wgmma still runs, then
        dS; otherwise both retire first and P and dS come out of one loop. `probs_args`:
        `probs`' (tScS, sLSE, stage, masked, n_block, m_block, seqlen_k, shift, scale_log2,
        win); sD is read at the same stage."""
        tScS, stage = probs_args[0], probs_args[2]
        if const_expr(self.OVERLAP):
            warpgroup.wait_group(1)
            self.probs(acc_S, *probs_args, None, softcap_pre)
            self.pack(acc_S, rP)
            if const_expr(self.STATS_SHFL):  # after P, before the wait (BwdConfig.stats_shfl)
                sD = self.load_shfl(sD, stage, False)
            warpgroup.wait_group(0)
            self.dscores(acc_S, acc_dP, tScS, sD, stage, scale)
        else:
            if const_expr(self.STATS_SHFL):
                sD = self.load_shfl(sD, stage, False)
            warpgroup.wait_group(0)
            self.probs(acc_S, *probs_args, (acc_dP, sD, scale), softcap_pre)
            self.pack(acc_S, rP)
        self.pack(acc_dP, rdS)

    @cute.jit
    def pack(self, acc: cute.Tensor, frag: cute.Tensor):
        """fp32 accumulator -> 16-bit A fragment of the same per-thread order (no data moves)."""
        n = cute.size(acc)
        r32 = cute.make_tensor(
            cute.recast_ptr(frag.iterator, dtype=Int32), cute.make_layout(n // 2)
        )  # (n/2,) 32-bit view of the fragment's registers
        for j in cutlass.range_constexpr(n // 2):
            r32[j] = cvt_pack_16x2(acc[2 * j], acc[2 * j + 1], self.dtype is cutlass.BFloat16)

    @cute.jit
    def store_dkv(
        self,
        thr_dkv,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        n_block: Int32,
        head_kv: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd
        seqlen_k: Int32,
        scale: Float32 | None = None,
    ):
        """dK and dV to gmem in the input dtype (rows past seqlen_k are skipped). SCALE_OUT:
        dK times `scale` (softmax_scale) first, which its dS^T did not carry."""
        tile = (self.TILE_N, self.HEAD_DIM)
        tcD = thr_dkv.partition_C(cute.make_identity_tensor(tile))
        if const_expr(self.SCALE_OUT):
            for i in cutlass.range_constexpr(cute.size(acc_dK)):
                acc_dK[i] = acc_dK[i] * scale
        for acc, m in ((acc_dK, mdK), (acc_dV, mdV)):
            g = cute.local_tile(rows.k_out(m, head_kv), tile, (n_block, 0))  # (TILE_N, D)
            tg = thr_dkv.partition_C(g)
            for i in cutlass.range_constexpr(cute.size(acc)):
                if n_block * self.TILE_N + tcD[i][0] < seqlen_k:
                    tg[i] = acc[i].to(self.dtype)

    @cute.jit
    def store_dkv_tma(
        self,
        thr_dkv,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        dkv_tmas: tuple,
        mtid: Int32,
        n_block: Int32,
        head_kv: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd
        transposed: cutlass.Constexpr[bool],
        scale: Float32 | None = None,
    ):
        """dK and dV in the input dtype into sK and sV (no longer read once every warpgroup is
        past its last S, dP and dQ GEMM: the first barrier), then one thread TMA-stores both
        (TILE_N, D) tiles; the TMA unit drops the rows past Nk (past the sequence's end on the
        ragged view). `transposed`: the fragments hold dK^T and dV^T (D, TILE_N) ("dkv_t",
        where stores from registers element by element spilled the two fragments and their
        row addresses). SCALE_OUT: dK times `scale` first, which its dS did not carry."""
        tile = (self.TILE_N, self.HEAD_DIM)
        mma_threads = self.MMA_THREADS
        if const_expr(self.SCALE_OUT):
            for i in cutlass.range_constexpr(cute.size(acc_dK)):
                acc_dK[i] = acc_dK[i] * scale
        cute.arch.barrier(barrier_id=int(Barrier.DS_FREE), number_of_threads=mma_threads)
        for acc, s in ((acc_dK, sK), (acc_dV, sV)):
            r = cute.make_rmem_tensor_like(acc, self.dtype)
            self.pack(acc, r)
            cute.autovec_copy(r, thr_dkv.partition_C(self._dkv_view(s, transposed)))
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> TMA reads
        cute.arch.barrier(barrier_id=int(Barrier.DS_READY), number_of_threads=mma_threads)
        if mtid == 0:
            tma_dk, tdK, tma_dv, tdV = dkv_tmas
            for tma, t, s in ((tma_dk, tdK, sK), (tma_dv, tdV, sV)):
                g = cute.local_tile(rows.k_rows(t, head_kv), tile, (n_block, 0))
                tma_store(tma, s, g)  # (TILE_N, D)
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem read before the CTA exits

    def _dkv_view(self, s: cute.Tensor, transposed: bool) -> cute.Tensor:
        """sK or sV as the dK / dV fragment indexes it: (TILE_N, D), or (D, TILE_N) when the
        fragment holds dK^T / dV^T (a plain function: decided while tracing)."""
        return self._transposed(s, self.TILE_N, self.HEAD_DIM) if transposed else s
