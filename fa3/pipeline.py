"""Producer loads on the TMA pipelines and the consumer warpgroups' ping-pong token.

`load_tile`: the producer warp's TMA loads of one tile (Q once, then K and V per block into
STAGES-deep rings, newest block first), on `PipelineTmaAsync` pipelines whose phases carry
over from tile to tile. `PingPong`: named barriers pass a token round the ring of consumer
warpgroups 0 -> 1 (-> 2) -> 0 so they take turns on the tensor cores. fp8 with
v_transpose="smem": `transpose_blocks`, the producer warpgroup's other warps turning each
loaded V block into a Vᵀ stage, and `VtPipe`, the consumers' side of that Vᵀ ring.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from flashsuite.fa3.fp8_ops import transpose_block
from flashsuite.fa3.utils import Barrier


class PingPong:
    """The tensor-core turn of `num_wgs` consumer warpgroups (a no-op when not `enabled`)."""

    def __init__(self, enabled: bool, num_wgs: int) -> None:
        self.ENABLED = enabled
        self.NUM_WGS = num_wgs

    @cute.jit
    def start(self, cwg: Int32):
        """Hand WG0 the "you start" token: it takes the first tensor-core turn.

        Each tile passes the token round the ring a whole number of times, so it is back at
        WG0 when the next tile starts (persistent).
        """
        if const_expr(self.ENABLED):  # noqa: SIM102 (a const_expr test stays its own `if`)
            if cwg == 0:
                cute.arch.barrier_arrive(
                    barrier_id=int(Barrier.PINGPONG_WG0), number_of_threads=256
                )

    @cute.jit
    def sync(self, cwg: Int32):
        """Wait for this WG's tensor-core turn (a token passed round the ring of consumer WGs)."""
        if const_expr(self.ENABLED):
            cute.arch.barrier(
                barrier_id=int(Barrier.PINGPONG_WG0) + cwg,
                number_of_threads=256,  # this WG syncs, its predecessor arrives
            )

    @cute.jit
    def arrive(self, cwg: Int32):
        """Pass the turn to the next WG of the ring (it may issue once its softmax is done).

        Every WG of a tile runs the same number of syncs and arrives, alternating, so the
        token goes round 0 -> 1 (-> 2) -> 0 and each barrier completes with 128 + 128 threads.
        """
        if const_expr(self.ENABLED):
            nxt = cwg + 1
            if const_expr(self.NUM_WGS == 2):
                nxt = 1 - cwg
            else:
                nxt = Int32(0) if nxt == self.NUM_WGS else nxt
            cute.arch.barrier_arrive(
                barrier_id=int(Barrier.PINGPONG_WG0) + nxt,
                number_of_threads=256,
            )


@cute.jit
def load_block(
    pipe: pipeline.PipelineTmaAsync,
    tma: cute.CopyAtom,
    tXg: cute.Tensor,  # (TMA, n_blocks) global blocks of K or V
    tXs: cute.Tensor,  # (TMA, STAGES) their shared-memory ring
    n_block: Int32,
    kv_state: pipeline.PipelineState,
):
    """Wait for ring stage `kv_state` to be free, then TMA-load block n_block into it."""
    pipe.producer_acquire(kv_state)
    cute.copy(
        tma,
        tXg[None, n_block],
        tXs[None, kv_state.index],
        tma_bar_ptr=pipe.producer_get_barrier(kv_state),
    )


