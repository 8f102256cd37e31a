"""The fa3 forward's build options: `Fa3Config`, one frozen dataclass per compiled kernel (part of
its compile key). Each field says what it changes in the kernel and, where a build was timed
with and without it, what that measured; `configs` holds the table of which builds ship.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fa3Config:
    """Static tile shape and schedule of the fa3 forward (part of the compile key)."""

    tile_m: int = 128  # query rows per CTA: 64 per consumer warpgroup
    tile_n: int = 128  # key/value rows per pipeline stage
    stages: int = 2  # depth of the K and V TMA rings
    pingpong: bool = True  # named-barrier turn taking between the two consumer warpgroups
    intra_wg_overlap: bool = True  # issue QK(n+1) before PV(n) and overlap softmax with PV
    o_alias_q: bool = False  # the epilogue's sO reuses sQ's buffer (frees room for a stage)
    # Consumer warpgroups of 64 query rows each (tile_m == 64 x this). 3 (tile_m 192) is FA3's
    # D=64 shape: a taller tile halves K/V smem traffic per FLOP at 160 registers a thread.
    num_consumer_wgs: int = 2
    # Persistent grid (one CTA per SM looping over tiles, heaviest causal tiles first) instead
    # of one CTA per tile.
    persistent: bool = False
    # Persistent only: overlap tile boundaries. The producer loads the next tile's first K block
    # before its Q and runs into the ring while the consumers finish the current tile; Q is
    # released right after the last Q·Kᵀ (not after the O store); with a separate sO each
    # consumer WG stores its own 64 rows and waits for that store's smem reads only before it
    # writes its slab again (kernels.py, "Persistent tile overlap").
    overlap_tiles: bool = False
    # Persistent only, a static schedule that balances causal work. The tile order's L2 sections
    # alternate direction, the last one heaviest first, so costs along the order form a smooth
    # triangle wave instead of a sawtooth; CTA i takes position i of even rounds and grid-1-i
    # of odd ones (snake). Modelled makespan / mean CTA load <= 1.006 (docs/results.md).
    balanced_order: bool = False
    # MiB of K and V per L2 section of the persistent (and lpt_grid) tile order: the (batch,
    # head) pairs whose tiles run, heads fastest, before the next section's start. A pair's
    # row tiles are spread over the whole section, so the section sets how far apart in time
    # the reads of its K/V lie (tile_scheduler.TileScheduler.tile_coords).
    l2_section_mib: int = 32
    # Persistent: each CTA's next tile from a global counter (the producer's atomic add, sent
    # to the consumers through shared memory) in the unbalanced order, not static rounds.
    tile_counter: bool = False
    # Causal / right window, intra-WG overlap only: a consumer WG whose 64 rows see none of
    # the tile's newest K/V block passes it by without its Q·Kᵀ and P·V (its P would be all 0:
    # the same bits; the GEMM work it saves: docs/design.md).
    skip_masked_wg: bool = False
    # Intra-WG overlap only: the softmax writes P into registers of its own (not over S) and
    # reduces each row's max and sum in four chains, and a loop with a runtime mask test holds
    # one whole softmax per side of its branch. ptxas otherwise moves P·V's wait_group(0) up to
    # the softmax's first instructions (it treats a write to the Q·Kᵀ accumulator as a hazard
    # with the P·V still in flight, and hoists a wgmma wait to the top of a basic block after a
    # branch's join), so the softmax runs after P·V retires, not under it (docs/design.md,
    # "The softmax under P·V").
    softmax_apart: bool = False
    # The producer's order of the K and V loads, blocks j = 0, 1, ... in the order the consumers
    # take them. False: K(0), V(0), K(1), V(1), ... True: K of the next block before V of this
    # one, K(0), K(1), V(0), K(2), V(1), ..., the order in which the intra-WG-overlap consumers
    # wait for them (Q·Kᵀ(j + 1) is issued before P·V(j)) and FA4's. With two stages K(j + 2)
    # otherwise queues behind V(j + 1), whose stage frees when P·V(j - 1) retires at the end of
    # iteration j; ahead of it, K(j + 2) goes as soon as Q·Kᵀ(j) has retired.
    k_ahead: bool = False
    # Intra-WG overlap only: where O takes the previous block's softmax correction. False:
    # after P·V(j - 1) retires, before the next turn's Q·Kᵀ is issued. True: right after
    # Q·Kᵀ(j + 1) is issued, just before P·V(j) (FA4's order above D = 128). Not taken: level
    # pass for pass at D = 192 / 256 (H200; docs/results.md, "O rescaled under Q·Kᵀ").
    rescale_before_pv: bool = False
    # float8 only: who makes Vᵀ (D x keys, keys contiguous: fp8 wgmma takes its B operand
    # K-major only). "host": a transpose copy before the launch (interface.transpose_v), the
    # kernel loads Vᵀ blocks. "smem": the kernel loads V blocks as they lie (keys x D) and warps
    # 1..TRANSPOSE_WARPS of the producer warpgroup transpose each into a Vᵀ ring of `stages`
    # more stages (ldmatrix.trans, prmt, stmatrix; fp8_ops.transpose_block) that P·V reads.
    v_transpose: str = "host"
    # Packed sequences on the plain grid, S > 0: a one-dimensional grid over the virtual
    # blocks of S query heads at a time, each block of the S heads before the next
    # (varlen.VarlenTiles.tile), so the last heads' heaviest tiles do not start last. 0: off.
    head_section: int = 0
    # Plain grid only: a one-dimensional grid whose block i runs tile `tile_coords(i)` of the
    # persistent order without its balancing (FA4's non-persistent longest-processing-time
    # order), instead of the (m_blocks, Hq, B) grid.
    lpt_grid: bool = False
    # Every ex2_emu-th probability of a thread's row by softmax.exp2_poly on the FMA pipe
    # rather than MUFU.EX2; 0: all by MUFU (docs/results.md, "Exponentials on the FMA pipe").
    ex2_emu: int = 0
    # t > 0: a row keeps its running max while a block's max exceeds it by at most t (log2
    # units, after the softmax scale), so P <= 2^t and the row's O rescale is exactly 1; a
    # warp rescales its O (tile_n-independent: D / 2 FMULs per thread at 64 rows) only when one
    # of its rows' max grew by more (softmax.online_softmax). 0: every block rescales.
    # At most RESCALE_THRESHOLD_MAX: 2^t must fit P's type (e4m3 448, fp16 65504).
    rescale_threshold: int = 0
    # With rescale_threshold 0: a warp skips O's rescale when no row of it moved its max in
    # the block (every rescale exactly 1.0; the table build multiplies by exp2 of an FFMA's
    # rounding residual there, a few ulps from 1, so the two agree to rounding). How often
    # that happens grows with the key length: a row's max moves in block j with probability
    # about 1 / j on exchangeable scores; a numpy model of i.i.d. scores in 128-key blocks has
    # a warp's 16 rows all stay put in 6 / 33 / 69 % of the blocks after the first at
    # N = 1k / 4k / 16k.
    skip_unit_rescale: bool = False
    # The in-place softmax's row max and row sum as four interleaved dependency chains each
    # (softmax._chains, as softmax_apart's), not one: under ping-pong a consumer warpgroup has
    # one warp per scheduler while it runs its softmax, so a 96-long FMNMX or FADD chain (a
    # row of a 192-key tile) is issued at its latency, not the pipe's rate. The max is exact
    # in any order; the sum changes its rounding order.
    row_chains: bool = False
    # With rescale_threshold t > 0: a block's exponentials against each row's running max,
    # taken beside the block's max rather than after it (P apart from S, which stays
    # unchanged); where every row of the warp kept its max (grew by <= t) that is the block's
    # P, else online_softmax runs on S as without it. Bit for bit the build without it; removes
    # the row max's latency from the exponentials' path (softmax.speculative_softmax).
    spec_exps: bool = False
    # float8 only: V's keys in fp8_ops.slot_key order within each 32-key block (the host's Vᵀ
    # copy, `interface.transpose_v`, or the smem transpose puts them there), so P goes from
    # S's C fragment to P·V's A fragment inside each thread: no quad exchange (two shfl.sync
    # and two prmt per 8 scores a thread). The order of the products of P·V changes, not
    # the products.
    permute_v_keys: bool = False
    # Q, K and Vᵀ's wgmma descriptors from the slice of the consumer warpgroup's first thread
    # (warp-uniform), not the thread's own (ptxas cannot see they depend on the warpgroup
    # only, so it builds them in vector registers and moves them across with R2UR). sm_90a
    # SASS: non-causal D = 128's loop 518 -> 487 instructions per block and warp (FA4 452),
    # D = 64's 446 -> 428 (415). Taken by the entries in _WG_SLICE and fp8 D = 256.
    wg_slice: bool = False
    # Each wgmma's K / Vᵀ descriptor as a static offset from the K/V stage's first one (the
    # stage's slice taken once before the k-blocks), not rebuilt from (k, stage): ptxas then
    # advances one 64-bit descriptor per wgmma (UIADD3.64). sm_90a, loop instructions per
    # block and warp: D = 64 with FA4's order (pv_wait_after_max, wg_slice, no loop mask test)
    # 438 -> 421 (FA4 415); the table builds lose 18-33 too, but timed level or slower.
    stage_desc: bool = False
    # Intra-WG overlap without causal or window masks: the main loop's runtime "is this block
    # masked" test, always false there (only the newest block, peeled off before the loop,
    # has keys past seqlen_k; softmax_apart builds never test). Its branch splits the loop
    # body, and ptxas then hoists P·V's wait above an in-place softmax, which runs after P·V
    # retires instead of under it. False drops it: with wg_slice too the D = 64 table entry's
    # softmax (68 FMNMX, 24 MUFU.EX2) and fp8 D = 128 / 256's move between the two waits
    # (benchmarks/fa3_softmax_sass; tests/test_fa3_softmax_overlap.py). The fp8 D = 128 / 256
    # entries and non-causal D = 64's (configs._FA4_LOOP) drop it.
    loop_mask_test: bool = True
    # Intra-WG overlap, causal (right) mask, no left window: the masked blocks (mask compiled
    # in), then the unmasked ones, as two loops with no runtime test, so each body is one
    # basic block and its softmax stays under P·V (FA4's order; one loop with the test keeps
    # S, P, O in the same registers but ptxas hoists the wait above the softmax). Causal
    # D = 128: 68 FMNMX, 23-27 MUFU.EX2 between the waits in each loop, 0 spills (_SPLIT_LOOPS).
    split_loops: bool = False
    # In-place overlap softmax: a never-taken branch before P·V's wait_group(0), which ptxas
    # moves to the top of its basic block, so the softmax stays under P·V (fa3_softmax_sass:
    # fp8 D = 128 100 FMNMX / 98 MUFU.EX2 between the waits, bf16 D = 64 68 / 66; else 1 / 0).
    pin_pv_wait: bool = False
    # In-place overlap softmax: P·V's wait issued between the rows' max, rescale and exponents
    # and their exponentials (softmax.online_softmax), behind a never-taken branch that keeps
    # ptxas from raising it: the row max under P·V, the exponentials after its wait at bf16
    # D = 64 and 128, the split of FA4's D = 64 loop (benchmarks/fa4_sass_compare). Alone on
    # bf16 D = 64's build with the loop's mask test it timed 0.979 / 0.978x that build at
    # N = 4k / 16k (H100, docs/design.md); with wg_slice, no mask test and stage_desc it ships
    # there (configs._FA4_LOOP).
    pv_wait_after_max: bool = False
    # With pv_wait_after_max (no effect without): each row's first that many exponentials
    # (of a thread's 16-64 a row) before P·V's wait as well, so some MUFU.EX2 issue under
    # P·V beside the row max. sm_90a, D = 64's loop: 3 / 11 / 19 / 35 / 66 MUFU.EX2 between
    # the waits at 0 / 4 / 8 / 16 / 32 (FA4's 11), 421 instructions each; configs._FA4_LOOP
    # takes 4 (FA4_LOOP_EXPS).
    pv_wait_exps: int = 0
    # Intra-WG overlap: acc_O not zeroed before the tile; the first P·V overwrites it. Off.
    o_zero_init: bool = False
    # The options below at a tile's edges: docs/results.md, "Short sequences". Persistent
    # with overlap_tiles and a separate sO: sQ buffers (1 or 2). With 2 the producer loads
    # each tile's Q first, into the buffer the tile before last released, so Q's latency lies
    # under the current tile, not between tiles (which a tile of few K/V blocks pays every
    # few blocks). Shipped for short D = 64 problems (SHORT_SEQLEN_K).
    q_stages: int = 1
    # Plain dense grid: an L2 prefetch of the Q tile of the CTA one wave later; O stored by
    # the consumer threads, not a TMA store. Both off (0.93-1.00x the table on an H100).
    prefetch_next_q: bool = False
    o_direct_store: bool = False
    # Per-WG epilogue (persistent, separate sO): the LSE out through sLSE and a TMA store; the
    # threads' global LSE stores make the compiler recompute most of the loop's exponentials
    # there. Needs seqlen_q % 4 == 0 (the TMA's 16-byte row stride).
    lse_tma: bool = False
    # Lab build (16-bit, dense): per-tile clock stamps (fa3/trace.py, benchmarks/fa3_timeline).
    trace: bool = False
    # 16-bit, D <= 128, 2 WGs: Q·Kᵀ with Q in registers (ldmatrix once a tile; 32 registers at
    # D = 128), not read from smem at every K block: a fifth less smem traffic (docs/results.md).
    q_in_regs: bool = False
