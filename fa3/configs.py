"""Tile configurations for the fa3 forward, one frozen dataclass per (head_dim, dtype, causal).

fp16 and bf16 share one table (`_tiles`, the same bytes per element); float8_e4m3fn has its own
(`FP8_CONFIGS`): the same kernel, with 1-byte Q/K/V tiles, a bf16 sO and 32-key P blocks.
Every entry was chosen from the shared-memory and register arithmetic written next to it (and
FA3's published choices); H200 numbers are noted where an entry was measured.
`python -m benchmarks.fa3_ablate --final` (16-bit) and `python -m benchmarks.fa3_fp8_check
--ablate` (fp8) time the candidates that may replace them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashsuite.common.validation import AttnParams
from flashsuite.fa3.fwd_config import Fa3Config

# Hopper: 227 KiB of dynamic shared memory per CTA (cutlass.memory.get_smem_capacity_in_bytes).
SMEM_CAPACITY = 232_448
# setmaxnreg split (producer, consumer) per number of consumer warpgroups, at one CTA per SM
# (65,536 registers): 2 WGs: 128 x 24 + 256 x 240 = 64,512; 3 WGs: 128 x 32 + 384 x 160 = 65,536.
REG_SPLIT = {2: (24, 240), 3: (32, 160)}
PRODUCER_REGS, CONSUMER_REGS = REG_SPLIT[2]
NUM_CONSUMER_WG = 2  # the default; Fa3Config.num_consumer_wgs may ask for 3
HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = (torch.float16, torch.bfloat16)  # the 16-bit inputs: O in the input dtype
FP8_DTYPE = torch.float8_e4m3fn  # e4m3 inputs with (B, Hkv) descales: O in bf16
# wgmma K per instruction: P's columns (keys) come in blocks of 16 (16-bit) or 32 (8-bit).
MMA_K = {2: 16, 1: 32}
# Registers a consumer thread needs beyond the fragments (addresses, row statistics, loop state)
# per number of consumer WGs. Under the 160 cap of 3 WGs ptxas packs tighter (FA3 runs 192x128 at
# D=64 there); the 0-spill check of tests/test_fa3_compile.py is the real judge.
_REG_OVERHEAD = {2: 40, 3: 24}
# e4m3 at two warpgroups packs tighter still: FA3's fp8 tiles, 128 x 224 at D = 128 (S 112 + O 64
# + P 28) and 128 x 128 at D = 256 (64 + 128 + 16), compile with 0 spills at 240 (sm_90a,
# benchmarks/fa3_softmax_sass, in-place softmax with row_chains and pin_pv_wait); 128 x 224 with
# V transposed in smem (224 registers, VT_REG_SPLIT) spills 96 bytes and serialises its wgmmas.
_REG_OVERHEAD_FP8 = {2: 32, 3: 24}


RESCALE_THRESHOLD_MAX = 8
V_TRANSPOSES = ("host", "smem")
# Producer-WG warps that transpose V with v_transpose="smem" (warp 0 keeps the TMA loads).
TRANSPOSE_WARPS = 3
VT_REG_SPLIT = {2: (56, 224), 3: (32, 160)}


def reg_split(cfg: Fa3Config) -> tuple[int, int]:
    """(producer, consumer) setmaxnreg of a build: VT_REG_SPLIT where the producer warpgroup
    transposes V in shared memory (e4m3 only; can_implement refuses it in 16 bits), else
    REG_SPLIT."""
    return (VT_REG_SPLIT if cfg.v_transpose == "smem" else REG_SPLIT)[cfg.num_consumer_wgs]


def _align(n: int, a: int = 1024) -> int:
    return (n + a - 1) // a * a


def smem_bytes(cfg: Fa3Config, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Shared memory of the kernel's storage struct: mbarriers, then 1 KiB-aligned sQ, sK, sV
    (Vᵀ for fp8) and sO (16-bit O in the input dtype, fp8's in bf16; none where sO aliases sQ).

    v_transpose="smem" adds the Vᵀ ring (a third K/V-sized buffer) and its full/empty barriers.
    Mirrors `Fa3Forward._storage` (compile.py checks the two agree on the real struct).
    """
    elem = dtype.itemsize
    rings = 3 if cfg.v_transpose == "smem" else 2  # K, V (and Vᵀ)
    mbar = 8 * (2 * cfg.q_stages + rings * 2 * cfg.stages)  # Q, K, V (and Vᵀ) full/empty
    if not cfg.o_alias_q and rings == 2:
        mbar = _align(mbar, 128) + 4 * cfg.tile_m  # sLSE, in this struct with or without lse_tma
    q = cfg.tile_m * head_dim * elem * cfg.q_stages
    kv = cfg.tile_n * head_dim * elem * cfg.stages
    o = 0 if cfg.o_alias_q else cfg.tile_m * head_dim * 2
    total = _align(mbar) + _align(q) + rings * _align(kv) + (_align(o) if o else 0)
    return total


def consumer_regs_estimate(
    cfg: Fa3Config, head_dim: int, dtype: torch.dtype = torch.bfloat16
) -> int:
    """fp32 S and O accumulators, the P fragment (two 16-bit or four 8-bit values per register)
    and overhead, per thread.

    With intra-WG overlap S(n+1) and P(n) are live together; without it, P takes S's place
    (the 192 x 128 and 192 x 144 tiles at D = 96 keep 0 spills at R157 of 160 that way, and
    spill 144 bytes with overlap).
    """
    rows_per_wg = cfg.tile_m // cfg.num_consumer_wgs
    acc_s = rows_per_wg * cfg.tile_n // 128
    acc_o = rows_per_wg * head_dim // 128
    p = acc_s * dtype.itemsize // 4 if cfg.intra_wg_overlap else 0
    overhead = _REG_OVERHEAD_FP8 if dtype.itemsize == 1 else _REG_OVERHEAD
    return acc_o + acc_s + p + overhead.get(cfg.num_consumer_wgs, 40)