@cute.jit
def load_tile(
    tma_q: cute.CopyAtom,
    tQ: cute.Tensor,
    tma_k: cute.CopyAtom,
    tK: cute.Tensor,
    tma_v: cute.CopyAtom,
    tV: cute.Tensor,
    sQ: cute.Tensor,
    sK: cute.Tensor,
    sV: cute.Tensor,
    pipe_q: pipeline.PipelineTmaAsync,
    pipe_k: pipeline.PipelineTmaAsync,
    pipe_v: pipeline.PipelineTmaAsync,
    q_state: pipeline.PipelineState,
    kv_state: pipeline.PipelineState,
    m_block: Int32,
    head: Int32,
    rows,  # varlen.DenseRows / SeqRows: the tile's sequence
    group: Int32,
    n_block_min: Int32,
    n_block_max: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    head_dim: cutlass.Constexpr[int],
    persistent: cutlass.Constexpr[bool],
    k_first: cutlass.Constexpr[bool],
    v_blocks: Callable,
    k_ahead: cutlass.Constexpr[bool] = False,
    q_stages: cutlass.Constexpr[int] = 1,
):
    """Producer warp: Q once, then K and V per n-block from n_block_max - 1 down.

    Returns the advanced (q_state, kv_state). Persistent: Q is loaded for every tile, even
    one with no K/V block, so that the consumers' Q wait/release (which guards sQ, and sO
    where it aliases sQ) stays in step with the producer. `k_first` (persistent tile
    overlap): the first K block before Q. `v_blocks(v_rows)`: V rows of one (sequence, kv head)
    as (TILE_N, D, n_blocks) blocks (Vᵀ blocks for fp8). `k_ahead` (Fa3Config.k_ahead): K of
    the next block before V of this one, K(1st), K(2nd), V(1st), K(3rd), V(2nd), ..., V(last),
    the order in which the intra-WG-overlap consumers wait for them. `q_stages` 2 (k_first
    only): sQ holds two buffers, and Q goes first, ahead of the first K: its buffer was freed
    by the tile before the previous one, so the load does not wait for the current tile.
    """
    head_kv = head // group
    gQ = cute.local_tile(rows.q_rows(tQ, head), (tile_m, head_dim), (m_block, 0))
    # (tile_m, D)
    gK = cute.local_tile(
        rows.k_rows(tK, head_kv), (tile_n, head_dim), (None, 0)
    )  # (tile_n, D, n_blocks)
    gV = v_blocks(rows.k_rows(tV, head_kv))  # (tile_n, D, n_blocks) (fp8: Vᵀ blocks)
    one = cute.make_layout(1)
    tQs, tQg = cpasync.tma_partition(
        tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
    )  # (TMA[, Q_STAGES]), (TMA)
    tKs, tKg = cpasync.tma_partition(
        tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
    )  # (TMA, STAGES), (TMA, n_blocks)
    tVs, tVg = cpasync.tma_partition(
        tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
    )
    if const_expr(k_first):
        # K(first) -> Q -> V(first) -> the other blocks: the first K load only needs a free
        # K stage, so it is in flight before the consumers release sQ (kernels.py protocol).
        # Two Q buffers: Q -> K(first) -> V(first) -> ..., the Q buffer being free already.
        if const_expr(q_stages > 1):
            pipe_q.producer_acquire(q_state)  # the Q·Kᵀ of the tile before last retired
            cute.copy(
                tma_q, tQg, tQs[None, q_state.index],
                tma_bar_ptr=pipe_q.producer_get_barrier(q_state),
            )  # fmt: skip
            q_state.advance()
        if n_block_max > n_block_min:
            load_block(pipe_k, tma_k, tKg, tKs, n_block_max - 1, kv_state)
        if const_expr(q_stages == 1):
            pipe_q.producer_acquire(q_state)  # both WGs' last Q·Kᵀ of the previous tile retired
            cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
        if const_expr(k_ahead):
            if n_block_max > n_block_min:
                kv_state = _load_k_ahead(
                    pipe_k, pipe_v, tma_k, tma_v, tKg, tKs, tVg, tVs, n_block_min, n_block_max,
                    kv_state,
                )  # fmt: skip
        elif n_block_max > n_block_min:
            load_block(pipe_v, tma_v, tVg, tVs, n_block_max - 1, kv_state)
            kv_state.advance()
            for i in cutlass.range(n_block_max - n_block_min - 1, unroll=1):
                n_block = n_block_max - 2 - i
                load_block(pipe_k, tma_k, tKg, tKs, n_block, kv_state)
                load_block(pipe_v, tma_v, tVg, tVs, n_block, kv_state)
                kv_state.advance()
    else:
        if const_expr(persistent):
            pipe_q.producer_acquire(q_state)  # the consumers released the previous tile's Q
            cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
        if n_block_max > n_block_min:
            if const_expr(not persistent):
                pipe_q.producer_acquire(q_state)
                cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            if const_expr(k_ahead):
                load_block(pipe_k, tma_k, tKg, tKs, n_block_max - 1, kv_state)
                kv_state = _load_k_ahead(
                    pipe_k, pipe_v, tma_k, tma_v, tKg, tKs, tVg, tVs, n_block_min, n_block_max,
                    kv_state,
                )  # fmt: skip
            else:
                for i in cutlass.range(n_block_max - n_block_min, unroll=1):
                    n_block = n_block_max - 1 - i
                    load_block(pipe_k, tma_k, tKg, tKs, n_block, kv_state)
                    load_block(pipe_v, tma_v, tVg, tVs, n_block, kv_state)
                    kv_state.advance()
    return q_state, kv_state


