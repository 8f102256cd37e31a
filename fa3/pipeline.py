"""Producer loads on the TMA pipelines and the consumer warpgroups' ping-pong token.

`load_tile`: the producer warp's TMA loads of one tile (Q once, then K and V per block into
STAGES-deep rings, newest block first), on `PipelineTmaAsync` pipelines whose phases carry
over from tile to tile. `PingPong`: named barriers pass a token round the ring of consumer
warpgroups 0 -> 1 (-> 2) -> 0 so they take turns on the tensor cores.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

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
):
    """Producer warp: Q once, then K and V per n-block from n_block_max - 1 down.

    Returns the advanced (q_state, kv_state). Persistent: Q is loaded for every tile, even
    one with no K/V block, so that the consumers' Q wait/release (which guards sQ, and sO
    where it aliases sQ) stays in step with the producer. `k_first` (persistent tile
    overlap): the first K block before Q. `v_blocks(v_rows)`: V rows of one (sequence, kv head)
    as (TILE_N, D, n_blocks) blocks (Vᵀ blocks for fp8).
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
    )
    tKs, tKg = cpasync.tma_partition(
        tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
    )  # (TMA, STAGES), (TMA, n_blocks)
    tVs, tVg = cpasync.tma_partition(
        tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
    )
    if const_expr(k_first):
        # K(first) -> Q -> V(first) -> the other blocks: the first K load only needs a free
        # K stage, so it is in flight before the consumers release sQ (kernels.py protocol).
        if n_block_max > n_block_min:
            load_block(pipe_k, tma_k, tKg, tKs, n_block_max - 1, kv_state)
        pipe_q.producer_acquire(q_state)  # both WGs' last Q·Kᵀ of the previous tile retired
        cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state.advance()
        if n_block_max > n_block_min:
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
            for i in cutlass.range(n_block_max - n_block_min, unroll=1):
                n_block = n_block_max - 1 - i
                load_block(pipe_k, tma_k, tKg, tKs, n_block, kv_state)
                load_block(pipe_v, tma_v, tVg, tVs, n_block, kv_state)
                kv_state.advance()
    return q_state, kv_state
