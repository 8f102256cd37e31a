"""Tile configurations for the fa3 backward (bwd_kernel.Fa3Backward), one frozen dataclass per
(head_dim, dtype, causal, softcap): the "sdp_t" layout (S^T and dP^T, dK / dV from registers) at
D = 64 / 96 / 128 and the "dkv_t" layout (P and dS through smem, dK^T / dV^T with D on M) at
D = 192 / 256, the setmaxnreg split, the dQ tile order of the writer warp, and the limits
`bwd_can_implement` checks. Each entry's shared-memory and register arithmetic is written next
to it; H200 numbers are noted where an entry was measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashsuite.fa3.configs import DTYPES, SMEM_CAPACITY, _align

# setmaxnreg split (producer, MMA) per number of MMA warpgroups: 128 x 24 + 256 x 240 = 64,512.
BWD_REG_SPLIT = {2: (24, 240)}
BWD_HEAD_DIMS = (64, 96, 128, 192, 256)
# Builds (head_dim, feature) that compile spill-free and pass the CPU checks but have not yet run
# on a GPU: dispatch takes fa3's own backward there only when FLASHSUITE_FA3_BWD=1 asks
# (interface.backward_opt_in), fa2's otherwise. A new build's features go here until its GPU
# tests pass. Empty: softcap, windows and the deterministic builds (dense, windowed, packed) at
# every head dim have passed their GPU oracle cases, the deterministic ones bitwise stable over
# 5-10 runs (docs/results.md; tests/test_attention.py, tests/test_fa3_varlen_bwd.py,
# benchmarks/fa3_bwd_check.py --stability).
BWD_UNVERIFIED: tuple[tuple[int, str], ...] = ()

# Whether dispatch differentiates fa3's forward with fa3's own backward without being asked
# (FLASHSUITE_FA3_BWD=1 asks, =0 refuses). On: with bwd_config_for's config (64-row tiles at
# both D in that run) the kernel ran at 1.3-1.7x fa2's backward on the H200, both timed in one
# run (commit 67913ca, bf16, B·N = 16k, Hq·D = 2048, N = 16k, TFLOP/s; docs/results.md):
# D = 128 571 vs 384, causal 551 vs 323; D = 64 452 vs 346, causal 452 vs 299. Not at N = 1k,
# D = 64 causal: 166 vs 188.
BWD_DEFAULT_ON = True

# Whether dispatch differentiates fa3's varlen forward with fa3's own varlen backward
# (bwd_varlen.py: the same kernel and configs on a virtual column-block grid) without being
# asked (FLASHSUITE_FA3_VARLEN_BWD=1 asks, =0 refuses, as does FLASHSUITE_FA3_BWD=0). On: its GPU
# oracle cases and memcheck pass, and it runs at 1.22-1.88x fa2's varlen backward
# (docs/inference.md).
VARLEN_BWD_AUTO = True

# Whether packed sequences take the dense builds' routes that need neither the 80-row tile nor
# the sectioned grid (bwd_config_for): D64_FA4_ROUTE at D = 64, the per-warpgroup hand-off with
# FA4_ELEMENTWISE at D = 96 / 128. Off: variants pipe128_dqm_tma / pipe_stm_tma. On: the GPU
# cases of tests/test_fa3_varlen_bwd.py pass with it, and on an H100 it timed 1.09-1.10x the
# builds without it at D = 64 and 1.03x at D = 128 (docs/inference.md, "Configs").
VARLEN_DENSE_ROUTES = True

# The head dims whose sliding windows (a left or right edge) take the same routes: the 15 window
# cases of benchmarks/fa3_bwd_check.py pass on them at D 64 / 96 / 128; at N = 16k on an H100
# they timed 1.085x (D 64, causal window 1024), 1.070x (D 96, window 512 both sides) and
# 1.032x (D 128, causal 1024) the builds without (docs/results.md, "Causal D = 96 / 128 ...").
WINDOW_ROUTE_HEAD_DIMS: tuple[int, ...] = (64, 96, 128)


@dataclass(frozen=True)
class BwdConfig:
    """Static tile shape of the fa3 backward (part of its compile key)."""

    tile_m: int = 64  # query rows per step of the row-block loop (S^T's N, dV/dK's K)
    tile_n: int = 128  # key rows per CTA: 64 per MMA warpgroup ("sdp_t")
    stages: int = 2  # depth of the Q / dO / LSE / D TMA ring ("dkv_t": of Q and LSE)
    num_mma_wgs: int = 2
    # Which products are transposed (docs/design.md, "The fa3 backward"). "sdp_t" (D <= 128):
    # S^T = K Q^T and dP^T = V dO^T with 64 keys per warpgroup on wgmma's M, P^T and dS^T
    # feeding dV += P^T dO and dK += dS^T Q from registers. "dkv_t" (D = 192, 256, where D x 64
    # keys of fp32 dK and dV do not fit the registers): S = Q K^T and dP = dO V^T with the query
    # rows on M (the warpgroups split the keys), P and dS through shared memory (sP, sdS),
    # dV^T += dO^T P and dK^T += Q^T dS with D on M, all four operands from shared memory.
    layout: str = "sdp_t"
    # "dkv_t": how the MMA warpgroups split dK^T and dV^T. "d": D / num_mma_wgs rows of D each
    # (whole m64 atoms) over every key; "keys": every row of D over tile_n / num_mma_wgs keys.
    dkv_split: str = "d"
    # "dkv_t": depth of the dO / D ring, which has its own mbarriers (Q and LSE keep `stages`);
    # the dO stage is released as soon as dV^T's wgmma retires. 0: `stages` (one ring).
    do_stages: int = 0
    # How a row block's dQ reaches the fp32 accumulator in global memory: "atomic", one
    # atom.global.add.f32 per element from registers; "warp", the MMA warpgroups store the
    # fragment to an fp32 smem tile in fragment order and warp 1 of the producer warpgroup adds
    # the whole tile with one cp.reduce.async.bulk into a tile-ordered accumulator
    # (B, Hq, Nq_pad, D), which the host permutes back (bwd_host.dq_from_tiles); "red", the
    # MMA threads add their fragment to that tile-ordered accumulator themselves, one
    # red.global.add.v4.f32 per 4 registers (16 contiguous bytes; a warp's 32 lanes 512), with
    # no sdQ tile and no writer warp (FA3's dQ route at D = 256, where the 64 KiB fp32 sdQ tile
    # costs the keys of a wider column block).
    dq_mode: str = "atomic"
    # How the MMA warpgroups split dQ = dS K (TILE_M x D). "d": each takes D / num_mma_wgs
    # columns of every row (TILE_M / 64 m64 atoms of n = D / num_mma_wgs). "m": each takes 64
    # rows and every column (one m64nD atom; needs tile_m = 64 x num_mma_wgs): at D = 64,
    # TILE_M = 128 half the wgmmas at twice the N (n64 rather than n32), and each warpgroup
    # reads only its own rows of sdS, so a third less shared-memory traffic for the GEMM.
    # "dt": D split as in "d", but computed transposed, dQ^T = K^T dS^T with D on wgmma's M
    # (one m64 atom of D per warpgroup: D = 64 x num_mma_wgs) and the query rows on N, so
    # TILE_M need not be a multiple of 64 (the 80-row tile at D = 128, FA4's dQ_swapAB); A is
    # sK as an MN-major (D, TILE_N) view, B is sdS as it is (K-major), and the fragment holds
    # dQ^T (dq_tile_modes orders sdQ for it).
    dq_split: str = "d"
    # "warp" dq_mode: how sdQ is handed to the writer warp. "cta": one DQ_FULL / DQ_EMPTY pair
    # of named barriers over every MMA thread and the writer, one bulk reduce of the whole
    # tile. "wg": a pair per MMA warpgroup (128 + 32 threads) and one bulk reduce per
    # warpgroup's chunk, so neither warpgroup waits for the other's dQ. "turn": the "wg" pairs
    # and bulk reduces through an sdQ of one warpgroup's chunk (TILE_M x D / NUM_MMA_WGS fp32),
    # filled by the warpgroups in turn: warpgroup g + 1 writes once the reduce of g's chunk has
    # read it (32 of the 64 KiB at D = 256 freed for keys).
    dq_handoff: str = "cta"
    # How dS^T (16-bit, accumulator layout) is written to sdS for dQ's wgmma: "scalar", one
    # 16-bit st.shared per element; "stmatrix", stmatrix.trans (four 8x8 matrices a warp).
    ds_store: str = "scalar"
    # Deterministic dQ (torch.use_deterministic_algorithms): the column blocks of one
    # (row block, head, batch) add their dQ in n_block order, each waiting on an int32 counter
    # in global memory (ld.acquire.gpu spin, red.release.gpu increment): by the MMA threads in
    # "atomic" dq_mode, by the writer warp in "warp" dq_mode.
    deterministic: bool = False
    # Buffers of sdS (and of sP, "dkv_t"). 1: every WG's wgmmas of the previous row block that
    # read them must retire before they are rewritten (a named barrier per row block); 2: row
    # blocks alternate buffers, and the one barrier that publishes dS also orders the reuse.
    ds_stages: int = 1
    # Issue order inside a row block. False: S^T and dP^T retire together, then P^T and dS^T,
    # then dV, dK and dQ, all retired before dQ is added. True: P^T while dP^T's wgmma runs;
    # dV, dQ, then dK issued; dQ leaves once dV and dQ retire, while dK still runs.
    overlap: bool = False
    # Grid order. False: (n_block, kv head, batch), blockIdx.x = n_block, so the column blocks of
    # one head run side by side and share its Q / dO tiles in L2. True: (kv head, batch,
    # n_block), so every head's n_block 0 launches before any n_block 1: the longest CTAs first
    # under causal masking (column block n sees the row blocks from n's diagonal down). On the
    # H200 True lost 2-24 % at D 64, N 4k / 16k, causal too (docs/results.md).
    lpt: bool = False
    # Grid order, S > 0: a one-dimensional grid over the (kv head, batch) pairs in sections of
    # S pairs; within a section column block 0 of each of its pairs, then column block 1, ...
    # (`bwd_blocks.section_tile`). Under causal masking the longest CTAs of a section start
    # first, as with `lpt`, while only S heads' Q and dO are in flight at once, as in the
    # default order. A greedy-dispatch model of the 132 SMs (`python -m
    # benchmarks.bwd_order_model`) puts the default order's tail at 5-6 % of a causal
    # backward at N = 1k-8k and S = 4-8's at 0-4 %. 0: off. Not with lpt, deterministic or
    # varlen.
    head_section: int = 0
    # "sdp_t": where the softmax scale enters dS = P (dP - D) scale. False: on every dS element
    # (one multiply per score). True: dS = P (dP - D) in the loop; dK is scaled once in the
    # epilogue, before its store, and dQ by the host in its fp32 -> dtype conversion (FA4's
    # order). Exact for softcap too: the tanh' factor stays on dS, the scale is linear.
    scale_out: bool = False
    # "sdp_t": how the row block's LSE and D reach the elementwise loop. False: read from sLSE /
    # sD per element after S^T / dP^T retire (ptxas keeps one LDS.64 per row pair). True: the
    # TILE_M / 4 rows a thread's fragment holds (columns 8 j + 2 (lane % 4) + c of S^T) are
    # loaded into registers once, LSE right after S^T's wgmma is issued and D after dP^T's,
    # so the loads run under the GEMMs (FA4's order); LSE's -inf -> +inf fix is done per row.
    # tile_m 64 only (R237 at D = 128; 128 rows spill).
    stats_regs: bool = False
    # "sdp_t": the LSE alone in registers (the TILE_M / 4 rows of a thread's fragment, as
    # stats_regs), loaded before S^T's wgmma is issued so the loads retire under it; D is read
    # from sD as with stats_regs False. Without it the LSE loads follow S^T's wait, and their
    # first use waits on them (short-scoreboard stalls at the first compare or FFMA).
    lse_regs: bool = False
    # "sdp_t": LSE and D through warp shuffles (FA4's route at D = 64). Each lane loads
    # TILE_M / 32 rows of each (two LDS.64 per 64 rows: LSE right after S^T's wgmma is issued,
    # D once P is packed, before dP^T's wait, FA4's order: with D loaded under the GEMMs as
    # well, ptxas raised dP^T's wait above every exponential) and the elementwise loop takes a
    # row's value with one SHFL from the lane that holds it, per row pair of the fragment:
    # TILE_M / 16 loads and TILE_M / 2 shuffles a row block in place of TILE_M / 4 LDS.64,
    # with TILE_M / 16 registers live, not TILE_M / 2.
    # Not with stats_regs, lse_regs or dv_early; tile_m a multiple of 64.
    stats_shfl: bool = False
    # "dkv_t" with dq_mode "red": dQ = dS K in this many column slices of each warpgroup's
    # D / NUM_MMA_WGS columns, each slice's wgmma issued, retired and added by its reductions
    # before the next is issued, so dQ holds 1 / dq_slices of its registers (FA3's hdim-256
    # slicing of the dQ GEMM): the first runs beside dK^T, the second after it.
    dq_slices: int = 1
    # How the wgmma fragments of the shared-memory operands are partitioned. False: with
    # each thread's slice of the TiledMma; True: with the slice of its warpgroup's first thread,
    # the warpgroup index made warp-uniform (FA4's order), so the descriptors are computed in
    # uniform registers rather than per wgmma in vector registers and moved across by R2UR.
    wg_slice: bool = False
    # Read an LSE of -inf as +inf in the kernel (a row that sees no key: P = 0, never NaN).
    # Both preprocesses (common/bwd_preprocess.py) already write +inf there and on padding rows,
    # so False drops the per-row compare and select (16 FSETP + 16 FSEL per row block and
    # MMA warp at D = 128) and relies on that contract.
    lse_guard: bool = True
    # "sdp_t": how dK and dV reach global memory. False: from registers, one predicated 32-bit
    # store per register pair (a warp's store covers 8 rows x 16 bytes). True: through sK / sV
    # (free once every warpgroup is past its last S^T and dQ) and one TMA store each, which
    # drops the rows past Nk (the ragged view's sequence end when packed), as "dkv_t" always
    # does (FA4's epilogue).
    dkv_tma: bool = False
    # "sdp_t" with overlap: when dV += P^T dO is issued. False: after dS^T is computed and
    # stored (FA4's order). True: as soon as P^T is packed, before dP^T retires, so dS^T is
    # computed while dV's wgmma runs and the exponentials of P^T have a consumer ahead of the
    # wait for dP^T (without one, ptxas sinks most of them past that wait: the S^T / dP^T
    # overlap then holds a few instructions, benchmarks/fa3_bwd_sass.py --listing mma).
    dv_early: bool = False
    # "sdp_t" with overlap: dV's wgmma (register P^T, dO from the TMA stage) issued between the
    # dS^T stores to sdS and the proxy fence that makes them visible to dQ's wgmma (FA4's
    # order), not after the fence: the tensor pipe gets dV while the fence drains the stores.
    dv_before_fence: bool = False
    # Programmatic dependent launch (PDL) through the backward's three launches (preprocess,
    # this kernel, the dQ postprocess of the tiled dq_modes): each is launched with
    # programmatic stream serialisation and waits (griddepcontrol.wait) for the launch before it
    # to complete before it touches memory that launch may write, so its launch, shared-memory
    # set-up and barrier init overlap the previous grid's last wave. Here the producer warp
    # issues the K / V tile loads (inputs no earlier launch of the backward writes) before its
    # wait; every other warp waits first. The preprocess signals its dependents
    # (griddepcontrol.launch_dependents) once its own wait has returned, so this kernel's
    # early K / V loads never run ahead of whatever produced them.
    pdl: bool = False


BWD_DQ_MODES = ("atomic", "warp", "red")
BWD_DS_STORES = ("scalar", "stmatrix")
BWD_LAYOUTS = ("sdp_t", "dkv_t")
BWD_DKV_SPLITS = ("d", "keys")
BWD_DQ_SPLITS = ("d", "m", "dt")
BWD_DQ_HANDOFFS = ("cta", "wg", "turn")
# dq_modes whose accumulator is (B, Hq, Nq_pad, D) in dq_tile_modes order (the host permutes it
# back); "atomic" adds into (B, Nq, Hq, D).
BWD_TILED_DQ_MODES = ("warp", "red")


def dq_tiled(cfg: BwdConfig) -> bool:
    """Whether cfg's dQ accumulator holds whole TILE_M x D row blocks in dq_tile_modes order."""
    return cfg.dq_mode in BWD_TILED_DQ_MODES