def can_implement(cfg: Fa3Config, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the kernel can be built for this config: tile legality, smem and registers."""
    fp8 = dtype == FP8_DTYPE
    if dtype not in DTYPES and not fp8:
        return False, f"fa3: dtype {dtype} not in (float16, bfloat16, float8_e4m3fn)"
    if head_dim not in HEAD_DIMS:
        return False, f"fa3: head_dim {head_dim} not in {set(HEAD_DIMS)}"
    if cfg.num_consumer_wgs not in REG_SPLIT:
        return False, f"fa3: num_consumer_wgs {cfg.num_consumer_wgs} not in {set(REG_SPLIT)}"
    if cfg.tile_m != 64 * cfg.num_consumer_wgs:
        return False, f"fa3: tile_m must be {64 * cfg.num_consumer_wgs} (64 rows per consumer WG)"
    if fp8 and cfg.o_alias_q:
        return False, "fa3: fp8 needs its own sO buffer (bf16 O does not fit on the fp8 sQ)"
    if cfg.v_transpose not in V_TRANSPOSES:
        return False, f"fa3: v_transpose {cfg.v_transpose!r} not in {V_TRANSPOSES}"
    if cfg.v_transpose == "smem":
        if not fp8:
            return False, "fa3: v_transpose='smem' is for float8_e4m3fn (16-bit V needs none)"
        if cfg.persistent:
            return False, "fa3: v_transpose='smem' is built for the plain grid (persistent=False)"
    # wgmma N is a multiple of 8 up to 256; P is the K operand of PV, so tile_n is a multiple of
    # its K (fp8: Vᵀ's smem rows are tile_n bytes, and 32 is a swizzle width that divides them).
    mma_k = MMA_K[dtype.itemsize]
    if not (mma_k <= cfg.tile_n <= 256 and cfg.tile_n % mma_k == 0):
        return False, f"fa3: tile_n {cfg.tile_n} must be a multiple of {mma_k} in [{mma_k}, 256]"
    if cfg.skip_masked_wg and not cfg.intra_wg_overlap:
        return False, "fa3: skip_masked_wg needs intra_wg_overlap=True"
    if not 0 <= cfg.rescale_threshold <= RESCALE_THRESHOLD_MAX:
        return False, (
            f"fa3: rescale_threshold expected in [0, {RESCALE_THRESHOLD_MAX}] (P <= 2^t must fit "
            f"e4m3), got {cfg.rescale_threshold}"
        )
    if cfg.permute_v_keys and dtype != FP8_DTYPE:
        return False, f"fa3: permute_v_keys is for float8 inputs (P·V's A fragment), not {dtype}"
    if cfg.l2_section_mib < 1:
        return False, f"fa3: l2_section_mib expected >= 1, got {cfg.l2_section_mib}"
    if cfg.tile_counter and not cfg.persistent:
        return False, "fa3: tile_counter needs persistent=True (the plain grid's CTAs own a tile)"
    if cfg.ex2_emu < 0:
        return False, f"fa3: ex2_emu expected >= 0 (0: all by MUFU), got {cfg.ex2_emu}"
    if cfg.spec_exps and not (
        cfg.rescale_threshold > 0
        and cfg.intra_wg_overlap
        and not (cfg.softmax_apart or cfg.pv_wait_after_max or cfg.pin_pv_wait)
    ):
        return False, (
            "fa3: spec_exps needs rescale_threshold > 0 and the in-place overlapped softmax "
            "(intra_wg_overlap=True; softmax_apart, pv_wait_after_max, pin_pv_wait off)"
        )
    if cfg.softmax_apart and not cfg.intra_wg_overlap:
        return False, "fa3: softmax_apart needs intra_wg_overlap=True"
    if cfg.rescale_before_pv and not cfg.intra_wg_overlap:
        return False, "fa3: rescale_before_pv needs intra_wg_overlap=True"
    if cfg.o_zero_init and not cfg.intra_wg_overlap:
        return False, "fa3: o_zero_init needs intra_wg_overlap=True (the overlapped main loop)"
    if cfg.split_loops and not cfg.intra_wg_overlap:
        return False, "fa3: split_loops needs intra_wg_overlap=True (the overlapped main loop)"
    if cfg.pv_wait_after_max and (not cfg.intra_wg_overlap or cfg.softmax_apart or cfg.pin_pv_wait):
        return False, (
            "fa3: pv_wait_after_max is for the in-place overlap softmax (intra_wg_overlap=True, "
            "softmax_apart=False), without pin_pv_wait (which pins the same wait)"
        )
    if cfg.pv_wait_exps < 0:
        return False, f"fa3: pv_wait_exps expected >= 0, got {cfg.pv_wait_exps}"
    if (cfg.overlap_tiles or cfg.balanced_order) and not cfg.persistent:
        return False, "fa3: overlap_tiles / balanced_order need persistent=True"
    if cfg.head_section < 0 or (cfg.head_section and cfg.persistent):
        return False, (
            f"fa3: head_section {cfg.head_section} expected >= 0, and 0 with persistent=True "
            "(it orders the plain grid of packed sequences)"
        )
    if cfg.lpt_grid and (cfg.persistent or cfg.head_section):
        return False, "fa3: lpt_grid orders the dense plain grid (persistent=False, head_section 0)"
    if cfg.stages < 2:
        return False, f"fa3: stages {cfg.stages} < 2 (the K/V ring needs double buffering)"
    if cfg.prefetch_next_q and (cfg.persistent or cfg.lpt_grid or cfg.head_section):
        return False, (
            "fa3: prefetch_next_q is for the dense plain grid (persistent=False, lpt_grid=False, "
            "head_section 0)"
        )
    if cfg.o_direct_store and (cfg.persistent or cfg.lpt_grid or cfg.head_section):
        return False, (
            "fa3: o_direct_store is for the dense plain grid (persistent=False, lpt_grid=False, "
            "head_section 0)"
        )
    if cfg.lse_tma and not (cfg.overlap_tiles and not cfg.o_alias_q and cfg.v_transpose != "smem"):
        return False, (
            "fa3: lse_tma is for the persistent tile overlap with a separate sO "
            "(persistent=True, overlap_tiles=True, o_alias_q=False, v_transpose='host')"
        )
    if cfg.q_in_regs and (dtype == FP8_DTYPE or head_dim > 128 or cfg.num_consumer_wgs != 2):
        why = f"got {dtype}, head_dim {head_dim}, {cfg.num_consumer_wgs} WGs"
        return False, f"fa3: q_in_regs: 16-bit, head_dim <= 128, 2 consumer WGs; {why}"
    if cfg.trace and dtype == FP8_DTYPE:
        return False, "fa3: trace is for 16-bit inputs (its tensor takes descale_q's slot)"
    if cfg.q_stages not in (1, 2):
        return False, f"fa3: q_stages expected 1 or 2, got {cfg.q_stages}"
    if cfg.q_stages == 2 and not (cfg.overlap_tiles and not cfg.o_alias_q):
        return False, (
            "fa3: q_stages=2 is for the persistent tile overlap with a separate sO "
            "(persistent=True, overlap_tiles=True, o_alias_q=False)"
        )
    smem = smem_bytes(cfg, head_dim, dtype)
    if smem > SMEM_CAPACITY:
        return False, f"fa3: {smem} B of shared memory > {SMEM_CAPACITY} B"
    regs = consumer_regs_estimate(cfg, head_dim, dtype)
    budget = reg_split(cfg)[1]  # fewer with the smem transpose: its producer warps keep more
    if regs > budget:
        return False, f"fa3: ~{regs} registers per consumer thread > {budget}"
    return True, ""


def get_config(
    head_dim: int, dtype: torch.dtype, causal: bool, seqlen_k: int | None = None
) -> Fa3Config:
    """The shipped config for (head_dim, dtype, causal), and for short key lengths `seqlen_k`
    (None: a long one) where that differs. fp16 and bf16 share tiles (same bytes);
    float8_e4m3fn takes `FP8_CONFIGS`, with V transposed in shared memory up to
    FP8_SMEM_VT_MAX_SEQLEN_K keys.

    16-bit tiles come from `_tiles`, with the schedule options of the tables below it. Every
    causal entry runs on the persistent scheduler v2 (tile overlap + balanced order; faster
    than the plain grid at every head_dim: docs/results.md, "fa3 causal: the persistent
    scheduler"), with skip_masked_wg at the head dims of _SKIP_MASKED_WG_DIMS. Causal D = 96
    keeps 128-row tiles up to SHORT_CAUSAL_SEQLEN_K keys (see _tiles); causal D = 64 takes two
    Q buffers up to SHORT_CAUSAL_TWO_Q keys.

    Non-causal entries are plain-grid builds, but D = 64 at seqlen_k <= SHORT_SEQLEN_K: a tile
    of a few K/V blocks pays its fill, drain and epilogue often, and v2 overlaps the epilogue
    with the next tile ("Short sequences"). Dense problems take config_for's builds on top.
    """
    if dtype == FP8_DTYPE:
        if fp8_vt_in_smem(head_dim, seqlen_k, causal):
            return fp8_smem_transpose_config(head_dim, causal)
        short = FP8_CAUSAL_SHORT.get(head_dim) if causal else None
        if short is not None and seqlen_k is not None and seqlen_k <= short[0]:
            return short[1]
        return _fp8_tiles(head_dim, causal)
    cfg = _tiles(head_dim, causal)
    fa4_loop = (head_dim, causal) in _FA4_LOOP
    if cfg.intra_wg_overlap:
        cfg = replace(
            cfg,
            softmax_apart=(head_dim, causal) in _SOFTMAX_APART,
            k_ahead=(head_dim, causal) in _K_AHEAD,
            wg_slice=(head_dim, causal) in _WG_SLICE or fa4_loop,
            split_loops=(head_dim, causal) in _SPLIT_LOOPS,
            pv_wait_after_max=(head_dim, causal) in _PV_WAIT_AFTER_MAX or fa4_loop,
            stage_desc=fa4_loop,
            loop_mask_test=not fa4_loop,
            pv_wait_exps=FA4_LOOP_EXPS if fa4_loop else 0,
        )
    if not causal:
        short = seqlen_k is not None and seqlen_k <= SHORT_SEQLEN_K
        return _two_q(_overlap(cfg)) if short and head_dim in _SHORT_PERSISTENT_DIMS else cfg
    if head_dim in _SHORT_Q_TILES and seqlen_k is not None and seqlen_k <= SHORT_CAUSAL_SEQLEN_K:
        return _overlap(_SHORT_Q_TILES[head_dim])
    cfg = replace(_overlap(cfg), skip_masked_wg=head_dim in _SKIP_MASKED_WG_DIMS)
    if seqlen_k is not None and seqlen_k <= SHORT_CAUSAL_TWO_Q.get(head_dim, 0):
        return _two_q(cfg)
    return cfg


# Causal head dims whose tiles are taller than tile_n and measured faster with skip_masked_wg.
_SKIP_MASKED_WG_DIMS = (64, 96, 192)
# (head_dim, causal) pairs that run the softmax apart from S (softmax_apart; config_for and
# varlen_config_for leave softcap and windowed problems out, which no GPU run has checked with
# it). Non-causal D = 128: see _tiles. Causal D = 256 +3.1 % at N = 8k (H200, 2026-12-04;
# D = 128 -2.2 %, D = 64 level); D = 192 686.1 / 650.6 TFLOP/s with / without (causal within
# noise, D = 256 639.7 / 679.2; docs/results.md).
_SOFTMAX_APART = ((256, True), (128, False), (192, False))
# (head_dim, causal) pairs whose producer loads K ahead of V (k_ahead). Non-causal D = 128: see
# _tiles. The others keep the K, V order: level or slower with it at every other head dim,
# causal or not (H200, 2026-12-04, N = 8k, 5 passes; docs/results.md).
_K_AHEAD = ((128, False),)
# (head_dim, causal) pairs whose wgmma descriptors come from the warpgroup's slice (wg_slice)
# and causal pairs whose masked and unmasked blocks run as two loops (split_loops; only causal
# problems without a left window take them): non-causal D = 128 with wg_slice 1.036 / 1.019x
# the build without at N = 4k / 16k, causal D = 128 with both 1.052 / 1.012, causal D = 64
# 1.057 / 1.014, causal D = 192 1.033 / 1.003 at 1k / 4k (H100 80GB HBM3, 2026-12-05/06; the
# builds not taken and the runs in docs/results.md, "Schedule options on an H100"). Softcap and
# windowed problems keep the builds without them; packed ones take them (varlen_configs).
_WG_SLICE = ((128, False), (128, True), (64, True), (96, True), (192, True))
_SPLIT_LOOPS = ((128, True), (64, True), (96, True), (192, True))
# (head_dim, causal) pairs whose P·V wait comes after the row max (pv_wait_after_max, the
# in-place softmax). Non-causal D = 256: 1.001 / 1.039 / 1.027x the build without at N = 1k /
# 4k / 16k, same run as causal D = 192 above. D = 64 lost with it alone (0.979 / 0.978x).
_PV_WAIT_AFTER_MAX = ((256, False),)
# (head_dim, causal) pairs that run FA4's loop, the four options together: the row max under
# P·V (pv_wait_after_max), descriptors from the warpgroup's slice (wg_slice) and from the
# stage's first (stage_desc), no mask test in the loop (loop_mask_test off). Non-causal
# D = 64: its ncu profile had the build without wait for P·V right after the first row-max
# instruction (5.5 % of the warp samples at that wait, N = 16k, H100; FA4 under 0.1 %); with
# them 1.015 / 1.007x that build at N = 4k / 16k (H100, 2026-12-07; docs/results.md, "D = 64
# on FA4's loop").
_FA4_LOOP = ((64, False),)
# Their exponentials before P·V's wait per row (pv_wait_exps; 11 MUFU.EX2 between the waits
# with the two row corrections, as in FA4's loop): non-causal D = 64's plain grid at 0.981 /
# 0.992x FA4 at N = 8k / 16k against 0.965 / 0.971x with none, and 0.991 against 0.965 at
# 16k in a second run; 8 0.955 / 0.974x, 16 and 32 0.90-0.91x (H100, 2026-12-07;
# docs/results.md, "Exponentials under P·V at D = 64").
FA4_LOOP_EXPS = 4
# Non-causal head dims that run problems with seqlen_k <= SHORT_SEQLEN_K on the v2 scheduler
# with two Q buffers (dense longer D = 64 too: config_for): N = 512 / 1k / 2k 1.095 / 1.034 /
# 0.976x the plain grid (H100, 2026-12-06, commit 8839a07; docs/results.md, "Short sequences").
SHORT_SEQLEN_K = 1024
_SHORT_PERSISTENT_DIMS = (64,)
# Causal head dims that take two Q buffers (q_stages) for seqlen_k up to this. Same run kind,
# `--causal --variant q2:q_stages=2` against the table entry, N = 1k / 2k / 4k: D = 64 1.060 /
# 1.025 / 0.991 (at 1k 1.213x FA4, 0.926x cuDNN); D = 128 1.004 / 1.016 / 0.994 / 0.969 at
# 1k / 2k / 4k / 16k, not taken.
SHORT_CAUSAL_TWO_Q = {64: 2048}
# Causal head dims in _SHORT_Q_TILES run that tile for seqlen_k up to this (D = 96: see _tiles).
SHORT_CAUSAL_SEQLEN_K = 1024


def _tiles(head_dim: int, causal: bool) -> Fa3Config:
    """Tile shape per head_dim (plain grid). D = 64 and D = 128 are chosen from H200
    measurements (quoted per branch); the others follow the smem arithmetic and FA3's published
    choices. Every entry compiles with the wgmma pipeline intact (no ptxas C7512/C7519) and no
    spills (tests/test_fa3_compile.py). ptxas max register index per consumer thread (budget
    240) is noted per branch.
    """
    if head_dim <= 64:
        # FA3's D=64 shape: three consumer warpgroups (192 query rows, 32/160 registers),
        # 128-wide K/V tiles, 3 stages (Q 24 + K/V 96 + sO 24 KiB). R157 of 160.
        # H200 2026-11-29 (bf16, `ablate --final`): N=16k 522 TFLOP/s vs cuDNN 458 (two
        # warpgroups 467; tile_n 192 471); causal N=16k 484 vs 441 (two warpgroups 436).
        return Fa3Config(tile_m=192, tile_n=128, stages=3, num_consumer_wgs=3)
    if head_dim <= 96:
        # Three consumer warpgroups (192 query rows at 160 registers, as FA4's 192 x 144 with P
        # through smem); with P in registers 112 keys is the widest S that keeps 0 spills (128:
        # 144 bytes). Q 36 + K/V 2 x 2 x 21 + sO 36 KiB = 156 KiB. R155. H200 2026-12-04,
        # commit b6d82ef, N = 8k / 16k: 578.4 / 589.5 TFLOP/s against 537.8 / 539.3 for
        # 128 x 128 on two warpgroups (other shapes in docs/results.md).
        # Causal too, with skip_masked_wg, split loops and wg_slice (keys up to
        # SHORT_CAUSAL_SEQLEN_K keep _SHORT_Q_TILES[96]): H100 80GB HBM3, 2026-12-06, commit
        # 403a0ef (`fa3_fwd_ab --head-dim 96 --causal --variant t3ss:tile_m=192,
        # num_consumer_wgs=3,tile_n=112,skip_masked_wg=1,split_loops=1,wg_slice=1`, medians of 5
        # passes) against 128 x 128 on two warpgroups at N = 1k / 2k / 4k / 16k: 0.909 / 1.079 /
        # 1.023 / 1.060x (fa3 / FA4 0.940 -> 0.989x at 16k); packed (64k tokens in 35
        # sequences, `fa3_varlen_order_ab`) 1.117x.
        return Fa3Config(tile_m=192, tile_n=112, stages=2, num_consumer_wgs=3)
    if head_dim <= 128:
        if causal:
            # Causal tiles are half masked on the diagonal: keep them square. 193 KiB (a
            # separate sO, so v2 stores O per warpgroup and releases Q early). R194.
            return Fa3Config(tile_n=128, stages=2)
        # FA4's non-causal shape (128 x 128, intra-WG overlap, sO on sQ: 160 KiB), which
        # get_config runs with the softmax apart from S and K loaded ahead of V: 602.7 / 623.9 /
        # 632.4 TFLOP/s at N = 4k / 8k / 16k against 580.0 / 614.0 / 622.2 for FA3's 128 x 176
        # (H200, 2026-12-04, commit 85469e0; docs/results.md). R184. Dense problems run it
        # persistent (config_for, _PERSISTENT_Q_REGS_DIMS).
        return Fa3Config(tile_n=128, stages=2, o_alias_q=True)
    if head_dim <= 192:
        # 42 KiB per K or V stage at tile_n 112; sO aliased on sQ: 216 KiB. R203.
        return Fa3Config(tile_n=112, stages=2, o_alias_q=True)
    # D=256: acc_O alone is 128 registers, so S stays narrow (tile_n 80 as in FA3);
    # Q 64 KiB + 2 x 2 x 40 KiB = 224 KiB with sO aliased on sQ (under v2: the K-first
    # producer order and the balanced order, no per-warpgroup sO). R212.
    # O is rescaled only when a row's max grows by more than 2^8 (rescale_threshold; its 128
    # FMULs a thread per block otherwise): +0.6 to +13 % at N = 1k-16k, causal or not (H200,
    # docs/results.md, "The softmax's instruction count"); D = 192 timed level at 16k.
    return Fa3Config(tile_n=80, stages=2, o_alias_q=True, rescale_threshold=8)


def _overlap(cfg: Fa3Config) -> Fa3Config:
    """The persistent scheduler with tile-boundary overlap and the balanced tile order."""
    return replace(cfg, persistent=True, overlap_tiles=True, balanced_order=True)


def _two_q(cfg: Fa3Config) -> Fa3Config:
    """A persistent v2 `cfg` with its own sO and two Q buffers (Fa3Config.q_stages)."""
    return replace(cfg, o_alias_q=False, q_stages=2)


def _plain(cfg: Fa3Config) -> Fa3Config:
    """`cfg` on the plain grid (the fp8 builds with V transposed in smem or block descales)."""
    return replace(cfg, persistent=False, overlap_tiles=False, balanced_order=False)


# ------------------------------------------------------------------------------------------------
# float8 e4m3 inputs
# ------------------------------------------------------------------------------------------------
def _fp8(tile_n: int, stages: int = 2, wgs: int = 2, **softmax) -> Fa3Config:
    # 64 rows per consumer WG, non-persistent; sO is bf16 (2 bytes) and cannot live on the sQ.
    return Fa3Config(tile_m=64 * wgs, tile_n=tile_n, stages=stages, num_consumer_wgs=wgs,
                     o_alias_q=False, persistent=False, **softmax)  # fmt: skip


# The e4m3 softmax of non-causal D = 128 and 256 and causal D = 256: O rescaled when a row's max
# grows by more than 1 bit, the row max and sum in four chains (row_chains): 1.042 / 1.001x
# (D = 128) and 1.050 / 1.038x (D = 256) the table build at N = 4k / 16k, all 142 oracle cases
# of `benchmarks/fa3_fp8_check` passed (H200, commit edeb6c2). A threshold of 8 bits is faster
# still but failed 6 of 142 (a stale max leaves a row's largest P at 2^δ, rounded in e4m3;
# commit b4d6c83). docs/results.md, "The softmax's instruction count".
_FP8_SOFTMAX = {"rescale_threshold": 1, "row_chains": True}


# e4m3 D = 128's 128 x 192 tile on two consumer warpgroups: what a keys-major V runs on the host
# route (FP8_CONFIGS' entry permutes V's keys, which would copy a V that is Vᵀ already), the
# base of the smem-Vᵀ build, and the per-block descales' tile. Q 16 + K/V 2 x 2 x 24 + sO
# 32 KiB = 144 KiB; S 96 + O 64 + P 24.
_FP8_D128_TWO_WGS = _fp8(192, **_FP8_SOFTMAX, wg_slice=True, loop_mask_test=False)

# head_dim -> fp8 tile config (non-causal and causal unless FP8_CAUSAL_CONFIGS says otherwise).
# Rnnn: highest register of the SASS (nvdisasm), budget 240; all 0 spills. D = 64, 128, 256
# from the H200 ablation of 2026-11-29 (commit 8867277, `fa3_fp8_check --ablate`, B·N = 16k,
# Hq·D = 2048, N = 8k, fp8 TFLOP/s with the Vᵀ copy, non-causal / causal); D = 96, 192 are
# not measured (smem and register arithmetic).
FP8_CONFIGS: dict[int, Fa3Config] = {
    # FA3's tile, 192 x 160 on 3 consumer WGs (160 registers each): H100 80GB HBM3,
    # 2026-12-05 (`fa3_fwd_ab --fp8 --head-dim 64 --variant t3n:tile_m=192,
    # num_consumer_wgs=3,tile_n=160`, medians of 3 interleaved passes, the whole call) 1.047 /
    # 1.101x the 128 x 192 tile at N = 4k / 16k (with pin_pv_wait 0.984 / 1.054); causal
    # 0.980 / 1.037, not taken. H200, 2-WG tiles: tile_n 192 499 / 421 TFLOP/s (128: 473 /
    # 419, 256: 489 / 441, 3 stages 476 / 420). Q 12 + K/V 2 x 2 x 10 + sO 24 KiB = 76 KiB,
    # 96 KiB with the Vᵀ ring of V transposed in smem (the table's choice at D = 64).
    64: _fp8(160, wgs=3),
    # Q 12 + K/V 2 x 2 x 12 + sO 24 KiB = 84 KiB; S 64 + O 48 + P 16. R165.
    96: _fp8(128),
    # Two WGs (_FP8_D128_TWO_WGS, what a keys-major V, the smem-Vᵀ build and the per-block
    # descales run): tile_n 192 760 / 630 (128: 726 / 619, 3 stages 737 / 613, no ping-pong
    # 747 / 618); FA3's 128 x 224 on the host-Vᵀ route 0.947x at N = 16k (H100 80GB HBM3,
    # 2026-12-06, `fa3_fwd_ab --fp8 --variant t224:tile_n=224,v_transpose=host`, 3 passes);
    # wg_slice with no mask test in the loop 1.053 / 1.041x at N = 8k / 16k (either alone
    # 0.976 / 0.992x; with pv_wait_after_max 0.973 / 0.978x; H100, commit 6558210, 5 passes).
    # The entry: 192 x 96 on three consumer warpgroups with permute_v_keys (160 registers;
    # loop 406 SASS instructions a block and warp against 714): H100 80GB HBM3, 2026-12-07,
    # commit d252b34, 3 passes, 1.066 / 1.027x and 1.011 / 1.026x the two-WG tile at N = 4k /
    # 16k in two calls (three WGs alone 0.989 / 0.981x, permute_v_keys alone 0.999x).
    128: _fp8(96, wgs=3, **_FP8_SOFTMAX, wg_slice=True, loop_mask_test=False, permute_v_keys=True),
    # Q 24 + K/V 2 x 2 x 24 + sO 48 KiB = 168 KiB; S 64 + O 96 + P 16. R207.
    192: _fp8(128),
    # acc_O alone is 128 registers: S stays narrow. tile_n 96: 914 / 712 (64: 837 / 644,
    # 3 stages 886 / 680, no ping-pong 851 / 684). Q 32 + K/V 2 x 2 x 24 + sO 64 KiB = 192 KiB.
    # wgmma descriptors from the warpgroup's slice and no mask test in the main loop:
    # H100 80GB HBM3, 2026-12-05, commit 6c5318d (`scripts/gpu_check.sh fwd-candidates`, medians
    # of 5 interleaved passes, N = 4k / 16k) 1.017 / 1.041x the build without (D = 128: 1.002 /
    # 0.987, D = 64: 0.986 / 1.026; not taken there).
    256: _fp8(96, **_FP8_SOFTMAX, wg_slice=True, loop_mask_test=False),
}
# Causal entries that differ: at D = 64 the widest S (256: 441 vs 421 TFLOP/s); at D = 128 and
# 256 the non-causal tiles in split loops with wg_slice (1.049 / 1.003x and 1.055 / 1.043x at
# N = 4k / 16k); every head dim on the persistent scheduler v2 (1.02-1.17x the plain grid at
# N = 1k-16k; D = 256 with _FP8_SOFTMAX 1.014 / 1.064x). H100 runs of commits 403a0ef, dc85b5f,
# 8526760 and 86b048f in docs/fp8.md and docs/results.md.
# Causal D = 128: the non-causal entry's tile, softmax and key order (192 x 96 on three
# consumer warpgroups, permute_v_keys, _FP8_SOFTMAX) in the causal build's split loops on the
# persistent scheduler: H100 80GB HBM3, 2026-12-07 (`fa3_fwd_ab --fp8 --causal --head-dim 128
# --variant t3r:...`, the whole call, medians of 5 interleaved passes) 0.965 / 1.028 / 1.026 /
# 1.068 / 1.053x the 128 x 192 two-WG build at N = 1k / 2k / 4k / 8k / 16k; that build stays
# up to FP8_CAUSAL_SHORT's 1k keys and runs a keys-major V.
_FP8_D128_CAUSAL_TWO_WGS = _overlap(_fp8(192, split_loops=True, wg_slice=True))
_FP8_D128_CAUSAL_THREE_WGS = replace(
    _FP8_D128_CAUSAL_TWO_WGS, tile_m=192, num_consumer_wgs=3, tile_n=96, permute_v_keys=True,
    **_FP8_SOFTMAX,
)  # fmt: skip
FP8_CAUSAL_CONFIGS: dict[int, Fa3Config] = {
    64: _overlap(_fp8(256)),
    96: _overlap(_fp8(128)),
    128: _FP8_D128_CAUSAL_THREE_WGS,
    192: _overlap(_fp8(128)),
    256: _overlap(_fp8(96, **_FP8_SOFTMAX, split_loops=True, wg_slice=True)),
}
# head_dim -> (most keys, config): causal builds that replace FP8_CAUSAL_CONFIGS' entry up to
# that key length (past the smem-Vᵀ route's), where the entry was measured behind.
FP8_CAUSAL_SHORT: dict[int, tuple[int, Fa3Config]] = {128: (1024, _FP8_D128_CAUSAL_TWO_WGS)}

# What a keys-major V runs where the entry above permutes V's keys (config_for).
_FP8_KEYS_IN_ORDER: dict[tuple[int, bool], Fa3Config] = {
    (128, False): _FP8_D128_TWO_WGS,
    (128, True): _FP8_D128_CAUSAL_TWO_WGS,
}


def fp8_key_order_config(head_dim: int, causal: bool) -> Fa3Config:
    """The host-Vᵀ build that reads V's keys in order at (head_dim, causal): what a keys-major V
    runs (`config_for`; the table's entry unless that permutes V's keys)."""
    return _FP8_KEYS_IN_ORDER.get((head_dim, causal)) or _fp8_tiles(head_dim, causal)


def _fp8_tiles(head_dim: int, causal: bool) -> Fa3Config:
    """The fp8 table's entry for (head_dim, causal)."""
    if head_dim not in FP8_CONFIGS:
        raise ValueError(f"fa3: fp8 head_dim {head_dim} not in {set(FP8_CONFIGS)}")
    if causal and head_dim in FP8_CAUSAL_CONFIGS:
        return FP8_CAUSAL_CONFIGS[head_dim]
    return FP8_CONFIGS[head_dim]


# Who transposes fp8 V (wgmma's B operand must be K-major: Vᵀ), per head_dim: the kernel, in
# shared memory (v_transpose="smem"), for key lengths up to this (None: any), else the host
# (`interface.transpose_v`: one Triton copy of V, 29-32 us at B·N = 16k, Hkv·D = 2048 on an
# H100, 2.1-2.3 TB/s; `benchmarks/keys_major_copy_bench`). The smem build's cost is a share of
# the kernel (10-22 % at D = 128 / 256), the copy's a fixed time that the kernel's O(N² D)
# outgrows, so the host wins from some length on. H100 80GB HBM3, 2026-12-06, commit 811b62d
# (`benchmarks/fa3_fwd_ab --fp8 --head-dim D [--causal] --variant h:v_transpose=host` (D = 256:
# tile_n=96 too), B·N = 16k, Hq·D = 2048, medians of 5 / 3 interleaved passes), the whole call
# on the host route / the smem build at N = 1k / 2k / 4k / 8k / 16k (where the smem build ran):
#     D = 64   4k-16k 0.975 / 1.031 / 1.003, causal 0.986 / 1.002 / 1.036: smem at any length
#     D = 128  0.958 / 1.000 / 1.044 / 1.070, causal 0.897 / 0.955 / 1.024 / 1.036 / 1.063
#     D = 256  1.020 / 1.103 / 1.167, causal 0.916 / 1.043 / 1.150
# D = 96 and 192 are not measured and keep the host copy. Lengths below 1k keep the smem build.
FP8_SMEM_VT_MAX_SEQLEN_K: dict[int, int | None] = {64: None, 128: 2048, 256: 512}
# Causal limits that differ (D = 64's and 128's host builds on the persistent scheduler are ahead
# from 1k keys; FP8_CAUSAL_CONFIGS).
FP8_SMEM_VT_CAUSAL_MAX_SEQLEN_K: dict[int, int | None] = {64: 512, 128: 512, 256: 1024}
# (head_dim, causal) whose smem build starts from another tile than the table's entry: e4m3
# D = 128 from the two-WG tile without wg_slice and with the loop's mask test (with them
# 0.975 / 0.980x at N = 1k / 2k; H100, 2026-12-06, c128a37).
_FP8_SMEM_TILES = {
    (128, False): replace(_FP8_D128_TWO_WGS, wg_slice=False, loop_mask_test=True),
    (128, True): _FP8_D128_CAUSAL_TWO_WGS,
}


def fp8_vt_in_smem(head_dim: int, seqlen_k: int | None, causal: bool = False) -> bool:
    """Whether the fp8 forward transposes V in shared memory for `seqlen_k` keys (None: long)."""
    limits = FP8_SMEM_VT_MAX_SEQLEN_K
    if causal and head_dim in FP8_SMEM_VT_CAUSAL_MAX_SEQLEN_K:
        limits = FP8_SMEM_VT_CAUSAL_MAX_SEQLEN_K
    if head_dim not in limits:
        return False
    limit = limits[head_dim]
    return limit is None or (seqlen_k is not None and seqlen_k <= limit)


def fp8_smem_transpose_config(head_dim: int, causal: bool) -> Fa3Config:
    """The fp8 table's entry for (head_dim, causal) with V transposed in shared memory
    (v_transpose="smem"; get_config takes it where fp8_vt_in_smem says so).

    The Vᵀ ring costs one more K/V-sized buffer. It fits beside the table's tiles at D <= 192
    (D = 128, tile_n 192: Q 16 + K, V, Vᵀ 3 x 2 x 24 + sO 32 = 192 KiB; D = 192, tile_n 128:
    24 + 3 x 48 + 48 = 216 KiB). At D = 256 tile_n 96 would need 32 + 3 x 48 + 64 = 240 KiB
    (> 227): tile_n 64 (32 + 3 x 32 + 64 = 192 KiB). _FP8_SMEM_TILES names the tiles that
    differ from the table's entry.
    The smem build runs on the plain grid (`can_implement`).
    """
    base = _FP8_SMEM_TILES.get((head_dim, causal)) or _fp8_tiles(head_dim, causal)
    cfg = replace(_plain(base), v_transpose="smem")
    if smem_bytes(cfg, head_dim, FP8_DTYPE) > SMEM_CAPACITY:
        cfg = replace(cfg, tile_n=64)
    return cfg


# Non-causal 16-bit head dims whose three-warpgroup tile (192 query rows) gives way to a
# 128-row tile of two warpgroups for query lengths that fill the taller tiles badly (`short_q`).
# D = 96: 192 x 112 runs TALL_TILE_GAIN faster per computed row than 128 x 128 at N = 4k-16k;
# at N = 1k its last row tile is a third full (docs/results.md, "K ahead of V": H200, 5 passes).
_SHORT_Q_TILES = {96: Fa3Config(tile_n=128, stages=2)}
TALL_TILE_GAIN = 1.07


def short_q(cfg: Fa3Config, seqlen_q: int, short: Fa3Config) -> bool:
    """Whether `short`'s row tiles beat `cfg`'s taller ones for `seqlen_q` query rows: the
    fraction of computed rows that are real, times TALL_TILE_GAIN for the taller tile."""

    def filled(tile_m: int) -> float:
        return seqlen_q / (-(-seqlen_q // tile_m) * tile_m)

    return filled(cfg.tile_m) * TALL_TILE_GAIN < filled(short.tile_m)


# Dense non-causal 16-bit problems (no softcap or window, seqlen_q % 4 == 0: lse_tma's TMA
# rows) that run `_persistent_q_regs`: D = 128 of the table's tiles (1.094 / 1.033 / 1.020x the
# plain entry at N = 1k / 4k / 16k, H200, commit 72ed3e5), D = 64 up to SHORT_SEQLEN_K keys on
# two warpgroups' 128-row tiles (Q in registers spills on three): 1.066 / 1.078x the v2 build
# at N = 512 / 1k (H100, commit aedf37c). Longer D = 64 up to SECTIONS_MAX_SEQLEN_K keys runs
# the v2 build with L2_SECTION_MIB sections: 1.038 / 1.028x the plain grid at 2k / 4k (H100,
# commit 955587e), level at 16k (0.999x, 97994b6); docs/results.md, "Sections and the tile counter".
_PERSISTENT_Q_REGS_DIMS = (128,)
_SHORT_Q_REGS_TILES = {64: Fa3Config(tile_n=128, stages=3)}
SECTIONS_MAX_SEQLEN_K = 4096
L2_SECTION_MIB = 8  # l2_section_mib of those builds (32 MiB reads K/V 2.5x from DRAM)
# Causal 16-bit head dims whose dense problems up to (seqlen_k) take their tiles from the tile
# counter (Fa3Config.tile_counter) with (l2_section_mib) sections: the static order is 0.870
# (D = 128), 0.956 (D = 64; 0.996 at 4k) and 0.939x (D = 256) the counter build at N = 1k
# (H100, commit aedf37c); 16k level or behind. Causal D = 64 up to SHORT_SEQLEN_K keys runs
# two warpgroups' 128-row tiles with Q in registers on top: 1.107x at 1k, 0.976x at 2k.
_TILE_COUNTER = {64: (4096, 16), 128: (1024, 16), 256: (1024, 32)}
_SHORT_CAUSAL = {64: dict(tile_m=128, num_consumer_wgs=2, skip_masked_wg=False, q_in_regs=True)}
# Causal 16-bit head dims whose dense problems up to (seqlen_k) run (tile_n)-key tiles: D = 256
# on 64 keys 1.022 / 1.039 / 1.037x the table's 80 at N = 1k / 2k / 4k (H100, commit cc9f5ad).
_CAUSAL_KEY_TILES = {256: (4096, 64)}


def _persistent_q_regs(cfg: Fa3Config) -> Fa3Config:
    """The persistent v2 build of a plain non-causal entry with its own sO, the LSE by TMA, the
    softmax in place without the loop's mask test, Q·Kᵀ with Q in registers (sQ released once
    loaded) and L2_SECTION_MIB sections."""
    return replace(_overlap(cfg), o_alias_q=False, lse_tma=True, softmax_apart=False,
                   loop_mask_test=False, q_in_regs=True, l2_section_mib=L2_SECTION_MIB)  # fmt: skip


def _dense_choice(p: AttnParams, cfg: Fa3Config) -> Fa3Config | None:
    """config_for's pick for dense 16-bit problems without softcap or window (None: none)."""
    if p.dtype not in DTYPES or p.softcap or p.is_local:
        return None
    short_keys = p.seqlen_k <= SHORT_SEQLEN_K
    if p.causal:
        keys, tile_n = _CAUSAL_KEY_TILES.get(p.head_dim, (-1, 0))
        if retiled := p.seqlen_k <= keys:
            cfg = replace(cfg, tile_n=tile_n)
        limit, mib = _TILE_COUNTER.get(p.head_dim, (-1, 0))
        if p.seqlen_k > limit:  # head dims outside _TILE_COUNTER never take it
            return cfg if retiled else None
        if short_keys and p.head_dim in _SHORT_CAUSAL:
            cfg = replace(cfg, **_SHORT_CAUSAL[p.head_dim])
        return replace(cfg, tile_counter=True, l2_section_mib=mib)
    short = _SHORT_Q_REGS_TILES.get(p.head_dim) if short_keys else None
    if p.seqlen_q % 4 == 0 and (short or p.head_dim in _PERSISTENT_Q_REGS_DIMS):
        return _persistent_q_regs(short or cfg)
    if p.head_dim in _SHORT_PERSISTENT_DIMS and p.seqlen_k <= SECTIONS_MAX_SEQLEN_K:
        return replace(_two_q(_overlap(cfg)), l2_section_mib=L2_SECTION_MIB)
    return None


def config_for(p: AttnParams) -> Fa3Config:
    """The tile config fa3 uses for problem `p` (`get_config` of its head_dim, dtype, causal
    flag and key length, the host-Vᵀ tiles for an fp8 V laid out keys-major;
    `_SHORT_Q_TILES` for query lengths the taller tile fills badly; `_dense_choice` for
    dense problems (persistent builds with Q in registers, 8 MiB L2 sections or the tile
    counter); softcap and windowed problems without
    softmax_apart, wg_slice and split_loops, and with the loop's mask test: the builds the GPU
    suite has checked with them)."""
    cfg = get_config(p.head_dim, p.dtype, p.causal, p.seqlen_k)
    if (dense := _dense_choice(p, cfg)) is not None:
        return dense
    if p.is_fp8 and p.v_keys_major and cfg.v_transpose == "smem":
        # A keys-major V is Vᵀ already: the host-Vᵀ build reads it without a copy, where the
        # smem build would need V copied token-major (docs/fp8.md, "V laid out keys-major").
        cfg = _fp8_tiles(p.head_dim, p.causal)
    if p.is_fp8 and p.v_keys_major and cfg.permute_v_keys:
        # ... and in key order: permute_v_keys would copy it (interface.transpose_v)
        cfg = fp8_key_order_config(p.head_dim, p.causal)
    short = _SHORT_Q_TILES.get(p.head_dim)
    if (
        short is not None
        and p.dtype in DTYPES
        and p.seqlen_q > 0
        and short_q(cfg, p.seqlen_q, short)
    ):
        cfg = _overlap(short) if p.causal else short
    if p.softcap or p.is_local:
        cfg = dense_options_off(cfg)
    if p.is_fp8 and (p.fp8_block_q or p.fp8_block_kv):
        cfg = fp8_block_config(cfg, p.head_dim, p.causal, p.fp8_block_kv)
    return cfg


def dense_options_off(cfg: Fa3Config) -> Fa3Config:
    """`cfg` without the schedule options (softmax_apart, wg_slice, stage_desc, split_loops,
    pv_wait_after_max, pv_wait_exps; the loop's mask test back in): what softcap and windowed
    problems run, dense (`config_for`) or packed (`varlen_config_for`), the builds the GPU
    suite has checked on them."""
    return replace(cfg, softmax_apart=False, wg_slice=False, stage_desc=False, split_loops=False,
                   loop_mask_test=True, pv_wait_after_max=False,
                   pv_wait_exps=0)  # fmt: skip


# The per-block build (fp8_blocks) runs the 2-WG tiles its GPU cases ran: at D = 64 and 128 the
# 128 x 192 tiles that the 3-WG table entries replaced, beside the causal ones.
_FP8_BLOCK_EXTRA: dict[int, tuple[Fa3Config, ...]] = {64: (_fp8(192),), 128: (_FP8_D128_TWO_WGS,)}


def _fp8_block_candidates(head_dim: int, causal: bool) -> list[Fa3Config]:
    own, other = _fp8_tiles(head_dim, causal), _fp8_tiles(head_dim, not causal)
    return [c for c in (own, *_FP8_BLOCK_EXTRA.get(head_dim, ()), other) if c.num_consumer_wgs == 2]


def fp8_block_tiles(head_dim: int) -> tuple[int, ...]:
    """The key tiles of the per-block build at `head_dim` (the fp8 table's 2-WG entries, causal
    and not, and _FP8_BLOCK_EXTRA): a k/v descale block that one divides runs on fa3 at every
    key length (`fp8_block_config`)."""
    return tuple(sorted({c.tile_n for c in _fp8_block_candidates(head_dim, False)}))


def fp8_block_config(cfg: Fa3Config, head_dim: int, causal: bool, block_kv: int) -> Fa3Config:
    """fp8 with a k/v descale every `block_kv` keys (each K/V block in one descale block): the
    first of `cfg` (a 3-WG one as its key-order build or _FP8_BLOCK_EXTRA's 2-WG tile), the
    table's entry, _FP8_BLOCK_EXTRA's and the other causal flag's whose tile_n divides
    block_kv (0: q's descales alone per block); else `cfg` (supports() refuses it, naming
    fp8_block_tiles)."""
    if cfg.num_consumer_wgs != 2:  # a 2-WG tile in its place, V transposed alike
        two = _FP8_KEYS_IN_ORDER.get((head_dim, causal)) or _FP8_BLOCK_EXTRA[head_dim][0]
        cfg = replace(two, v_transpose=cfg.v_transpose)
    candidates = [_plain(c) for c in (cfg, *_fp8_block_candidates(head_dim, causal))]
    return next((c for c in candidates if block_kv % c.tile_n == 0), candidates[0])


def shipped_configs() -> list[tuple[int, torch.dtype, bool, Fa3Config]]:
    """Every 16-bit (head_dim, dtype, causal, config) the table returns for long keys."""
    return [
        (d, dt, c, get_config(d, dt, c)) for d in HEAD_DIMS for dt in DTYPES for c in (False, True)
    ]


def shipped_cases() -> list[tuple[str, int, torch.dtype, bool, Fa3Config]]:
    """Every 16-bit config the table can return, named: "shipped" (long keys),
    "shipped-short" (seqlen_k <= SHORT_SEQLEN_K, where that differs), "shipped-short-q"
    (config_for's `_SHORT_Q_TILES`) and "shipped-dense-N" (`_dense_choice` of a dense N x N
    problem, where that differs). What CI compiles (tests/test_fa3_compile.py; fp8:
    `fp8_shipped_configs`)."""
    out = [("shipped", *c) for c in shipped_configs()]
    for d, dt, c, cfg in shipped_configs():
        short = get_config(d, dt, c, seqlen_k=SHORT_SEQLEN_K)
        if short != cfg:
            out.append(("shipped-short", d, dt, c, short))
        if not c and d in _SHORT_Q_TILES:
            out.append(("shipped-short-q", d, dt, c, _SHORT_Q_TILES[d]))
        for n in (SHORT_SEQLEN_K, 4096, 16384):
            window = (-1, 0 if c else -1)
            p = AttnParams(1, n, n, 1, 1, d, d, dt, torch.device("cpu"), c, *window, 0.0, 1.0)
            dense = _dense_choice(p, get_config(d, dt, c, n))
            if dense is not None and all(dense != o[4] for o in out if o[1:4] == (d, dt, c)):
                out.append((f"shipped-dense-{n}", d, dt, c, dense))
    return out


def fp8_shipped_configs() -> list[tuple[int, torch.dtype, bool, Fa3Config]]:
    """Every fp8 (head_dim, dtype, causal, config) of the table with V copied on the host
    (get_config's pick past FP8_SMEM_VT_MAX_SEQLEN_K keys; at non-causal D = 64, which
    transposes in shared memory at every length, the baseline of that build); the builds
    with V transposed in shared memory are fp8_smem_transpose_config's
    (tests/test_fa3_fp8_compile.py compiles both)."""
    return [(d, FP8_DTYPE, c, _fp8_tiles(d, c)) for d in HEAD_DIMS for c in (False, True)]
