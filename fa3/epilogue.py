"""Epilogue stores: an accumulator tile from registers through shared memory to a TMA store.

`store_o` writes the whole tile (every consumer warpgroup) through one sO and one TMA store;
`store_o_wg` writes one warpgroup's 64-row slab through its own slab of sO and its own store,
so a warpgroup that is done moves on without the others. `store_o_direct` writes the whole
tile through sO and then 16-byte loads and stores by every consumer thread, so the CTA has no
store to wait for before it exits. The caller has scaled the tile; the LSE is stored by the
kernel (its rows are the softmax's, see softmax.finalize_row).
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from flashsuite.fa3.utils import Barrier


@cute.jit
def tma_store(tma_o: cute.CopyAtom, sO: cute.Tensor, gO: cute.Tensor):
    """One thread: TMA-store the smem tile sO ((rows, D) of O, or (rows,) of the LSE) to gO
    and commit the bulk group."""
    n = cute.rank(sO)
    tOs, tOg = cpasync.tma_partition(
        tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, n), cute.group_modes(gO, 0, n)
    )
    cute.copy(tma_o, tOs, tOg)
    cute.arch.cp_async_bulk_commit_group()


@cute.jit
def o_to_smem(acc_O: cute.Tensor, mma: cute.TiledMma, sO: cute.Tensor, thread: Int32, o_dtype):
    """acc_O (the C fragment of `mma`, thread `thread`) converted to o_dtype and written to sO
    by stmatrix."""
    rO = cute.make_rmem_tensor_like(acc_O, o_dtype)
    rO.store(acc_O.load().to(o_dtype))
    r2s = cute.make_tiled_copy_C(
        cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), o_dtype), mma
    )
    thr_r2s = r2s.get_slice(thread)
    cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))


@cute.jit
def store_o(
    tma_o: cute.CopyAtom,
    tO: cute.Tensor,
    mma_pv: cute.TiledMma,
    sO: cute.Tensor,
    acc_O: cute.Tensor,
    ctid: Int32,
    warp: Int32,
    m_block: Int32,
    head: Int32,
    rows,  # varlen.DenseRows / SeqRows: the tile's sequence
    tile_m: cutlass.Constexpr[int],
    head_dim: cutlass.Constexpr[int],
    o_dtype: cutlass.Constexpr,
    consumer_threads: cutlass.Constexpr[int],
    sync_first: cutlass.Constexpr[bool],
):
    """The whole tile_m x D tile through sO, one TMA store by warp 4 (all consumer WGs).

    `sync_first`: sO overwrites sQ (every WG's QK wgmmas, which read sQ, must have retired),
    or a persistent CTA's previous store must have read sO (warp 4 waits for it before it
    reaches this barrier).
    """
    if const_expr(sync_first):
        cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=consumer_threads)
    o_to_smem(acc_O, mma_pv, sO, ctid, o_dtype)
    # Generic-proxy smem writes must be visible to the TMA (async proxy) store.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=consumer_threads)
    if warp == 4:
        gO = cute.local_tile(rows.q_rows(tO, head), (tile_m, head_dim), (m_block, 0))  # (tile_m, D)
        tma_store(tma_o, sO, gO)
        cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def store_o_direct(
    mO: cute.Tensor,
    mma_pv: cute.TiledMma,
    sO: cute.Tensor,
    acc_O: cute.Tensor,
    ctid: Int32,
    m_block: Int32,
    head: Int32,
    rows,  # varlen.DenseRows: the tile's batch
    seqlen_q: Int32,
    tile_m: cutlass.Constexpr[int],
    head_dim: cutlass.Constexpr[int],
    o_dtype: cutlass.Constexpr,
    consumer_threads: cutlass.Constexpr[int],
    sync_first: cutlass.Constexpr[bool],
):
    """The whole tile_m x D tile through sO (stmatrix), then every consumer thread copies rows
    of it to global memory in 16-byte vectors, rows past seqlen_q left out.

    With the TMA store the store warp must wait for the store to have read sO before the CTA
    exits (its smem is the next CTA's), and on the plain grid nothing else runs on the SM by
    then. Here each thread's loads from sO have completed when its stores issue, so the CTA
    exits as soon as they are issued. `mO` is O's (Nq, D, Hq, B) view in global memory.
    `sync_first` as in store_o.
    """
    if const_expr(sync_first):
        cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=consumer_threads)
    o_to_smem(acc_O, mma_pv, sO, ctid, o_dtype)
    cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=consumer_threads)
    vec = 128 // o_dtype.width
    per_row = head_dim // vec  # threads on one row
    # Rows a pass: a power of two, so it divides tile_m (D = 192: 8 rows of 24 threads, the
    # other 64 consumer threads idle).
    pass_rows = 1 << ((consumer_threads // per_row).bit_length() - 1)
    s2g = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), o_dtype, num_bits_per_copy=128),
        cute.make_layout((pass_rows, per_row), stride=(per_row, 1)),
        cute.make_layout((1, vec)),
    )
    if ctid < pass_rows * per_row:
        thr = s2g.get_slice(ctid)
        gO = cute.local_tile(rows.q_rows(mO, head), (tile_m, head_dim), (m_block, 0))
        tOsO = thr.partition_S(sO)
        tOgO = thr.partition_D(gO)
        tOcO = thr.partition_D(cute.make_identity_tensor((tile_m, head_dim)))
        tOrO = cute.make_rmem_tensor_like(tOsO)
        cute.copy(s2g, tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if m_block * tile_m + tOcO[0, m, 0][0] < seqlen_q:
                cute.copy(s2g, tOrO[None, m, None], tOgO[None, m, None])


@cute.jit
def store_o_wg(
    tma_o: cute.CopyAtom,
    tO: cute.Tensor,
    sO: cute.Tensor,
    acc_O: cute.Tensor,
    ctid: Int32,
    warp: Int32,
    cwg: Int32,
    m_block: Int32,
    head: Int32,
    rows,  # varlen.DenseRows / SeqRows: the tile's sequence
    head_dim: cutlass.Constexpr[int],
    ab_dtype: cutlass.Constexpr,
    o_dtype: cutlass.Constexpr,
    pv_b_major: cutlass.Constexpr,
    num_wgs: cutlass.Constexpr[int],
    lse_out=None,  # (TMA atom, (Nq, Hq, B) coordinates, sLSE (TILE_M,), the thread's 2 LSE)
    tScS=None,  # with lse_out: (row, col) in the tile of each S element of the thread
):
    """This WG's 64 rows through its own sO slab and its own TMA store (per-WG epilogue).

    Only the 128 threads of WG c sync here, so a WG done with its tile moves on to the next
    while the other WG still runs its last P·V. The previous tile's store of this slab is
    waited for (smem reads only) just before the slab is written again. `ab_dtype` and
    `pv_b_major`: the operands of the P·V wgmma whose C fragment acc_O is. With `lse_out` the
    WG's 64 LSE go the same way: one lane of each quad writes its two rows' LSE to the WG's
    slab of sLSE, and the store warp stores the slab by TMA after O (rows past Nq clipped by
    the TMA), in the same bulk group, so the same wait covers both slabs.
    """
    bar = int(Barrier.EPILOGUE_WG0) + cwg
    store_warp = warp % 4 == 0  # the first warp of each consumer WG
    if store_warp:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.barrier(barrier_id=bar, number_of_threads=128)
    sO_wg = sO[None, None, cwg]  # (64, D) slab
    # One warpgroup's P·V tiling: its C fragment is the same per-thread acc_O layout.
    mma_wg = sm90.make_trivial_tiled_mma(
        ab_dtype,
        ab_dtype,
        cute.nvgpu.OperandMajorMode.K,
        pv_b_major,
        Float32,
        (1, 1, 1),
        (64, head_dim),
        a_source=warpgroup.OperandSource.RMEM,
    )
    o_to_smem(acc_O, mma_wg, sO_wg, ctid % 128, o_dtype)
    if const_expr(lse_out is not None):  # noqa: SIM102 (a const_expr test stays its own `if`)
        if tScS[0][1] == 0:  # one lane of each quad owns its two rows' statistics
            for r in cutlass.range_constexpr(2):
                lse_out[2][tScS[2 * r][0]] = lse_out[3][r]
    # Generic-proxy smem writes must be visible to the TMA (async proxy) store.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=bar, number_of_threads=128)
    if store_warp:
        gO = cute.local_tile(
            rows.q_rows(tO, head), (64, head_dim), (m_block * num_wgs + cwg, 0)
        )  # (64, D)
        tma_store(tma_o, sO_wg, gO)
        if const_expr(lse_out is not None):
            tma_lse, tLSE, sLSE = lse_out[0], lse_out[1], lse_out[2]
            sL = cute.local_tile(sLSE, (64,), (cwg,))  # this WG's rows
            gL = cute.local_tile(tLSE[None, head, rows.batch], (64,), (m_block * num_wgs + cwg,))
            tma_store(tma_lse, sL, gL)