def sdq_floats(cfg: BwdConfig, head_dim: int) -> int:
    """fp32 words of the sdQ staging tile: TILE_M x D in "warp" dq_mode (one warpgroup's chunk
    with dq_handoff "turn"), one unused word otherwise (no staging)."""
    if cfg.dq_mode != "warp":
        return 1
    tile = cfg.tile_m * head_dim
    return tile // cfg.num_mma_wgs if cfg.dq_handoff == "turn" else tile


def dq_tile_modes(
    tile_m: int, head_dim: int, num_wgs: int, split: str = "d", one_chunk: bool = False
) -> tuple[tuple, tuple]:
    """(shape, stride) of the "warp" dq_mode's (TILE_M, D) fp32 tile layout, used in smem and
    in each TILE_M x D block of the global accumulator (bwd_dq.dq_tile_layout builds it,
    bwd_host.dq_from_tiles inverts it).

    With `split` "d" warpgroup g owns columns [g D/G, (g+1) D/G) (dQ's atom layout (1, G, 1));
    in it, warp w of the m64nNk16 accumulator holds rows 16 w + 8 r + a (a = lane / 4) and
    columns 8 j + 2 b + c (b = lane % 4) in register c + 2 r + 4 j. Offset c + 2 r + 4 b + 16 a
    + 128 w + 512 j (+ g TILE_M D / G) puts each thread's registers 4 j .. 4 j + 3 in 16
    contiguous bytes and a warp's 32 lanes in 512: one conflict-free st.shared.v4 per 4
    registers, and one bulk copy per tile (or per warpgroup: each one's chunk is contiguous).
    With `split` "m" (atom layout (G, 1, 1), TILE_M = 64 G) warpgroup g owns rows
    [64 g, 64 g + 64) and every column, in the same order with j < D / 8, at g 64 D.
    With `split` "dt" (dQ^T = K^T dS^T: atom layout (G, 1, 1) over (D, TILE_M), D = 64 G) the
    fragment's rows are D and its columns query rows: warpgroup g's register c + 2 r + 4 j holds
    column 64 g + 16 w + 8 r + a of query row 8 j + 2 b + c (j < TILE_M / 8), at the same
    offset as above (+ g 64 TILE_M): the same v4 stores, and each warpgroup's chunk is
    contiguous again. `one_chunk` (the sdQ of dq_handoff "turn"): the warpgroup mode's stride
    0, every chunk at offset 0 of one chunk of smem."""
    shape, stride = _dq_tile_modes(tile_m, head_dim, num_wgs, split)
    if one_chunk:  # the warpgroup mode is the last of the rows ("m") or of the columns
        side = 0 if split == "m" else 1
        wg_free = (*stride[side][:-1], 0)
        stride = (wg_free, stride[1]) if side == 0 else (stride[0], wg_free)
    return shape, stride