@cute.jit
def _load_k_ahead(
    pipe_k, pipe_v, tma_k, tma_v, tKg, tKs, tVg, tVs, n_block_min: Int32, n_block_max: Int32,
    kv_state: pipeline.PipelineState,
):  # fmt: skip
    """`load_tile`'s k_ahead order once K(n_block_max - 1) is in flight at `kv_state`: K(n - 1)
    then V(n) for n = n_block_max - 1 down, each at its own block's ring stage, then
    V(n_block_min); returns the state past the last block."""
    for i in cutlass.range(n_block_max - n_block_min - 1, unroll=1):
        n_block = n_block_max - 1 - i
        v_state = kv_state.clone()
        kv_state.advance()
        load_block(pipe_k, tma_k, tKg, tKs, n_block - 1, kv_state)
        load_block(pipe_v, tma_v, tVg, tVs, n_block, v_state)
    load_block(pipe_v, tma_v, tVg, tVs, n_block_min, kv_state)
    kv_state.advance()
    return kv_state


class VtPipe:
    """The consumers' view of the Vᵀ ring's `PipelineAsync` (v_transpose="smem"), with the
    calls the main loop makes on a V pipeline: waits as they are, releases by lane 0 of each
    consumer warp (its empty barriers count consumer warps, as the TMA rings' do)."""

    def __init__(self, pipe: pipeline.PipelineAsync) -> None:
        self.pipe = pipe

    def consumer_try_wait(self, state: pipeline.PipelineState):
        return self.pipe.consumer_try_wait(state)

    def consumer_wait(self, state: pipeline.PipelineState, token=None):
        self.pipe.consumer_wait(state, token)

    @cute.jit
    def consumer_release(self, state: pipeline.PipelineState):
        if cute.arch.lane_idx() == 0:
            self.pipe.consumer_release(state)


@cute.jit
def transpose_blocks(
    vt_args: tuple,  # (pipe_v, pipe_vt, sV address, sVt address) from _allocate_smem
    sV_l: cute.ComposedLayout,  # (TILE_N, D, STAGES)
    sVt_l: cute.ComposedLayout,  # (D, TILE_N, STAGES)
    v_state: pipeline.PipelineState,  # consumer state of the V ring
    vt_state: pipeline.PipelineState,  # producer state of the Vᵀ ring
    n_blocks: Int32,
    warp: Int32,  # 0 .. num_warps - 1 among the transposing warps
    num_warps: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    head_dim: cutlass.Constexpr[int],
    keys_permuted: cutlass.Constexpr[bool] = False,
):
    """Transposing warps: V block i (the producer's i-th V load of the tile) -> Vᵀ stage, for
    i < n_blocks; returns the advanced (v_state, vt_state).

    Per block: wait for the V stage (its TMA bytes landed), wait for the Vᵀ stage (both
    consumer WGs' P·V that read it retired), ldmatrix / prmt / stmatrix, then every lane fences
    its generic-proxy writes for the wgmma's async-proxy reads and the warp syncs, and lane 0
    arrives on V's empty barrier (the stage may be reloaded) and on Vᵀ's full barrier (count:
    the transposing warps). Both rings have STAGES stages and advance together.
    """
    pipe_v, pipe_vt, sV_base, sVt_base = vt_args
    lane = cute.arch.lane_idx()
    for _ in cutlass.range(n_blocks, unroll=1):
        pipe_v.consumer_wait(v_state, pipe_v.consumer_try_wait(v_state))
        pipe_vt.producer_acquire(vt_state)
        transpose_block(
            sV_base, sVt_base, sV_l, sVt_l, v_state.index, vt_state.index, warp, num_warps,
            tile_n, head_dim, keys_permuted,
        )  # fmt: skip
        cute.arch.fence_proxy("async.shared", space="cta")  # stmatrix writes -> wgmma reads
        cute.arch.sync_warp()
        pipe_v.consumer_release(v_state)  # lane 0 (PipelineTmaAsync's signalling lane)
        if lane == 0:
            pipe_vt.producer_commit(vt_state)
        v_state.advance()
        vt_state.advance()
    return v_state, vt_state