def _dq_tile_modes(tile_m: int, head_dim: int, num_wgs: int, split: str) -> tuple[tuple, tuple]:
    """`dq_tile_modes` with every warpgroup's chunk in its place."""
    if split not in BWD_DQ_SPLITS:
        raise ValueError(f"dq_tile_modes: split {split!r} not in {BWD_DQ_SPLITS}")
    if split == "dt":
        if head_dim != 64 * num_wgs or tile_m % 8 or not 8 <= tile_m <= 256:
            raise ValueError(
                f"dq_tile_modes: split 'dt' needs head_dim 64 x {num_wgs} (one m64 atom of D "
                f"per warpgroup) and tile_m a wgmma N (a multiple of 8 in [8, 256]), not "
                f"{head_dim} and {tile_m}"
            )
        rows, row_strides = (2, 4, tile_m // 8), (1, 4, 512)
        return (rows, (8, 2, 4, num_wgs)), (row_strides, (16, 2, 128, 64 * tile_m))
    if tile_m % 64:
        raise ValueError(f"dq_tile_modes: tile_m {tile_m} not a multiple of 64 (m64 atoms)")
    if split == "m":
        if tile_m != 64 * num_wgs or head_dim % 8:
            raise ValueError(
                f"dq_tile_modes: split 'm' needs tile_m 64 x {num_wgs} and head_dim a multiple "
                f"of 8, not {tile_m} and {head_dim}"
            )
        j = head_dim // 8
        rows, row_strides = (8, 2, 4, num_wgs), (16, 2, 128, 64 * head_dim)
        return (rows, (2, 4, j)), (row_strides, (1, 4, 512))
    if head_dim % (8 * num_wgs):
        raise ValueError(f"dq_tile_modes: head_dim {head_dim} not a multiple of 8 x {num_wgs}")
    j = head_dim // num_wgs // 8
    chunk = tile_m * head_dim // num_wgs
    # A second m64 atom (tile_m = 128: rows 64 m + ...) follows the first's j blocks, as its
    # registers follow them in the fragment.
    rows, row_strides = (8, 2, 4), (16, 2, 128)
    if tile_m > 64:
        rows, row_strides = (*rows, tile_m // 64), (*row_strides, 512 * j)
    return (rows, (2, 4, j, num_wgs)), (row_strides, (1, 4, 512, chunk))


def stats_stage_rows(tile_m: int) -> int:
    """The stage stride of sLSE and sD in floats: TILE_M rounded up to 32, so that each stage,
    a TMA destination, starts 128-byte aligned (80 rows: 96)."""
    return -(-tile_m // 32) * 32


def bwd_smem_bytes(cfg: BwdConfig, head_dim: int, elem_bytes: int = 2) -> int:
    """Shared memory of Fa3Backward's storage struct (the host checks it on the real struct):
    mbarriers, sLSE and sD, then 1 KiB-aligned sQ, sdO (per stage), sK, sV, sdS (and sP,
    "dkv_t"), then sdQ (`sdq_floats`). sdS and sP have ds_stages buffers; "dkv_t" gives dO and
    D their own do_stages ring."""
    do_stages = cfg.do_stages or cfg.stages
    dkv_t = cfg.layout == "dkv_t"
    mbar = 8 * (2 + 2 * cfg.stages + (2 * do_stages if dkv_t else 0))
    rows = stats_stage_rows(cfg.tile_m)
    stats = _align(rows * cfg.stages * 4, 128) + _align(rows * do_stages * 4, 128)
    q = cfg.tile_m * head_dim * elem_bytes * cfg.stages
    do = cfg.tile_m * head_dim * elem_bytes * do_stages
    kv = cfg.tile_n * head_dim * elem_bytes
    ds = cfg.tile_m * cfg.tile_n * elem_bytes * cfg.ds_stages
    dq = sdq_floats(cfg, head_dim) * 4
    body = _align(_align(mbar, 128) + stats) + _align(q) + _align(do) + 2 * _align(kv)
    body += (2 if dkv_t else 1) * _align(ds)
    return body + _align(dq)  # the struct rounds up to its 1 KiB alignment


def bwd_regs_estimate(cfg: BwdConfig, head_dim: int) -> int:
    """fp32 accumulators per MMA thread at their peak plus overhead; ptxas
    (tests/test_fa3_bwd_compile.py) is the judge.

    "sdp_t": S^T, dP^T, dV and dK. The packed 16-bit P^T and dS^T take the place of S^T and
    dP^T, and dQ's fragment comes after both are consumed, so neither is counted. "dkv_t": dK^T
    and dV^T for the whole loop, plus the larger of two phases: S, dP and their 16-bit copies
    (before sP and sdS are written) with 16 registers of overhead, and dQ (one slice of it with
    dq_slices) with 24, its route's addresses live while dK^T's wgmma runs. Against ptxas'
    highest register: R224-R228 at D = 192 (estimated 232), R183-R191 at D = 256, 48 keys
    (184); at 80 keys R234 with dQ in two slices (236), 484 bytes of spills without (248)."""
    w = cfg.num_mma_wgs
    if cfg.layout == "dkv_t":
        dkv = 2 * head_dim * cfg.tile_n // (128 * w)
        sdp = 2 * cfg.tile_m * cfg.tile_n // (128 * w)
        dq = cfg.tile_m * head_dim // (128 * w * cfg.dq_slices)
        return dkv + max(sdp + sdp // 2 + 16, dq + 24)
    rows = cfg.tile_n // w
    s = rows * cfg.tile_m // 128
    dkv = rows * head_dim // 128
    return 2 * s + 2 * dkv + 24


# FA4's elementwise work and issue order around dV (bwd_config_for): no softmax scale on dS
# (dK and the host's dQ pass take it), no -inf LSE guard (the preprocess writes +inf),
# descriptors per warpgroup, dV issued before the sdS fence. Taken by the 64-row tiles of
# causal D = 96 / 128 and of packed sequences at D = 96 / 128.
FA4_ELEMENTWISE = dict(scale_out=True, lse_guard=False, wg_slice=True, dv_before_fence=True)
# The dense D = 64 build's route: that, LSE and D by warp shuffle and sdQ handed over per
# warpgroup.
D64_FA4_ROUTE = dict(stats_shfl=True, dq_handoff="wg", **FA4_ELEMENTWISE)

# (kv head, batch) pairs per launch section of causal grids (bwd_config_for: dense problems,
# D = 64, 96, 128 and 256, without softcap or window).
CAUSAL_HEAD_SECTION = 4


def bwd_config_for(
    head_dim: int,
    dtype: torch.dtype,
    causal: bool,
    softcap: bool = False,
    sdq: bool = False,
    *,
    local: bool = False,
    varlen: bool = False,
) -> BwdConfig:
    """The backward config for (head_dim, dtype, causal, softcap); fp16 and bf16 share it.
    `sdq`: at D = 256 the 64 x 48 tile whose dQ goes through the writer warp's sdQ, not the
    80-key tile with dQ by the MMA threads' reductions; the deterministic build starts from it
    (bwd_interface._bwd_config orders its dQ). `local` (a sliding window) and `varlen` (packed
    sequences) describe the problem: D = 128's 80-row tile is for dense problems without either.

    D = 128 without causal masking, window, packed sequences or softcap takes FA4's 80-row tile
    (dQ computed as dQ^T = K^T dS^T, wgmma operands sliced per warpgroup, sdQ handed to the
    writer per warpgroup; variant pipe80_wgs_wgdq_tma). The tile: interleaved A/B on the H200
    (`python3 -m benchmarks.fa3_bwd_ab --variant pipe80_wgs_tma --variant pipe80_tma --variant
    pipe_stm_tma --head-dim 128 --repeats 3`,
    2026-12-04, commit 3243fe2, medians of 3; docs/results.md), N = 4k / 16k: 553 / 584 against
    539 / 575 for the 64-row tile; causal 477 / 572 against 480 / 562, so causal problems keep
    64 rows (FA4's choice too). The per-warpgroup hand-off on it (`--variant pipe80_wgs_tma
    --variant pipe80_wgs_wgdq_tma --seqlen 4096 --seqlen 8192 --seqlen 16384 --repeats 7`,
    2026-12-04, commit 4284f4d, medians of 7 passes), N = 4k / 8k / 16k: 547.0 / 565.7 / 586.3
    against 535.3 (the shipped path) / 565.7 / 572.3 (FA4 560.0 / 585.4 / 601.9, cuDNN 500.2 /
    519.9 / 529.2). dV's wgmma issued before the sdS fence on it (dv_before_fence, variant
    pipe80_wgs_wgdq_tma_dvf; H100 80GB HBM3, 2026-12-05, commit 6c5318d, `scripts/gpu_check.sh
    OUT bwd-candidates`, medians of 5 interleaved passes, ratio to SDPA cuDNN at N = 4k / 16k):
    1.179 / 1.161 against 1.148 / 1.139 without (FA4 1.138 / 1.161); the training step at
    N = 8k level (598.2 TFLOP/s both, 7 passes spread 0.96-1.25x cuDNN). Its oracle cases
    passed first. Causal (pipe_sec4_wgdq_tma_dvf) timed 1.131 / 1.100 against 1.119 / 1.069
    and the shipped call's 1.139 / 1.088: not taken.

    128 keys per CTA, 2 MMA warpgroups, a 2-stage Q/dO ring, dQ through the writer warp
    ("warp"), two sdS buffers, dS^T by stmatrix and the overlapped issue order; 64-row Q tiles
    at D = 128, 128-row ones at D = 64 (FA3's and FA4's shapes). Chosen on the H200 (bf16,
    B·N = 16k, Hq·D = 2048, TFLOP/s at N = 16k,
    `benchmarks/fa3_bwd_check.py --variant ... --bench`, docs/results.md), against the first
    config (per-element dQ atomics, one sdS buffer, serial issue): D = 128 516 vs 297, causal
    510 vs 297; D = 64 434 vs 274, causal 417 vs 276. The writer warp alone gives most of it
    (483 / 484 / 411 / 398); the overlapped order and the second sdS buffer gain nothing without it
    (301 / 306 / 269 / 284); stmatrix adds 0-7 % at D = 128. At D = 64, 128-row Q tiles
    (variant pipe128: twice the work per barrier and per K/V load) take N = 4k / 16k from
    420 / 452 to 438 / 479 and causal from 371 / 452 to 380 / 464 (+2-6 %; the 64-row numbers
    through dispatch and pipe128 through its variant run, one device session, commit 67913ca;
    0.97-1.07x cuDNN); they
    passed the variant oracle cases at D = 64 (one block, fp16 causal GQA with Nq != Nk, causal
    MQA at 513 x 700, strided). With those tiles D = 64 splits dQ = dS K by rows (dq_split "m":
    each warpgroup one m64n64 atom over its own 64 rows of sdS, not two m64n32 over all 128):
    variant pipe128_dqm took N = 4k / 16k from 432 / 470 to 456 / 494 and causal from 377 / 464
    to 396 / 485 (+4.5-5.4 %; 1.06-1.13x SDPA cuDNN, 0.88-0.94x FA4's SM90 backward, all timed
    in one run, commit 63c3300); handing sdQ over per warpgroup on top (pipe128_dqm_wgdq: 450 /
    497 / 397 / 483) or scaling outside the loop (pipe128_dqm_sout: 464 / 494 / 386 / 480) gained
    nothing consistent. Softcap builds keep the serial issue order (dS needs tanh' from the P
    loop) and 64-row tiles. At D = 128 neither pipe_wgdq (507 / 523 / 437 / 556) nor
    pipe_sout_sreg (484 / 506 / 400 / 505) beat the shipped tiles (526 / 561 / 443 / 545).
    Fewer instructions per row block do not pay at D <= 128 either: the wgmma operands sliced
    per warpgroup, dS scaled outside the loop and no -inf LSE compare (pipe_wgs_sout_ng, 404 ->
    372 SASS instructions per row block, FA4's count) time as the shipped tiles do (N = 4k / 16k,
    non-causal: 529 / 561 against 521 / 562; medians of 3 interleaved passes, commit 8234997),
    as does pipe128_dqm_wgs_ng at D = 64 (465 / 489 against 463 / 486): the loop is not
    issue-bound there.

    dK and dV leave through sK / sV by TMA stores (dkv_tma, FA4's epilogue) rather than from
    registers: interleaved A/B against the register stores (`python3 -m benchmarks.fa3_bwd_ab
    --variant pipe_stm_tma --variant pipe_stm --repeats 3`, and pipe128_dqm_tma against
    pipe128_dqm at D = 64; H200, 2026-12-03, commit f50a837; medians, N = 4k / 16k):
    D = 128 539 / 559 against 531 / 562, causal 483 / 556 against 461 / 547; D = 64 470 / 490
    against 462 / 490 (+0-5 %, most at 4k, where a CTA's epilogue is a larger share). Both
    variants passed their oracle cases first (15 and 4, D 64 / 96 / 128); packed sequences take
    the same builds (their TMA stores go through the ragged views, rows past a sequence
    dropped). Softcap builds keep the register stores. Slicing the wgmma fragments per
    warpgroup on top (wg_slice, with and without the -inf LSE guard: variants pipe_wgs_tma,
    pipe_wgs_ng_tma, pipe128_dqm_wgs_ng_tma) times level again (H200, 2026-12-03, commit
    40823ed, medians of 3 interleaved passes, N = 4k / 16k: D = 128 540 / 565 and 537 / 564
    against 530 / 564; causal 478 / 551 against 477 / 551; D = 64 468 / 489 against 467 / 492):
    the epilogue fixed, the loop is still not issue-bound.

    Causal D = 128 launches its grid in sections of CAUSAL_HEAD_SECTION (kv head, batch) pairs
    (head_section: column block 0 of each pair first, then block 1, ...) and hands sdQ to the writer
    warp per warpgroup (dq_handoff "wg", FA4's hand-off): variant pipe_sec4_wgdq_tma. Interleaved
    A/B on the H200 (`python3 -m benchmarks.fa3_bwd_ab --variant pipe_stm_tma --variant
    pipe_sec4_tma --variant pipe_wgdq_tma --variant pipe_sec4_wgdq_tma --causal --seqlen 4096
    --seqlen 8192 --seqlen 16384 --repeats 7`, 2026-12-04, commit 3cc3931, medians of 7 passes), N =
    4k / 8k / 16k: 479.7 / 516.9 / 561.0 for the 64-row tile alone, 490.8 / 529.2 / 555.6 with
    sections of 4, 478.8 / 522.6 / 558.2 with the per-warpgroup hand-off, 494.3 / 531.2 / 556.3 with
    both (FA4 497.5 / 539.1 / 587.2, cuDNN 445.5 / 480.7 / 514.9); the causal training step at N =
    8k (fwd + bwd TFLOP/s, medians of 7 passes, `--variant pipe_stm_tma --variant pipe_sec4_wgdq_tma
    --causal --step --seqlen 8192 --repeats 7`): 539.8 -> 559.1 (cuDNN 507.1, FA4 566.2). Sections
    timed +2.4 to +6.3 % at 8k in four runs and -0.2 to -1.8 % at 16k, 1k level; why 16k loses is
    not known (the four heads' Q and dO, 16 MB at 8k and 32 MB at 16k against a 50 MB L2, would
    explain it at D = 128 but not D = 64's -0.8 % at 16k, where they take 16 MB). Causal D = 64
    takes the sections too (variant pipe128_dqm_sec4_tma against pipe128_dqm_tma, same command at
    --head-dim 64, commit d1b3569, medians of 5 passes, N = 4k / 8k / 16k): 438.8 / 473.7 / 486.2
    against 425.1 / 468.8 / 490.3 (an earlier run, 3 passes: +2.4 / +1.6 % at 4k / 16k; FA4 439.4 /
    481.5 / 519.8 in this one). Causal D = 96 (D = 128's 64-row tile) takes both, as D = 128 does
    (`--variant pipe_stm_tma --variant pipe_sec4_tma --variant pipe_sec4_wgdq_tma --head-dim 96
    --causal --seqlen 4096 --seqlen 8192 --seqlen 16384 --repeats 5`, commit 4284f4d, medians of
    5): 448.6 / 482.3 / 490.2 against 429.5 (the shipped path) / 460.9 / 485.5 for the tile alone
    and 466.2 / 486.4 at 8k / 16k for the sections alone (FA4 455.5 / 498.9 / 504.3, cuDNN 363.6 /
    388.8 / 405.8). At D = 256 sections of 8 (wide256_red80_wgs_sec8) timed +2.2 / -1.9 / -2.9 % at
    4k / 8k / 16k; sections of 4 are shipped at causal D = 256 (variant wide256_red80_wgs_sec4,
    H100 80GB HBM3, 2026-12-05, commit 1fdfad0, `benchmarks.step_ab --backward --head-dim 256
    --causal --variant wide256_red80_wgs_sec2 --variant wide256_red80_wgs_sec4 --variant
    wide256_red80_wgs_sec8`, call by call in rotation, median per-repetition ratio to the shipped
    path at N = 4k / 8k / 16k): 1.040 / 1.032 / 1.007, sections of 2 1.013 and of 8 1.031 at 4k;
    against SDPA cuDNN 1.153 / 1.116 / 1.185 where the grid without sections took 1.107 / 1.082
    / 1.177. The greedy model puts the default order's efficiency at 0.933 at N = 4k and
    sections of 4 at 0.991.

    Non-causal D = 96 hands sdQ over per warpgroup as well (variant pipe_wgdq_tma against the
    shipped path's pipe_stm_tma, `--variant pipe_wgdq_tma --head-dim 96 --seqlen 4096 --seqlen
    8192 --seqlen 16384 --repeats 5`, commit 4284f4d, medians of 5): 489.9 / 488.3 / 509.1
    against 479.4 / 491.4 / 490.4 (FA4 484.4 / 516.0 / 520.0, cuDNN 395.3 / 409.2 / 411.3).

    D = 64 (128-row tiles, dQ split by rows) takes FA4's elementwise route and dQ hand-off
    together (D64_FA4_ROUTE: LSE and D by warp shuffle, the softmax scale out of dS, no -inf
    LSE guard, wgmma descriptors per warpgroup, sdQ handed over per warpgroup, dV before the
    sdS fence). Each alone timed level on the H200 (above); together, call by call in rotation
    on an H100 (2026-12-05, commit 79b3e66, `benchmarks.step_ab --backward --head-dim 64
    [--causal] --seqlen 4096 --seqlen 16384 --variant ...`, median per-repetition ratios at N
    = 4k / 16k, after the variants' oracle cases passed): 1.120 / 1.132x the build without
    them (pipe128_dqm_tma), 1.000 / 1.008x FA4's SM90 backward, 1.231 / 1.262x SDPA cuDNN;
    causal, on the sectioned grid, 1.096 / 1.120x, 1.021 / 1.027x FA4, 1.313 / 1.343x cuDNN.
    Without the shuffles 1.075 / 1.080x; the shuffles alone 1.021 / 1.020x. The MMA loop
    issues 586 instructions per warp and row block (the build without them 717, FA4's 642;
    `benchmarks/fa4_bwd_sass_compare --head-dim 64`). The deterministic build keeps none of
    them (bwd_interface.ordered_config).

    Causal D = 96 / 128 add FA4_ELEMENTWISE (causal D = 128 the shuffles too): 1.057 / 1.076x and
    1.018 / 1.022x the builds without them at N = 4k / 16k, 0.99-1.00x / 0.98-1.00x FA4 (H100,
    commit a80ca9d; docs/results.md, "Causal D = 96 / 128 on the same route").

    D = 96 takes D = 128's shape (64-row tiles): 32 + 32 fp32 for S^T and dP^T,
    2 x 48 for dK and dV, 48 for dQ; ptxas' highest register R205 (causal) of 240, 0 spills;
    smem 2 x 2 x 12 KiB Q/dO + 2 x 24 KiB K/V + 2 x 16 KiB sdS + 24 KiB sdQ = 152 KiB.
    """
    del dtype
    if head_dim not in BWD_HEAD_DIMS:
        raise ValueError(f"fa3 backward: head_dim {head_dim} not in {BWD_HEAD_DIMS}")
    if head_dim > 128:
        cfg = _bwd_wide_config(head_dim, softcap, sdq)
        if head_dim == 256 and causal and not (softcap or sdq or local or varlen):
            cfg = replace(cfg, head_section=CAUSAL_HEAD_SECTION)
        return cfg
    wide_m = head_dim == 64 and not softcap
    cfg = BwdConfig(
        tile_m=128 if wide_m else 64,
        dq_split="m" if wide_m else "d",
        tile_n=128,
        stages=2,
        dq_mode="warp",
        ds_store="stmatrix",
        ds_stages=2,
        overlap=not softcap,
        dkv_tma=not softcap,
    )
    window_plain = local and head_dim not in WINDOW_ROUTE_HEAD_DIMS
    if softcap or window_plain or (varlen and not VARLEN_DENSE_ROUTES):
        return cfg
    if head_dim == 64:
        # FA4's D = 64 route (variant pipe128_dqm_wgs_sout_ng_shfl_wgdq_tma_dvf; docstring)
        cfg = replace(cfg, **D64_FA4_ROUTE)
    if head_dim in (96, 128):
        cfg = replace(cfg, dq_handoff="wg")
        if causal or varlen or local:  # the 64-row tiles (docstring); causal D 128 shuffles
            shfl = head_dim == 128 and causal and not (varlen or local)
            cfg = replace(cfg, stats_shfl=shfl, **FA4_ELEMENTWISE)
    if varlen or local:  # packed sequences, windows: neither the 80-row tile nor the sections
        return cfg
    if head_dim == 128 and not causal:
        cfg = replace(cfg, tile_m=80, dq_split="dt", wg_slice=True, dv_before_fence=True)
    if causal:
        cfg = replace(cfg, head_section=CAUSAL_HEAD_SECTION)
    return cfg


def _bwd_wide_config(head_dim: int, softcap: bool, sdq: bool = False) -> BwdConfig:
    """The "dkv_t" configs of D = 192 and 256 (FA3's and FA4's SM90 structure for these head
    dims: S not transposed, P and dS through smem, dK^T / dV^T with D on wgmma's M, 64-row Q
    tiles); the serial issue order for softcap.

    D = 256 takes FA3's hdim-256 tile, 64 x 80, with dQ added by the MMA threads themselves
    (dq_mode "red": red.global.add.v4.f32 in two column slices of m64n64, the first issued
    beside dK^T), so no fp32 sdQ tile holds 64 KiB of shared memory:
        Q 2 x 32 + dO 32 + K, V 2 x 40 + sP, sdS 2 x 10 (+ LSE, D, barriers) = 198 KiB.
    On the H200 (bf16, B·N = 16k, Hq·D = 2048, backward TFLOP/s at N = 4k / 16k, non-causal
    then causal; `fa3_bwd_check --variant wide256 --variant wide256_red80_wgs --bench`, one
    run, commit 8234997, docs/results.md) it took 374 / 394 / 347 / 389 to
    430 / 453 / 395 / 454 (+14-17 %; 1.13-1.26x SDPA cuDNN, 1.17-1.23x FA4's SM90 backward
    in the same run), after passing the variant oracle cases.

    Packed sequences (the varlen build) take the same tile; their GPU oracle cases
    (tests/test_fa3_varlen_bwd.py, 18 cases) passed with it on the H200 at commit ca256a4.

    The 64 x 48 tile before it, kept for softcap (the serial issue order) and for the
    deterministic build (dQ by ordered atomics, tests/test_fa3_bwd_compile.py checks both),
    and D = 192's 64 x 96, stage dQ through the writer warp's fp32 sdQ tile. With a 2-stage
    Q ring and a 1-stage dO ring (dO's stage is released once dV^T retires, early in the row
    block, so its next load overlaps dQ, dK^T and the next S) and one sP / sdS buffer:
        D = 192, tile_n 96: Q 2 x 24 + dO 24 + K, V 2 x 36 + sP, sdS 2 x 12 + sdQ 48 = 216 KiB
        D = 256, tile_n 48: Q 2 x 32 + dO 32 + K, V 2 x 24 + sP, sdS 2 x 6 + sdQ 64 = 220 KiB
    (+ 2 KiB of mbarriers, LSE and D). D = 192 cannot give each warpgroup whole m64 atoms of
    D (96 rows), so they split the keys (192 x 48 each: 3 m64n48 atoms), dK^T + dV^T 144,
    S + dP 48, dQ 48; R224-R228 of 240, 0 spills.

    Without softcap both slice their wgmma operands per warpgroup (wg_slice: the descriptors
    in uniform registers, benchmarks/fa3_bwd_sass.py): at D = 192 484 / 508 / 433 / 495 with
    it against 486 / 496 / 432 / 487 without, same run; at D = 256 neutral (377 / 395 / 347 /
    389 against 374 / 394 / 347 / 389) and shipped with the 80-key tile it was checked with.
    """
    common = {
        "tile_m": 64,
        "stages": 2,
        "do_stages": 1,
        "dq_mode": "warp",
        "ds_stages": 1,
        "overlap": not softcap,
        "layout": "dkv_t",
        "wg_slice": not (softcap or sdq),
    }
    if head_dim == 192:
        return BwdConfig(tile_n=96, dkv_split="keys", **common)
    if softcap or sdq:
        return BwdConfig(tile_n=48, dkv_split="d", **common)
    return BwdConfig(tile_n=80, dkv_split="d", **{**common, "dq_mode": "red"}, dq_slices=2)


def bwd_can_implement(
    cfg: BwdConfig,
    head_dim: int,
    dtype: torch.dtype,
    *,
    causal: bool = False,
    local: bool = False,
    varlen: bool = False,
) -> tuple[bool, str]:
    """Whether Fa3Backward can be built for this config: tile legality, smem and registers;
    `causal`, `local` (a sliding window) and `varlen` (packed sequences) describe the problem,
    which the 80-row tile refuses (`_tile_m80_ok`)."""
    if dtype not in DTYPES:
        return False, f"fa3 backward: dtype {dtype} not in (float16, bfloat16)"
    if head_dim not in BWD_HEAD_DIMS:
        return False, f"fa3 backward: head_dim {head_dim} not in {BWD_HEAD_DIMS}"
    if cfg.num_mma_wgs not in BWD_REG_SPLIT:
        return False, f"fa3 backward: num_mma_wgs {cfg.num_mma_wgs} not in {set(BWD_REG_SPLIT)}"
    if cfg.layout not in BWD_LAYOUTS:
        return False, f"fa3 backward: layout {cfg.layout!r} not in {BWD_LAYOUTS}"
    if cfg.dq_slices not in (1, 2):
        return False, f"fa3 backward: dq_slices {cfg.dq_slices} not in (1, 2)"
    ok, reason = (_dkvt_tiles_ok if cfg.layout == "dkv_t" else _sdpt_tiles_ok)(cfg, head_dim)
    if not ok:
        return False, reason
    if head_dim % (8 * cfg.num_mma_wgs) != 0:
        return False, f"fa3 backward: head_dim {head_dim} not split by {cfg.num_mma_wgs} WGs"
    if cfg.stages < 1:
        return False, f"fa3 backward: stages {cfg.stages} < 1"
    if cfg.dq_mode not in BWD_DQ_MODES:
        return False, f"fa3 backward: dq_mode {cfg.dq_mode!r} not in {BWD_DQ_MODES}"
    if cfg.ds_store not in BWD_DS_STORES:
        return False, f"fa3 backward: ds_store {cfg.ds_store!r} not in {BWD_DS_STORES}"
    if cfg.ds_stages not in (1, 2):
        return False, f"fa3 backward: ds_stages {cfg.ds_stages} not in (1, 2)"
    if cfg.layout != "sdp_t" and (
        cfg.scale_out or cfg.stats_regs or cfg.lse_regs or cfg.stats_shfl
    ):
        return False, (
            f"fa3 backward: scale_out {cfg.scale_out} / stats_regs {cfg.stats_regs} / lse_regs "
            f"{cfg.lse_regs} / stats_shfl {cfg.stats_shfl} need layout 'sdp_t', not "
            f"{cfg.layout!r}"
        )
    if cfg.dv_early and not (cfg.layout == "sdp_t" and cfg.overlap):
        return False, "fa3 backward: dv_early needs layout 'sdp_t' and overlap (its loop order)"
    if cfg.dv_before_fence and not (cfg.layout == "sdp_t" and cfg.overlap and not cfg.dv_early):
        return False, (
            "fa3 backward: dv_before_fence needs layout 'sdp_t' and overlap without dv_early "
            "(its loop order)"
        )
    if cfg.stats_shfl and (cfg.stats_regs or cfg.lse_regs or cfg.dv_early or cfg.tile_m % 64):
        return False, (
            f"fa3 backward: stats_shfl needs tile_m a multiple of 64 and none of stats_regs, "
            f"lse_regs, dv_early, not tile_m {cfg.tile_m}, stats_regs {cfg.stats_regs}, "
            f"lse_regs {cfg.lse_regs}, dv_early {cfg.dv_early}"
        )
    if cfg.stats_regs and cfg.tile_m != 64:
        # 128 rows: 32 LSE + 32 D registers on top of S^T, dP^T, dK and dV (R236 without
        # them) spill (136 bytes at D = 64); FA4 spreads them over 8 lanes there instead.
        return False, f"fa3 backward: stats_regs needs tile_m 64 (registers), not {cfg.tile_m}"
    if cfg.lse_regs and cfg.tile_m != 64:
        return False, f"fa3 backward: lse_regs needs tile_m 64 (registers), not {cfg.tile_m}"
    ok, reason = _dq_route_ok(cfg)
    if ok and cfg.tile_m == 80:
        ok, reason = _tile_m80_ok(cfg, causal, local, varlen)
    if not ok:
        return False, reason
    smem = bwd_smem_bytes(cfg, head_dim)
    if smem > SMEM_CAPACITY:
        return False, f"fa3 backward: {smem} B of shared memory > {SMEM_CAPACITY} B"
    regs, budget = bwd_regs_estimate(cfg, head_dim), BWD_REG_SPLIT[cfg.num_mma_wgs][1]
    if regs > budget:
        return False, f"fa3 backward: ~{regs} registers per MMA thread > {budget}"
    return True, ""


def _dq_route_ok(cfg: BwdConfig) -> tuple[bool, str]:
    """How dQ is split between the warpgroups and handed to the writer warp."""
    if cfg.dq_split not in BWD_DQ_SPLITS:
        return False, f"fa3 backward: dq_split {cfg.dq_split!r} not in {BWD_DQ_SPLITS}"
    if cfg.dq_split == "m" and (cfg.layout != "sdp_t" or cfg.tile_m != 64 * cfg.num_mma_wgs):
        return False, (
            f"fa3 backward: dq_split 'm' needs layout 'sdp_t' and tile_m "
            f"{64 * cfg.num_mma_wgs} (64 rows per MMA WG), not {cfg.layout!r} and {cfg.tile_m}"
        )
    if cfg.dq_split == "dt" and (
        cfg.layout != "sdp_t" or cfg.tile_m != 80 or cfg.dq_mode != "warp"
    ):
        # dQ^T's fragment is ordered for the writer warp's sdQ tile (dq_tile_modes); the
        # "atomic" route indexes a (TILE_M, D) fragment. 64 / 128 rows take "d" or "m".
        return False, (
            "fa3 backward: dq_split 'dt' needs layout 'sdp_t', tile_m 80 and dq_mode 'warp', "
            f"not {cfg.layout!r}, {cfg.tile_m} and {cfg.dq_mode!r}"
        )
    if cfg.dq_handoff not in BWD_DQ_HANDOFFS:
        return False, f"fa3 backward: dq_handoff {cfg.dq_handoff!r} not in {BWD_DQ_HANDOFFS}"
    if cfg.dq_handoff != "cta" and (cfg.dq_mode != "warp" or cfg.deterministic):
        return False, (
            f"fa3 backward: dq_handoff {cfg.dq_handoff!r} needs dq_mode 'warp' and "
            f"deterministic False, not {cfg.dq_mode!r} and {cfg.deterministic}"
        )
    if cfg.dq_slices > 1 and (cfg.layout != "dkv_t" or cfg.dq_mode != "red"):
        # Each slice leaves by its own reductions before the next is computed; the sdQ routes
        # hand over whole tiles.
        return False, (
            f"fa3 backward: dq_slices {cfg.dq_slices} needs layout 'dkv_t' and dq_mode 'red', "
            f"not {cfg.layout!r} and {cfg.dq_mode!r}"
        )
    if cfg.dq_mode == "red" and (cfg.deterministic or cfg.dq_split == "dt"):
        # The reductions land in arrival order; the dQ^T fragment of "dt" is not indexed here.
        return False, (
            "fa3 backward: dq_mode 'red' needs deterministic False and dq_split 'd' or 'm', not "
            f"{cfg.deterministic} and {cfg.dq_split!r}"
        )
    return True, ""


def _tile_m80_ok(cfg: BwdConfig, causal: bool, local: bool, varlen: bool) -> tuple[bool, str]:
    """What the 80-row tile is built for: FA4's dense D = 128 problem without a window, causal
    or not (FA4 takes 64-row tiles for causal ones; the row-block range and the diagonal's
    mask are computed from TILE_M, whatever it is). Windows are not built for it.
    Packed sequences: the varlen preprocess writes 64-row pieces that must each fall inside one
    TILE_M block of a sequence's padded rows (common/bwd_preprocess.py), so TILE_M must be a
    multiple of 64. The deterministic build is interface._bwd_config's own (64-row tiles,
    per-element atomics in n_block order)."""
    del causal
    for flag, name in ((local, "a sliding window"), (varlen, "varlen")):
        if flag:
            return False, (
                f"fa3 backward: tile_m 80 is built for dense problems without a window, not {name}"
            )
    if cfg.deterministic:
        return False, "fa3 backward: tile_m 80 needs deterministic False (64-row tiles order dQ)"
    return True, ""


def _sdpt_tiles_ok(cfg: BwdConfig, head_dim: int) -> tuple[bool, str]:
    """Tile legality of the "sdp_t" layout: 64 keys per MMA warpgroup, one Q / dO ring."""
    if cfg.tile_n != 64 * cfg.num_mma_wgs:
        return False, f"fa3 backward: tile_n must be {64 * cfg.num_mma_wgs} (64 keys per MMA WG)"
    # tile_m is the M of dQ's wgmma (64-row atoms, the WGs split D) and S^T's N. 128 rows
    # fit the registers at D = 64 only, and only with dQ through the writer warp.
    if cfg.tile_m not in (64, 80, 128):
        return False, f"fa3 backward: tile_m {cfg.tile_m} not in (64, 80, 128)"
    if cfg.tile_m == 128 and (head_dim != 64 or cfg.dq_mode != "warp"):
        return False, "fa3 backward: tile_m 128 needs head_dim 64 and dq_mode 'warp'"
    # 80 rows (FA4's non-causal tile at D = 128): per MMA thread S^T and dP^T are m64n80, 40 +
    # 40 fp32, dV and dK 64 + 64 (K = 80: 5 k-steps of RS m64n128k16), ~232 of 240 with the
    # overhead of bwd_regs_estimate; dQ is computed as dQ^T (dq_split "dt": 80 is not whole m64
    # atoms), its 40 fp32 after P^T and dS^T are consumed. Shared memory: Q, dO 2 x 2 x 20 KiB
    # + K, V 2 x 32 KiB + sdS 2 x 20 KiB + sdQ 40 KiB + 2 KiB of mbarriers, LSE and D (96-float
    # stages: stats_stage_rows) = 226 KiB of 227.
    if cfg.tile_m == 80 and (head_dim != 128 or cfg.dq_split != "dt"):
        return False, (
            f"fa3 backward: tile_m 80 needs head_dim 128 and dq_split 'dt', not {head_dim} and "
            f"{cfg.dq_split!r}"
        )
    if cfg.do_stages not in (0, cfg.stages):
        return False, f"fa3 backward: layout 'sdp_t' has one Q/dO ring, do_stages {cfg.do_stages}"
    return True, ""


def _dkvt_tiles_ok(cfg: BwdConfig, head_dim: int) -> tuple[bool, str]:
    """Tile legality of the "dkv_t" layout: one m64 atom of query rows (S, dP, dQ), the keys
    split between the warpgroups in S and dP, D (or the keys) in dK^T and dV^T."""
    w = cfg.num_mma_wgs
    if cfg.tile_m != 64:
        return False, f"fa3 backward: layout 'dkv_t' needs tile_m 64, not {cfg.tile_m}"
    # Each WG's S columns are a wgmma N (a multiple of 8); the keys are dQ's K (16 a step).
    if cfg.tile_n % 16 or cfg.tile_n % (8 * w) or not 16 <= cfg.tile_n <= 256:
        return False, (
            f"fa3 backward: tile_n {cfg.tile_n} must be a multiple of 16 and of 8 x {w} in "
            "[16, 256] (layout 'dkv_t')"
        )
    if cfg.dkv_split not in BWD_DKV_SPLITS:
        return False, f"fa3 backward: dkv_split {cfg.dkv_split!r} not in {BWD_DKV_SPLITS}"
    rows = head_dim // w if cfg.dkv_split == "d" else head_dim
    if rows % 64 or head_dim % w:
        return False, (
            f"fa3 backward: dkv_split {cfg.dkv_split!r} gives each WG {rows} rows of D for "
            "dK^T / dV^T, not whole m64 atoms"
        )
    if cfg.dkv_split == "keys" and (cfg.tile_n // w) % 8:
        return False, f"fa3 backward: tile_n {cfg.tile_n} not split into wgmma N by {w} WGs"
    if cfg.ds_store != "scalar":
        return False, "fa3 backward: layout 'dkv_t' stores P and dS with ds_store 'scalar'"
    if cfg.dq_slices > 1 and (head_dim // w // cfg.dq_slices) % 64:
        # A slice of sK's MN-major (D, TILE_N) view, dQ's B operand, starts on a whole 128-byte
        # swizzle atom of D (64 columns) per warpgroup.
        cols = head_dim // w // cfg.dq_slices
        return False, (
            f"fa3 backward: dq_slices {cfg.dq_slices} gives each WG {cols} columns of D per "
            "slice of dQ, not a multiple of 64"
        )
    if cfg.do_stages < 0 or cfg.do_stages > cfg.stages:
        return False, f"fa3 backward: do_stages {cfg.do_stages} not in [0, stages]"
    return True, ""


def bwd_shipped_configs(local: bool = False) -> list[tuple[int, torch.dtype, bool, BwdConfig]]:
    """Every (head_dim, dtype, causal, config) bwd_config_for returns for dense problems without
    softcap, or with `local` for those with a sliding window (the configs packed sequences take
    too: 64-row tiles at D = 128)."""
    return [
        (d, dt, c, bwd_config_for(d, dt, c, local=local))
        for d in BWD_HEAD_DIMS
        for dt in DTYPES
        for c in (False, True)
    ]
